"""Issue 17's drive, the same on every backend: `python3 -i` on a terminal task."""

from __future__ import annotations

import anyio

from dsh_bash import BashExecRequest, BashExecutor, BashTask, TerminalSize


async def read_until(ex: BashExecutor, task: BashTask, want: str) -> str:
    """Read the task's output until it holds ``want`` (the caller bounds the wait); return all of it."""
    seen = ""
    while want not in seen:
        seen += (await ex.read_output(task.id)).delta
        await anyio.sleep(0.05)
    return seen


async def drive_python_repl(ex: BashExecutor, limit_s: float = 20) -> None:
    """An expression in, its value out, Ctrl-D at a line start ends the REPL with exit code 0."""
    task = await ex.start(
        ex.resolve(BashExecRequest(command="python3 -i -q", terminal=TerminalSize(rows=24, cols=80)))
    )
    with anyio.fail_after(limit_s):
        seen = await read_until(ex, task, ">>> ")
        await ex.write_input(task.id, "6*7\n", owner=None)
        seen += await read_until(ex, task, "42\r\n")
        await ex.write_input(task.id, "\x04", owner=None)
        await task.wait()
    assert (task.status, task.exit_code) == ("completed", 0), seen
