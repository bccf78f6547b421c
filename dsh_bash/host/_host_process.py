"""One command on this host: a fresh bash in a session of its own, read through non-blocking pipes.

Shared by every backend whose commands are processes of this Linux host (the local backend, and
sandboxing backends that wrap its argv in a launcher); public through :mod:`dsh_bash.backend`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import termios
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from .._errors import (
    BashInfrastructureError,
    InfraReason,
)
from .._output import OutputStream
from .._protocol import (
    MARKER_VAR,
    MAX_INLINE_COMMAND,
    UNKNOWN_PREFIX,
    CommandProcess,
    ExitStatus,
    Launch,
)
from .._types import BashExecSpec, TerminalSize
from ..supervisor import SupervisorRecords
from ._fork_server import (
    SupervisorServer,
    pidfd_exited,
    received_fds,
)
from ._proc_scan import (
    InputIdentity,
    ProcScanError,
    ProcScanner,
    descendants,
    input_waiters,
    signal_marked,
)
from ._spill_dir import HostSpillDir

__all__ = [
    "ChannelPool",
    "HostProcess",
    "StartHelper",
    "SupervisedProcess",
    "WrapCommand",
    "spawn_host_process",
    "unknown_leftovers",
    "workdir_problem",
]

_FIRST_READ = 64 * 1024
_BIG_READ = 1024 * 1024

log = logging.getLogger("dsh_bash")

#: ``start_helper(async_fn, *args)``: runs a helper in the executor's task group.
StartHelper = Callable[..., None]
#: ``wrap(argv, launch) -> (argv, host_workdir)``: see ``HostBashExecutor._wrap_command``.
WrapCommand = Callable[[list[str], Launch], tuple[list[str], str]]


def unknown_leftovers(error: OSError) -> str:
    """What a kill reports as left when /proc could not be read: unknown, never "nothing"."""
    return f"{UNKNOWN_PREFIX}/proc could not be read: {error.strerror or error})"


def _set_nonblocking(fd: int) -> None:
    os.set_blocking(fd, False)


class HostProcess(CommandProcess):
    """The process group ``pgid`` (our unreaped child leads it) plus every process carrying the marker."""

    #: What the command's open input is (set at spawn for a task with open input or a terminal).
    _input_identity: InputIdentity | None = None

    def __init__(
        self,
        popen: subprocess.Popen[bytes] | None,
        launch: Launch,
        *,
        stdout_fd: int,
        stderr_fd: int,
        stdin_fd: int | None,
        scanner: ProcScanner,
        start_helper: StartHelper,
        script: tuple[HostSpillDir, str] | None,
    ) -> None:
        self._popen = popen
        self._pid = 0 if popen is None else popen.pid
        self._launch = launch
        self._fds: dict[int, bool] = {stdout_fd: False, stderr_fd: False}  # fd -> reached EOF
        self._stdout_fd = stdout_fd
        self._stderr_fd = stderr_fd
        self._stdin_fd = stdin_fd
        self._scanner = scanner
        self._start_helper = start_helper
        self._script = script
        self._reaped = False
        self._pidfd: int | None = None
        if popen is not None:
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self._pid)

    # -- exit ------------------------------------------------------------------------------------

    def _peek_exit(self) -> ExitStatus | None:
        """The leader's exit status, leaving it a zombie so its group id stays reserved for us."""
        result = os.waitid(os.P_PID, self._pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if result is None:
            return None
        if result.si_code == os.CLD_EXITED:
            return ExitStatus(code=result.si_status)
        return ExitStatus(code=None, signal=result.si_status)

    async def wait(self) -> ExitStatus:
        if self._pidfd is not None:
            await anyio.wait_readable(self._pidfd)
        delay = 0.002
        while (status := self._peek_exit()) is None:
            # Without pidfd (old kernels) this polls; with it, a spurious wake-up is all it handles.
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return status

    # -- output ----------------------------------------------------------------------------------

    async def pump_output(self) -> None:
        if self._stdin_fd is None or self._launch.spec.open_stdin:
            # An open stdin is written by send_input, for as long as the task runs.
            await self._read_both()
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_stdin, self._stdin_fd)
            await self._read_both()
        # The stdin writer may still wait on a reader that never reads; pumping is done either way.

    async def _read_both(self) -> None:
        """Read stdout and stderr to EOF in one task: one epoll set of their own is waited on for both,
        which spares a short command a second task and a second wait (the event loop's turns are most
        of what it costs). Without a descriptor for the set, each stream gets a task of its own."""
        streams = {self._stdout_fd: self._launch.stdout, self._stderr_fd: self._launch.stderr}
        try:
            ready = select.epoll(len(streams))
        except OSError:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, self._stdout_fd, self._launch.stdout)
                await self._read(self._stderr_fd, self._launch.stderr)
            return
        buffers: dict[int, bytearray] = {}
        with ready:
            for fd in streams:
                ready.register(fd, select.EPOLLIN)
            while streams:
                events = ready.poll(0)
                if not events:
                    await anyio.wait_readable(ready.fileno())
                    continue
                fed = False
                for fd, _mask in events:
                    count = _read_once(fd, streams[fd], buffers)
                    if count == 0:
                        ready.unregister(fd)
                        del streams[fd]
                        self._fds[fd] = True
                    fed = fed or count > 0
                if fed:
                    # Always yield after data: a stream that never blocks must not starve timers and
                    # other tasks.
                    await anyio.lowlevel.checkpoint()

    async def _read(self, fd: int, stream: OutputStream) -> None:
        buffers: dict[int, bytearray] = {}
        while True:
            count = _read_once(fd, stream, buffers)
            if count == 0:
                self._fds[fd] = True
                return
            if count < 0:
                await anyio.wait_readable(fd)
            else:
                await anyio.lowlevel.checkpoint()

    async def _write_stdin(self, fd: int) -> None:
        """The spec's stdin, then end of file (a command without open input)."""
        data = self._launch.spec.stdin
        assert data is not None
        try:
            await self.send_input(data.encode() if isinstance(data, str) else data)
        except BrokenPipeError:
            pass  # the command closed its stdin: the rest has no reader
        finally:
            self._stdin_fd = None
            os.close(fd)

    async def send_input(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            fd = self._stdin_fd
            if fd is None:
                raise BrokenPipeError("the command's stdin is closed")
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                await anyio.wait_writable(fd)
                continue
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EBADF):
                    raise BrokenPipeError(exc.errno, "the command closed its stdin") from exc
                raise
            view = view[written:]

    async def end_input(self) -> None:
        fd, self._stdin_fd = self._stdin_fd, None
        if fd is not None:
            os.close(fd)

    async def sample_input_waiting(self) -> bool | None:
        identity = self._input_identity
        if identity is None:
            return None
        if not self._pid:
            return False  # a supervisor whose pid has not come yet
        # The tree under the command's leader (or its supervisor, a subreaper that holds every
        # orphan): no scan of every process here, which a busy host makes slow. A handful of small
        # /proc reads per process; a task of thousands is looked at in part.
        return bool(input_waiters(descendants(self._pid, _WAIT_SAMPLE_MAX), identity))

    async def resize(self, size: TerminalSize) -> None:
        # The input fd of a terminal task is the terminal's master side (a dup of the one read).
        if self._stdin_fd is not None:
            set_terminal_size(self._stdin_fd, size)

    # -- kill ------------------------------------------------------------------------------------

    async def _members(self) -> tuple[bool, list[int]]:
        """(whether the group is verifiably ours, live marked pids outside the group)."""
        entries = await self._scanner.entries()
        marker = self._launch.marker
        pgid = self._pid
        group_ours = not self._reaped or any(e.marker == marker and e.pgrp == pgid for e in entries)
        outside = [e.pid for e in entries if e.alive and e.marker == marker and e.pgrp != pgid]
        return group_ours, outside

    async def signal_all(self, sig: int) -> None:
        # In the event loop, not a worker thread: the kill path needs nothing it may not get (a
        # thread under a pids limit a fork bomb filled). A failed scan is logged; remaining() then
        # reports the command's processes as unknown, so that the kill sequence tries again.
        try:
            group_ours, outside = await self._members()
        except ProcScanError as exc:
            log.warning("cannot find the processes of %s: %s", self._launch.marker, exc)
            group_ours, outside = not self._reaped, []
        # Never pid 0 (a supervised command whose supervisor never answered has no pid of its own):
        # killpg(0) would signal this process's own group, the harness.
        if group_ours and self._pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pid, sig)
        marker = self._launch.marker
        for pid in outside:
            try:
                signal_marked(pid, marker, sig, True, self._scanner.reserve)
            except OSError as exc:
                log.warning("cannot signal process %d of %s: %s", pid, marker, exc)
            await anyio.lowlevel.checkpoint()
        self._scanner.invalidate()

    async def remaining(self) -> list[str]:
        try:
            entries = await self._scanner.entries()
        except ProcScanError as exc:
            return [unknown_leftovers(exc)]
        marker = self._launch.marker
        pgid = self._pid
        group_ours = not self._reaped or any(e.marker == marker and e.pgrp == pgid for e in entries)
        return [
            str(e.pid) for e in entries if e.alive and (e.marker == marker or (group_ours and e.pgrp == pgid))
        ]

    # -- release ---------------------------------------------------------------------------------

    async def release(self) -> None:
        await self._release_fds()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._peek_exit() is not None:
            os.waitpid(self._pid, 0)  # noqa: ASYNC222 - it has exited: this reaps, it does not wait
            self._reaped = True
            # Tell Popen the child is reaped, so it never waits on a recycled pid.
            if self._popen is not None:
                self._popen.returncode = 0

    async def _release_fds(self) -> None:
        """Close the pipes (draining those descendants still hold) and remove the command's script."""
        if self._stdin_fd is not None:
            os.close(self._stdin_fd)
            self._stdin_fd = None
        for fd, at_eof in self._fds.items():
            if at_eof:
                os.close(fd)
            else:
                # Descendants still hold the pipe: keep draining it into the void so their writes
                # neither block nor die of SIGPIPE, until they close it or the executor closes.
                self._start_helper(_discard_until_eof, fd)
        self._fds = {}
        if self._script is not None:
            directory, name = self._script
            self._script = None
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=directory.fd)


def _read_once(fd: int, stream: OutputStream, buffers: dict[int, bytearray]) -> int:
    """One non-blocking read of ``fd`` into ``stream``: the count fed, 0 at EOF, -1 when nothing is there.

    Small reads first; a stream that fills one switches to a large buffer of its own, reused."""
    buffer = buffers.get(fd)
    try:
        if buffer is None:
            data: bytes | memoryview = os.read(fd, _FIRST_READ)
            count = len(data)
            if count == _FIRST_READ:
                buffers[fd] = bytearray(_BIG_READ)
        else:
            count = os.readv(fd, [buffer])
            data = memoryview(buffer)[:count]
    except BlockingIOError:
        return -1
    except OSError as exc:
        if exc.errno == errno.EIO:
            return 0  # a terminal's master side: every process closed the terminal
        raise
    if count:
        stream.feed(data)
    return count


#: The most processes of one command a waiting-for-input sample looks at.
_WAIT_SAMPLE_MAX = 256


def set_terminal_size(fd: int, size: TerminalSize) -> None:
    """Set the size of the terminal ``fd`` is a side of; its foreground process group gets SIGWINCH."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


def _take_terminal() -> None:  # pragma: no cover - runs in the child, between fork and exec
    # After Popen's setsid: the session leader makes its stdin, a terminal, its controlling terminal,
    # so that Ctrl-C, job control and /dev/tty work as in a terminal emulator.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@dataclass(slots=True)
class CommandChannels:
    """A supervised command's plumbing: the status socket, the stdout and stderr pipes (ours
    non-blocking; theirs go to the supervisor with the request, and are closed here after it)."""

    status: socket.socket
    status_theirs: int
    out_r: int
    out_w: int
    err_r: int
    err_w: int

    @classmethod
    def open(cls) -> CommandChannels:
        made: list[int] = []
        # A socket, not a pipe: a pipe's end in this process could be reopened for writing through
        # /proc/<our pid>/fd/N by a command of the same user; a socket cannot be opened through /proc
        # at all, so only the supervisor can write the status.
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            made.append(theirs.detach())
            status.setblocking(False)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            made += [out_r, out_w]
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            made += [err_r, err_w]
            _set_nonblocking(out_r)
            _set_nonblocking(err_r)
        except BaseException:
            for fd in made:
                os.close(fd)
            status.close()
            raise
        return cls(status, made[0], out_r, out_w, err_r, err_w)

    def close(self) -> None:
        for fd in (self.status_theirs, self.out_r, self.out_w, self.err_r, self.err_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.status.close()


class ChannelPool:
    """One set of :class:`CommandChannels` made ahead of the next command: made while the previous
    one starts, it is not made on the next one's way (a short command feels each system call)."""

    def __init__(self) -> None:
        self._ready: CommandChannels | None = None

    def take(self) -> CommandChannels | None:
        ready, self._ready = self._ready, None
        return ready

    def refill(self) -> None:
        if self._ready is None:
            with contextlib.suppress(OSError):  # out of descriptors: the next command makes its own
                self._ready = CommandChannels.open()

    def close(self) -> None:
        if self._ready is not None:
            self._ready.close()
            self._ready = None


#: How often a command no supervisor answered yet continues the fork server and its spare.
_NUDGE_EVERY_S = 0.5

#: Where a launcher's program finds the status socket when a supervisor runs inside its sandbox.
_INNER_STATUS_FD = 3

#: How long an abandoned start waits for its supervisor to report that nothing is left (its SIGKILL
#: passes take milliseconds; the bound is for a supervisor the command stopped or killed).
_ABANDON_BOUND_S = 2.0


class SupervisedProcess(HostProcess):
    """A command under a ``dsh-supervise`` supervisor (a child of the executor's fork server).

    The supervisor is a subreaper: every orphan of the command re-parents to it, so the whole
    subtree stays below it whatever its processes do to their session, group or environment, and
    it signals that subtree on request (SIGUSR1: SIGTERM to all; SIGUSR2: SIGKILL until none is
    left). It reports on a socket only it holds (it is non-dumpable, so the command cannot reach its
    end through ``/proc``, and a socket cannot be reopened there), which makes the outcome impossible
    to forge: first its own pid with a pidfd (signals go through it, never to a recycled pid), then
    the command's start and exit status. It exits once its last descendant is gone, after writing
    ``empty``; the fork server reaps it.
    """

    def __init__(
        self,
        launch: Launch,
        *,
        status: socket.socket,
        bash: str,
        nudge: Callable[[], None],
        nested: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(None, launch, **kw)
        self._bash = bash
        #: Continues the fork server and its spare (a command may have stopped them) while this
        #: command waits for a supervisor to take it.
        self._nudge = nudge
        #: A second supervisor runs inside the launcher's sandbox and reports the command on the same
        #: socket: its ``empty`` comes while the launcher still runs, so only the outer one's counts.
        self._nested = nested
        #: Set once the supervisor's pid and pidfd came, or the channel ended without them.
        self._answered = anyio.Event()
        self._status: socket.socket | None = status  # non-blocking; closed at release
        self._status_buffer = b""
        self._status_eof = False
        self._records = SupervisorRecords()
        self._reading = False
        self._supervisor_reaped = False
        #: The executor's set of live supervised commands: this one leaves it once its supervisor is gone.
        self.registry: set[SupervisedProcess] | None = None
        #: Called once the supervisor is found gone before it said that nothing was left: processes
        #: may then live that no supervisor holds, which only a scan by marker can still find.
        self.on_lost: Callable[[], None] | None = None

    # -- the status channel ----------------------------------------------------------------------

    def _pump_status(self) -> None:
        """Read whatever the supervisor wrote, without blocking, and apply every whole record."""
        sock = self._status
        while sock is not None and not self._status_eof:
            try:
                data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, ancdata = b"", []
            for fd in received_fds(ancdata):
                if self._pidfd is None and self._records.supervisor_pid is None:
                    self._pidfd = fd  # the supervisor's own, sent with its first record
                    self._answered.set()
                else:
                    os.close(fd)
            if not data:
                self._status_eof = True
                self._answered.set()
                break
            self._status_buffer += data
            *records, self._status_buffer = self._status_buffer.split(b"\n")
            for record in records:
                self._records.apply(record.decode("ascii", "replace"))
            if self._records.supervisor_pid is not None and not self._pid:
                self._pid = self._records.supervisor_pid

    async def _status_until(self, done: Callable[[], bool]) -> None:
        # Only this loop reads while it runs: a record another task took from under it would leave
        # it waiting for the next one (``empty``, which a leftover may delay by a whole grace).
        self._reading = True
        try:
            while True:
                self._pump_status()
                if done() or self._status_eof or self._status is None:
                    return
                await anyio.wait_readable(self._status)
        finally:
            self._reading = False

    def _pump_unless_read(self) -> None:
        if not self._reading:
            self._pump_status()

    @property
    def answered(self) -> bool:
        """True once a supervisor took the command (its first record came)."""
        return self._records.supervisor_pid is not None

    def _start_known(self) -> bool:
        records = self._records
        known = (records.child, records.exec_failed, records.workdir_failed)
        return any(value is not None for value in known)

    async def started(self) -> None:
        """Return once the command's bash runs; raise BashInfrastructureError when it could not start."""
        records = self._records
        await self._until_answered(self._start_known)
        spec = self._launch.spec
        if records.workdir_failed is not None:
            code = records.workdir_failed
            reason: InfraReason = "start_failed"
            if code in (errno.ENOENT, errno.ENOTDIR):
                reason = "workdir_missing"
            elif code == errno.EACCES:
                reason = "workdir_not_accessible"
            raise BashInfrastructureError(
                f"workdir {spec.workdir!r} cannot be entered: {os.strerror(code)}", reason=reason
            )
        if records.exec_failed is not None:
            raise _start_error(self._bash, spec.workdir, records.exec_failed, self._launch.env)
        if records.child is None:
            raise BashInfrastructureError(
                "the command's supervisor (dsh-supervise) ended before the command started",
                reason="start_failed",
            )

    async def _await_answer(self) -> None:
        """Wait (bounded) until the supervisor's pid and pidfd came, or its channel ended."""
        if self._answered.is_set():
            return
        with anyio.move_on_after(_ABANDON_BOUND_S):
            if self._reading:
                await self._answered.wait()  # the reading task applies it
            else:
                await self._until_answered(self._answered.is_set)

    async def _until_answered(self, done: Callable[[], bool]) -> None:
        """Read records until ``done()`` or the channel ends, nudging whoever must write them every
        half second: while no supervisor answered, the fork server and its spare (continued if
        stopped); then the supervisor itself, which the command may stop (SIGSTOP, same user) before
        it reported the start."""
        while not done() and not self._status_eof and self._status is not None:
            answered = self._answered.is_set()

            def changed(was: bool = answered) -> bool:
                return done() or self._answered.is_set() != was

            with anyio.move_on_after(_NUDGE_EVERY_S):
                await self._status_until(changed)
            if done():
                return
            if not self._answered.is_set():
                self._nudge()
            elif self._pidfd is not None and not self._supervisor_gone():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGCONT)

    async def abandon(self) -> None:
        """Kill whatever started, wait until it is gone, and release everything (a start that failed
        or was cancelled: the caller's cancellation must not propagate while the command still runs)."""
        self._pump_unless_read()
        # Its pid and pidfd come with its first records, the moment the command has started.
        await self._await_answer()
        if self._signal_supervisor(signal.SIGUSR2):
            with anyio.move_on_after(_ABANDON_BOUND_S):
                await self._status_until(lambda: self._records.empty)
        await self.release()

    @property
    def ended(self) -> bool:
        """True once the supervisor and every process under it are gone."""
        return self._supervisor_reaped or (self._records.empty and self._supervisor_gone())

    def _nothing_left(self) -> bool:
        """The supervisor said no process is left (nested: and the outer one is gone too)."""
        return self._records.empty and (not self._nested or self._supervisor_gone())

    # -- exit ------------------------------------------------------------------------------------

    async def wait(self) -> ExitStatus:
        # A foreground command's start is confirmed here (spawn_host_process did not wait for it).
        await self.started()
        await self._status_until(lambda: self._records.command_exit is not None)
        if self._records.command_exit is None:
            raise BashInfrastructureError(
                "the command's supervisor died before it reported how the command ended (killed by "
                "the command itself?); its exit status is lost",
                reason="command_lost",
            )
        return self._records.command_exit

    # -- kill ------------------------------------------------------------------------------------

    def _supervisor_gone(self) -> bool:
        if self._supervisor_reaped:
            return True
        if self._pidfd is None:
            # No supervisor answered: there is none we know of once the channel ended or we closed it
            # (a request still queued at the server then runs unanswered until the server closes,
            # which kills it: the executor's aclose, or the server's death).
            return self._status_eof or self._status is None
        return pidfd_exited(self._pidfd)

    def _signal_supervisor(self, sig: int) -> bool:
        """Send ``sig`` to the supervisor while it lives; False when it is gone (or never came)."""
        if self._pidfd is None or self._supervisor_gone():
            return False
        with contextlib.suppress(ProcessLookupError):
            # SIGCONT first: a command may have stopped its supervisor (same user), which would
            # leave the request pending for ever.
            for each in (signal.SIGCONT, sig):
                signal.pidfd_send_signal(self._pidfd, each)
        return True

    async def signal_all(self, sig: int) -> None:
        self._pump_unless_read()
        await self._await_answer()
        if self._nothing_left():
            return
        request = signal.SIGUSR2 if sig == signal.SIGKILL else signal.SIGUSR1
        if self._signal_supervisor(request):
            return
        # The supervisor died with descendants left (the command killed it): they re-parented to
        # init, so only the marker, the last hint, can still find them.
        self._report_lost()
        await super().signal_all(sig)

    async def left_behind(self, settle_s: float) -> list[str]:
        if not self._reading:
            with anyio.move_on_after(settle_s):
                await self._status_until(self._nothing_left)
        return await self.remaining()

    async def remaining(self) -> list[str]:
        self._pump_unless_read()
        if self._nothing_left():
            return []
        if not self._supervisor_gone():
            return [f"processes under dsh-supervise {self._pid or '(starting)'}"]
        self._report_lost()
        return await super().remaining()

    def _report_lost(self) -> None:
        if self.on_lost is not None and not self._records.empty:
            self.on_lost()

    async def _members(self) -> tuple[bool, list[int]]:
        # Without a live supervisor only the marker finds them; the command's group is not ours to
        # verify (its leader was the supervisor's child, never ours).
        entries = await self._scanner.entries()
        marker = self._launch.marker
        return False, [e.pid for e in entries if e.alive and e.marker == marker]

    # -- release ---------------------------------------------------------------------------------

    async def release(self) -> None:
        if self._status is not None:
            self._pump_unless_read()  # an ``empty`` already there tells that nothing is left
            self._status.close()
            self._status = None
        self._reaped = True  # the supervisor, not us, reaps the command's processes
        await super()._release_fds()
        if self._nothing_left() or self._supervisor_gone():
            # After ``empty`` the supervisor has no descendant and can get none: it is exiting (the
            # fork server reaps it), so there is nothing left to watch for.
            self._forget_supervisor()
        else:
            # Leftovers live on under the supervisor; it exits once they are gone.
            self._start_helper(self._forget_supervisor_when_gone)

    def _forget_supervisor(self) -> None:
        if self._supervisor_reaped:
            return
        self._report_lost()
        self._supervisor_reaped = True  # the fork server reaps it
        if self.registry is not None:
            self.registry.discard(self)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def _forget_supervisor_when_gone(self) -> None:
        try:
            while not self._supervisor_gone():
                assert self._pidfd is not None
                await anyio.wait_readable(self._pidfd)
        finally:
            if self._supervisor_gone():
                self._forget_supervisor()


def _start_error(bash: str, workdir: str, code: int, env: Mapping[str, str]) -> BashInfrastructureError:
    """The error for a command's bash that could not be exec'd with errno ``code``."""
    if code == errno.E2BIG:
        # The command itself is never too long here (long ones run from a file): what overflowed
        # is the environment, whose total size the kernel limits.
        size = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
        return BashInfrastructureError(
            f"cannot start {bash!r}: the command's environment (env) is too large for the "
            f"system ({size} bytes in {len(env)} variables): {os.strerror(code)}",
            reason="start_failed",
        )
    missing = code in (errno.ENOENT, errno.EACCES)
    return BashInfrastructureError(
        f"cannot start {bash!r} in {workdir!r}: {os.strerror(code)}",
        reason="shell_missing" if missing else "start_failed",
    )


async def _discard_until_eof(fd: int) -> None:
    try:
        while True:
            try:
                if not os.read(fd, _BIG_READ):
                    return
            except BlockingIOError:
                await anyio.wait_readable(fd)
            except OSError as exc:
                if exc.errno == errno.EIO:  # a terminal nobody holds any more
                    return
                raise
    finally:
        os.close(fd)


def workdir_problem(workdir: str) -> tuple[str, InfraReason] | None:
    """Why ``workdir`` cannot be a command's working directory on this host (what, and the reason
    of the contract), or None when it can."""
    try:
        st = os.stat(workdir)
    except FileNotFoundError:
        return "does not exist", "workdir_missing"
    except NotADirectoryError:
        return "does not exist (a path component is not a directory)", "workdir_missing"
    except OSError as exc:
        return f"cannot be examined: {exc.strerror}", "workdir_not_accessible"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory", "workdir_not_directory"
    if not os.access(workdir, os.X_OK):
        return "cannot be entered (permission denied)", "workdir_not_accessible"
    return None


async def spawn_host_process(
    launch: Launch,
    *,
    bash: str,
    spill_dir: HostSpillDir,
    scanner: ProcScanner,
    start_helper: StartHelper,
    wrap: WrapCommand | None = None,
    supervisor: SupervisorServer | None = None,
    inner_supervisor: str | None = None,
    channels: ChannelPool | None = None,
) -> HostProcess:
    """Start ``launch`` as ``bash --noprofile --norc`` in a new session of this host; return once it runs.

    ``wrap`` lets a sandboxing backend put a launcher in front of the argv. ``supervisor`` is the
    executor's ``dsh-supervise`` fork server: the command then runs under a supervisor of its own (a
    subreaper that keeps every descendant findable and reports the exit status where the command
    cannot write), and a :class:`SupervisedProcess` is returned. Raises
    :class:`dsh_bash.BashInfrastructureError` (with its ``reason``) when it cannot start.

    ``inner_supervisor`` (with ``supervisor``): the path of ``dsh-supervise`` as ``wrap``'s launcher
    sees it. The argv given to ``wrap`` then starts with ``INNER --status-fd 3 --``, the launcher gets
    the status socket as fd 3 and must pass it through: the command's exit status comes from the
    supervisor inside the sandbox (a launcher reports a signal death as ``128+n`` at best), while the
    outer one still holds the launcher and everything under it.

    ``channels`` (with ``supervisor``): where a command's status socket and pipes are made ahead of
    time, while the previous command starts.
    """
    argv, script = _bash_argv(launch.spec.command, bash, spill_dir)
    if launch.confine is not None:
        argv = [*launch.confine, *argv]  # the policy's step, in the command's own process
    try:
        nested = supervisor is not None and inner_supervisor is not None
        if nested:
            argv = _under_inner_supervisor(argv, str(inner_supervisor), launch.marker)
        argv, host_workdir = _wrapped(argv, launch, wrap)
        if supervisor is not None:
            return await _spawn_under_fork_server(
                launch,
                argv,
                host_workdir,
                supervisor,
                bash=bash,
                script=script,
                scanner=scanner,
                start_helper=start_helper,
                nested=nested,
                channels=channels,
            )
        return _spawn_marked(
            launch, argv, host_workdir, bash=bash, scanner=scanner, start_helper=start_helper, script=script
        )
    except BaseException:
        # A process that holds the script removes it at release; a start that failed leaves no file.
        if script is not None:
            with contextlib.suppress(OSError):
                os.unlink(script[1], dir_fd=spill_dir.fd)
        raise


def _bash_argv(
    command: str, bash: str, spill_dir: HostSpillDir
) -> tuple[list[str], tuple[HostSpillDir, str] | None]:
    """The argv that runs ``command`` in ``bash``, and the script file it reads it from, if any.

    A command longer than ``MAX_INLINE_COMMAND`` goes through a file in the spill directory: execve
    refuses a single argument that long."""
    encoded = command.encode("utf-8", "surrogateescape")
    if len(encoded) <= MAX_INLINE_COMMAND:
        return [bash, "--noprofile", "--norc", "-c", "--", command], None
    script_file = spill_dir.new_file("sh")
    script_file.write(encoded)
    script_file.close()
    script = (spill_dir, os.path.basename(script_file.path))
    return [bash, "--noprofile", "--norc", script_file.path], script


def _under_inner_supervisor(argv: list[str], inner_supervisor: str, marker: str) -> list[str]:
    """``argv`` run by the supervisor that goes inside the launcher's sandbox."""
    # The marker reaches the shell alone (--setenv): neither the launcher nor the supervisor
    # inside carries it, so whoever looks for the command's processes by it finds the shell.
    marking = f"{MARKER_VAR}={marker}"
    return [inner_supervisor, "--setenv", marking, "--status-fd", str(_INNER_STATUS_FD), "--", *argv]


def _wrapped(argv: list[str], launch: Launch, wrap: WrapCommand | None) -> tuple[list[str], str]:
    """``argv`` behind ``wrap``'s launcher, and the host directory it starts in; raises
    BashInfrastructureError (with the workdir's reason) when that directory is not usable."""
    host_workdir = launch.spec.workdir
    if wrap is not None:
        argv, host_workdir = wrap(argv, launch)
    problem = workdir_problem(host_workdir)
    if problem is not None:
        what, why = problem
        raise BashInfrastructureError(f"workdir {launch.spec.workdir!r} {what}", reason=why)
    return argv, host_workdir


async def _spawn_under_fork_server(
    launch: Launch,
    argv: list[str],
    host_workdir: str,
    server: SupervisorServer,
    *,
    bash: str,
    script: tuple[HostSpillDir, str] | None,
    scanner: ProcScanner,
    start_helper: StartHelper,
    nested: bool,
    channels: ChannelPool | None,
) -> SupervisedProcess:
    """Start the command under a supervisor of its own, forked by ``server``."""
    # A server a command killed takes the request with it: the command never ran, so it
    # may be asked again of a new server, once.
    for attempt in (1, 2):
        process = await _spawn_supervised(
            launch,
            argv,
            host_workdir,
            server,
            bash=bash,
            script=script,
            scanner=scanner,
            start_helper=start_helper,
            nested=nested,
            channels=channels,
        )
        if process is not None:
            return process
        if attempt == 1:
            log.warning("dsh-supervise's fork server is gone (killed?): starting another")
    raise BashInfrastructureError(
        "the command's supervisor (dsh-supervise) ended before the command started",
        reason="start_failed",
    )


def _spawn_marked(
    launch: Launch,
    argv: list[str],
    host_workdir: str,
    *,
    bash: str,
    scanner: ProcScanner,
    start_helper: StartHelper,
    script: tuple[HostSpillDir, str] | None,
) -> HostProcess:
    """Start the command as our own child (no supervisor: its processes are found by the marker in
    their environment), on a terminal or on pipes. A descriptor made on the way is closed if a later
    step fails."""
    opened: list[int] = []
    try:
        if launch.spec.terminal is not None:
            return _spawn_on_terminal(
                launch,
                argv,
                host_workdir,
                launch.spec.terminal,
                bash=bash,
                scanner=scanner,
                start_helper=start_helper,
                script=script,
                opened=opened,
            )
        return _spawn_on_pipes(
            launch,
            argv,
            host_workdir,
            bash=bash,
            scanner=scanner,
            start_helper=start_helper,
            script=script,
            opened=opened,
        )
    except BaseException:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _spawn_on_pipes(
    launch: Launch,
    argv: list[str],
    host_workdir: str,
    *,
    bash: str,
    scanner: ProcScanner,
    start_helper: StartHelper,
    script: tuple[HostSpillDir, str] | None,
    opened: list[int],
) -> HostProcess:
    """Start the command with its stdout and stderr on pipes, and its stdin on a pipe when the spec
    gives input (else /dev/null). Ours are non-blocking. Descriptors go in ``opened`` until they are
    handed over."""
    spec = launch.spec
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    opened += [out_r, out_w]
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    opened += [err_r, err_w]
    stdin: Any = subprocess.DEVNULL
    in_w: int | None = None
    if spec.stdin is not None or spec.open_stdin:
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        opened += [in_r, in_w]
        stdin = in_r
    popen = _popen(launch, argv, host_workdir, bash, stdin=stdin, stdout=out_w, stderr=err_w)
    # The child holds its own copies now; ours must go, or EOF would never come.
    for fd in (out_w, err_w) + ((stdin,) if in_w is not None else ()):
        os.close(fd)
        opened.remove(fd)
    for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
        _set_nonblocking(fd)
    opened.clear()
    process = HostProcess(
        popen,
        launch,
        stdout_fd=out_r,
        stderr_fd=err_r,
        stdin_fd=in_w,
        scanner=scanner,
        start_helper=start_helper,
        script=script,
    )
    if spec.open_stdin and in_w is not None:
        process._input_identity = InputIdentity.of_fd(in_w, terminal=False)
    return process


def _popen(
    launch: Launch,
    argv: list[str],
    host_workdir: str,
    bash: str,
    *,
    stdin: Any,
    stdout: int,
    stderr: int,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen[bytes]:
    """``bash`` (``argv``) in a new session of this host; what keeps it from starting, as the
    contract's infrastructure errors. ``preexec_fn`` (a terminal's) costs the vfork fast path."""
    try:
        # Popen forks (vfork) and execs in the calling thread, as asyncio's own subprocess does.
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=host_workdir,
            env=launch.env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - a terminal's: it runs after setsid
        )
    except OSError as exc:
        if exc.errno in (errno.E2BIG, errno.ENOENT, errno.EACCES) or exc.errno is None:
            raise _start_error(bash, launch.spec.workdir, exc.errno or 0, launch.env) from exc
        raise BashInfrastructureError(
            f"cannot start {bash!r} in {launch.spec.workdir!r}: {exc.strerror or exc}", reason="start_failed"
        ) from exc
    except subprocess.SubprocessError as exc:  # preexec_fn failed in the child
        raise BashInfrastructureError(
            f"cannot give the command its terminal: {exc}", reason="start_failed"
        ) from exc


@dataclass(frozen=True, slots=True)
class _Terminal:
    master: int  # read as the task's stdout
    writer: int  # a dup of the master, written as the task's input
    slave: int  # the command's stdin, stdout and stderr
    identity: InputIdentity


def _open_terminal(size: TerminalSize, opened: list[int]) -> _Terminal:
    """A pty pair of ``size`` for a terminal task, its descriptors in ``opened`` as soon as they exist
    (the caller closes them if a later step fails); ours non-blocking."""
    master, slave = os.openpty()
    opened += [master, slave]
    writer = os.dup(master)
    opened.append(writer)
    set_terminal_size(master, size)
    for fd in (master, writer):
        _set_nonblocking(fd)
    return _Terminal(master, writer, slave, InputIdentity.of_fd(slave, terminal=True))


def _spawn_on_terminal(
    launch: Launch,
    argv: list[str],
    host_workdir: str,
    size: TerminalSize,
    *,
    bash: str,
    scanner: ProcScanner,
    start_helper: StartHelper,
    script: tuple[HostSpillDir, str] | None,
    opened: list[int],
) -> HostProcess:
    """Start the command on a new pseudo-terminal: its stdin, stdout and stderr, and its controlling
    terminal. Ours is the master side, read as the command's stdout (stderr is an empty stream) and
    written as its input. Descriptors go in ``opened`` until they are handed over."""
    terminal = _open_terminal(size, opened)
    master, slave, writer = terminal.master, terminal.slave, terminal.writer
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    opened += [err_r, err_w]
    popen = _popen(
        launch, argv, host_workdir, bash, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_take_terminal
    )
    # Only the command holds the terminal's slave side now (EIO on the master once it closed it), and
    # nobody writes the stderr pipe (EOF at once: a terminal has one stream).
    for fd in (slave, err_w):
        os.close(fd)
        opened.remove(fd)
    _set_nonblocking(err_r)
    opened.clear()
    process = HostProcess(
        popen,
        launch,
        stdout_fd=master,
        stderr_fd=err_r,
        stdin_fd=writer,
        scanner=scanner,
        start_helper=start_helper,
        script=script,
    )
    process._input_identity = terminal.identity
    return process


@dataclass(frozen=True, slots=True)
class _SupervisedStdio:
    """A supervised command's stdin, stdout and stderr as the request gives them, and our ends."""

    command_in: int
    command_out: int
    command_err: int
    read_out: int  # read as the task's stdout
    write_in: int | None  # written as its input
    identity: InputIdentity | None  # set for open input or a terminal


def _supervised_stdio(
    spec: BashExecSpec,
    plumbing: CommandChannels,
    server: SupervisorServer,
    *,
    ours: list[int],
    theirs: list[int],
) -> _SupervisedStdio:
    """The command's stdio from ``plumbing``'s pipes, a terminal or an input pipe; what it opens goes
    in ``ours`` (kept) or ``theirs`` (closed once the request went)."""
    if spec.terminal is not None:
        # The terminal's slave side is the command's stdin, stdout and stderr (the supervisor
        # makes it the controlling terminal); ours is the master, read as stdout and written as
        # input. The stdout pipe goes unused, the stderr pipe ends at once.
        terminal = _open_terminal(spec.terminal, ours)
        ours.remove(terminal.slave)  # goes with the request
        theirs.append(terminal.slave)
        slave = terminal.slave
        return _SupervisedStdio(slave, slave, slave, terminal.master, terminal.writer, terminal.identity)
    if spec.stdin is not None or spec.open_stdin:
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        _set_nonblocking(in_w)
        identity = InputIdentity.of_fd(in_w, terminal=False) if spec.open_stdin else None
        ours.append(in_w)
        theirs.append(in_r)
        return _SupervisedStdio(in_r, plumbing.out_w, plumbing.err_w, plumbing.out_r, in_w, identity)
    return _SupervisedStdio(server.null, plumbing.out_w, plumbing.err_w, plumbing.out_r, None, None)


async def _spawn_supervised(
    launch: Launch,
    argv: list[str],
    host_workdir: str,
    server: SupervisorServer,
    *,
    bash: str,
    script: tuple[HostSpillDir, str] | None,
    scanner: ProcScanner,
    start_helper: StartHelper,
    nested: bool,
    channels: ChannelPool | None,
) -> SupervisedProcess | None:
    """One request to the fork server; None when the server died before a supervisor took it."""
    plumbing = channels.take() if channels is not None else None
    if plumbing is None:
        plumbing = CommandChannels.open()
    theirs = [plumbing.status_theirs, plumbing.out_w, plumbing.err_w]
    ours = [plumbing.out_r, plumbing.err_r]
    status = plumbing.status
    try:
        stdio = _supervised_stdio(launch.spec, plumbing, server, ours=ours, theirs=theirs)
        env = launch.env
        if nested:
            env = {name: value for name, value in env.items() if name != MARKER_VAR}
        await server.request(
            argv,
            env,
            host_workdir,
            status=plumbing.status_theirs,
            stdin=stdio.command_in,
            stdout=stdio.command_out,
            stderr=stdio.command_err,
            status_in_program=_INNER_STATUS_FD if nested else -1,
        )
    except BaseException:
        for fd in theirs + ours:
            with contextlib.suppress(OSError):
                os.close(fd)
        status.close()
        raise
    # The server holds its own copies now; ours must go, or EOF would never come.
    for fd in theirs:
        os.close(fd)
    if channels is not None:
        # While the supervisor starts this command: the next one finds its plumbing ready.
        channels.refill()
    if stdio.read_out != plumbing.out_r:
        os.close(plumbing.out_r)
    err_r = plumbing.err_r
    process = SupervisedProcess(
        launch,
        status=status,
        stdout_fd=stdio.read_out,
        stderr_fd=err_r,
        stdin_fd=stdio.write_in,
        scanner=scanner,
        start_helper=start_helper,
        script=None,  # not before it started: a retry still needs the file
        bash=bash,
        nudge=server.nudge,
        nested=nested,
    )
    process._input_identity = stdio.identity
    if not launch.background:
        # A foreground command's start is confirmed by its wait(), whose errors run() raises as
        # they are: meanwhile the executor sets up its reading, while the supervisor starts it.
        process._script = script
        return process
    return await _confirmed_start(process, server, script)


async def _confirmed_start(
    process: SupervisedProcess, server: SupervisorServer, script: tuple[HostSpillDir, str] | None
) -> SupervisedProcess | None:
    """``process`` once its command runs (a background command's start is confirmed before it is
    returned); None when the server died before a supervisor took the request."""
    try:
        await process.started()
    except BashInfrastructureError:
        with anyio.CancelScope(shield=True):
            await process.abandon()
        if not process.answered and not server.running:
            return None
        raise
    except BaseException:
        with anyio.CancelScope(shield=True):
            await process.abandon()
        raise
    process._script = script
    return process
