"""SSH faults: the connection cut mid-command, mid-task and under an interactive task, three ways
(the server restarted among them); a detached task's status file replaced under the follower.

Written against behaviour only: the caller is told the truth,
the executor reconnects for the next command, and no process of a cut command is left running.
See docs/faults.md for each outcome.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from fault_support import GRACE_MS, eventually_gone, restart_sshd, session_sshds, wait_for_processes
from interactive_support import read_until
from ssh_support import SshServer

from dsh_bash import (
    BashExecRequest,
    BashInfrastructureError,
    BashTask,
    TaskInputError,
    TerminalSize,
)

pytestmark = [pytest.mark.faults, pytest.mark.ssh, pytest.mark.anyio]

Cut = Literal["tcp-reset", "session-killed", "server-restarted"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cutter(server: SshServer, cut: Cut) -> Callable[[], None]:
    def reset_tcp() -> None:
        # SOCK_DESTROY on this host's client sockets to the server's port: the connection dies
        # as it would when a middlebox drops it, with both processes still alive.
        subprocess.run(
            ["ss", "-K", "dst", server.host, "dport", "=", str(server.port)], check=True, capture_output=True
        )

    def kill_sessions() -> None:
        for pid in session_sshds(server):
            os.kill(pid, signal.SIGKILL)

    def restart() -> None:
        restart_sshd(server)

    return {"tcp-reset": reset_tcp, "session-killed": kill_sessions, "server-restarted": restart}[cut]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cut", ["tcp-reset", "session-killed", "server-restarted"])
async def test_connection_cut_mid_command_and_mid_task(ssh_server: SshServer, marker: str, cut: Cut) -> None:
    strike = _cutter(ssh_server, cut)
    async with ssh_server.executor(grace_ms=GRACE_MS) as ex:
        # A background task runs detached on the host: it outlives the connection, and once the
        # executor is back it goes on being followed (the "or, if they were detached").
        task = await ex.start(
            ex.resolve(
                BashExecRequest(command=f"echo task-before; bash -c 'sleep 4; :' {marker}-t; echo task-after")
            )
        )
        await wait_for_processes(f"{marker}-t")

        async def cut_once_running() -> None:
            await wait_for_processes(f"{marker}-run")
            await anyio.to_thread.run_sync(strike)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(cut_once_running)
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec(f"echo run-before; bash -c 'sleep 60; :' {marker}-run")
        took = time.monotonic() - started
        print(f"{cut}: the run was told after {took:.1f}s: {raised.value}")
        assert took < 15, took
        with anyio.fail_after(30):
            await task.wait()
        assert (task.status, task.end_cause, task.exit_code) == ("completed", "exited", 0), task
        assert (await ex.read_output(task.id)).delta == "task-before\ntask-after\n"
        # Recovery: the next command reconnects and runs.
        with anyio.fail_after(20):
            result = await ex.exec("echo back")
        assert result.stdout.text == "back\n"
        # Nothing of the cut command is left running (a dropped connection alone does not stop it).
        assert await eventually_gone(f"{marker}-run", 5) == []
    # And certainly not after aclose.
    assert await eventually_gone(marker, 5) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cut", ["tcp-reset", "session-killed"])
async def test_a_detached_tasks_status_file_is_resumed_after_a_cut(
    ssh_server: SshServer, marker: str, cut: Cut, caplog: pytest.LogCaptureFixture
) -> None:
    """The follower reads a detached task's signed status file as it grows; across a cut it goes on
    at its offset with the same verifier: the task's own signal (a self-kill, written after the
    cut) arrives verified, and no line read twice is taken for a forgery."""
    strike = _cutter(ssh_server, cut)
    async with ssh_server.executor(grace_ms=GRACE_MS) as ex:
        task = await ex.start(
            ex.resolve(
                BashExecRequest(
                    command=f"echo before; bash -c 'sleep 3; :' {marker}-t; echo after; kill -TERM $$"
                )
            )
        )
        await wait_for_processes(f"{marker}-t")
        await anyio.sleep(0.5)  # the follower has read the first records
        await anyio.to_thread.run_sync(strike)
        with anyio.fail_after(40):
            await task.wait()
        assert (task.status, task.end_cause, task.signal, task.exit_code) == (
            "completed",
            "signaled",
            "SIGTERM",
            None,
        ), task
        assert (await ex.read_output(task.id)).delta == "before\nafter\n"
    assert not [r.getMessage() for r in caplog.records if "do not verify" in r.getMessage()]
    assert await eventually_gone(marker, 5) == []


# -- an interactive task under a cut ----------------------------------------------------------------------

Mode = Literal["pipe", "terminal"]


def _answering(marker: str, mode: Mode, notes: Path) -> BashExecRequest:
    # Each line is answered, then noted in a file this test reads (the SSH host is this host): once
    # the note is there, the answer was written before it and is on its way to the executor.
    script = f'while IFS= read -r x; do echo "got $x"; echo "$x" >> {shlex.quote(str(notes))}; done'
    command = f"bash -c {shlex.quote(script)} {marker}-i"
    if mode == "terminal":
        return BashExecRequest(command=command, terminal=TerminalSize(rows=24, cols=80))
    return BashExecRequest(command=command, open_stdin=True)


async def _noted(notes: Path, want: str) -> None:
    while True:
        if notes.exists() and want in notes.read_text():
            return
        await anyio.sleep(0.05)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["pipe", "terminal"])
@pytest.mark.parametrize("cut", ["tcp-reset", "session-killed", "server-restarted"])
async def test_an_interactive_task_under_a_cut_ends_lost_once(
    ssh_server: SshServer, marker: str, cut: Cut, mode: Mode
) -> None:
    """An attached task (open input over its channel, or a terminal) cannot outlive its channel: the
    cut ends it ``killed``/``lost`` exactly once, never a forged exit; input calls are refused as
    ``task_ended`` at once; what arrived before the cut stays readable; nothing of it is left."""
    strike = _cutter(ssh_server, cut)
    notes = Path(tempfile.gettempdir()) / f"{marker}.notes"
    done: list[BashTask] = []
    try:
        async with ssh_server.executor(grace_ms=GRACE_MS) as ex:
            ex.on_task_done(done.append)
            task = await ex.start(ex.resolve(_answering(marker, mode, notes)))
            await wait_for_processes(f"{marker}-i")
            with anyio.fail_after(15):
                await ex.write_input(task.id, "one\n", owner=None)
                await read_until(ex, task, "got one")
                # Answered, left unread: it must still be readable once the task ended.
                await ex.write_input(task.id, "two\n", owner=None)
                await _noted(notes, "two")
            await anyio.sleep(1)  # the answer crosses the loopback connection
            await anyio.to_thread.run_sync(strike)
            cut_at = time.monotonic()
            # Racing the end: queued (to be lost with the channel) or refused, never a hang.
            with anyio.fail_after(5):
                try:
                    await ex.write_input(task.id, "cut\n", owner=None)
                except TaskInputError as exc:
                    assert exc.reason in {"task_ended", "input_broken"}, exc
            with anyio.fail_after(20):
                await task.wait()
            print(f"{cut}/{mode}: the task ended {time.monotonic() - cut_at:.1f}s after the cut")
            assert (task.status, task.end_cause, task.exit_code, task.signal) == (
                "killed",
                "lost",
                None,
                None,
            ), task
            assert done == [task]
            with anyio.fail_after(5):
                rest = (await ex.read_output(task.id)).delta
                assert "got two" in rest, rest
                assert "got one" not in rest, rest  # read before: reads consume
                assert (await ex.read_output(task.id)).delta == ""
            refusals: list[str] = []
            with anyio.fail_after(5):
                with pytest.raises(TaskInputError) as raised:
                    await ex.write_input(task.id, "three\n", owner=None)
                refusals.append(raised.value.reason)
                with pytest.raises(TaskInputError) as raised:
                    await ex.close_input(task.id, owner=None)
                refusals.append(raised.value.reason)
                with pytest.raises(TaskInputError) as raised:
                    await ex.resize_terminal(task.id, TerminalSize(rows=30, cols=100), owner=None)
                refusals.append(raised.value.reason)
            assert refusals[:2] == ["task_ended", "task_ended"], refusals
            # A task without a terminal may be told either: both are true of it.
            assert refusals[2] in ({"task_ended"} if mode == "terminal" else {"task_ended", "not_terminal"})
            # The remote end went with the channel (its supervisor kills all when its stdin closes).
            assert await eventually_gone(marker, 5) == []
            assert notes.read_text() == "one\ntwo\n"  # nothing written after the cut arrived
            with anyio.fail_after(20):  # and the executor reconnects for the next command
                assert (await ex.exec("echo back")).stdout.text == "back\n"
            closing = time.monotonic()
            with anyio.fail_after(10):
                await ex.aclose()
            took = time.monotonic() - closing
            # Nothing ran any more: the base bound (2 graces and 0.5 s), and slack for a loaded host.
            assert took < 2 * GRACE_MS / 1000 + 2, took
        assert done == [task]
        assert await eventually_gone(marker, 5) == []
    finally:
        notes.unlink(missing_ok=True)


# -- a server without an SFTP subsystem --------------------------------------------------------------


def _hundred_tasks(marker: str) -> list[str]:
    # `; :` keeps each marked bash alive (a lone `sleep` would be exec'd in its place, marker and all).
    loop = f"bash -c 'while :; do sleep 1; done' {marker}-loop"
    sleeper = f"bash -c 'sleep 30; :' {marker}-sleep"
    return [loop, sleeper] * 50


@pytest.mark.timeout(120)
async def test_without_sftp_a_hundred_background_tasks_start_and_aclose_ends(
    server_without_sftp: SshServer, marker: str
) -> None:
    """Issue 15: against an sshd with no SFTP subsystem, 100 background tasks (loops, `sleep 30`)
    all start, none waiting for another to end, and aclose ends them all within its bound."""
    tasks = []
    async with server_without_sftp.executor(grace_ms=GRACE_MS) as ex:
        started = time.monotonic()
        for command in _hundred_tasks(marker):
            with anyio.fail_after(10):  # a start that waits for a channel never returns
                tasks.append(await ex.start(ex.resolve(BashExecRequest(command=command))))
        print(f"100 starts without SFTP took {time.monotonic() - started:.1f}s")
        await wait_for_processes(f"{marker}-loop", 50, within_s=30)
        await wait_for_processes(f"{marker}-sleep", 50, within_s=30)
        assert all(task.status == "running" for task in tasks)
        closing = time.monotonic()
        with anyio.fail_after(30):  # before: it never ended (the 2-minute limit)
            await ex.aclose()
        print(f"aclose with 100 tasks without SFTP took {time.monotonic() - closing:.2f}s")
    assert [task.status for task in tasks] == ["killed"] * 100
    assert await eventually_gone(marker, within_s=5) == []


@pytest.mark.timeout(120)
async def test_without_any_sftp_starts_past_the_channel_budget_are_refused(
    server_without_sftp: SshServer, marker: str
) -> None:
    """Without SFTP and without an sftp-server to run (``exec_sftp_server=False``), background
    tasks hold a channel each: a start past the channel budget is refused at once (reason
    ``task_limit``), never left waiting for a task to end; the others run; aclose ends them all."""
    started: list[Any] = []
    refused: list[BashInfrastructureError] = []
    async with server_without_sftp.executor(grace_ms=GRACE_MS, exec_sftp_server=False) as ex:
        for command in _hundred_tasks(marker)[:20]:
            with anyio.fail_after(10):
                try:
                    started.append(await ex.start(ex.resolve(BashExecRequest(command=command))))
                except BashInfrastructureError as exc:
                    refused.append(exc)
        # max_channels 8: one channel is kept for kills, one for other commands, 6 hold a task each.
        assert len(started) == 6, (len(started), refused[:1])
        assert {exc.reason for exc in refused} == {"task_limit"}, refused
        assert "SFTP" in str(refused[0]), refused[0]
        assert all(task.status == "running" for task in started)
        with anyio.fail_after(10):  # foreground commands still run meanwhile
            assert (await ex.exec("echo ok", timeout_ms=5000)).stdout.text == "ok\n"
        # A task's end frees its channel: the next start is accepted.
        assert await ex.kill(started[0].id)
        with anyio.fail_after(10):
            await started[0].wait()
            started.append(await ex.start(ex.resolve(BashExecRequest(command=_hundred_tasks(marker)[1]))))
        assert started[-1].status == "running"
        with anyio.fail_after(30):
            await ex.aclose()
    assert await eventually_gone(marker, within_s=5) == []


# -- a planted status file (issue 30) ------------------------------------------------------------------

Planted = Literal["fifo", "symlink", "directory"]
When = Literal["before-the-first-read", "after-a-cut"]
_PLANT: dict[Planted, str] = {
    "fifo": 'rm -f -- "$f" && mkfifo -- "$f"',
    "symlink": 'rm -f -- "$f" && ln -s /dev/zero "$f"',
    "directory": 'rm -f -- "$f" && mkdir -- "$f"',
}


def _planting(marker: str, planted: Planted, notes: Path, *, wait_s: float) -> BashExecRequest:
    """A task that finds its own status file (the one whose first record names its supervisor, the
    command's parent), waits ``wait_s``, replaces it by ``planted``, notes that, and sleeps."""
    script = (
        'for f in "${TMPDIR:-/tmp}"/dsh-bash-*/*.status; do\n'
        '  [[ -f $f && ! -L $f ]] && IFS= read -r line < "$f" &&\n'
        '    [[ $line == "0 supervisor $PPID "* ]] && break\n'
        "  f=\n"
        "done\n"
        "[[ -n $f ]] || exit 99\n"
        f"sleep {wait_s}\n"
        f"{_PLANT[planted]}\n"
        f"echo {planted} >> {shlex.quote(str(notes))}\n"
        f"exec bash -c 'sleep 30; :' {marker}-{planted}\n"
    )
    return BashExecRequest(command=script)


def _sftp_servers(server: SshServer) -> list[int]:
    """The SFTP servers of ``server``'s sessions (``internal-sftp`` runs in an sshd child of its own)."""
    found = []
    for pid in session_sshds(server):
        with contextlib.suppress(OSError):
            if b"internal-sftp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


async def _all_noted(notes: Path, want: set[str]) -> None:
    while True:
        if notes.exists() and set(notes.read_text().split()) >= want:
            return
        await anyio.sleep(0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before-the-first-read", "after-a-cut"])
async def test_a_planted_status_file_ends_the_task_lost(
    ssh_server: SshServer, marker: str, when: When
) -> None:
    """Issue 30, "A planted status file": a detached task's status file replaced by a FIFO, a link
    to /dev/zero or a directory, before the follower's first read (the follower's SFTP server is
    stopped meanwhile) or before it opens the file again after a cut. Each such task ends ``killed``
    with end cause ``lost`` within the grace plus two seconds, never ``running`` for good, and its
    processes are gone; the follower never blocks on the FIFO (before: an SFTP open of a FIFO waited
    for a writer for ever, which stopped following every task), a task beside them ends normally,
    a new task and the next command run."""
    notes = Path(tempfile.gettempdir()) / f"{marker}.notes"
    kinds: list[Planted] = ["fifo", "symlink", "directory"]
    bound_s = GRACE_MS / 1000 + 2
    stopped: list[int] = []
    try:
        async with ssh_server.executor(grace_ms=GRACE_MS) as ex:
            keeper = await ex.start(
                ex.resolve(BashExecRequest(command=f"bash -c 'sleep 30; :' {marker}-keeper"))
            )
            await wait_for_processes(f"{marker}-keeper")
            victims = []
            if when == "before-the-first-read":
                await anyio.sleep(0.3)  # the follower's SFTP channel is open (it follows the keeper)
                stopped = _sftp_servers(ssh_server)
                assert len(stopped) == 1, stopped
                os.kill(stopped[0], signal.SIGSTOP)
                for kind in kinds:
                    victims.append(await ex.start(ex.resolve(_planting(marker, kind, notes, wait_s=0))))
                    with anyio.fail_after(10):
                        await _noted(notes, kind)  # one at a time: each finds its file among regular ones
                os.kill(stopped.pop(), signal.SIGCONT)
            else:
                for kind in kinds:
                    victims.append(await ex.start(ex.resolve(_planting(marker, kind, notes, wait_s=1))))
                with anyio.fail_after(10):
                    await _all_noted(notes, set(kinds))
                await anyio.to_thread.run_sync(_cutter(ssh_server, "tcp-reset"))
            struck = time.monotonic()
            for kind, victim in zip(kinds, victims, strict=True):
                with anyio.fail_after(max(0.1, struck + bound_s - time.monotonic())):
                    await victim.wait()
                print(f"{when}/{kind}: ended {time.monotonic() - struck:.2f}s after the plant was let in")
                assert (victim.status, victim.end_cause, victim.exit_code, victim.signal) == (
                    "killed",
                    "lost",
                    None,
                    None,
                ), (kind, victim)
            for kind in kinds:
                assert await eventually_gone(f"{marker}-{kind}", 5) == [], kind
            # The follower goes on: the keeper's end is read from its own status file.
            assert keeper.status == "running"
            assert await ex.kill(keeper.id)
            with anyio.fail_after(10):
                await keeper.wait()
            assert (keeper.status, keeper.end_cause) == ("killed", "killed"), keeper
            with anyio.fail_after(10):
                fresh = await ex.start(ex.resolve(BashExecRequest(command="echo fresh")))
                await fresh.wait()
                assert (fresh.status, fresh.exit_code) == ("completed", 0), fresh
                assert (await ex.read_output(fresh.id)).delta == "fresh\n"
                assert (await ex.exec("echo next")).stdout.text == "next\n"
        assert await eventually_gone(marker, 5) == []
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        notes.unlink(missing_ok=True)
