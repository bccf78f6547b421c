"""One command on the SSH host: its channel's exit status is the command's; kills use a reserved channel."""

from __future__ import annotations

import logging
import signal as signal_module
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import anyio.lowlevel
import asyncssh

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    CommandProcess,
    ExitStatus,
    InfraReason,
    Launch,
)
from dsh_bash.remote import (
    CommandStart,
    boot_failure,
    find_boot_ok,
    kill_args,
)

from ._connection import ChannelPool, SlotSession
from ._scripts import BOOT_FAIL, KILL, READY, STDERR_OK

__all__ = ["CommandSession", "RemoteMarked", "SshProcess", "boot_verdict", "signal_number"]

log = logging.getLogger("dsh_bash.ssh")

#: How long one signal delivery (a KILL script run) may take even after its caller gave up.
_SIGNAL_BOUND_S = 10.0
#: rc-file noise kept while looking for the boot verdict (only its tail can hold a marker).
_MAX_NOISE = 64 * 1024


class RemoteMarked:
    """The processes on the host carrying a marker (exactly, or as a prefix), and their groups.

    Found and signalled by the shared KILL script, run over the pool's reserved kill channel (the
    connection is re-established first when it dropped: a command outlives its connection).

    For one command (``exact``) whose BOOT reported its start (:attr:`start`), the script skips
    processes that started before it without reading their environments (issue 15).
    """

    def __init__(
        self,
        pool: ChannelPool,
        *,
        marker: str,
        exact: bool,
        unreached: Callable[[RemoteMarked], None] | None = None,
    ) -> None:
        self._pool = pool
        self._marker = marker
        self._exact = exact
        self._unreached = unreached
        #: The command's start on the host's clock, from BOOT's BOOT_AT record (None until then).
        self.start: CommandStart | None = None

    @property
    def marker(self) -> str:
        return self._marker

    def _args(self, mode: Literal["signal", "list"], sig: int) -> tuple[str, ...]:
        return kill_args(mode, sig, self._marker, exact=self._exact, start=self.start)

    async def signal_all(self, sig: int) -> None:
        # Shielded: a kill sequence's bound may expire while the script runs (a slow login's rc
        # files, a busy /proc); a signal whose delivery already began is delivered all the same.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SIGNAL_BOUND_S):
            try:
                await self._pool.run_script(KILL, *self._args("signal", sig), kill=True)
            except BashInfrastructureError:
                # The host cannot be reached (the server restarts, say): these processes are no
                # longer accounted for; they are killed once the executor reconnects.
                if self._unreached is not None:
                    self._unreached(self)
                raise

    async def remaining(self) -> list[str]:
        # Shielded as well: a script cancelled half-way keeps its server session until it exits
        # (sshd frees a session only once its process is gone), so cancelled scans in a row would
        # exhaust MaxSessions while the pool believes its kill slot free.
        found: list[str] = []
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SIGNAL_BOUND_S):
            _, out, _ = await self._pool.run_script(KILL, *self._args("list", 0), kill=True)
            found = sorted(set(out.decode(errors="replace").split()))
        await anyio.lowlevel.checkpoint()  # a cancellation that came meanwhile takes effect here
        return found


def signal_number(name: str) -> int | None:
    """The number of a signal as sshd names it in exit-signal ('TERM', 'KILL', 'USR1@openssh.com')."""
    name = name.removesuffix("@openssh.com").upper()
    try:
        return int(getattr(signal_module.Signals, name if name.startswith("SIG") else "SIG" + name))
    except AttributeError:
        return None


class CommandSession(SlotSession):
    """The channel of one foreground command: its data, its end, as asyncssh reports them.

    The boot script writes BOOT_OK (or BOOT_FAIL) on stdout and STDERR_OK on stderr before it
    becomes the command; whatever comes before them is rc-file noise and is dropped. Output is
    fed to the launch's streams as it arrives (that feed is synchronous and cheap, so nothing is
    buffered and no reader task is needed); after :meth:`stop_feeding` it is discarded, which also
    keeps the channel drained while leftovers hold it.

    Under dsh-supervise (``framed``), what follows BOOT_OK on stdout is the supervisor's frames,
    handed to ``framed`` as they come; stderr after STDERR_OK can only be the supervisor's own
    complaint (it points its stderr at /dev/null once the command runs), kept for the error.

    Backpressure: when a feed leaves one of the command's spill files with a backlog
    (``backlogged()``), reading pauses (the channel's window then holds the command back) and
    :attr:`wake` is set, so the pump waits for the spill writers and calls :meth:`resume`.
    """

    def __init__(
        self,
        launch: Launch | None = None,
        backlogged: Callable[[], bool] | None = None,
        framed: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__()
        self._launch = launch
        self._backlogged = backlogged
        self._framed = framed
        #: What the channel's stderr carried after STDERR_OK under the supervisor (bounded).
        self.stray_stderr = bytearray()
        #: A warm channel's session (no launch yet) waits for WAITER's READY before the preamble.
        self.warm = launch is None
        self._ready = not self.warm
        self._heard = False  # any stdout after READY: BOOT's verdict, or the start of it
        #: Set once a warm channel's login shell waits for a request, or the channel closed.
        self.ready_or_closed = anyio.Event()
        self.paused = False
        #: Set when the pump has something to do: EOF arrived, or reading paused.
        self.wake = anyio.Event()
        self._out_started = False
        self._err_started = False
        self._out_held = bytearray()
        self._err_held = b""
        self._feeding = True
        self.boot_failure: str | None = None
        #: The command's start on the host's clock, when BOOT reported it with its verdict.
        self.command_start: CommandStart | None = None
        self.preamble_done = anyio.Event()
        self.exit: ExitStatus | None = None
        self.exit_signal_name: str | None = None
        self.ended = anyio.Event()  # exit reported, or the channel closed
        self.eof = anyio.Event()  # output complete, or the channel closed
        self.lost: Exception | None = None
        self.closed = False
        #: Set while asyncssh's send buffer is below its limit (see pause_writing).
        self.writable = anyio.Event()
        self.writable.set()
        #: Called once the channel closed (by either side, or with its connection).
        self.on_closed: Callable[[], None] | None = None

    @property
    def ready(self) -> bool:
        return self._ready and not self.closed

    @property
    def died_unused(self) -> bool:
        """A warm channel whose shell ended (its connection fine) before BOOT wrote anything: BOOT
        writes its verdict before it becomes the command, and sshd passes on all output before the
        exit, so the command did not start."""
        return (
            self.warm
            and not self._heard
            and self.boot_failure is None
            and self.exit is not None
            and self.lost is None
        )

    def adopt(
        self,
        launch: Launch,
        backlogged: Callable[[], bool],
        framed: Callable[[bytes], None] | None = None,
    ) -> None:
        """Take on a command: a warm channel's session, ready, becomes its command's."""
        assert self._launch is None and self._ready
        self._launch = launch
        self._backlogged = backlogged
        self._framed = framed

    async def follow(self, done: anyio.Event, wait_writable: Callable[[], Awaitable[None]]) -> None:
        """Until ``done`` is set: whenever reading paused for full spills, resume once they drained."""
        while True:
            await self.wake.wait()
            if done.is_set():
                return
            self.wake = anyio.Event()
            if self.paused:
                await wait_writable()
                self.resume()

    def stop_feeding(self) -> None:
        self._feeding = False
        self.resume()  # what still comes is discarded: never hold the command back for it

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.chan is not None:
                self.chan.resume_reading()

    def _check_backlog(self) -> None:
        assert self._backlogged is not None
        if self._feeding and not self.paused and self._backlogged():
            self.paused = True
            if self.chan is not None:
                self.chan.pause_reading()
            self.wake.set()

    def data_received(self, data: bytes, datatype: int | None) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            if not self._err_started:
                held = self._err_held + data
                index = held.find(STDERR_OK)
                if index < 0:
                    self._err_held = held[-(len(STDERR_OK) - 1) :]
                    return
                self._err_started = True
                self._err_held = b""
                data = held[index + len(STDERR_OK) :]
            if self._framed is not None:
                if len(self.stray_stderr) < 4096:
                    self.stray_stderr += data[:4096]
                return
            if data and self._feeding and self._launch is not None:
                self._launch.stderr.feed(data)
                self._check_backlog()
            return
        if not self._out_started:
            self._preamble(data)
            return
        if self._framed is not None:
            self._framed(data)  # read to the end, fed or not: the supervisor must never block on us
            self._check_backlog()
            return
        if self._feeding and self._launch is not None:
            self._launch.stdout.feed(data)
            self._check_backlog()

    def _preamble(self, data: bytes) -> None:
        buf = self._out_held
        buf += data
        if not self._ready:
            ready = buf.find(READY)
            if ready < 0:
                if len(buf) > _MAX_NOISE:
                    del buf[: len(buf) - _MAX_NOISE // 2]
                return
            del buf[: ready + len(READY)]  # rc noise: no command saw it
            self._ready = True
            self.ready_or_closed.set()
        self._heard = self._heard or bool(buf)
        found = find_boot_ok(buf)
        if found is not None:
            _, end, self.command_start = found
            self._out_started = True
            rest = bytes(buf[end:])
            self._out_held = bytearray()
            self.preamble_done.set()
            if self._framed is not None:
                if rest:
                    self._framed(rest)
                    self._check_backlog()
            elif rest and self._feeding and self._launch is not None:
                self._launch.stdout.feed(rest)
            return
        fail = buf.find(BOOT_FAIL)
        if fail >= 0:
            end = buf.find(b"\0", fail + len(BOOT_FAIL))
            if end >= 0:
                self.boot_failure = bytes(buf[fail + len(BOOT_FAIL) : end]).decode("utf-8", "replace")
                self.preamble_done.set()
                return
        if len(buf) > _MAX_NOISE:
            del buf[: len(buf) - _MAX_NOISE // 2]

    @property
    def started(self) -> bool:
        """BOOT said the command starts (BOOT_OK)."""
        return self._out_started

    def noise(self) -> str:
        return bytes(self._out_held).decode("utf-8", "replace").strip("\0 \n")

    def exit_status_received(self, status: int) -> None:
        self.exit = ExitStatus(code=status)
        self.ended.set()

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        number = signal_number(signal)
        self.exit_signal_name = signal
        if number is not None:
            # The command's own death only without the supervisor (under it, the supervisor's, whose
            # records tell the command's): the channel's process is the command's bash (exec'd), so
            # the server's exit-signal is exact.
            self.exit = ExitStatus(code=None, signal=number)
        self.ended.set()

    def eof_received(self) -> bool:
        self.eof.set()
        self.wake.set()
        return True  # keep our side half-open: an EOF from here would be one more packet for nothing

    def pause_writing(self) -> None:
        self.writable = anyio.Event()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()
        self.closed = True
        self.lost = exc
        self.ready_or_closed.set()
        self.preamble_done.set()
        self.ended.set()
        self.eof.set()
        self.wake.set()
        super().connection_lost(exc)
        if self.on_closed is not None:
            self.on_closed()

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()


#: BOOT's report when the supervisor it was to run is not there (see _scripts._CHECK_SUPERVISOR).
SUPERVISOR_MISSING = "supervisor_missing"


class SupervisorMissing(BashInfrastructureError):
    """BOOT found no dsh-supervise where the executor installed it at open."""


async def boot_verdict(session: CommandSession, pool: ChannelPool, launch: Launch) -> None:
    """Wait for BOOT's verdict on ``session``; raise BashInfrastructureError when it did not start."""
    await session.preamble_done.wait()
    report = session.boot_failure
    if report == SUPERVISOR_MISSING:
        raise SupervisorMissing(f"dsh-supervise is missing on {pool.where}", reason="start_failed")
    if report is not None:
        raise boot_failure(report, workdir=launch.spec.workdir, where=f"on {pool.where}")
    if session.closed and session.exit is None and session.lost is not None:
        raise BashInfrastructureError(
            f"the connection to {pool.where} failed while starting the command: {session.lost}",
            reason="connection_lost",
        )
    if not session.started:
        status = session.exit.code if session.exit is not None else None
        reason: InfraReason = "start_failed"
        if status == 127:  # the login shell found no bash to run BOOT with
            reason = "shell_missing"
        elif status is None and not pool.connected():
            reason = "connection_lost"
        raise BashInfrastructureError(
            f"the command could not start on {pool.where} "
            f"(exit status {status}): {session.noise() or 'no output'}",
            reason=reason,
        )


class SshProcess(CommandProcess):
    def __init__(
        self,
        *,
        pool: ChannelPool,
        session: CommandSession,
        launch: Launch,
        marked: RemoteMarked,
        on_release: Callable[[], Awaitable[None]],
        wait_writable: Callable[[], Awaitable[None]],
    ) -> None:
        self._pool = pool
        self._wait_writable = wait_writable
        self._session = session
        self._launch = launch
        self._marked = marked
        self._on_release = on_release

    async def read_preamble(self) -> None:
        """Wait for the boot script's verdict; raise when the command cannot start."""
        await boot_verdict(self._session, self._pool, self._launch)

    async def wait(self) -> ExitStatus:
        session = self._session
        await session.ended.wait()
        if session.exit is not None:
            return session.exit
        if session.exit_signal_name is not None:
            raise BashInfrastructureError(
                f"the command on {self._pool.where} died of a signal the server named "
                f"{session.exit_signal_name!r}, unknown here",
                reason="command_lost",
            )
        if session.lost is not None or not self._pool.connected():
            raise BashInfrastructureError(
                f"lost the command: the SSH connection to {self._pool.where} failed"
                + (f" ({session.lost})" if session.lost else ""),
                reason="connection_lost",
            )
        raise BashInfrastructureError(
            f"the command's channel on {self._pool.where} closed without reporting an exit status",
            reason="command_lost",
        )

    async def pump_output(self) -> None:
        session = self._session
        try:
            await session.follow(session.eof, self._wait_writable)
        finally:
            session.stop_feeding()

    async def signal_all(self, sig: int) -> None:
        await self._marked.signal_all(sig)

    async def remaining(self) -> list[str]:
        return await self._marked.remaining()

    async def release(self) -> None:
        session = self._session
        session.stop_feeding()
        if session.eof.is_set() and session.exit is None:
            session.close()
        # With an exit status and EOF, sshd closes the channel itself (closing it from here would
        # cost an EOF and a CLOSE packet). Without EOF, leftovers still hold the command's output:
        # the channel stays open, its data discarded as it comes (so their writes never block).
        # Either way the session frees its slot when the channel closes.
        await self._on_release()
