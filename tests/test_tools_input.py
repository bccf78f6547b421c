"""``bash_input`` and ``bash``'s ``open_stdin``: the escape notation (pure, and fuzzed), then the tool
driven against the local backend's real processes (a scripted executor only where a refusal is all there
is to see: a backend without open input)."""

from __future__ import annotations

import re
import time
from typing import Any

import anyio
import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_bash import OwnerToken
from dsh_bash.testing import Script, ScriptedConfig, ScriptedExecutor
from dsh_tool_bash import BashToolset, ToolResult
from dsh_tool_bash._keys import NAMED_KEYS, KeyNotationError, decode_keys

ALICE = OwnerToken("alice")
BOB = OwnerToken("bob")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the escape notation (pure) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "data"),
    [
        ("", b""),
        ("plain text", b"plain text"),
        ("héllo ✓", "héllo ✓".encode()),
        ("a\\nb\\rc\\td", b"a\nb\rc\td"),
        ("real\nnewline", b"real\nnewline"),
        ("C:\\\\dir", b"C:\\dir"),
        ("\\e[1m", b"\x1b[1m"),
        ("\\x00\\xff\\x1B\\xaB", b"\x00\xff\x1b\xab"),
        ("\\^C\\^c\\^D\\^Z\\^A", b"\x03\x03\x04\x1a\x01"),
        ("\\^@\\^[\\^\\\\^]\\^^\\^_\\^?", b"\x00\x1b\x1c\x1d\x1e\x1f\x7f"),
        ("\\<up>\\<down>\\<right>\\<left>", b"\x1b[A\x1b[B\x1b[C\x1b[D"),
        ("\\<enter>\\<tab>\\<backspace>\\<esc>\\<UP>", b"\r\t\x7f\x1b\x1b[A"),
        ("yes\\<enter>", b"yes\r"),
        ("x<up>^C", b"x<up>^C"),  # without a backslash nothing is an escape
    ],
)
def test_decode_keys(text: str, data: bytes) -> None:
    assert decode_keys(text) == data


@pytest.mark.parametrize(
    ("text", "message", "position"),
    [
        ("ab\\q", 'unknown escape "\\q" at position 2', 2),
        ("\\", 'incomplete escape "\\" at position 0', 0),
        ("ok\\x4", 'incomplete escape "\\x4" at position 2', 2),
        ("\\xzz", 'incomplete escape "\\xzz" at position 0', 0),
        ("\\^", 'incomplete escape "\\^" at position 0', 0),
        ("\\^1", 'unknown escape "\\^1" at position 0', 0),
        ("\\<home>", 'unknown escape "\\<home>" at position 0', 0),
        ("\\<up", 'incomplete escape "\\<" at position 0', 0),
        ("\\<" + "u" * 1000 + ">", 'incomplete escape "\\<" at position 0', 0),
        ("\\n\\u001b", 'unknown escape "\\u" at position 2', 2),
        ("ab\ud800", "U+D800 at position 2 has no UTF-8 form", 2),
    ],
)
def test_decode_keys_refuses_and_names_the_escape(text: str, message: str, position: int) -> None:
    with pytest.raises(KeyNotationError) as caught:
        decode_keys(text)
    assert message in str(caught.value)
    assert caught.value.position == position
    assert len(str(caught.value)) < 300  # a stray \< does not quote the rest of the input


def _escape_text(text: str) -> str:
    return text.replace("\\", "\\\\")


_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
def test_fuzz_literal_text_with_doubled_backslashes_is_its_utf8(text: str) -> None:
    assert decode_keys(_escape_text(text)) == text.encode()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_fuzz_every_byte_goes_through_hex(data: bytes) -> None:
    assert decode_keys("".join(f"\\x{byte:02x}" for byte in data)) == data


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.sampled_from(["\\", "x", "^", "<", ">", "up", "4", "f", "C", "n", "é", "\ud800"]), max_size=12
    )
)
def test_fuzz_anything_decodes_or_is_refused_by_name(pieces: list[str]) -> None:
    text = "".join(pieces)
    try:
        data = decode_keys(text)
    except KeyNotationError as exc:
        assert 0 <= exc.position < len(text)
        assert text[exc.position] == "\\" or "UTF-8" in str(exc)
    else:
        assert isinstance(data, bytes)
        if "\\" not in text:
            assert data == text.encode()


def test_named_keys_are_the_documented_ones() -> None:
    assert set(NAMED_KEYS) == {"up", "down", "left", "right", "enter", "tab", "backspace", "esc"}


# -- the tool on the local backend -----------------------------------------------------------------------


def _executor(**fields: Any) -> LocalBashExecutor:
    fields.setdefault("grace_ms", 300)
    return LocalBashExecutor(LocalConfig(**fields))


async def _start(tools: BashToolset, command: str, *, open_stdin: bool = True) -> str:
    started = await tools.call(
        "bash", {"command": command, "run_in_background": True, "open_stdin": open_stdin}
    )
    assert not started.is_error, started.text
    assert started.data["open_stdin"] is open_stdin
    return str(started.data["task_id"])


async def _read_until(tools: BashToolset, task_id: str, want: str, limit_s: float = 10) -> str:
    seen = ""
    with anyio.fail_after(limit_s):
        while want not in seen:
            result = await tools.call("bash_output", {"task_id": task_id})
            assert not result.is_error, result.text
            if result.data["new_output"]:
                seen += result.text.rsplit("[status:", 1)[0]
            await anyio.sleep(0.05)
    return seen


async def _input(tools: BashToolset, task_id: str, text: str, **more: Any) -> ToolResult:
    return await tools.call("bash_input", {"task_id": task_id, "input": text, **more})


@pytest.mark.anyio
async def test_answering_a_prompt() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex, owner=ALICE)
        task_id = await _start(tools, 'printf "name? "; read -r n; echo "hi $n"')
        assert await _read_until(tools, task_id, "name? ") == "name? \n"  # the newline before the status
        started = time.monotonic()
        answered = await _input(tools, task_id, "bob\\n", yield_ms=10_000)
        assert time.monotonic() - started < 5  # the task ended: no need to wait the 10 s
        assert not answered.is_error, answered.text
        assert answered.text == (
            f"wrote 4 bytes to task {task_id}\nhi bob\n[status: completed, exit code: 0]"
        )
        data = answered.data
        assert (data["tool"], data["task_id"], data["bytes_written"], data["closed_input"]) == (
            "bash_input",
            task_id,
            4,
            False,
        )
        assert data["status"] == "completed" and data["exit_code"] == 0 and data["new_output"] is True


@pytest.mark.anyio
async def test_escapes_reach_the_task_as_bytes() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        task_id = await _start(tools, "head -c 9 | od -An -tx1 | tr -s ' '")
        result = await _input(tools, task_id, "é\\^C\\<up>\\x00\\\\", yield_ms=0)
        assert result.text == f"wrote 8 bytes to task {task_id}\n(no new output)\n[status: running]"
        result = await _input(tools, task_id, "z", yield_ms=10_000)  # the 9th byte: head ends, od prints
        assert result.text.startswith(f"wrote 1 byte to task {task_id}\n c3 a9 03 1b 5b 41 00 5c 7a"), (
            result.text
        )
        assert result.text.endswith("[status: completed, exit code: 0]")


@pytest.mark.anyio
async def test_close_sends_end_of_input() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        task_id = await _start(tools, "wc -c")
        first = await _input(tools, task_id, "abc", yield_ms=0)
        assert first.text == f"wrote 3 bytes to task {task_id}\n(no new output)\n[status: running]"
        closed = await _input(tools, task_id, "de\\n", close=True, yield_ms=10_000)
        assert closed.text == (
            f"wrote 3 bytes to task {task_id}; closed its input\n6\n[status: completed, exit code: 0]"
        )
        assert closed.data["closed_input"] is True


async def _until_waiting(tools: BashToolset, task_id: str, limit_s: float = 10) -> str:
    """Read the task until a read reports it waiting for input; return what it printed meanwhile."""
    seen = ""
    with anyio.fail_after(limit_s):
        while True:
            result = await tools.call("bash_output", {"task_id": task_id})
            assert not result.is_error, result.text
            if result.data["new_output"]:
                seen += result.text.rsplit("[status:", 1)[0]
            if result.data["waiting_for_input"]:
                return seen
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_yield_ms_waits_while_the_task_runs() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        task_id = await _start(tools, 'read -r l; echo "got $l"; sleep 30')
        # Waiting before the write: that verdict is the write's to clear, not a reason to return early.
        await _until_waiting(tools, task_id)
        started = time.monotonic()
        echoed = await _input(tools, task_id, "one\\n", yield_ms=1500)
        elapsed = time.monotonic() - started
        assert 1.5 <= elapsed < 4, elapsed
        # It read its line and sleeps: it does not wait for input again, so the whole yield_ms passes.
        assert echoed.text == f"wrote 4 bytes to task {task_id}\ngot one\n[status: running]"
        assert echoed.data["waiting_for_input"] is False
        await tools.call("bash_kill", {"task_id": task_id})


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("command", "text", "answer"),
    [
        ('while read -r l; do echo "got $l"; done', "one\\n", "got one\n"),
        ("python3 -i", "6*7\\n", "42\n"),
    ],
    ids=["while-read", "python3-i"],
)
async def test_bash_input_returns_once_the_task_waits_again(command: str, text: str, answer: str) -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        task_id = await _start(tools, command)
        await _until_waiting(tools, task_id)
        started = time.monotonic()
        answered = await _input(tools, task_id, text, yield_ms=10_000)
        elapsed = time.monotonic() - started
        # It answered and blocks reading its next line (seen twice, 200 ms apart): no need to wait 10 s.
        assert elapsed < 5, elapsed
        assert not answered.is_error, answered.text
        assert answer in answered.text, answered.text
        assert answered.text.endswith("[status: running, waiting for input]"), answered.text
        assert answered.data["waiting_for_input"] is True
        started = time.monotonic()
        quick = await _input(tools, task_id, "", yield_ms=0)
        assert time.monotonic() - started < 0.3
        # A write, even an empty one, clears the wait until it is seen again.
        assert quick.text == f"wrote 0 bytes to task {task_id}\n(no new output)\n[status: running]"
        await tools.call("bash_kill", {"task_id": task_id})


async def _refusal(tools: BashToolset, task_id: str, text: str = "x", **more: Any) -> ToolResult:
    result = await _input(tools, task_id, text, yield_ms=0, **more)
    assert result.is_error, result.text
    assert result.data["tool"] == "bash_input" and result.data["task_id"] == task_id
    return result


@pytest.mark.anyio
async def test_refusals_name_the_reason() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        unknown = await _input(tools, "bash-999", "x")
        assert (unknown.text, unknown.data["error"]) == ('unknown bash task "bash-999"', "unknown_task")

        closed_id = await _start(tools, "exec -a input-closed sleep 30", open_stdin=False)
        refused = await _refusal(tools, closed_id)
        assert refused.data["error"] == "input_not_open"
        assert refused.text.startswith(f"task {closed_id} was not started with open_stdin")

        ended_id = await _start(tools, "read -r line")
        ending = await _input(tools, ended_id, "\\n", yield_ms=10_000)
        assert ending.data["status"] == "completed", ending.text
        refused = await _refusal(tools, ended_id)
        assert (refused.text, refused.data["error"]) == (
            f"task {ended_id} has finished; its input is closed",
            "task_ended",
        )

        sleeper = await _start(tools, "sleep 30")
        first = await _input(tools, sleeper, "", close=True, yield_ms=0)
        assert first.text.startswith(f"wrote 0 bytes to task {sleeper}; closed its input\n")
        for close in (False, True):
            refused = await _refusal(tools, sleeper, close=close)
            assert refused.data["error"] == "input_closed"
            assert refused.text.startswith(f"the input of task {sleeper} was closed")

        broken = await _start(tools, "exec 0<&-; sleep 30")
        with anyio.fail_after(10):
            while not (result := await _input(tools, broken, "x" * 1000, yield_ms=50)).is_error:
                pass
        assert (result.text, result.data["error"]) == (f"task {broken} closed its input", "input_broken")

        full = await _start(tools, "sleep 30")  # never reads
        with anyio.fail_after(20):
            writes = 0
            while not (result := await _input(tools, full, "é" * 65_536, yield_ms=0)).is_error:
                writes += 1
        assert result.data["error"] == "input_full", result.text
        assert result.text.startswith(f"task {full} has not read the input it was sent yet"), result.text
        assert 7 <= writes <= 9  # 1 MiB of pending input in writes of 128 KiB (a pipe buffer more held)

        for task_id in (closed_id, sleeper, broken, full):
            await tools.call("bash_kill", {"task_id": task_id})


@pytest.mark.anyio
async def test_another_owner_cannot_write_and_nothing_reaches_the_task() -> None:
    async with _executor() as ex:
        alice, bob, anyone = BashToolset(ex, owner=ALICE), BashToolset(ex, owner=BOB), BashToolset(ex)
        task_id = await _start(alice, "cat")
        for intruder in (bob, anyone):
            refused = await _refusal(intruder, task_id, "intruder\\n", close=True)
            assert (refused.text, refused.data["error"]) == (
                f"task {task_id} belongs to another session",
                "other_owner",
            )
        mine = await _input(alice, task_id, "mine\\n", yield_ms=1500)
        # Still open: cat waits for more.
        assert mine.text == f"wrote 5 bytes to task {task_id}\nmine\n[status: running, waiting for input]"
        shared = await _start(anyone, "cat")  # ownerless: anyone may write
        echoed = await _input(bob, shared, "shared\\n", close=True, yield_ms=10_000)
        assert echoed.text.endswith("shared\n[status: completed, exit code: 0]"), echoed.text
        await alice.call("bash_kill", {"task_id": task_id})


# -- arguments -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "arguments", "needle"),
    [
        ("bash", {"command": "cat", "open_stdin": True}, '"open_stdin" needs "run_in_background": true'),
        ("bash", {"command": "cat", "open_stdin": True, "run_in_background": False}, '"open_stdin" needs'),
        (
            "bash",
            {"command": "cat", "run_in_background": True, "open_stdin": "true"},
            'argument "open_stdin"',
        ),
        ("bash", {"command": "cat", "run_in_background": True, "open_stdin": 1}, 'argument "open_stdin"'),
        ("bash_input", {"task_id": "bash-1"}, 'missing required argument "input"'),
        ("bash_input", {"input": "x"}, 'missing required argument "task_id"'),
        ("bash_input", {"task_id": "bash-1", "input": None}, 'argument "input"'),
        ("bash_input", {"task_id": "bash-1", "input": 5}, 'argument "input"'),
        ("bash_input", {"task_id": "bash-1", "input": "x" * 65_537}, 'argument "input": String should have'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "close": "yes"}, 'argument "close"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "close": 0}, 'argument "close"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "yield_ms": "100"}, 'argument "yield_ms"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "yield_ms": True}, 'argument "yield_ms"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "yield_ms": -1}, 'argument "yield_ms"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "yield_ms": 30_001}, 'argument "yield_ms"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "yield_ms": float("nan")}, 'argument "yield_ms"'),
        ("bash_input", {"task_id": "bash-1", "input": "x", "terminal": True}, 'unknown argument "terminal"'),
        (
            "bash_input",
            {"task_id": "bash-1", "input": "ok\\q"},
            'argument "input": unknown escape "\\q" at position 2',
        ),
        ("bash_input", {"task_id": "bash-1", "input": "\\x1"}, 'incomplete escape "\\x1" at position 0'),
    ],
)
@pytest.mark.anyio
async def test_invalid_arguments(tool: str, arguments: dict[str, Any], needle: str) -> None:
    async with _scripted() as ex:
        result = await BashToolset(ex).call(tool, arguments)
        assert result.is_error and result.data["error"] == "invalid_arguments", result.text
        assert result.text.startswith(f"invalid arguments for {tool}: "), result.text
        assert needle in result.text, result.text
        assert len(result.text) < 600
    assert ex.calls == []


@pytest.mark.anyio
async def test_valid_bounds_and_nulls_are_taken() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        task_id = await _start(tools, "cat")
        for more in ({"yield_ms": 0}, {"yield_ms": 0.5}, {"close": None, "yield_ms": None}):
            result = await _input(tools, task_id, "", **more)
            assert not result.is_error, result.text
        longest = await _input(tools, task_id, "x" * 65_536, yield_ms=0)
        assert longest.text.startswith(f"wrote 65536 bytes to task {task_id}\n"), longest.text[:200]
        await tools.call("bash_kill", {"task_id": task_id})


def _scripted() -> ScriptedExecutor:
    ex = ScriptedExecutor(ScriptedConfig(grace_ms=300), default="raise")
    ex.on("cat", Script(until_killed=True))
    return ex


@pytest.mark.anyio
async def test_a_backend_without_open_input_is_a_clear_start_error() -> None:
    async with _scripted() as ex:
        result = await BashToolset(ex).call(
            "bash", {"command": "cat", "run_in_background": True, "open_stdin": True}
        )
        assert result.is_error and result.data["error"] == "infrastructure", result.text
        assert result.data["reason"] == "interactive_unsupported"
        assert result.text.startswith(
            "the background task could not start: this shell cannot keep a task's stdin open"
        )
        assert "bash_input" in result.text
        plain = await BashToolset(ex).call("bash", {"command": "cat", "run_in_background": True})
        assert not plain.is_error and plain.data["open_stdin"] is False


@pytest.mark.anyio
async def test_a_closed_executor_is_an_error() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        task_id = await _start(tools, "cat")
    result = await _input(tools, task_id, "x")
    assert result.is_error and result.data["error"] == "executor_closed", result.text
    assert result.text == "could not write to the task: the shell executor is closed"


@pytest.mark.anyio
async def test_foreground_only_toolset_has_no_input() -> None:
    async with _scripted() as ex:
        tools = BashToolset(ex, background=False)
        unknown = await tools.call("bash_input", {"task_id": "bash-1", "input": "x"})
        assert unknown.text == 'unknown tool "bash_input" (available: bash)'
        refused = await tools.call("bash", {"command": "cat", "open_stdin": True})
        assert 'unknown argument "open_stdin"' in refused.text


def test_definitions_offer_bash_input_beside_the_background_tools() -> None:
    tools = BashToolset(_scripted())
    definitions = {d.name: d for d in tools.definitions()}
    assert list(definitions) == ["bash", "bash_output", "bash_input", "bash_kill"]
    schema = definitions["bash_input"].input_schema
    assert schema["required"] == ["task_id", "input"] and schema["additionalProperties"] is False
    assert schema["properties"]["input"]["maxLength"] == 65_536
    assert schema["properties"]["yield_ms"] == {
        "type": "number",
        "minimum": 0,
        "maximum": 30_000,
        "default": 1000,
        "description": schema["properties"]["yield_ms"]["description"],
    }
    assert schema["properties"]["close"]["type"] == "boolean"
    description = definitions["bash_input"].description
    for needle in (
        "\\n",
        "\\xHH",
        "\\^C",
        "\\<up>",
        "\\<backspace>",
        "close: true",
        "yield_ms",
        "wrote N bytes",
    ):
        assert needle in description, needle
    bash = definitions["bash"]
    assert bash.input_schema["properties"]["open_stdin"]["type"] == "boolean"
    assert "open_stdin" in bash.description and "bash_input" in bash.description
    assert re.search(
        r"\bbash_input\b", definitions["bash"].input_schema["properties"]["open_stdin"]["description"]
    )


@pytest.mark.anyio
async def test_a_terminal_task_through_the_tools() -> None:
    async with _executor() as ex:
        tools = BashToolset(ex)
        refused = await tools.call("bash", {"command": "tty", "terminal": True})
        assert refused.is_error and refused.data["error"] == "invalid_arguments"
        assert 'argument "terminal" needs "run_in_background": true' in refused.text
        started = await tools.call(
            "bash",
            {
                "command": 'stty size; read -r -p "pass? " p; echo "[$p]"',
                "run_in_background": True,
                "terminal": True,
            },
        )
        assert (started.data["terminal"], started.data["open_stdin"]) == (True, True)
        task_id = str(started.data["task_id"])
        asked = await _input(tools, task_id, "", yield_ms=2000)
        # The prompt reads the terminal: the wait is seen, and the terminal's size is the tools' 24x80.
        assert asked.text.endswith("24 80\r\npass? \n[status: running, waiting for input]"), asked.text
        answered = await _input(tools, task_id, "s3cret\\r", yield_ms=5000)
        assert answered.text == (
            f"wrote 7 bytes to task {task_id}\ns3cret\r\n[s3cret]\r\n[status: completed, exit code: 0]"
        ), answered.text
        closing = await _input(tools, task_id, "x", close=True, yield_ms=0)
        assert closing.data["error"] == "task_ended"
