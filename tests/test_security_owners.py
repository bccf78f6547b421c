"""Security: a background task cannot be read, written to or killed through another owner's toolset.

Two ``BashToolset``s (owners alice and bob) and an ownerless one share one executor of each backend.
Refused calls must neither consume the owner's output nor disturb the task. Over MCP, two HTTP
sessions are two owners: ``tests/test_mcp.py::test_http_sessions_are_isolated_owners`` covers that.
"""

from __future__ import annotations

import anyio
import pytest
from security_support import BACKENDS, make_executor

from dsh_bash import OwnerToken
from dsh_tool_bash import BashToolset, ToolResult

pytestmark = [pytest.mark.faults, pytest.mark.anyio]

ALICE = OwnerToken("alice")
BOB = OwnerToken("bob")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _read_until(tools: BashToolset, task_id: str, want: str, limit_s: float = 15) -> ToolResult:
    with anyio.fail_after(limit_s):
        while True:
            result = await tools.call("bash_output", {"task_id": task_id})
            assert not result.is_error, result
            if want in result.text:
                return result
            await anyio.sleep(0.05)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_another_owner_cannot_read_or_kill_a_task(request: pytest.FixtureRequest, backend: str) -> None:
    async with make_executor(request, backend) as ex:
        alice = BashToolset(ex, owner=ALICE)
        bob = BashToolset(ex, owner=BOB)
        anyone = BashToolset(ex)
        bob_notices: list[str] = []
        bob.on_completion(lambda text, task: bob_notices.append(text))

        started = await alice.call(
            "bash",
            {"command": "echo alice-private; sleep 1; echo alice-more; sleep 30", "run_in_background": True},
        )
        assert not started.is_error, started
        task_id = started.data["task_id"]
        await anyio.sleep(1.5)  # both lines printed, unread

        for intruder in (bob, anyone):
            for tool in ("bash_output", "bash_kill", "bash_input"):
                # bash_input is refused as another session's before the task's input state is looked at
                extra = {"input": "x\\n", "close": True} if tool == "bash_input" else {}
                refused = await intruder.call(tool, {"task_id": task_id, **extra})
                assert refused.is_error, (tool, refused)
                assert refused.text == f"task {task_id} belongs to another session"
                assert refused.data["error"] == "other_owner"
                assert "alice-private" not in refused.text
            # Also as a JSON string with extra whitespace: the same refusal, not a bypass.
            refused = await intruder.call("bash_output", f'  {{"task_id": "{task_id}"}}  ')
            assert refused.data.get("error") == "other_owner", refused
        assert bob.running_tasks() == []
        assert await bob.kill_all() == []
        assert await anyone.kill_all() == []

        # Alice's output was not consumed by the refused reads, and her task still runs.
        mine = await _read_until(alice, task_id, "alice-more")
        assert mine.text.startswith("alice-private\nalice-more\n"), mine.text
        assert mine.data["status"] == "running"
        assert [task.id for task in alice.running_tasks()] == [task_id]

        killed = await alice.call("bash_kill", {"task_id": task_id})
        assert killed.text == f"killed background task {task_id}"
        final = await _read_until(alice, task_id, "[status: killed")
        assert final.data["status"] == "killed"
        # After the end too: still another session's.
        refused = await bob.call("bash_output", {"task_id": task_id})
        assert refused.data["error"] == "other_owner"
        assert bob_notices == []


@pytest.mark.parametrize("backend", ["local"])
async def test_ownerless_tasks_are_open_to_all(request: pytest.FixtureRequest, backend: str) -> None:
    async with make_executor(request, backend) as ex:
        anyone = BashToolset(ex)
        bob = BashToolset(ex, owner=BOB)
        started = await anyone.call("bash", {"command": "echo shared; sleep 30", "run_in_background": True})
        task_id = started.data["task_id"]
        read = await _read_until(bob, task_id, "shared")
        assert read.data["status"] == "running"
        killed = await bob.call("bash_kill", {"task_id": task_id})
        assert killed.text == f"killed background task {task_id}"
