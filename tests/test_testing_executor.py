"""dsh_bash.testing: the scripted executor, on asyncio and trio.

Each test drives the real base class through the scripted backend, so what it checks is the seam's
behaviour (classification, accounting, reads, kills, listeners, close) on scripted commands.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from dsh_bash import (
    AbortController,
    BashExecRequest,
    BashExecSpec,
    BashInfrastructureError,
    BashTask,
    ExecutorClosedError,
    OwnerToken,
    load_executor,
)
from dsh_bash.backend import MARKER_VAR
from dsh_bash.testing import (
    Chunk,
    InfraFailure,
    Script,
    ScriptedConfig,
    ScriptedExecutor,
    UnscriptedCommandError,
    command_not_found,
)

SIGTERM, SIGKILL = int(signal.SIGTERM), int(signal.SIGKILL)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _executor(**fields: Any) -> ScriptedExecutor:
    fields.setdefault("grace_ms", 200)
    return ScriptedExecutor(ScriptedConfig(**fields))


def _request(command: str, **fields: Any) -> BashExecRequest:
    return BashExecRequest(command=command, **fields)


async def _read_all(ex: ScriptedExecutor, task: BashTask, limit_s: float = 5) -> list[Any]:
    """Read until the task ended and a last read came after the end; return every read."""
    reads = []
    with anyio.fail_after(limit_s):
        while True:
            ended = task.status != "running"
            reads.append(await ex.read_output(task.id))
            if ended:
                return reads
            await anyio.sleep(0.02)


# -- matching -------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_rules_match_exact_regex_and_predicate_first_match_wins() -> None:
    ex = ScriptedExecutor(scripts={"ls": Script(stdout="a\nb\n")})
    ex.on(re.compile(r"^git (status|diff)\b"), Script(stdout="clean\n")).on(
        lambda spec: spec.workdir.endswith("/sub"), Script(stdout="in sub\n")
    )
    ex.on("ls", Script(stdout="never: an earlier rule matches\n"))
    ex.on(re.compile(r"^echo (.*)"), lambda spec: Script(stdout=spec.command[5:] + "\n"))
    async with ex:
        assert (await ex.exec("ls")).stdout.text == "a\nb\n"
        assert (await ex.exec("git status --short")).stdout.text == "clean\n"
        assert (await ex.exec("ls -l")).exit_code == 127  # exact means exact
        assert (await ex.exec("pwd", workdir="sub")).stdout.text == "in sub\n"
        assert (await ex.exec("echo hi there")).stdout.text == "hi there\n"
        ex.on("late", Script(exit_code=5))  # rules can be added while open
        assert (await ex.exec("late")).exit_code == 5
    assert ex.commands == ["ls", "git status --short", "ls -l", "pwd", "echo hi there", "late"]
    assert [c.matched for c in ex.calls] == [True, True, False, True, True, True]
    assert [c.command for c in ex.unmatched] == ["ls -l"]


@pytest.mark.anyio
async def test_default_is_bash_command_not_found() -> None:
    async with ScriptedExecutor() as ex:
        result = await ex.exec("frobnicate --all")
        assert result.exit_code == 127 and result.signal is None
        assert result.stderr.text == "bash: line 1: frobnicate: command not found\n"
        assert result.stdout.text == ""
        blank = await ex.exec("   ")
        assert (blank.exit_code, blank.stderr.text) == (0, "")
    assert [c.script for c in ex.unmatched] == [
        command_not_found(ex.calls[0].spec),
        Script(),
    ]


@pytest.mark.anyio
async def test_default_can_be_a_script_a_function_or_raise() -> None:
    async with ScriptedExecutor(default=Script(stdout="anything\n")) as ex:
        assert (await ex.exec("whatever")).stdout.text == "anything\n"
    async with ScriptedExecutor(default=lambda spec: Script(stdout=f"<{spec.command}>")) as ex:
        assert (await ex.exec("x y")).stdout.text == "<x y>"
    async with ScriptedExecutor(default="raise").on("ok", Script()) as ex:
        assert (await ex.exec("ok")).exit_code == 0
        with pytest.raises(UnscriptedCommandError, match="'surprise'") as caught:
            await ex.exec("surprise")
        assert caught.value.reason == "start_failed"
        assert isinstance(caught.value, BashInfrastructureError)
        with pytest.raises(UnscriptedCommandError):
            await ex.start(ex.resolve(_request("background surprise")))
        assert [(c.command, c.script) for c in ex.unmatched] == [
            ("surprise", None),
            ("background surprise", None),
        ]


@pytest.mark.anyio
async def test_an_answer_that_returns_no_script_is_a_start_failure() -> None:
    async with ScriptedExecutor().on("bad", lambda spec: "oops") as ex:  # type: ignore[arg-type,return-value]
        with pytest.raises(BashInfrastructureError, match="not a Script") as caught:
            await ex.exec("bad")
        assert caught.value.reason == "start_failed"


# -- what is recorded ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_calls_record_the_resolved_specs() -> None:
    controller = AbortController()
    ex = _executor(
        cwd="/repo",
        timeout_ms=1_000,
        max_timeout_ms=5_000,
        ambient_env={"PATH": "/bin", "GITHUB_TOKEN": "secret", "LANG": "C"},
    )
    ex.on(re.compile(""), Script())
    async with ex:
        await ex.exec("a")
        await ex.exec(
            "b",
            workdir="src",
            timeout_ms=60_000,
            env={"X": "1"},
            stdin=b"\x00input",
            owner=OwnerToken("alice"),
            signal=controller.signal,
        )
        task = await ex.start(ex.resolve(_request("c", workdir="/abs", stdin="text", task_timeout_ms=9_000)))
        await task.wait()
    first, second, third = ex.calls
    assert (first.command, first.workdir, first.timeout_ms, first.owner, first.stdin) == (
        "a",
        "/repo",
        1_000,
        None,
        None,
    )
    assert first.background is False and first.spec.env is None
    assert (second.workdir, second.timeout_ms, second.owner, second.stdin) == (
        "/repo/src",
        5_000,  # clamped to max_timeout_ms
        "alice",
        b"\x00input",
    )
    assert second.spec.env == {"X": "1"} and second.spec.signal is controller.signal
    assert (third.workdir, third.stdin, third.background) == ("/abs", "text", True)
    assert (first.spec.task_timeout_ms, third.spec.task_timeout_ms) == (None, 5_000)  # clamped too
    # The whole environment the command got: ambient minus the scrub, the model-friendly set, the caller's.
    env = second.env
    assert env["PATH"] == "/bin" and env["LANG"] == "C" and env["X"] == "1"
    assert "GITHUB_TOKEN" not in env
    assert env["PAGER"] == "cat" and env["NO_COLOR"] == "1"
    assert env[MARKER_VAR] != first.env[MARKER_VAR]
    assert all(isinstance(c.spec, BashExecSpec) for c in ex.calls)
    assert ex.calls is not ex.calls  # a copy each time


# -- foreground -------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_foreground_output_exit_code_and_signal() -> None:
    ex = _executor()
    ex.on("mixed", Script(stdout="out", stderr=b"err\n", chunks=[Chunk("more\n")], exit_code=3))
    ex.on("segv", Script(stdout="x\n", signal=signal.SIGSEGV))
    ex.on("slowish", Script(duration_s=0.2))
    async with ex:
        mixed = await ex.exec("mixed")
        assert (mixed.stdout.text, mixed.stderr.text, mixed.exit_code) == ("outmore\n", "err\n", 3)
        assert mixed.stdout.total_bytes == 8 and not mixed.stdout.truncated
        assert not (mixed.timed_out or mixed.aborted) and mixed.signal is None
        segv = await ex.exec("segv")
        assert (segv.exit_code, segv.signal, segv.timed_out) == (None, "SIGSEGV", False)
        slow = await ex.exec("slowish")
        assert slow.exit_code == 0 and slow.duration_ms >= 190
    assert [c.signals for c in ex.calls] == [[], [], []]
    assert not any(c.running for c in ex.calls)


@pytest.mark.anyio
async def test_timeout_kills_a_slow_script_with_sigterm() -> None:
    ex = _executor().on("slow", Script(stdout="begun\n", duration_s=30))
    async with ex:
        started = time.monotonic()
        result = await ex.exec("slow", timeout_ms=150)
        elapsed = time.monotonic() - started
    assert 0.14 <= elapsed < 2
    assert (result.timed_out, result.aborted, result.exit_code, result.signal) == (
        True,
        False,
        None,
        "SIGTERM",
    )
    assert result.stdout.text == "begun\n" and result.timeout_ms == 150
    assert ex.calls[0].signals == [SIGTERM] and not ex.calls[0].running


@pytest.mark.anyio
async def test_timeout_of_a_script_that_ignores_sigterm_ends_in_sigkill_after_the_grace() -> None:
    ex = _executor(grace_ms=300).on("stubborn", Script(until_killed=True, ignores_sigterm=True))
    async with ex:
        started = time.monotonic()
        result = await ex.exec("stubborn", timeout_ms=100)
        elapsed = time.monotonic() - started
    assert 0.38 <= elapsed < 3  # the timeout, then the whole grace
    assert (result.timed_out, result.signal, result.exit_code) == (True, "SIGKILL", None)
    assert ex.calls[0].signals == [SIGTERM, SIGKILL]


@pytest.mark.anyio
async def test_abort_during_a_run_and_before_it() -> None:
    ex = _executor().on("wait", Script(stdout="waiting\n", until_killed=True))
    async with ex:
        controller = AbortController()
        results = []

        async def run() -> None:
            results.append(await ex.exec("wait", signal=controller.signal, timeout_ms=10_000))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                while True:
                    if ex.calls and ex.calls[0].running:
                        break
                    await anyio.sleep(0.01)
                controller.abort()
        (result,) = results
        assert (result.aborted, result.timed_out, result.signal) == (True, False, "SIGTERM")
        assert result.stdout.text == "waiting\n"
        # An already aborted signal starts nothing: the backend is never asked.
        with pytest.raises(BashInfrastructureError) as caught:
            await ex.exec("wait", signal=controller.signal)
        assert caught.value.reason == "already_aborted"
    assert ex.commands == ["wait"]


@pytest.mark.anyio
async def test_callers_cancellation_kills_the_script() -> None:
    ex = _executor().on("forever", Script(until_killed=True))
    async with ex:
        with anyio.move_on_after(0.1):
            await ex.exec("forever")
        assert ex.calls[0].signals == [SIGTERM] and not ex.calls[0].running


@pytest.mark.anyio
async def test_truncation_and_spill_in_memory() -> None:
    whole = "".join(f"{i}\n" for i in range(1, 1001)).encode()
    ex = _executor(max_output_bytes=100).on("seq", Script(stdout=whole, stderr="e" * 50))
    async with ex:
        result = await ex.exec("seq")
        out = result.stdout
        assert out.truncated and out.total_bytes == len(whole)
        assert out.text == whole[-100:].decode()
        assert out.spill_path is not None and out.spill_path.startswith("/tmp/dsh-bash-scripted/")
        assert out.spill_path.endswith(".stdout")
        assert ex.read_spill(out.spill_path) == whole
        assert not result.stderr.truncated and result.stderr.spill_path is None
        with pytest.raises(FileNotFoundError):
            ex.read_spill("/tmp/dsh-bash-scripted/nothing.stdout")
    with pytest.raises(FileNotFoundError):  # spill files go with the executor, as real ones do
        ex.read_spill(out.spill_path)


@pytest.mark.anyio
async def test_spill_caps_apply() -> None:
    ex = _executor(max_output_bytes=10, max_spill_bytes=100).on("big", Script(stdout=b"x" * 101))
    ex.on("chunked", Script(chunks=[Chunk(b"y" * 60), Chunk(b"y" * 60)]))
    async with ex:
        assert (await ex.exec("big")).stdout.spill_path is None  # over the cap from the start
        chunked = (await ex.exec("chunked")).stdout
        assert chunked.truncated and chunked.spill_path is None and chunked.total_bytes == 120
        assert len(ex.calls) == 2


# -- background -------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_background_reads_are_incremental_and_exactly_once() -> None:
    chunks = [Chunk(f"line {i}\n", delay_s=0.03) for i in range(8)]
    chunks.insert(4, Chunk("warn\n", stream="stderr"))
    # A character split across two chunks is decoded whole.
    chunks += [Chunk(b"caf\xc3", delay_s=0.03), Chunk(b"\xa9\n", delay_s=0.03)]
    ex = _executor().on("tail", Script(chunks=chunks, exit_code=2))
    async with ex:
        task = await ex.start(ex.resolve(_request("tail")))
        assert task.status == "running"
        reads = await _read_all(ex, task)
        again = await ex.read_output(task.id)
    assert (again.delta, again.lossy) == ("", False)
    assert len([r for r in reads if r.delta]) >= 2  # it arrived over time
    stdout = "".join(r.delta.split("[stderr]\n")[0] for r in reads)
    assert stdout.replace("\n", "") == "".join(f"line {i}" for i in range(8)) + "caf\xe9"
    assert sum(r.delta.count("warn\n") for r in reads) == 1
    assert not any(r.lossy for r in reads)
    assert (task.status, task.exit_code, task.end_cause) == ("completed", 2, "exited")


@pytest.mark.anyio
async def test_background_reads_are_lossy_with_a_small_tail() -> None:
    chunks = [Chunk(f"{i:04d}\n".encode(), delay_s=0.005 if i % 50 == 0 else 0) for i in range(400)]
    whole = b"".join(c.payload for c in chunks)
    ex = _executor(max_output_bytes=64).on("fast", Script(chunks=chunks))
    async with ex:
        task = await ex.start(ex.resolve(_request("fast")))
        await task.wait()
        read = await ex.read_output(task.id)
        assert read.lossy and read.dropped_bytes == len(whole) - 64
        assert read.delta == whole[-64:].decode()
        assert read.stdout_spill_path is not None and read.stderr_spill_path is None
        assert ex.read_spill(read.stdout_spill_path) == whole
        again = await ex.read_output(task.id)
        assert (again.delta, again.lossy, again.dropped_bytes) == ("", False, 0)


@pytest.mark.anyio
async def test_listeners_are_called_once_per_task_and_not_after_close() -> None:
    ex = _executor()
    ex.on("quick", Script(stdout="q"))
    ex.on("later", Script(chunks=[Chunk("x", delay_s=0.05)], exit_code=1))
    ex.on("forever", Script(until_killed=True))
    seen: list[tuple[str, str | None, int | None]] = []
    ex.on_task_done(lambda task: seen.append((task.id, task.end_cause, task.exit_code)))
    ex.on_task_done(lambda task: 1 / 0)  # a raising listener disturbs nothing
    async with ex:
        quick = await ex.start(ex.resolve(_request("quick")))
        later = await ex.start(ex.resolve(_request("later")))
        killed = await ex.start(ex.resolve(_request("forever")))
        forever = await ex.start(ex.resolve(_request("forever")))
        for task in (quick, later):
            await task.wait()
        assert await ex.kill(killed.id) is True
        await killed.wait()
        assert await ex.kill(killed.id) is False
        await anyio.sleep(0.05)
    assert sorted(seen) == sorted(
        [(quick.id, "exited", 0), (later.id, "exited", 1), (killed.id, "killed", None)]
    )
    assert forever.end_cause == "closed" and forever.status == "killed"


@pytest.mark.anyio
async def test_kill_and_owner() -> None:
    ex = _executor().on("server", Script(stdout="listening\n", until_killed=True))
    async with ex:
        task = await ex.start(ex.resolve(_request("server", owner=OwnerToken("bob"))))
        assert ex.owner_of(task.id) == "bob" and task.owner == "bob"
        await anyio.sleep(0.02)
        assert await ex.kill(task.id) is True
        await task.wait()
        assert (task.status, task.end_cause, task.signal, task.exit_code) == (
            "killed",
            "killed",
            "SIGTERM",
            None,
        )
        assert (await ex.read_output(task.id)).delta == "listening\n"
    assert ex.calls[0].signals == [SIGTERM]


@pytest.mark.anyio
async def test_kill_of_a_script_that_ignores_sigterm() -> None:
    ex = _executor(grace_ms=600).on("trap", Script(until_killed=True, ignores_sigterm=True))
    async with ex:
        task = await ex.start(ex.resolve(_request("trap")))
        started = time.monotonic()
        await ex.kill(task.id)
        await anyio.sleep(0.1)
        assert task.status == "running" and ex.calls[0].running  # SIGTERM did nothing
        await task.wait()
        assert time.monotonic() - started >= 0.59
        assert (task.end_cause, task.signal) == ("killed", "SIGKILL")
    assert ex.calls[0].signals == [SIGTERM, SIGKILL]


@pytest.mark.anyio
async def test_a_script_that_signals_itself_is_signaled_not_killed() -> None:
    ex = _executor().on("crash", Script(chunks=[Chunk("x", delay_s=0.02)], signal=signal.SIGABRT))
    async with ex:
        task = await ex.start(ex.resolve(_request("crash")))
        await task.wait()
        assert (task.status, task.end_cause, task.signal) == ("completed", "signaled", "SIGABRT")
    assert ex.calls[0].signals == []


# -- infrastructure failures --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_infrastructure_failure_at_start() -> None:
    missing = Script(failure=InfraFailure("workdir_missing", "no such directory: /nope"))
    ex = _executor().on(lambda spec: spec.workdir == "/nope", missing)
    async with ex:
        for start in (ex.run, ex.start):
            with pytest.raises(BashInfrastructureError, match="no such directory") as caught:
                await start(ex.resolve(_request("ls", workdir="/nope")))
            assert caught.value.reason == "workdir_missing"
        assert (await ex.exec("true", workdir="/ok")).exit_code == 127
    assert [c.workdir for c in ex.calls] == ["/nope", "/nope", "/ok"]
    assert not any(c.running for c in ex.calls)


@pytest.mark.anyio
async def test_infrastructure_failure_mid_run() -> None:
    lost = Script(
        stdout="partial\n",
        duration_s=0.05,
        failure=InfraFailure("connection_lost", "the host went away", at_start=False),
    )
    ex = _executor().on("remote", lost)
    async with ex:
        with pytest.raises(BashInfrastructureError, match="the host went away") as caught:
            await ex.exec("remote")
        assert caught.value.reason == "connection_lost"
        task = await ex.start(ex.resolve(_request("remote")))
        await task.wait()
        assert (task.status, task.end_cause) == ("killed", "lost")
        assert (await ex.read_output(task.id)).delta == "partial\n"


# -- lifecycle ----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_aclose_kills_everything_and_is_idempotent() -> None:
    ex = _executor(grace_ms=200)
    ex.on("fg", Script(until_killed=True))
    ex.on("bg", Script(until_killed=True, ignores_sigterm=True))
    outcome: list[BaseException] = []
    async with ex:
        task = await ex.start(ex.resolve(_request("bg")))

        async def foreground() -> None:
            try:
                await ex.exec("fg")
            except ExecutorClosedError as exc:
                outcome.append(exc)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(foreground)
                while True:
                    if len(ex.calls) == 2:
                        break
                    await anyio.sleep(0.01)
                tg.start_soon(ex.aclose)
                await ex.aclose()
    assert len(outcome) == 1
    assert (task.status, task.end_cause, task.signal) == ("killed", "closed", "SIGKILL")
    assert not any(c.running for c in ex.calls)
    # Each command gets its own kill sequence, and the sweep of leftovers signals what still runs.
    signals = {c.command: c.signals for c in ex.calls}
    assert signals["bg"][0] == SIGTERM and set(signals["bg"]) == {SIGTERM, SIGKILL}
    assert signals["fg"] == [SIGTERM]
    with pytest.raises(ExecutorClosedError):
        await ex.exec("fg")
    with pytest.raises(ExecutorClosedError):
        ex.resolve(_request("fg"))
    assert len(ex.calls) == 2


@pytest.mark.anyio
async def test_load_executor_builds_it_from_fields() -> None:
    ex = load_executor(
        {"backend": "dsh_bash.testing:ScriptedExecutor.from_fields", "cwd": "/w", "ambient_env": {"A": "b"}},
        max_output_bytes=5,
    )
    assert isinstance(ex, ScriptedExecutor)
    async with ex:
        result = await ex.exec("nope")
        assert result.stderr.truncated
    assert ex.calls[0].workdir == "/w" and ex.calls[0].env["A"] == "b"


# -- validation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Script(exit_code=256), "0..255"),
        (lambda: Script(exit_code=True), "exit_code must be an int"),
        (lambda: Script(signal=0), "signal number"),
        (lambda: Script(exit_code=1, signal=9), "exit_code and signal"),
        (lambda: Script(until_killed=True, signal=9), "signal and until_killed"),
        (lambda: Script(until_killed=True, duration_s=1), "duration_s"),
        (lambda: Script(duration_s=-1), "duration_s"),
        (lambda: Script(duration_s=float("inf")), "duration_s"),
        (lambda: Script(stdout="x", failure=InfraFailure()), "fails at start"),
        (lambda: Script(chunks=["x"]), "Chunk objects"),  # type: ignore[list-item]
        (lambda: Script(stdout=1), "bytes or str"),  # type: ignore[arg-type]
        (lambda: Chunk("x", stream="both"), "stream"),  # type: ignore[arg-type]
        (lambda: Chunk("x", delay_s=-0.1), "delay_s"),
        (lambda: Chunk(5), "bytes or str"),  # type: ignore[arg-type]
        (lambda: InfraFailure("nope"), "unknown infrastructure error reason"),  # type: ignore[arg-type]
        (lambda: ScriptedExecutor().on(5, Script()), "match must be"),  # type: ignore[arg-type]
        (lambda: ScriptedExecutor().on("x", "y"), "answer must be"),  # type: ignore[arg-type]
    ],
)
def test_invalid_scripts_are_refused(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        make()


def test_scripts_are_frozen_values() -> None:
    script = Script(chunks=[Chunk("a")])
    assert script.chunks == (Chunk("a"),)
    assert script == Script(chunks=(Chunk("a"),))
    with pytest.raises(AttributeError):
        script.exit_code = 1  # type: ignore[misc]
    assert Chunk("é").payload == "é".encode()


# -- the documented examples run ----------------------------------------------------------------------------


@pytest.mark.parametrize("readme", ["README.md", "dsh_bash/README.md"])
def test_documented_examples_run(readme: str) -> None:
    root = Path(__file__).resolve().parent.parent
    blocks = re.findall(r"```python\n(.*?)```", (root / readme).read_text(), flags=re.DOTALL)
    examples = [block for block in blocks if "from dsh_bash.testing import" in block]
    assert len(examples) == 1
    exec(compile(examples[0], f"{readme} (ScriptedExecutor example)", "exec"), {"__name__": "example"})
