"""Security: malformed tool calls over MCP (what a model's JSON becomes on the wire) are answered with
an error naming the problem, and the server keeps serving.

The in-process fuzzing of the same arguments is in ``test_security_fuzz.py``; this module sends a
fixed list of bad calls through the official SDK client to ``dsh-bash mcp`` over stdio.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp", reason="backend unavailable: the mcp SDK is missing (pip install 'dsh-bash[mcp]')")

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp_types import CallToolResult, TextContent

pytestmark = [pytest.mark.faults, pytest.mark.anyio]

REPO = Path(__file__).resolve().parent.parent
LAUNCH = "import sys; from dsh_bash_cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _text(result: CallToolResult) -> str:
    assert len(result.content) == 1
    content = result.content[0]
    assert isinstance(content, TextContent)
    return content.text


#: (tool, arguments, words the error must contain)
BAD_CALLS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("bash", {}, ['missing required argument "command"']),
    ("bash", {"command": 5}, ['"command"']),
    ("bash", {"command": None}, ['"command"']),
    ("bash", {"command": ["echo", "hi"]}, ['"command"']),
    ("bash", {"command": "true\u0000rm"}, ["command", "NUL"]),
    ("bash", {"command": "true", "timeout_ms": "100"}, ['"timeout_ms"']),
    ("bash", {"command": "true", "timeout_ms": -1}, ['"timeout_ms"']),
    ("bash", {"command": "true", "timeout_ms": 0}, ['"timeout_ms"']),
    ("bash", {"command": "true", "timeout_ms": 10**400}, ['"timeout_ms"']),
    ("bash", {"command": "true", "timeout_ms": True}, ['"timeout_ms"']),
    ("bash", {"command": "true", "workdir": 7}, ['"workdir"']),
    ("bash", {"command": "true", "workdir": "/tmp\u0000x"}, ["workdir", "NUL"]),
    ("bash", {"command": "true", "run_in_background": "yes"}, ['"run_in_background"']),
    ("bash", {"command": "true", "description": {"a": 1}}, ['"description"']),
    ("bash", {"command": "true", "env": {"A": "1"}}, ['unknown argument "env"']),
    ("bash", {"command": "true", "stdin": "data"}, ['unknown argument "stdin"']),
    ("bash", {"command": "true", "owner": "someone-else"}, ['unknown argument "owner"']),
    ("bash_output", {}, ['missing required argument "task_id"']),
    ("bash_output", {"task_id": 5}, ['"task_id"']),
    ("bash_output", {"task_id": None}, ['"task_id"']),
    ("bash_output", {"task_id": "bash-1", "follow": True}, ['unknown argument "follow"']),
    ("bash_output", {"task_id": "x" * 100_000}, ["unknown bash task"]),
    ("bash_kill", {"task_id": ["bash-1"]}, ['"task_id"']),
    ("bash_kill", {"task_id": "../../etc/passwd"}, ['unknown bash task "../../etc/passwd"']),
    ("rm", {"path": "/"}, ['unknown tool "rm"']),
]


async def test_malformed_calls_are_named_and_the_server_keeps_serving(tmp_path: Path) -> None:
    config = tmp_path / "local.toml"
    config.write_text(f'backend = "local"\ngrace_ms = 300\ncwd = "{tmp_path}"\n')
    params = StdioServerParameters(
        command=sys.executable, args=["-c", LAUNCH, "mcp", "--config", str(config)], cwd=str(REPO)
    )
    failures = []
    with anyio.fail_after(60):
        async with Client(stdio_client(params)) as client:
            for tool, arguments, words in BAD_CALLS:
                result = await client.call_tool(tool, arguments)
                text = _text(result)
                if not result.is_error or not all(word in text for word in words):
                    failures.append((tool, str(arguments)[:80], result.is_error, text[:300]))
            alive = await client.call_tool("bash", {"command": "echo alive"})
            assert (_text(alive), alive.is_error) == ("alive\n", False)
    assert failures == []
