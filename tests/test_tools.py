"""dsh_tool_bash: rendering (pure), and BashToolset driven against executors.

What only needs an executor's answers (rendering of results, argument validation, owners, limits,
completion notices) runs on the scripted executor of :mod:`dsh_bash.testing`, without processes; what
needs real processes (a spill file a later command reads, processes gone after an abort, a
cancellation or a kill, trio end to end) runs on the local backend.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from dsh_bash_conformance import find_host_processes
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import (
    AbortController,
    BashRunResult,
    BashTask,
    BashTaskId,
    CollectedOutput,
    OwnerToken,
    SandboxPolicy,
)
from dsh_bash.testing import Chunk, InfraFailure, Script, ScriptedConfig, ScriptedExecutor
from dsh_tool_bash import BashToolset, ToolDefinition, ToolResult
from dsh_tool_bash._render import (
    Line,
    completion_notice,
    join,
    policy_line,
    render_output,
    render_run,
    status_line,
    status_summary,
)

ALICE = OwnerToken("alice")
BOB = OwnerToken("bob")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _executor(**fields: Any) -> LocalBashExecutor:
    fields.setdefault("grace_ms", 300)
    return LocalBashExecutor(LocalConfig(**fields))


def _scripted(**fields: Any) -> ScriptedExecutor:
    """A scripted executor that knows a few commands; any other one fails the call (``default="raise"``)."""
    fields.setdefault("grace_ms", 300)
    ex = ScriptedExecutor(ScriptedConfig(**fields), default="raise")
    ex.on("sleep 30", Script(until_killed=True))
    ex.on(re.compile(r"^echo \w+$"), lambda spec: Script(stdout=spec.command.removeprefix("echo ") + "\n"))
    ex.on(re.compile(r"^exit \d+$"), lambda spec: Script(exit_code=int(spec.command.removeprefix("exit "))))
    return ex


def _alive(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``: the kit's own probe."""
    return find_host_processes(marker)


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"toolstest-{os.urandom(6).hex()}"
    yield value
    for pid in _alive(value):
        os.kill(pid, 9)


async def _until_finished(tools: BashToolset, task_id: str, limit_s: float = 10) -> list[ToolResult]:
    """Poll bash_output until the status line is no longer running; return every read."""
    reads: list[ToolResult] = []
    with anyio.fail_after(limit_s):
        while True:
            result = await tools.call("bash_output", {"task_id": task_id})
            reads.append(result)
            if result.data.get("status") != "running":
                return reads
            await anyio.sleep(0.05)


# -- rendering (pure) --------------------------------------------------------------------------------------


def _out(text: str = "", truncated: bool = False, spill: str | None = None) -> CollectedOutput:
    data = text.encode()
    return CollectedOutput(text=text, truncated=truncated, spill_path=spill, total_bytes=len(data), data=data)


def _result(
    stdout: CollectedOutput | None = None,
    /,
    stderr: CollectedOutput | None = None,
    *,
    exit_code: int | None = 0,
    signal: str | None = None,
    timed_out: bool = False,
    timeout_ms: float = 1000,
) -> BashRunResult:
    return BashRunResult(
        exit_code=exit_code,
        signal=signal,
        timed_out=timed_out,
        aborted=False,
        timeout_ms=timeout_ms,
        duration_ms=1.0,
        stdout=stdout or _out(),
        stderr=stderr or _out(),
    )


def test_join_puts_notices_on_lines_of_their_own_and_adds_no_trailing_newline() -> None:
    assert join(["a\n", Line("[x]")]) == "a\n[x]"
    assert join(["a", Line("[x]")]) == "a\n[x]"
    assert join([Line("[x]"), "b"]) == "[x]\nb"
    assert join([Line("[x]"), Line("[y]")]) == "[x]\n[y]"
    assert join(["", Line("[x]"), "", "b\n"]) == "[x]\nb\n"
    assert join(["a\n\n", Line("[x]")]) == "a\n\n[x]"  # output is never altered


@pytest.mark.parametrize(
    ("result", "text"),
    [
        (_result(_out("hi\n")), "hi\n"),
        (_result(_out("hi")), "hi"),
        (_result(), "(no output)"),
        (_result(exit_code=3), "(no output)\n[exit code: 3]"),
        (_result(_out("hi\n"), exit_code=1), "hi\n[exit code: 1]"),
        (_result(_out("hi"), _out("oops\n")), "hi\n[stderr]\noops\n"),
        (_result(_out("hi\n"), _out("oops"), exit_code=2), "hi\n[stderr]\noops\n[exit code: 2]"),
        (_result(stderr=_out("oops\n")), "[stderr]\noops\n"),
        (
            _result(_out("tail\n", True, "/s/out")),
            "tail\n[output truncated; full output: /s/out]",
        ),
        (
            _result(_out("tail", True, None), _out("e", True, "/s/err")),
            "tail\n[output truncated; full output: (unavailable)]\n[stderr]\ne\n"
            "[output truncated; full output: /s/err]",
        ),
        (
            _result(_out("x\n"), exit_code=None, signal="SIGKILL", timed_out=True, timeout_ms=1500.4),
            "x\n[timed out after 1500ms]\n[killed by signal: SIGKILL]",
        ),
        (_result(exit_code=None, signal="SIGTERM"), "(no output)\n[killed by signal: SIGTERM]"),
        (_result(exit_code=0, timed_out=True, timeout_ms=250), "(no output)\n[timed out after 250ms]"),
    ],
)
def test_render_run(result: BashRunResult, text: str) -> None:
    assert render_run(result) == text


def test_status_lines() -> None:
    assert status_line("running", None, None) == "[status: running]"
    assert status_line("completed", 0, None) == "[status: completed, exit code: 0]"
    assert status_line("completed", None, "SIGSEGV") == "[status: completed, signal: SIGSEGV]"
    assert status_line("killed", None, None) == "[status: killed]"
    assert status_line("killed", None, "SIGTERM") == "[status: killed, signal: SIGTERM]"
    assert status_line("killed", None, "SIGTERM", end_cause="timed_out") == "[status: killed, timed out]"
    assert status_summary("completed", 4, None) == "completed, exit code: 4"


def test_render_output() -> None:
    running = "[status: running]"
    assert render_output("", lossy=False, spill_paths=(None, None), status=running) == (
        "(no new output)\n[status: running]"
    )
    assert (
        render_output("a\n", lossy=False, spill_paths=(None, None), status=running) == "a\n[status: running]"
    )
    assert render_output("a", lossy=True, spill_paths=("/o", "/e"), status=running) == (
        "a\n[some output was dropped from memory; full output: /o, /e]\n[status: running]"
    )
    assert render_output("", lossy=True, spill_paths=(None, "/e"), status=running) == (
        "(no new output)\n[some output was dropped from memory; full output: /e]\n[status: running]"
    )
    assert render_output("a", lossy=True, spill_paths=(None, None), status=running) == (
        "a\n[some output was dropped from memory; full output: (unavailable)]\n[status: running]"
    )


def test_completion_notice() -> None:
    assert completion_notice("bash-4", "completed, exit code: 0") == (
        "background bash task bash-4 finished: completed, exit code: 0. Read its output with bash_output."
    )


# -- definitions -------------------------------------------------------------------------------------------


def test_definitions_formats_and_schemas() -> None:
    tools = BashToolset(_scripted())
    definitions = tools.definitions()
    assert all(isinstance(d, ToolDefinition) for d in definitions)
    assert [d.name for d in definitions] == ["bash", "bash_output", "bash_input", "bash_kill"]
    bash = definitions[0]
    schema = bash.input_schema
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["command"]
    assert set(schema["properties"]) == {
        "command",
        "description",
        "timeout_ms",
        "workdir",
        "run_in_background",
        "open_stdin",
        "yield_ms",
        "terminal",
    }
    assert schema["properties"]["timeout_ms"]["type"] == "number"
    assert "title" not in json.dumps(schema)
    for needle in ("fresh", "workdir", "[exit code: N]", "full output: PATH", "grep", "run_in_background"):
        assert needle in bash.description, needle
    assert "bash_output" in bash.description and "bash_kill" in bash.description
    assert "120000" in bash.description and "600000" in bash.description
    for definition in definitions[1:]:
        assert definition.input_schema["required"][0] == "task_id"
        assert definition.input_schema["additionalProperties"] is False

    openai = tools.openai_tools()
    assert [t["type"] for t in openai] == ["function"] * 4
    assert openai[0]["function"]["name"] == "bash"
    assert openai[0]["function"]["parameters"] == schema
    anthropic = tools.anthropic_tools()
    assert [t["name"] for t in anthropic] == ["bash", "bash_output", "bash_input", "bash_kill"]
    assert anthropic[0]["input_schema"] == schema
    anthropic[0]["input_schema"]["properties"].clear()  # callers get copies
    assert tools.definitions()[0].input_schema == schema


def test_foreground_only_toolset_offers_bash_alone() -> None:
    tools = BashToolset(_scripted(), background=False)
    definitions = tools.definitions()
    assert [d.name for d in definitions] == ["bash"]
    assert "run_in_background" not in definitions[0].input_schema["properties"]
    assert "run_in_background" not in definitions[0].description
    assert "bash_output" not in definitions[0].description
    assert [t["function"]["name"] for t in tools.openai_tools()] == ["bash"]


def test_max_running_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_running"):
        BashToolset(_scripted(), max_running=0)


# -- foreground --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_foreground_outputs_and_markers(tmp_path: Any) -> None:
    ex = _scripted(cwd=str(tmp_path))
    ex.on("printf out; echo err >&2; exit 3", Script(stdout="out", stderr="err\n", exit_code=3))
    ex.on("true", Script())
    ex.on("kill -TERM $$", Script(signal=signal.SIGTERM))
    ex.on("pwd", lambda spec: Script(stdout=f"{spec.workdir}\n"))
    async with ex:
        tools = BashToolset(ex)
        ok = await tools.call("bash", {"command": "echo hello", "description": "Say hello"})
        assert (ok.text, ok.is_error) == ("hello\n", False)
        assert ok.data["exit_code"] == 0 and ok.data["description"] == "Say hello"
        assert ok.data["workdir"] == str(tmp_path)

        mixed = await tools.call("bash", '{"command": "printf out; echo err >&2; exit 3"}')
        assert mixed.text == "out\n[stderr]\nerr\n[exit code: 3]"
        assert mixed.is_error is False
        assert mixed.data["exit_code"] == 3 and mixed.data["signal"] is None

        quiet = await tools.call("bash", {"command": "true"})
        assert quiet.text == "(no output)"

        signaled = await tools.call("bash", {"command": "kill -TERM $$"})
        assert signaled.text == "(no output)\n[killed by signal: SIGTERM]"
        assert signaled.is_error is False and signaled.data["signal"] == "SIGTERM"

        where = await tools.call("bash", {"command": "pwd", "workdir": "sub"})
        assert where.text == f"{tmp_path}/sub\n"
    # What the tool asked the executor for: the config's timeout, no owner, nothing else.
    assert ex.commands == [
        "echo hello",
        "printf out; echo err >&2; exit 3",
        "true",
        "kill -TERM $$",
        "pwd",
    ]
    assert {(c.timeout_ms, c.owner, c.stdin, c.spec.env, c.background) for c in ex.calls} == {
        (120_000, None, None, None, False)
    }
    assert [c.workdir for c in ex.calls] == [str(tmp_path)] * 4 + [f"{tmp_path}/sub"]


@pytest.mark.anyio
async def test_timeout_is_not_an_error() -> None:
    ex = _scripted().on("echo begun; sleep 10", Script(stdout="begun\n", duration_s=10))
    async with ex:
        started = time.monotonic()
        result = await BashToolset(ex).call("bash", {"command": "echo begun; sleep 10", "timeout_ms": 300})
        assert time.monotonic() - started < 5
        assert result.is_error is False
        assert result.text.startswith("begun\n[timed out after 300ms]")
        assert result.data["timed_out"] is True
        assert ex.calls[0].timeout_ms == 300 and ex.calls[0].signals == [signal.SIGTERM]


@pytest.mark.anyio
async def test_truncation_names_the_spill_file() -> None:
    async with _executor(max_output_bytes=100) as ex:
        command = "seq 1 1000; seq 1 500 >&2"
        result = await BashToolset(ex).call("bash", {"command": command})
        assert result.is_error is False
        out_path, err_path = result.data["stdout_spill_path"], result.data["stderr_spill_path"]
        assert result.data["truncated"] is True and out_path and err_path
        assert f"[output truncated; full output: {out_path}]\n[stderr]\n" in result.text
        assert result.text.endswith(f"500\n[output truncated; full output: {err_path}]")
        with open(out_path) as fh:
            assert fh.read() == "".join(f"{i}\n" for i in range(1, 1001))
        grep = await BashToolset(ex).call("bash", {"command": f"grep -c . {out_path}"})
        assert grep.text == "1000\n"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        ({"command": "env", "env": {"A": "1"}}, 'unknown argument "env"'),
        ({"command": "cat", "stdin": "x"}, 'unknown argument "stdin"'),
        ({"command": "x", "env": {}, "stdin": ""}, 'unknown arguments "env", "stdin"'),
        ({}, 'missing required argument "command"'),
        ({"command": "x", "timeout_ms": "5000"}, 'argument "timeout_ms"'),
        ({"command": "x", "timeout_ms": True}, 'argument "timeout_ms"'),
        ({"command": "x", "timeout_ms": -1}, 'argument "timeout_ms"'),
        ({"command": "x", "run_in_background": "yes"}, 'argument "run_in_background"'),
        ({"command": 5}, 'argument "command"'),
        ({"command": "echo \x00"}, "NUL"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
    ],
)
async def test_invalid_arguments_are_error_results(arguments: Any, needle: str) -> None:
    async with _scripted() as ex:
        result = await BashToolset(ex).call("bash", arguments)
        assert result.is_error is True
        assert result.text.startswith("invalid arguments for bash: ")
        assert needle in result.text
        assert result.data["error"] == "invalid_arguments"
    assert ex.calls == []


@pytest.mark.anyio
async def test_unknown_tool_and_foreground_only_refusals() -> None:
    async with _scripted() as ex:
        result = await BashToolset(ex).call("python", {"code": "1"})
        assert (
            result.is_error
            and result.text == 'unknown tool "python" (available: bash, bash_output, bash_input, bash_kill)'
        )
        tools = BashToolset(ex, background=False)
        assert (await tools.call("bash_output", {"task_id": "bash-1"})).text == (
            'unknown tool "bash_output" (available: bash)'
        )
        refused = await tools.call("bash", {"command": "sleep 5", "run_in_background": True})
        assert refused.is_error and 'unknown argument "run_in_background"' in refused.text
        null_ok = await BashToolset(ex).call(
            "bash", {"command": "echo x", "workdir": None, "timeout_ms": None}
        )
        assert null_ok.text == "x\n"
    assert ex.commands == ["echo x"]


@pytest.mark.anyio
async def test_infrastructure_failures_are_errors(tmp_path: Any) -> None:
    nope = str(tmp_path / "nope")
    ex = _scripted().on(
        lambda spec: spec.workdir == nope,
        Script(failure=InfraFailure("workdir_missing", f"working directory {nope} does not exist")),
    )
    async with ex:
        tools = BashToolset(ex)
        missing = await tools.call("bash", {"command": "true", "workdir": str(tmp_path / "nope")})
        assert missing.is_error is True and missing.data["error"] == "infrastructure"
        assert missing.text == f"the command could not run: working directory {tmp_path}/nope does not exist"
    closed = await tools.call("bash", {"command": "true"})
    assert closed.is_error and closed.data["error"] == "executor_closed"
    assert (await tools.call("bash_output", {"task_id": "bash-1"})).data["error"] == "executor_closed"


@pytest.mark.anyio
async def test_abort_before_and_during_a_run(tmp_path: Any, marker: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        controller = AbortController()
        controller.abort()
        flag = tmp_path / "ran"
        before = await tools.call("bash", {"command": f"touch {flag}"}, signal=controller.signal)
        assert (before.text, before.is_error) == ("command aborted", True)
        assert not flag.exists()

        controller = AbortController()
        results: list[ToolResult] = []

        async def run() -> None:
            results.append(
                await tools.call("bash", {"command": f"exec -a {marker} sleep 30"}, signal=controller.signal)
            )

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                while True:
                    if _alive(marker):
                        break
                    await anyio.sleep(0.02)
                controller.abort("user pressed stop")
        assert results[0].text == "command aborted"
        assert results[0].is_error and results[0].data["aborted"] is True
        assert _alive(marker) == []


@pytest.mark.anyio
async def test_callers_cancellation_propagates_and_kills(marker: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        returned: list[ToolResult] = []

        async def call() -> None:
            returned.append(await tools.call("bash", {"command": f"exec -a {marker} sleep 30"}))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                while True:
                    if _alive(marker):
                        break
                    await anyio.sleep(0.02)
                tg.cancel_scope.cancel()
            assert returned == []  # the cancellation propagated instead of becoming a result
            assert _alive(marker) == []


# -- background --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_background_start_poll_and_finish() -> None:
    ex = _scripted().on(
        "echo one; sleep 0.3; echo two >&2; exit 4",
        Script(stdout="one\n", chunks=[Chunk("two\n", "stderr", delay_s=0.3)], exit_code=4),
    )
    async with ex:
        tools = BashToolset(ex, owner=ALICE)
        started = await tools.call(
            "bash", {"command": "echo one; sleep 0.3; echo two >&2; exit 4", "run_in_background": True}
        )
        task_id = started.data["task_id"]
        assert started.text == f"started background task {task_id}" and not started.is_error
        assert started.data["status"] == "running" and ex.owner_of(BashTaskId(task_id)) == ALICE
        reads = await _until_finished(tools, task_id)
        text = "".join(r.text.rsplit("[status:", 1)[0] for r in reads)
        assert "one\n" in text and "[stderr]\ntwo\n" in text
        assert reads[-1].text.endswith("[status: completed, exit code: 4]")
        assert reads[-1].data["exit_code"] == 4 and reads[-1].data["end_cause"] == "exited"
        again = await tools.call("bash_output", {"task_id": task_id})
        assert again.text == "(no new output)\n[status: completed, exit code: 4]"
        assert again.data["new_output"] is False
        finished = await tools.call("bash_kill", {"task_id": task_id})
        assert finished.text == f"task {task_id} had already finished" and not finished.is_error
    assert [(c.background, c.owner) for c in ex.calls] == [(True, ALICE)]


@pytest.mark.anyio
async def test_background_kill(marker: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        started = await tools.call(
            "bash", {"command": f"exec -a {marker} sleep 30", "run_in_background": True}
        )
        task_id = started.data["task_id"]
        killed = await tools.call("bash_kill", {"task_id": task_id})
        assert killed.text == f"killed background task {task_id}" and killed.data["killed"] is True
        reads = await _until_finished(tools, task_id)
        assert reads[-1].text.endswith("[status: killed]") or "[status: killed, signal:" in reads[-1].text
        assert reads[-1].data["status"] == "killed"
        assert _alive(marker) == []


@pytest.mark.anyio
async def test_unknown_and_foreign_tasks() -> None:
    async with _scripted() as ex:
        alice, bob, anyone = BashToolset(ex, owner=ALICE), BashToolset(ex, owner=BOB), BashToolset(ex)
        for tool in ("bash_output", "bash_kill"):
            unknown = await alice.call(tool, {"task_id": "bash-999"})
            assert (unknown.text, unknown.is_error) == ('unknown bash task "bash-999"', True)
        task_id = (await alice.call("bash", {"command": "sleep 30", "run_in_background": True})).data[
            "task_id"
        ]
        for intruder in (bob, anyone):
            for tool in ("bash_output", "bash_kill"):
                refused = await intruder.call(tool, {"task_id": task_id})
                assert (refused.text, refused.is_error) == (
                    f"task {task_id} belongs to another session",
                    True,
                )
        assert (
            await alice.call("bash_output", {"task_id": task_id})
        ).text == "(no new output)\n[status: running]"
        open_id = (await anyone.call("bash", {"command": "echo shared", "run_in_background": True})).data[
            "task_id"
        ]
        reads = await _until_finished(bob, open_id)  # ownerless tasks are open to all
        assert "shared\n" in "".join(r.text for r in reads)
        assert (await alice.call("bash_kill", {"task_id": task_id})).data["killed"] is True


@pytest.mark.anyio
async def test_max_running_per_owner() -> None:
    async with _scripted() as ex:
        first, second = (
            BashToolset(ex, owner=ALICE, max_running=2),
            BashToolset(ex, owner=ALICE, max_running=2),
        )
        ids = []
        for tools in (first, second):
            ids.append(
                (await tools.call("bash", {"command": "sleep 30", "run_in_background": True})).data["task_id"]
            )
        over = await first.call("bash", {"command": "sleep 30", "run_in_background": True})
        assert over.is_error and over.data["error"] == "too_many_running"
        assert "too many background tasks running (2 of at most 2)" in over.text
        other = await BashToolset(ex, owner=BOB, max_running=2).call(
            "bash", {"command": "sleep 30", "run_in_background": True}
        )
        assert not other.is_error  # the limit is per owner
        assert {t.id for t in first.running_tasks()} == set(ids)
        await first.call("bash_kill", {"task_id": ids[0]})
        await _until_finished(first, ids[0])
        assert not (await second.call("bash", {"command": "sleep 30", "run_in_background": True})).is_error
        assert len(await second.kill_all()) == 2
    assert [c.owner for c in ex.calls] == [ALICE, ALICE, BOB, ALICE]  # the refused start never ran


@pytest.mark.anyio
async def test_max_running_total_across_owners() -> None:
    async with _scripted() as ex:
        alice = BashToolset(ex, owner=ALICE, max_running=2, max_running_total=3)
        bob = BashToolset(ex, owner=BOB, max_running=2, max_running_total=3)
        start = {"command": "sleep 30", "run_in_background": True}
        ids = [(await tools.call("bash", start)).data["task_id"] for tools in (alice, alice, bob)]
        over = await bob.call("bash", start)
        assert over.is_error and over.data["error"] == "too_many_running"
        assert over.data["max_running_total"] == 3 and over.data["running_total"] == 3
        assert "across all sessions (3 of at most 3)" in over.text
        mine = await alice.call("bash", start)  # the owner's own cap is checked first
        assert "(2 of at most 2)" in mine.text and "across" not in mine.text
        await alice.call("bash_kill", {"task_id": ids[0]})
        await _until_finished(alice, ids[0])
        assert not (await bob.call("bash", start)).is_error  # room again
        assert len(await alice.kill_all()) == 1 and len(await bob.kill_all()) == 2
    with pytest.raises(ValueError, match="max_running_total"):
        BashToolset(ex, max_running_total=0)


@pytest.mark.anyio
async def test_lossy_read_names_the_spill_files() -> None:
    seq = "".join(f"{i}\n" for i in range(1, 2001)).encode()
    ex = _scripted(max_output_bytes=100).on("seq 1 2000", Script(stdout=seq))
    async with ex:
        tools = BashToolset(ex)
        task_id = (await tools.call("bash", {"command": "seq 1 2000", "run_in_background": True})).data[
            "task_id"
        ]
        reads = await _until_finished(tools, task_id)
        lossy = [r for r in reads if r.data["lossy"]]
        assert lossy
        path = lossy[0].data["stdout_spill_path"]
        assert f"[some output was dropped from memory; full output: {path}]\n[status: " in lossy[0].text
        assert ex.read_spill(path) == seq


@pytest.mark.anyio
async def test_on_completion_notices_only_the_owners_tasks() -> None:
    async with _scripted() as ex:
        alice, bob = BashToolset(ex, owner=ALICE), BashToolset(ex, owner=BOB)
        notices: list[tuple[str, BashTask]] = []
        unsubscribe = alice.on_completion(lambda text, task: notices.append((text, task)))
        alice.on_completion(lambda text, task: 1 / 0)  # a raising callback disturbs nothing
        mine = (await alice.call("bash", {"command": "exit 3", "run_in_background": True})).data["task_id"]
        theirs = (await bob.call("bash", {"command": "exit 0", "run_in_background": True})).data["task_id"]
        await _until_finished(alice, mine)
        await _until_finished(bob, theirs)
        notice = (
            f"background bash task {mine} finished: completed, exit code: 3. "
            "Read its output with bash_output."
        )
        assert [(text, task.id) for text, task in notices] == [(notice, mine)]
        unsubscribe()
        later = (await alice.call("bash", {"command": "sleep 30", "run_in_background": True})).data["task_id"]
        await alice.call("bash_kill", {"task_id": later})
        await _until_finished(alice, later)
        assert len(notices) == 1


@pytest.mark.anyio
async def test_the_next_result_tells_each_ended_task_once() -> None:
    async with _scripted() as ex:
        alice, alice_too, bob = (
            BashToolset(ex, owner=ALICE),
            BashToolset(ex, owner=ALICE),
            BashToolset(ex, owner=BOB),
        )
        first = (await alice.call("bash", {"command": "exit 3", "run_in_background": True})).data["task_id"]
        shown = (await alice.call("bash", {"command": "exit 4", "run_in_background": True})).data["task_id"]
        theirs = (await bob.call("bash", {"command": "exit 0", "run_in_background": True})).data["task_id"]
        for task_id in (first, shown, theirs):
            await (await ex.read_output(BashTaskId(task_id))).task.wait()  # the executor's, not a tool's read
        # A read that shows a task's end tells it: no line for that one.
        read = await alice.call("bash_output", {"task_id": shown})
        assert read.text.startswith("(no new output)\n[status: completed, exit code: 4]")
        tail = "Read its output with bash_output."
        notice = f"background bash task {first} finished: completed, exit code: 3. {tail}"
        assert read.text.endswith("\n" + notice), read.text
        assert [entry["task_id"] for entry in read.data["ended_tasks"]] == [first]
        # Once, for every toolset of the owner; never another owner's.
        assert (await alice_too.call("bash", {"command": "echo x"})).text == "x\n"
        bobs = await bob.call("bash", {"command": "echo y"})
        assert bobs.text.startswith("y\nbackground bash task " + theirs) and "ended_tasks" in bobs.data


@pytest.mark.anyio
async def test_background_start_with_aborted_signal_starts_nothing() -> None:
    async with _scripted() as ex:
        controller = AbortController()
        controller.abort()
        tools = BashToolset(ex)
        result = await tools.call(
            "bash", {"command": "touch ran", "run_in_background": True}, signal=controller.signal
        )
        assert (result.text, result.is_error) == ("command aborted", True)
        assert ex.calls == [] and tools.running_tasks() == []  # the executor was never asked


# -- bash with yield_ms: calls that move to the background (issue 31) --------------------------------------


@pytest.mark.anyio
async def test_yield_returns_a_command_that_ends_within_the_window() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex, owner=ALICE)
        notices: list[str] = []
        tools.on_completion(lambda text, task: notices.append(text))
        started = time.monotonic()
        result = await tools.call("bash", {"command": "echo hi; echo err >&2; exit 3", "yield_ms": 5000})
        assert time.monotonic() - started < 4, "the call waited out its window for a command that ended"
        assert not result.is_error and result.data["moved_to_background"] is False
        assert result.text == "hi\n[stderr]\nerr\n[status: completed, exit code: 3]", result.text
        assert (result.data["exit_code"], result.data["end_cause"]) == (3, "exited")
        assert tools.running_tasks() == []
        await anyio.sleep(0.1)
        assert notices == [], "the call reported the end itself: no completion notice as well"
        after = await tools.call("bash", {"command": "echo after"})
        assert after.text == "after\n" and "ended_tasks" not in after.data, "nor a line in the next result"


@pytest.mark.anyio
async def test_yield_moves_a_long_command_to_the_background(marker: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex, owner=ALICE)
        notices: list[str] = []
        tools.on_completion(lambda text, task: notices.append(text))
        started = time.monotonic()
        result = await tools.call(
            "bash", {"command": f"echo early; exec -a {marker} sleep 30", "yield_ms": 700}
        )
        took = time.monotonic() - started
        assert 0.6 <= took < 5, f"the call returned after {took:.2f} s, its window 0.7 s"
        task_id = result.data["task_id"]
        assert not result.is_error and result.data["moved_to_background"] is True
        assert result.text.startswith(f"still running after 700 ms: moved to background task {task_id}\n")
        assert "early\n" in result.text and result.text.endswith("[status: running]")
        assert [task.id for task in tools.running_tasks()] == [task_id] and _alive(marker)
        assert (await tools.call("bash_output", {"task_id": task_id})).text == (
            "(no new output)\n[status: running]"
        )
        assert (await tools.call("bash_kill", {"task_id": task_id})).data["killed"] is True
        await _until_finished(tools, task_id)
        assert _alive(marker) == []
        assert len(notices) == 1 and task_id in notices[0], notices


@pytest.mark.anyio
async def test_yield_moves_a_python_server_and_shows_what_it_printed(marker: str) -> None:
    """Issue 31's case: a server started without `&` comes back after the window with its task id and
    its first line (Python's print, unbuffered by the model-friendly PYTHONUNBUFFERED=1)."""
    # Scrubbed from the ambient (this machine's own environment may set it): the policy must add it.
    async with _executor(env_scrub=[*LocalConfig().env_scrub, "PYTHONUNBUFFERED"]) as ex:
        tools = BashToolset(ex)
        server = f"exec -a {marker} {shlex.quote(sys.executable)} -m http.server 0 --bind 127.0.0.1"
        result = await tools.call("bash", {"command": server, "yield_ms": 2000})
        assert result.data["moved_to_background"] is True, result.text
        assert "Serving HTTP on 127.0.0.1 port" in result.text, result.text
        task_id = result.data["task_id"]
        assert (await tools.call("bash_kill", {"task_id": task_id})).data["killed"] is True
        await _until_finished(tools, task_id)
        assert _alive(marker) == []


@pytest.mark.anyio
async def test_yield_keeps_the_commands_timeout(marker: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        result = await tools.call(
            "bash", {"command": f"exec -a {marker} sleep 30", "yield_ms": 200, "timeout_ms": 800}
        )
        assert result.data["moved_to_background"] is True
        reads = await _until_finished(tools, result.data["task_id"], limit_s=5)
        assert (reads[-1].data["status"], reads[-1].data["end_cause"]) == ("killed", "timed_out")
        assert reads[-1].text.endswith("[status: killed, timed out]"), reads[-1].text
        assert _alive(marker) == []


@pytest.mark.anyio
async def test_yield_aborted_within_the_window_kills_the_command(marker: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        controller = AbortController()

        async def abort_soon() -> None:
            await anyio.sleep(0.3)
            controller.abort()

        async with anyio.create_task_group() as tg:
            tg.start_soon(abort_soon)
            result = await tools.call(
                "bash", {"command": f"exec -a {marker} sleep 30", "yield_ms": 5000}, signal=controller.signal
            )
        assert (result.text, result.is_error) == ("command aborted", True)
        assert result.data["status"] == "killed" and tools.running_tasks() == []
        assert _alive(marker) == []


@pytest.mark.anyio
async def test_yield_is_refused_with_run_in_background() -> None:
    async with _scripted() as ex:
        tools = BashToolset(ex)
        result = await tools.call("bash", {"command": "echo x", "yield_ms": 100, "run_in_background": True})
        assert result.is_error and 'argument "yield_ms"' in result.text and ex.calls == []


def test_works_under_trio() -> None:
    async def main() -> None:
        async with _executor() as ex:
            tools = BashToolset(ex)
            assert (await tools.call("bash", {"command": "echo trio"})).text == "trio\n"
            task_id = (await tools.call("bash", {"command": "echo bg", "run_in_background": True})).data[
                "task_id"
            ]
            reads = await _until_finished(tools, task_id)
            assert reads[-1].data["status"] == "completed"

    anyio.run(main, backend="trio")


# -- sessions (issue 31) --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_bash_carries_the_shell_state_from_call_to_call_and_restart_drops_it(tmp_path: Any) -> None:
    """Issue 31's case: `cd /tmp && export A=1 && f() { echo f; }`, then `pwd; echo $A; f` prints
    /tmp, 1, f; the directory change is shown once; `restart` starts from a fresh shell."""
    async with _executor(cwd=str(tmp_path)) as ex:
        tools = BashToolset(ex)
        definition = tools.definitions()[0]
        assert "carry over" in definition.description and "restart" in definition.input_schema["properties"]
        first = await tools.call("bash", {"command": "cd /tmp && export A=1 && f() { echo f; }"})
        assert first.text == "(no output)\n[cwd: /tmp]" and first.data["cwd"] == "/tmp"
        second = await tools.call("bash", {"command": "pwd; echo $A; f"})
        assert second.text == "/tmp\n1\nf\n"
        elsewhere = await tools.call("bash", {"command": "pwd", "workdir": str(tmp_path)})
        assert elsewhere.text == f"{tmp_path}\n"  # for that call alone
        timed = await tools.call("bash", {"command": "cd /; export A=2; sleep 5", "timeout_ms": 300})
        assert timed.text.endswith("[shell state not kept: the command timed out]")
        assert timed.data["session_kept_previous"] == "the command timed out"
        kept = await tools.call("bash", {"command": "pwd; echo $A"})
        assert kept.text == "/tmp\n1\n"
        fresh = await tools.call(
            "bash", {"command": "pwd; echo ${A-unset}; type -t f || echo none", "restart": True}
        )
        assert fresh.text == f"{tmp_path}\nunset\nnone\n"
        task = await tools.call("bash", {"command": "cd /tmp; pwd", "run_in_background": True})
        await ex._tasks[BashTaskId(task.data["task_id"])].task.wait()  # type: ignore[union-attr]
        after = await tools.call("bash", {"command": "pwd"})
        assert after.text.startswith(f"{tmp_path}\n")  # a task starts from the state, changes nothing


@pytest.mark.anyio
async def test_owners_have_sessions_of_their_own_and_sessions_can_be_turned_off(tmp_path: Any) -> None:
    async with _executor(cwd=str(tmp_path)) as ex:
        alice, bob = BashToolset(ex, owner=ALICE), BashToolset(ex, owner=BOB)
        await alice.call("bash", {"command": "cd /tmp; export SEEN=alice"})
        theirs = await bob.call("bash", {"command": "pwd; echo ${SEEN-none}"})
        assert theirs.text == f"{tmp_path}\nnone\n"
        off = BashToolset(ex, owner=ALICE, sessions=False)
        definition = off.definitions()[0]
        assert "nothing carries over" in definition.description
        assert "restart" not in definition.input_schema["properties"]
        plain = await off.call("bash", {"command": "pwd; echo ${SEEN-none}"})
        assert plain.text == f"{tmp_path}\nnone\n" and "cwd" not in plain.data


@pytest.mark.anyio
async def test_the_model_is_told_when_its_sandbox_policy_refused_a_command(tmp_path: Any) -> None:
    policy = SandboxPolicy.workspace_write(network="none")
    refused = "echo x > /etc/dsh-policy-probe; echo x > /dev/udp/127.0.0.1/9"
    async with _executor(policy=policy, cwd=str(tmp_path)) as ex:
        tools = BashToolset(ex)
        result = await tools.call("bash", {"command": refused})
        assert result.data["policy_refusal"] is True
        assert result.text.endswith(
            f"[sandbox policy: writes only beneath {tmp_path}, /tmp, /dev; unreadable: ~/.ssh, ~/.aws, "
            "~/.config/gcloud, ~/.docker, ~/.netrc; no network. An error above may be the policy's, which "
            "nothing in the command can lift: work within it]"
        ), result.text
        fine = await tools.call("bash", {"command": "echo fine > here && cat here"})
        assert fine.text == "fine\n" and "policy_refusal" not in fine.data
        # A background task's read says it too, once its output shows the refusal.
        started = await tools.call("bash", {"command": refused, "run_in_background": True})
        task_id = started.data["task_id"]
        reads = await _until_finished(tools, task_id)
        # (the read whose new output shows the refusal: the last, or one before it while it ran)
        told = [read for read in reads if read.data.get("policy_refusal") is True]
        assert told, [read.text for read in reads]
        assert told[-1].text.endswith("nothing in the command can lift: work within it]"), told[-1].text
    async with _executor(cwd=str(tmp_path)) as ex:  # no policy: the same errors are the machine's own
        result = await BashToolset(ex).call("bash", {"command": "echo 'Permission denied' >&2; exit 1"})
        assert "Permission denied" in result.text
        assert "sandbox policy" not in result.text and "policy_refusal" not in result.data


def test_the_policy_line_names_each_rule_and_only_follows_what_the_policy_refuses() -> None:
    policy = SandboxPolicy(
        network="allow-list", allow_hosts=("pypi.org", "*.github.com"), limits={"processes": 64}
    )  # type: ignore[arg-type]
    refused = "curl: (56) CONNECT tunnel failed, response 403\n"
    line = policy_line(policy, "/w", refused, None)
    assert line == Line(
        "[sandbox policy: network: only through its HTTP proxy (HTTPS_PROXY), to pypi.org, *.github.com; "
        "limits: processes 64. An error above may be the policy's, which nothing in the command can lift: "
        "work within it]"
    )
    assert policy_line(policy, "/w", "fine\n", None) is None
    assert policy_line(None, "/w", refused, None) is None
    assert policy_line(SandboxPolicy(limits={"cpu_seconds": 1}), "/w", "", "SIGXCPU") is not None  # type: ignore[arg-type]
