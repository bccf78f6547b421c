"""Input to running tasks and terminals, beyond the kit: the seam's types and errors, and the drives the
issue asks for (a REPL through a terminal) on the local backend."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig
from interactive_support import drive_python_repl
from pydantic import ValidationError

from dsh_bash import (
    INPUT_REFUSALS,
    MAX_INPUT_BYTES,
    BashExecRequest,
    BashExecSpec,
    BashTask,
    TaskInputError,
    TerminalSize,
)
from dsh_bash.host._proc_scan import (
    InputIdentity,
    input_waiters,
)

pytestmark = pytest.mark.anyio


# -- types --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 1001, -1, True, 2.0, "24"])
def test_terminal_size_is_strict_and_bounded(bad: Any) -> None:
    with pytest.raises(ValidationError):
        TerminalSize(rows=bad, cols=80)
    with pytest.raises(ValidationError):
        TerminalSize(rows=24, cols=bad)


def test_open_stdin_is_a_strict_bool() -> None:
    with pytest.raises(ValidationError):
        BashExecRequest(command="cat", open_stdin=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        BashExecRequest(command="cat", open_stdin="yes")  # type: ignore[arg-type]
    assert BashExecRequest(command="cat").open_stdin is False


def test_a_spec_with_a_terminal_must_have_open_input() -> None:
    size = TerminalSize(rows=24, cols=80)
    with pytest.raises(ValidationError, match="open_stdin=True"):
        BashExecSpec(command="x", workdir="/", timeout_ms=1.0, owner=None, user=None, terminal=size)
    spec = BashExecSpec(
        command="x", workdir="/", timeout_ms=1.0, owner=None, user=None, terminal=size, open_stdin=True
    )
    assert spec.terminal == size


def test_task_input_error_keeps_its_reason_across_pickling() -> None:
    for reason in INPUT_REFUSALS:
        error = pickle.loads(pickle.dumps(TaskInputError("message", reason=reason)))
        assert (type(error), str(error), error.reason) == (TaskInputError, "message", reason)
    with pytest.raises(ValueError, match="unknown input refusal"):
        TaskInputError("x", reason="nope")  # type: ignore[arg-type]


# -- the local backend --------------------------------------------------------------------------------


@pytest.fixture(params=["subreaper", "marker"])
async def executor(request: pytest.FixtureRequest) -> AsyncIterator[LocalBashExecutor]:
    async with LocalBashExecutor(LocalConfig(containment=request.param, grace_ms=300)) as ex:
        yield ex


async def _until(ex: LocalBashExecutor, task: BashTask, want: str, limit_s: float = 5) -> str:
    seen = ""
    with anyio.fail_after(limit_s):
        while want not in seen:
            seen += (await ex.read_output(task.id)).delta
            await anyio.sleep(0.02)
    return seen


async def test_resolve_opens_the_input_of_a_terminal_task(executor: LocalBashExecutor) -> None:
    spec = executor.resolve(BashExecRequest(command="x", terminal=TerminalSize(rows=3, cols=4)))
    assert (spec.open_stdin, spec.terminal) == (True, TerminalSize(rows=3, cols=4))


async def test_bad_input_is_refused_before_anything_is_queued(executor: LocalBashExecutor) -> None:
    task = await executor.start(executor.resolve(BashExecRequest(command="cat", open_stdin=True)))
    with pytest.raises(ValueError, match="lone surrogate"):
        await executor.write_input(task.id, "a\udcff", owner=None)
    with pytest.raises(TypeError, match="str or bytes"):
        await executor.write_input(task.id, 42, owner=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="more than one write takes"):
        await executor.write_input(task.id, b"x" * (MAX_INPUT_BYTES + 1), owner=None)
    await executor.write_input(task.id, bytearray(b"ok\xff\n"), owner=None)
    assert await _until(executor, task, "ok") == "ok\ufffd\n"
    assert await executor.close_input(task.id, owner=None) is True
    with anyio.fail_after(5):
        await task.wait()
    assert task.exit_code == 0


async def test_run_refuses_open_input_and_terminals(executor: LocalBashExecutor) -> None:
    for fields in ({"open_stdin": True}, {"terminal": TerminalSize(rows=24, cols=80)}):
        with pytest.raises(ValueError, match="for start"):
            await executor.run(executor.resolve(BashExecRequest(command="true", **fields)))


@pytest.mark.skipif(shutil.which("python3") is None, reason="python3 is not installed on this host")
async def test_python_repl_through_a_terminal(executor: LocalBashExecutor) -> None:
    await drive_python_repl(executor, limit_s=10)


async def test_a_command_waiting_on_read_is_answered(executor: LocalBashExecutor) -> None:
    task = await executor.start(
        executor.resolve(BashExecRequest(command='read -r -p "name? " n; echo "hi $n"', open_stdin=True))
    )
    await executor.write_input(task.id, "agent\n", owner=None)
    with anyio.fail_after(5):
        await task.wait()
    # bash prompts only when its input is a terminal: a pipe gets the answer alone.
    assert (await executor.read_output(task.id)).delta == "hi agent\n"


# -- the waiting-for-input look ------------------------------------------------------------------------


def _until_found(pids: list[int], identity: InputIdentity, want: bool) -> list[int]:
    deadline = time.monotonic() + 5
    while True:
        found = input_waiters(pids, identity)
        if bool(found) == want or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_input_waiters_sees_a_reader_of_that_pipe_only() -> None:
    read_end, write_end = os.pipe()
    other_r, other_w = os.pipe()
    readers = [
        subprocess.Popen(["cat"], stdin=read_end, stdout=subprocess.DEVNULL),
        subprocess.Popen(["cat"], stdin=other_r, stdout=subprocess.DEVNULL),  # another pipe
        subprocess.Popen(["sleep", "30"], stdin=read_end),  # holds it, reads nothing
    ]
    try:
        identity = InputIdentity.of_fd(write_end, terminal=False)
        pids = [process.pid for process in readers]
        assert _until_found(pids, identity, True) == [readers[0].pid]
        assert input_waiters(pids, identity, machine="sparc") == []  # unknown machine: never a guess
        os.write(write_end, b"x" * 65536 * 4)  # more than the pipe holds: cat is busy or writing
        os.close(write_end)
        write_end = -1
        readers[0].wait(5)
        assert input_waiters(pids, identity) == []
    finally:
        for process in readers:
            process.kill()
            process.wait()
        for fd in (read_end, other_r, other_w, write_end):
            if fd >= 0:
                os.close(fd)
