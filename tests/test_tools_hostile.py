"""dsh_tool_bash against hostile input: arguments nested too deeply or too large, and command output
full of terminal control sequences.

- Arguments (a JSON string or an already-parsed object) nested more than ``MAX_ARGUMENT_DEPTH`` levels
  or larger than ``MAX_ARGUMENT_BYTES`` are refused as ``invalid_arguments`` naming the problem, fast,
  before anything runs; never ``internal`` (a ``RecursionError``), never a hang.
- The text for the model shows control characters escaped (``\\x1b``, ``\\x07``, ``\\x9b``, a lone CR as
  ``\\x0d``), and a backslash that would read as such an escape is doubled; ``data`` and the executor's
  own results keep the raw text.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_bash import BashRunResult, CollectedOutput, OwnerToken
from dsh_bash.testing import Chunk, Script, ScriptedConfig, ScriptedExecutor
from dsh_tool_bash import BashToolset
from dsh_tool_bash._render import escape_controls, render_output, render_run
from dsh_tool_bash._toolset import MAX_ARGUMENT_BYTES, MAX_ARGUMENT_DEPTH

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _scripted() -> ScriptedExecutor:
    ex = ScriptedExecutor(ScriptedConfig(grace_ms=300), default="raise")
    ex.on("echo ok", Script(stdout="ok\n"))
    return ex


def _nested_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _nested_dict(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


async def _refused(arguments: Any, needle: str, tool: str = "bash") -> None:
    async with _scripted() as ex:
        started = time.monotonic()
        result = await BashToolset(ex).call(tool, arguments)
        elapsed = time.monotonic() - started
        assert result.data.get("error") == "invalid_arguments", result.text[:300]
        assert result.is_error is True
        assert result.text.startswith(f"invalid arguments for {tool}: "), result.text[:300]
        assert needle in result.text, result.text[:300]
        assert len(result.text) < 500
        assert elapsed < 5
    assert ex.calls == []


# -- arguments: nested too deeply ---------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH + 1, 1_000, 100_000])
@pytest.mark.parametrize("tool", ["bash", "bash_output", "bash_kill"])
async def test_json_string_nested_too_deeply_is_invalid_arguments(depth: int, tool: str) -> None:
    text = '{"command": ' + "[" * depth + "]" * depth + "}"
    await _refused(text, "nested too deeply", tool)


@pytest.mark.parametrize("depth", [1_000, 100_000])
async def test_top_level_json_nested_too_deeply_is_invalid_arguments(depth: int) -> None:
    await _refused("[" * depth + "]" * depth, "nested too deeply")
    await _refused('{"a":' * depth + "1" + "}" * depth, "nested too deeply")


@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH + 1, 100_000])
async def test_mapping_nested_too_deeply_is_invalid_arguments(depth: int) -> None:
    await _refused({"command": _nested_list(depth)}, "nested too deeply")
    await _refused({"command": "echo ok", "description": _nested_dict(depth)}, "nested too deeply")


async def test_a_deeply_nested_key_is_invalid_arguments_not_a_crash() -> None:
    key: Any = ()
    for _ in range(100_000):
        key = (key,)
    await _refused({key: 1, "command": "echo ok"}, "invalid arguments")


async def test_nesting_within_the_bound_is_judged_by_the_schema() -> None:
    await _refused({"command": _nested_list(MAX_ARGUMENT_DEPTH - 1)}, 'argument "command"')


# -- arguments: too large -----------------------------------------------------------------------------


async def test_json_string_too_large_is_invalid_arguments() -> None:
    text = json.dumps({"command": "echo ok", "description": "x" * MAX_ARGUMENT_BYTES})
    await _refused(text, "too large")
    await _refused(
        json.dumps({"command": "echo ok", "description": "é" * (MAX_ARGUMENT_BYTES // 2)}), "too large"
    )
    await _refused(" " * (50 * MAX_ARGUMENT_BYTES) + "{}", "too large")


async def test_mapping_too_large_is_invalid_arguments() -> None:
    await _refused({"command": "echo ok", "description": "x" * (2 * MAX_ARGUMENT_BYTES)}, "too large")
    await _refused({"command": "x" * (50 * MAX_ARGUMENT_BYTES)}, "too large")
    await _refused({f"k{i}": i for i in range(300_000)}, "too large")
    await _refused({"command": "echo ok", "description": [[1] * 1000] * 1000}, "too large")


async def test_large_arguments_within_the_bound_still_run() -> None:
    description = "x" * (MAX_ARGUMENT_BYTES - 1000)
    async with _scripted() as ex:
        tools = BashToolset(ex)
        as_json = await tools.call("bash", json.dumps({"command": "echo ok", "description": description}))
        as_dict = await tools.call("bash", {"command": "echo ok", "description": description})
    assert (as_json.text, as_json.is_error) == ("ok\n", False)
    assert (as_dict.text, as_dict.is_error) == ("ok\n", False)


# -- output: terminal control sequences ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain text\n\ttabbed\n", "plain text\n\ttabbed\n"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
        ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
        ("\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\", "\\x1b]8;;http://evil\\x1b\\link\\x1b]8;;\\x1b\\"),
        ("\x00\x01\x08\x0b\x0c\x1f\x7f", "\\x00\\x01\\x08\\x0b\\x0c\\x1f\\x7f"),
        ("\x9b31m\x9d0;t\x9c\x80\x85\x9f", "\\x9b31m\\x9d0;t\\x9c\\x80\\x85\\x9f"),
        ("crlf\r\nline\r\n", "crlf\r\nline\r\n"),
        ("progress 10%\rprogress 99%\r", "progress 10%\\x0dprogress 99%\\x0d"),
        ("é 𝄞 \u00a0 \u200b", "é 𝄞 \u00a0 \u200b"),
        # backslashes the command printed: doubled only where they would read as an escape
        ("C:\\dir\\new \\n \\u001b \\\\", "C:\\dir\\new \\n \\u001b \\\\"),
        ("\\x1b[31m", "\\\\x1b[31m"),
        ("\\\\x07", "\\\\\\\\x07"),
        ("\\\x1b", "\\\\\\x1b"),
        ("\\xZZ \\x1", "\\xZZ \\x1"),
    ],
)
def test_escape_controls(raw: str, shown: str) -> None:
    assert escape_controls(raw) == shown


def _unescape(text: str) -> str:
    """The documented reading of the escaping: in a run of backslashes before ``xHH``, pairs are one
    backslash each, and an odd last one with ``xHH`` is the character U+00HH."""

    def one(match: re.Match[str]) -> str:
        run, code = match.group(1), match.group(2)
        return "\\" * (len(run) // 2) + (chr(int(code, 16)) if len(run) % 2 else "x" + code)

    return re.sub(r"(\\+)x([0-9a-fA-F]{2})", one, text)


@pytest.mark.parametrize(
    "raw",
    ["\\x1b\x1b", "\\\\\x07\\x07", "a\\\\\\x9b\x9b\\", "\r\r\n\\x0d", "".join(chr(i) for i in range(0x100))],
)
def test_escaping_is_unambiguous(raw: str) -> None:
    shown = escape_controls(raw)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown.replace("\r\n", "")), shown
    assert _unescape(shown) == raw


@settings(max_examples=500, deadline=None, database=None)
@given(
    st.text(alphabet=st.sampled_from(["\\", "x", "1", "b", "F", "\x1b", "\r", "\n", "\x9b", "\t", "é"]))
    | st.text()
)
def test_escaping_reads_back_exactly(raw: str) -> None:
    shown = escape_controls(raw)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown.replace("\r\n", "")), shown
    assert _unescape(shown) == raw


def test_rendered_text_escapes_stdout_stderr_and_deltas() -> None:
    out = CollectedOutput(
        text="\x1b[2J\x1b]0;title\x07out\n",
        total_bytes=0,
        truncated=False,
        spill_path=None,
        data=b"\x1b[2J\x1b]0;title\x07out\n",
    )
    err = CollectedOutput(
        text="\x9b1;1Herr\r", total_bytes=0, truncated=False, spill_path=None, data="\x9b1;1Herr\r".encode()
    )
    result = BashRunResult(
        exit_code=1,
        signal=None,
        timed_out=False,
        aborted=False,
        timeout_ms=1000,
        duration_ms=1,
        stdout=out,
        stderr=err,
    )
    assert render_run(result) == "\\x1b[2J\\x1b]0;title\\x07out\n[stderr]\n\\x9b1;1Herr\\x0d\n[exit code: 1]"
    assert render_output("\x1bc\x07", lossy=False, spill_paths=(None, None), status="[status: running]") == (
        "\\x1bc\\x07\n[status: running]"
    )


async def test_background_deltas_are_escaped() -> None:
    ex = ScriptedExecutor(ScriptedConfig(grace_ms=300), default="raise")
    chunks = [Chunk("\x1b]52;c;Y2xpcA==\x07"), Chunk("\x07\x9b", stream="stderr")]
    ex.on("noisy", Script(chunks=chunks))
    async with ex:
        tools = BashToolset(ex, owner=OwnerToken("o"))
        started = await tools.call("bash", {"command": "noisy", "run_in_background": True})
        task_id = started.data["task_id"]
        texts = []
        for _ in range(100):
            read = await tools.call("bash_output", {"task_id": task_id})
            texts.append(read.text)
            if read.data["status"] != "running":
                break
    text = "".join(texts)
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert "\\x1b]52;c;Y2xpcA==\\x07" in text and "\\x07\\x9b" in text


async def test_local_command_output_is_escaped_for_the_model_and_raw_for_the_api() -> None:
    command = r"printf '\033[31mred\033[0m\a\r\n'; printf '\302\233x\\x1b' >&2"
    async with LocalBashExecutor(LocalConfig(grace_ms=300)) as ex:
        raw = await ex.exec(command)
        result = await BashToolset(ex).call("bash", {"command": command})
    assert raw.stdout.text == "\x1b[31mred\x1b[0m\x07\r\n"
    assert raw.stderr.text == "\x9bx\\x1b"
    assert result.text == "\\x1b[31mred\\x1b[0m\\x07\r\n[stderr]\n\\x9bx\\\\x1b"
    assert result.is_error is False


async def test_error_texts_are_escaped() -> None:
    async with _scripted() as ex:
        result = await BashToolset(ex).call("bash_output", {"task_id": "bash-\x1b]0;x\x07"})
    assert result.data["error"] == "unknown_task"
    assert result.text == 'unknown bash task "bash-\\x1b]0;x\\x07"'
    assert result.data["task_id"] == "bash-\x1b]0;x\x07"
