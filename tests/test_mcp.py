"""``dsh-bash mcp`` driven by the official MCP SDK's own client, over stdio and streamable HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from dsh_bash_conformance import find_host_processes

pytest.importorskip("mcp", reason="backend unavailable: the mcp SDK is missing (pip install 'dsh-bash[mcp]')")

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp_types import CallToolResult, LoggingMessageNotificationParams, TextContent

from dsh_tool_bash._mcp_server import DATA_META_KEY, _FdLines, parse_http_address

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent
LAUNCH = "import sys; from dsh_bash_cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _alive(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``: the kit's own probe."""
    return find_host_processes(marker)


async def _eventually(predicate: Callable[[], object], limit_s: float = 10) -> None:
    with anyio.fail_after(limit_s):
        while True:
            if predicate():
                return
            await anyio.sleep(0.02)


async def _until_gone(marker: str, limit_s: float = 10) -> None:
    await _eventually(lambda: not _alive(marker), limit_s)


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"mcptest-{os.urandom(6).hex()}"
    yield value
    for pid in _alive(value):  # never leave a process behind, even when a test fails
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "local.toml"
    path.write_text(f'backend = "local"\ngrace_ms = 300\ncwd = "{tmp_path}"\n')
    return path


def _server_args(config: Path, marker: str, *extra: str) -> list[str]:
    # The marker in the -c program puts it on the server's command line, where /proc finds it.
    return ["-c", f"{LAUNCH}  # {marker}-server", "mcp", "--config", str(config), *extra]


def _text(result: CallToolResult) -> str:
    assert len(result.content) == 1
    content = result.content[0]
    assert isinstance(content, TextContent)
    return content.text


def _data(result: CallToolResult) -> dict[str, Any]:
    assert result.meta is not None
    data = result.meta[DATA_META_KEY]
    assert isinstance(data, dict)
    return data


async def _poll(client: Client, task_id: str, limit_s: float = 10) -> tuple[str, CallToolResult]:
    """bash_output until the task is no longer running: (all delta text, the last result)."""
    texts: list[str] = []
    with anyio.fail_after(limit_s):
        while True:
            result = await client.call_tool("bash_output", {"task_id": task_id})
            assert not result.is_error, _text(result)
            text = _text(result)
            if _data(result)["new_output"]:
                texts.append(text[: text.rindex("[status:")])
            if _data(result)["status"] != "running":
                return "".join(texts), result
            await anyio.sleep(0.05)


@contextlib.asynccontextmanager
async def _outliving(client: Client) -> AsyncIterator[Client]:
    """A client whose server dies under it: errors of its exit (the server is gone) are ignored."""
    entered = await client.__aenter__()
    try:
        yield entered
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await client.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    else:
        with contextlib.suppress(Exception):
            await client.__aexit__(None, None, None)


async def _start(client: Client, command: str) -> str:
    result = await client.call_tool("bash", {"command": command, "run_in_background": True})
    assert not result.is_error, _text(result)
    task_id = _data(result)["task_id"]
    assert _text(result) == f"started background task {task_id}"
    return str(task_id)


def test_parse_http_address() -> None:
    assert parse_http_address("8000") == ("127.0.0.1", 8000)
    assert parse_http_address("0.0.0.0:9") == ("0.0.0.0", 9)
    assert parse_http_address("[::1]:0") == ("::1", 0)
    assert parse_http_address(":7") == ("127.0.0.1", 7)
    for bad in ("host:port", "70000", "x"):
        with pytest.raises(ValueError, match="--http"):
            parse_http_address(bad)


async def test_stdin_lines_reader_splits_lines_across_chunks_and_characters() -> None:
    read_fd, write_fd = os.pipe()
    data = ("a" * 200_000 + "\n" + "é" * 10 + "\n\nlast").encode()

    async def writer() -> None:
        for start in range(0, len(data), 50_001):  # chunks that split a line and a character
            await anyio.to_thread.run_sync(os.write, write_fd, data[start : start + 50_001])
        os.close(write_fd)

    lines: list[str] = []
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                async for line in _FdLines(read_fd):
                    lines.append(line)
    finally:
        os.close(read_fd)
    assert lines == ["a" * 200_000 + "\n", "é" * 10 + "\n", "\n", "last"]


# -- stdio ------------------------------------------------------------------------------------------------


async def test_stdio_tools_foreground_background_and_no_orphans(config: Path, marker: str) -> None:
    notices: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        notices.append(params)

    params = StdioServerParameters(command=sys.executable, args=_server_args(config, marker), cwd=str(REPO))
    with anyio.fail_after(40):
        async with Client(stdio_client(params), logging_callback=on_log) as client:
            listed = await client.list_tools()
            assert [tool.name for tool in listed.tools] == ["bash", "bash_output", "bash_input", "bash_kill"]
            bash = listed.tools[0]
            assert bash.input_schema["additionalProperties"] is False
            assert "run_in_background" in bash.input_schema["properties"]
            assert bash.description and "workdir" in bash.description
            assert "carry over" in bash.description and "restart" in bash.input_schema["properties"]

            fg = await client.call_tool("bash", {"command": "echo hi; echo oops >&2; exit 2"})
            assert (_text(fg), fg.is_error) == ("hi\n[stderr]\noops\n[exit code: 2]", False)
            assert _data(fg)["exit_code"] == 2 and _data(fg)["workdir"] == str(config.parent)

            smuggled = await client.call_tool("bash", {"command": "env", "env": {"A": "1"}})
            assert smuggled.is_error and 'unknown argument "env"' in _text(smuggled)
            unknown = await client.call_tool("bash_output", {"task_id": "bash-999"})
            assert (_text(unknown), unknown.is_error) == ('unknown bash task "bash-999"', True)

            sleeper = await _start(client, f"exec -a {marker}-bg sleep 30")
            first = await client.call_tool("bash_output", {"task_id": sleeper})
            assert _text(first) == "(no new output)\n[status: running]"

            quick = await _start(client, "echo quick; exit 5")
            text, last = await _poll(client, quick)
            assert text == "quick\n" and _text(last).endswith("[status: completed, exit code: 5]")

            yielded = await client.call_tool(
                "bash", {"command": f"echo before; exec -a {marker}-yield sleep 30", "yield_ms": 500}
            )
            moved = str(_data(yielded)["task_id"])
            assert _data(yielded)["moved_to_background"] is True, _text(yielded)
            assert _text(yielded).startswith(f"still running after 500 ms: moved to background task {moved}")
            assert "before\n" in _text(yielded)
            assert not (await client.call_tool("bash_kill", {"task_id": moved})).is_error
            _, last = await _poll(client, moved)  # its end shown here: no later result tells it again
            assert _data(last)["status"] == "killed"

            killed = await client.call_tool("bash_kill", {"task_id": sleeper})
            assert _text(killed) == f"killed background task {sleeper}"
            _, last = await _poll(client, sleeper)
            assert _data(last)["status"] == "killed"
            again = await client.call_tool("bash_kill", {"task_id": sleeper})
            assert _text(again) == f"task {sleeper} had already finished"

            await _eventually(lambda: len(notices) >= 3, 5)
            tail = "Read its output with bash_output."
            assert sorted(str(notice.data) for notice in notices) == sorted(
                [
                    f"background bash task {quick} finished: completed, exit code: 5. {tail}",
                    f"background bash task {moved} finished: killed, signal: SIGTERM. {tail}",
                    f"background bash task {sleeper} finished: killed, signal: SIGTERM. {tail}",
                ]
            )
            assert all(notice.logger == "dsh-bash" and notice.level == "info" for notice in notices)

            await _start(client, f"exec -a {marker}-left sleep 30")  # still running when the client leaves
            # Started is not yet exec'd: the name appears once bash has run `exec -a`.
            await _eventually(lambda: len(_alive(f"{marker}-left")) == 1, 5)
            assert len(_alive(f"{marker}-server")) == 1
        # The client closed the server's stdin and waited for it: nothing it started is left.
        await _until_gone(marker, 5)


async def test_stdio_bash_input_answers_a_prompt(config: Path, marker: str) -> None:
    params = StdioServerParameters(command=sys.executable, args=_server_args(config, marker), cwd=str(REPO))
    with anyio.fail_after(40):
        async with Client(stdio_client(params)) as client:
            listed = {tool.name: tool for tool in (await client.list_tools()).tools}
            assert listed["bash_input"].input_schema["required"] == ["task_id", "input"]
            started = await client.call_tool(
                "bash",
                {"command": 'read -r n; echo "hi $n"; cat', "run_in_background": True, "open_stdin": True},
            )
            task_id = _data(started)["task_id"]
            assert _data(started)["open_stdin"] is True
            answered = await client.call_tool(
                "bash_input", {"task_id": task_id, "input": "bob\\n", "yield_ms": 1500}
            )
            assert (_text(answered), answered.is_error) == (
                f"wrote 4 bytes to task {task_id}\nhi bob\n[status: running, waiting for input]",
                False,
            )
            closed = await client.call_tool(
                "bash_input", {"task_id": task_id, "input": "bye\\n", "close": True, "yield_ms": 10_000}
            )
            assert _text(closed) == (
                f"wrote 4 bytes to task {task_id}; closed its input\nbye\n[status: completed, exit code: 0]"
            )
            assert _data(closed)["tool"] == "bash_input" and _data(closed)["closed_input"] is True
            refused = await client.call_tool("bash_input", {"task_id": task_id, "input": "more"})
            assert refused.is_error and _data(refused)["error"] == "task_ended"
            assert _text(refused) == f"task {task_id} has finished; its input is closed"


@pytest.mark.parametrize(("signum", "background"), [(signal.SIGTERM, True), (signal.SIGINT, False)])
async def test_stdio_server_stops_on_a_signal_and_kills_everything(
    config: Path, marker: str, signum: int, background: bool
) -> None:
    extra = () if background else ("--no-background",)
    params = StdioServerParameters(
        command=sys.executable, args=_server_args(config, marker, *extra), cwd=str(REPO)
    )
    outcome: list[BaseException | CallToolResult] = []
    with anyio.fail_after(40):
        async with _outliving(Client(stdio_client(params))) as client:
            listed = await client.list_tools()
            assert [tool.name for tool in listed.tools] == (
                ["bash", "bash_output", "bash_input", "bash_kill"] if background else ["bash"]
            )
            if background:
                await _start(client, f"exec -a {marker}-bg sleep 30")
            server = _alive(f"{marker}-server")
            assert len(server) == 1

            async def foreground() -> None:
                try:
                    outcome.append(
                        await client.call_tool("bash", {"command": f"exec -a {marker}-fg sleep 30"})
                    )
                except Exception as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(foreground)
                await _eventually(lambda: _alive(f"{marker}-fg"), 10)
                os.kill(server[0], signum)
                await _until_gone(marker, 10)  # the server, the foreground run and the background task
                tg.cancel_scope.cancel()


# -- hostile arguments and output over stdio ---------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


async def test_stdio_hostile_arguments_and_output(config: Path, marker: str) -> None:
    """Arguments nested too deeply or too large are invalid_arguments; control characters are escaped."""
    params = StdioServerParameters(command=sys.executable, args=_server_args(config, marker), cwd=str(REPO))
    with anyio.fail_after(40):
        async with Client(stdio_client(params)) as client:
            deep = await client.call_tool("bash", {"command": _nested(150)})
            assert deep.is_error and _data(deep)["error"] == "invalid_arguments"
            assert _text(deep).startswith("invalid arguments for bash: nested too deeply"), _text(deep)

            big = await client.call_tool("bash", {"command": "true", "description": "x" * (2 << 20)})
            assert big.is_error and _data(big)["error"] == "invalid_arguments"
            assert _text(big).startswith("invalid arguments for bash: too large"), _text(big)[:200]

            noisy = await client.call_tool("bash", {"command": r"printf '\033]0;t\a\302\233x\\x1b'"})
            assert (_text(noisy), noisy.is_error) == ("\\x1b]0;t\\x07\\x9bx\\\\x1b", False)


async def _raw_stdio_calls(config: Path, marker: str, lines: list[str]) -> list[dict[str, Any]]:
    """Send initialize and ``lines`` (requests with ids 2, 3, ...) as raw JSON-RPC; return the answers."""
    hello = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"},
        },
    }
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    sent = [json.dumps(hello), json.dumps(initialized), *lines]
    async with await anyio.open_process(
        [sys.executable, *_server_args(config, marker)], cwd=str(REPO)
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        answers: dict[Any, dict[str, Any]] = {}
        buffer = b""
        for line in sent:
            await proc.stdin.send(line.encode() + b"\n")
        want = {1, *range(2, 2 + len(lines))}
        with anyio.move_on_after(20):
            while not want <= set(answers):
                buffer += await proc.stdout.receive()
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    message = json.loads(raw)
                    if "id" in message:
                        answers[message["id"]] = message
        await proc.stdin.aclose()
        with anyio.move_on_after(10):
            await proc.wait()
    return [answers.get(number, {}) for number in range(2, 2 + len(lines))]


async def test_stdio_arguments_too_deep_for_the_sdk_parser_are_answered(config: Path, marker: str) -> None:
    """Deeper than the SDK's JSON parser goes (it drops such a line unanswered), the call still gets its
    invalid_arguments result, and the server keeps serving."""

    def call(number: int, arguments: str, name: str = "bash") -> str:
        return (
            f'{{"jsonrpc": "2.0", "id": {number}, "method": "tools/call", '
            f'"params": {{"name": "{name}", "arguments": {arguments}}}}}'
        )

    depth = 100_000
    lines = [
        call(2, '{"command": ' + "[" * depth + "]" * depth + "}"),
        call(
            3, '{"command": "true", "description": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}", "bash_output"
        ),
        '{"jsonrpc": "2.0", "id": 4, "method": "tools/list", "params": {"x": '
        + "[" * depth
        + "]" * depth
        + "}}",
        call(5, '{"command": "echo alive"}'),
    ]
    deep, deep_dict, listing, alive = await _raw_stdio_calls(config, marker, lines)
    for answer, tool in ((deep, "bash"), (deep_dict, "bash_output")):
        result = answer.get("result", {})
        assert result.get("isError") is True, answer
        assert result["content"][0]["text"].startswith(f"invalid arguments for {tool}: nested too deeply")
        assert result["_meta"][DATA_META_KEY]["error"] == "invalid_arguments"
    assert "error" in listing, listing
    assert alive.get("result", {}).get("content") == [{"type": "text", "text": "alive\n"}], alive


# -- streamable HTTP --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _http_server(config: Path, marker: str) -> AsyncIterator[tuple[anyio.abc.Process, str]]:
    args = [sys.executable, *_server_args(config, marker, "--http", "127.0.0.1:0")]
    process = await anyio.open_process(args, cwd=str(REPO), stdin=None, stdout=None)
    try:
        assert process.stderr is not None
        said = b""
        with anyio.fail_after(20):  # a warning (no token) may come first
            while not re.search(rb"serving (http://\S+)\n", said):
                said += await process.stderr.receive()
        found = re.search(rb"serving (http://\S+)\n", said)
        assert found, said
        yield process, found.group(1).decode()
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await process.wait()


async def test_http_sessions_are_isolated_owners(config: Path, marker: str) -> None:
    notices_a: list[str] = []
    notices_b: list[str] = []

    async def on_log_a(params: LoggingMessageNotificationParams) -> None:
        notices_a.append(str(params.data))

    async def on_log_b(params: LoggingMessageNotificationParams) -> None:
        notices_b.append(str(params.data))

    with anyio.fail_after(40):
        async with (
            _http_server(config, marker) as (process, url),
            _outliving(Client(url, logging_callback=on_log_b)) as b,
        ):
            async with Client(url, logging_callback=on_log_a) as a:
                task_a = await _start(a, f"exec -a {marker}-a sleep 30")
                task_b = await _start(b, f"exec -a {marker}-b sleep 30")
                for tool in ("bash_output", "bash_kill", "bash_input"):
                    extra = {"input": "x"} if tool == "bash_input" else {}
                    refused = await b.call_tool(tool, {"task_id": task_a, **extra})
                    assert refused.is_error
                    assert _text(refused) == f"task {task_a} belongs to another session"
                refused = await a.call_tool("bash_output", {"task_id": task_b})
                assert _text(refused) == f"task {task_b} belongs to another session"
                mine = await a.call_tool("bash_output", {"task_id": task_a})
                assert _text(mine) == "(no new output)\n[status: running]"

                # Each connection is a shell session of its own (issue 31): a's cd and export hold
                # for a's next call, and never reach b.
                moved = await a.call_tool("bash", {"command": "cd /tmp && export WHO=a"})
                assert _text(moved) == "(no output)\n[cwd: /tmp]"
                here = await a.call_tool("bash", {"command": "pwd; echo $WHO"})
                assert _text(here) == "/tmp\na\n"
                there = await b.call_tool("bash", {"command": "pwd; echo ${WHO-none}"})
                assert _text(there) == f"{config.parent}\nnone\n"

                quick = await _start(a, "echo done")
                text, _ = await _poll(a, quick)
                assert text == "done\n"
                await _eventually(lambda: notices_a, 5)
                assert notices_a == [
                    f"background bash task {quick} finished: completed, exit code: 0. "
                    "Read its output with bash_output."
                ]
            # a ended its session: its task is killed, b's runs on.
            await _until_gone(f"{marker}-a", 10)
            await _eventually(lambda: len(_alive(f"{marker}-b")) == 1, 5)
            assert notices_b == []
            still = await b.call_tool("bash_output", {"task_id": task_b})
            assert _text(still) == "(no new output)\n[status: running]"

            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                assert await process.wait() == 0
            await _until_gone(marker, 5)


@pytest.mark.docker
async def test_stdio_same_tools_over_a_docker_container_by_config_alone(
    docker_test_image: str, tmp_path: Path, marker: str
) -> None:
    from docker_support import SESSION_ID, SESSION_LABEL  # noqa: PLC0415 - a Docker-only test

    config = tmp_path / "docker.toml"
    config.write_text(
        f'backend = "docker"\nimage = "{docker_test_image}"\ngrace_ms = 300\n'
        f'labels = {{ "{SESSION_LABEL}" = "{SESSION_ID}" }}\n'
    )
    params = StdioServerParameters(command=sys.executable, args=_server_args(config, marker), cwd=str(REPO))
    with anyio.fail_after(60):
        async with Client(stdio_client(params)) as client:
            listed = await client.list_tools()
            assert [tool.name for tool in listed.tools] == ["bash", "bash_output", "bash_input", "bash_kill"]
            # PID 1 is the container's init: the command ran inside the container.
            fg = await client.call_tool("bash", {"command": "tr '\\0' ' ' < /proc/1/cmdline; exit 3"})
            assert not fg.is_error
            assert _text(fg).startswith("/sbin/docker-init -- ")
            assert _text(fg).endswith("[exit code: 3]")
            task_id = await _start(client, "echo from-the-container; sleep 30")
            # The kill comes once the line was written (a kill right after the start can come
            # before the command's first line, and then there is rightly nothing to read).
            seen = ""
            with anyio.fail_after(10):
                while "\n" not in seen:
                    result = await client.call_tool("bash_output", {"task_id": task_id})
                    if _data(result)["new_output"]:
                        seen += _text(result)[: _text(result).rindex("[status:")]
                    await anyio.sleep(0.05)
            killed = await client.call_tool("bash_kill", {"task_id": task_id})
            assert _text(killed) == f"killed background task {task_id}"
            text, last = await _poll(client, task_id)
            assert seen + text == "from-the-container\n" and _data(last)["status"] == "killed"
