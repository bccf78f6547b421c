"""One ``dsh-supervise --fork-server`` per host executor: a command's supervisor costs a fork, not an exec.

The server keeps a spare child ready, a fork of itself, which takes the next request (the command's
argv, environment and directory, with its stdio and status socket passed as descriptors) and becomes
that command's supervisor; the server then forks the next spare. Exec'ing a fresh supervisor for each
command cost about a third of a command's latency on small machines; a fork of an idle static process
costs a fraction of that, and the request needs no exec of Python's own (``subprocess``) machinery.

The server announces each spare on the request socket (``spare PID`` with a pidfd), so that a spare a
command stopped (same user: it can) is continued before the next request goes to it. A server a
command killed is started again for the next command; the commands it was running end with it (every
supervisor dies with its server: PR_SET_PDEATHSIG), which ``docs/security.md`` lists.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import select
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence

import anyio

from ..supervisor import command_payload

__all__ = ["SupervisorServer", "pidfd_exited", "received_fds"]

#: How long closing waits for the server to exit once its socket is closed (it exits at once).
_CLOSE_BOUND_S = 2.0


def pidfd_exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited (a pidfd polls readable then, for any process,
    not only a child)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class SupervisorServer:
    """A running ``dsh-supervise --fork-server``: :meth:`request` hands it one command.

    ``start_helper(async_fn, *args)`` runs a watcher in the executor's task group: a server that dies
    (a command of the same user killed it) has its socket closed at once, so that a request it took
    with it ends (its status socket, in flight in that socket, closes) instead of waiting for ever.
    """

    def __init__(self, binary: str, start_helper: Callable[..., None]) -> None:
        self._binary = binary
        self._start_helper = start_helper
        self._popen: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._socket: socket.socket | None = None
        self._send_lock = anyio.Lock()
        self._spare_pidfd: int | None = None
        self._null: int | None = None  # /dev/null, the stdin of commands that are given none
        self._watched = False  # whether a watcher runs for the current server

    @property
    def running(self) -> bool:
        return self._pidfd is not None and not pidfd_exited(self._pidfd)

    @property
    def null(self) -> int:
        """A descriptor of /dev/null (read-only) to pass as a command's stdin; the server owns it."""
        assert self._null is not None
        return self._null

    def start(self) -> None:
        """Start the server (ending one that ran before). Raises OSError when it cannot start."""
        self._end_now()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # An empty environment: no value of the host's is in a process that serves every
            # command (each request brings the command's own environment).
            self._popen = subprocess.Popen(
                [self._binary, "--fork-server", "--die-with-parent"],
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={},
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._socket = ours
        self._pidfd = os.pidfd_open(self._popen.pid)
        if self._null is None:
            self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._watched = False

    async def _watch(self, pidfd: int, sock: socket.socket) -> None:
        try:
            await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        if self._socket is sock:
            self._close_socket()

    async def request(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        *,
        status: int,
        stdin: int,
        stdout: int,
        stderr: int,
        status_in_program: int = -1,
    ) -> None:
        """Hand one command to the server; what becomes of it comes on the ``status`` socket.

        A server that is gone (a command killed it) is started again first. The descriptors are
        duplicated into the request: the caller still owns (and closes) its own.
        ``status_in_program`` (3 or more): the program gets the status socket as that fd too (a
        launcher whose sandbox runs a supervisor of its own, which reports the command).
        """
        payload = command_payload(argv, env, cwd, status_in_program)
        message = len(payload).to_bytes(4, "big") + payload
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_array(status, stdin, stdout, stderr))]
        # One request at a time, whole: a request that waits for room in the socket (a large
        # environment, many commands at once) would otherwise let another's bytes in between its
        # own, and the server would read neither (two waits for room at once also fail).
        async with self._send_lock:
            await self._send(message, fds)

    async def _send(self, message: bytes, fds: list[tuple[int, int, bytes]]) -> None:
        # One sendmsg carries the descriptors with the first bytes; the rest (a large environment)
        # follows as the server's spare reads.
        sent = 0
        sock: socket.socket | None = None
        for attempt in (1, 2):
            if self._socket is None:
                self.start()
            sock = self._socket
            assert sock is not None and self._popen is not None
            if not self._watched:
                # From the first request on (the executor's helpers run once it is open). The
                # watcher gets a pidfd of its own: ours may be closed under its wait.
                self._start_helper(self._watch, os.pidfd_open(self._popen.pid), sock)
                self._watched = True
            try:
                while sent == 0:
                    try:
                        sent = sock.sendmsg([message], fds)
                    except BlockingIOError:
                        self.nudge()  # a stopped server fills its socket
                        await anyio.wait_writable(sock)
                # After sending, not before: the spare starts on the request meanwhile.
                self.nudge()
                break
            except (BrokenPipeError, ConnectionResetError):
                if attempt == 2:
                    raise
                self._close_socket()  # the server is gone (a command killed it): nothing was sent
        assert sock is not None
        if sent == len(message):
            return
        view = memoryview(message)[sent:]
        with anyio.CancelScope(shield=True):
            # Half a request would leave the server's next spare reading the rest of it for ever.
            while view:
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    self.nudge()  # a stopped server fills its socket
                    await anyio.wait_writable(sock)

    def nudge(self) -> None:
        """SIGCONT the server and its current spare (taking the server's spare announcements first):
        a command of the same user may have stopped either, which would leave requests unanswered."""
        sock = self._socket
        if sock is None:
            return
        while True:
            try:
                data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(4 * 8))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return
            for fd in received_fds(ancdata):
                if self._spare_pidfd is not None:
                    os.close(self._spare_pidfd)
                self._spare_pidfd = fd
            if not data:
                break
        for pidfd in (self._pidfd, self._spare_pidfd):
            if pidfd is not None:
                with contextlib.suppress(ProcessLookupError, OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGCONT)

    def _close_socket(self) -> None:
        """Close our end: the server exits (and with it every supervisor still running under it).

        The current spare is killed first: it runs nothing yet, and one a command stopped would never
        act on its PDEATHSIG, outliving the executor. The server is continued, so that it sees EOF.
        """
        if self._socket is not None:
            self.nudge()  # the latest announcement, and the server continued
            self._socket.close()
            self._socket = None
        if self._spare_pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._spare_pidfd, signal.SIGKILL)
            os.close(self._spare_pidfd)
            self._spare_pidfd = None

    def _end_now(self) -> None:
        """End the server we had, if any, and reap it (a restart: it is gone or going already)."""
        self._close_socket()
        if self._pidfd is None:
            return
        if not pidfd_exited(self._pidfd):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._reap()

    async def aclose(self) -> None:
        """Close the socket, wait (bounded) for the server to exit, kill it if it would not, reap it."""
        self._close_socket()
        if self._null is not None:
            os.close(self._null)
            self._null = None
        if self._pidfd is None:
            return
        # Awaited on a duplicate of the pidfd (readable once the server exited, which it does at
        # once): the watcher waits on a pidfd of its own, and ours stays ours to close in
        # ``_end_now``. A poll every few milliseconds cost each short ``dsh-bash run`` one sleep.
        if not pidfd_exited(self._pidfd):
            exited = os.dup(self._pidfd)
            try:
                with anyio.move_on_after(_CLOSE_BOUND_S, shield=True):
                    await anyio.wait_readable(exited)
            finally:
                os.close(exited)
        # Still there: stopped, most likely (a command of the same user can). Its supervisors die
        # with it.
        self._end_now()

    def _reap(self) -> None:
        """Reap the server (it has exited or was just killed: the wait is short)."""
        assert self._popen is not None and self._pidfd is not None
        with contextlib.suppress(ChildProcessError):
            if os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED) is not None:
                self._popen.returncode = 0
        os.close(self._pidfd)
        self._pidfd = None
        self._popen = None


def _fd_array(*fds: int) -> bytes:
    return array.array("i", fds).tobytes()


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in ``recvmsg``'s ancillary data (SCM_RIGHTS), in order."""
    fds: list[int] = []
    for level, kind, blob in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            values = array.array("i")
            values.frombytes(blob[: len(blob) - len(blob) % values.itemsize])
            fds.extend(values)
    return fds


def server_problem(error: OSError) -> str:
    """Why the server could not start, in words."""
    if error.errno in (errno.ENOENT, errno.EACCES):
        return f"dsh-supervise cannot be executed: {error.strerror}"
    return f"dsh-supervise --fork-server could not start: {error.strerror or error}"
