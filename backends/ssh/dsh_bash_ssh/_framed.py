"""A foreground command under ``dsh-supervise --frame``: after BOOT's verdict the channel is the supervisor's.

BOOT runs as for any foreground command (in the login's process, reading its header or the warm
request from the channel's stdin), says BOOT_OK, and then that process becomes the supervisor
(``_scripts._RUN_SUPERVISED``), which runs the command's bash. From there on the channel's stdout
carries only the supervisor's frames (the command's output, its status records) and its stdin only
ours (the command's stdin, kill requests). So:

- the outcome is the wait status the supervisor observed (a self-kill is a signal), and nothing the
  command writes can forge it: the command's output is a payload inside frames;
- a kill reaches every process of the command however it hides (session, group, environment):
  orphans re-parent to the supervisor, a subreaper, which signals its whole subtree;
- when the channel drops (the connection broke, the executor died), sshd closes the supervisor's
  stdin and the supervisor kills everything.

The supervisor exits once the command's last process is gone; until then (leftovers of a command
that returned) the channel stays open and is read and discarded, and the process stays in the
executor's registry of supervised commands for the leftovers' kill at ``aclose``. A channel that
closes without the ``empty`` record means the supervisor was killed (by the command itself: same
user): the marker, the last hint, finds what is left.
"""

from __future__ import annotations

import errno
import logging
import signal
from collections.abc import Awaitable, Callable

import anyio
import asyncssh

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    CommandProcess,
    ExitStatus,
    FrameDecoder,
    FrameError,
    InfraReason,
    Launch,
    SupervisorRecords,
    encode_frame,
)

from ._connection import ChannelPool
from ._process import CommandSession, RemoteMarked, boot_verdict

__all__ = ["FramedSshProcess"]

log = logging.getLogger("dsh_bash.ssh")

#: Stdin goes to the supervisor in frames of at most this size, and the next one only while
#: asyncssh's send buffer is below its limit, so a kill request queues behind one chunk at most.
_STDIN_CHUNK = 64 * 1024


class FramedSshProcess(CommandProcess):
    def __init__(
        self,
        *,
        pool: ChannelPool,
        launch: Launch,
        marked: RemoteMarked,
        on_release: Callable[[], Awaitable[None]],
        wait_writable: Callable[[], Awaitable[None]],
        registry: set[FramedSshProcess],
    ) -> None:
        self._pool = pool
        self._launch = launch
        self._marked = marked
        self._on_release = on_release
        self._wait_writable = wait_writable
        self._registry = registry
        self._session: CommandSession | None = None
        self._records = SupervisorRecords()
        self._decoder = FrameDecoder(
            on_stdout=self._on_stdout,
            on_stderr=self._on_stderr,
            on_status=self._on_status,
            on_eof=self._on_eof,
        )
        self._discard = False  # the pump ended: output has nowhere to go any more
        self._eof: set[str] = set()
        self._broken: str | None = None
        self._abandoned = False
        self._decided = anyio.Event()  # started, exec failed, or the channel is done
        self._exit_or_end = anyio.Event()
        self._output_done = anyio.Event()

    # -- the supervisor's frames (called by the session as data arrives) ---------------------------

    def feed(self, data: bytes) -> None:
        if self._broken is not None:
            return
        try:
            self._decoder.feed(data)
        except FrameError as exc:
            self._broken = f"the supervisor's stream broke its framing: {exc}"
            log.warning("command %s: %s", self._launch.marker, self._broken)
            # Nothing more can be read from it: closing the channel makes the supervisor kill all.
            if self._session is not None:
                self._session.close()
            self._done()

    def _on_stdout(self, data: memoryview) -> None:
        if not self._discard:
            self._launch.stdout.feed(data)

    def _on_stderr(self, data: memoryview) -> None:
        if not self._discard:
            self._launch.stderr.feed(data)

    def _on_status(self, record: str) -> None:
        records = self._records
        records.apply(record)
        if records.child is not None or records.exec_failed is not None:
            self._decided.set()
        if records.command_exit is not None:
            self._decided.set()
            self._exit_or_end.set()
        if records.empty:
            self._registry.discard(self)

    def _on_eof(self, stream: str) -> None:
        self._eof.add(stream)
        if len(self._eof) == 2:
            self._output_done.set()
            self._wake()

    def _wake(self) -> None:
        if self._session is not None:
            self._session.wake.set()

    def _done(self) -> None:
        self._decided.set()
        self._exit_or_end.set()
        self._output_done.set()
        self._wake()

    def _closed(self) -> None:
        if not self._records.empty and not self._abandoned and self._broken is None:
            log.warning(
                "command %s: the supervisor's channel on %s closed before it reported that no process "
                "is left (the connection dropped, or it was killed); its leftovers are looked for by marker",
                self._launch.marker,
                self._pool.where,
            )
        self._done()

    # -- start ------------------------------------------------------------------------------------------

    def attach(self, session: CommandSession) -> None:
        """The session whose channel runs this command (its ``framed`` hook is :meth:`feed`)."""
        self._session = session
        session.on_closed = self._closed
        if session.closed:
            self._closed()

    async def read_preamble(self) -> None:
        """Wait until the supervisor started the command; raise BashInfrastructureError when it did not."""
        session = self._session
        assert session is not None
        await boot_verdict(session, self._pool, self._launch)
        await self._decided.wait()
        records = self._records
        if records.child is not None:
            return
        where = f"on {self._pool.where}"
        if records.exec_failed is not None:
            code = records.exec_failed
            reason: InfraReason = "shell_missing" if code in (errno.ENOENT, errno.EACCES) else "start_failed"
            raise BashInfrastructureError(
                f"cannot start the command's bash {where}: errno {code}", reason=reason
            )
        if session.lost is not None or not self._pool.connected():
            raise BashInfrastructureError(
                f"the connection to {self._pool.where} failed while starting the command",
                reason="connection_lost",
            )
        said = bytes(session.stray_stderr).decode("utf-8", "replace").strip()
        status = session.exit.code if session.exit is not None else None
        raise BashInfrastructureError(
            f"dsh-supervise did not start the command {where} (exit status {status}): "
            f"{self._broken or said or 'no output'}",
            reason="start_failed",
        )

    def start(self) -> None:
        """The command runs: its supervisor is one the executor's leftovers must reach until it exits."""
        if not self._records.empty and not self.ended:
            self._registry.add(self)

    def abandon(self) -> None:
        """A start given up: closing the channel makes the supervisor kill everything."""
        self._abandoned = True
        if self._session is not None:
            self._session.close()

    # -- the process protocol ---------------------------------------------------------------------------

    async def wait(self) -> ExitStatus:
        await self._exit_or_end.wait()
        if self._records.command_exit is not None:
            return self._records.command_exit
        if self._broken is not None:
            raise BashInfrastructureError(
                self._broken + "; the command's exit status is lost", reason="command_lost"
            )
        session = self._session
        if session is not None and (session.lost is not None or not self._pool.connected()):
            raise BashInfrastructureError(
                f"lost the command: the SSH connection to {self._pool.where} failed"
                + (f" ({session.lost})" if session.lost else ""),
                reason="connection_lost",
            )
        raise BashInfrastructureError(
            f"the command's supervisor on {self._pool.where} ended before it reported how the command "
            "ended (killed by the command itself?); its exit status is lost",
            reason="command_lost",
        )

    async def pump_output(self) -> None:
        session = self._session
        assert session is not None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_stdin)
                while True:
                    await session.wake.wait()
                    if self._output_done.is_set():
                        break
                    session.wake = anyio.Event()
                    if session.paused:
                        await self._wait_writable()
                        session.resume()
                # Whatever stdin is still unsent has no reader left.
                tg.cancel_scope.cancel()
        finally:
            self._discard = True
            session.stop_feeding()

    async def _send_stdin(self) -> None:
        stdin = self._launch.spec.stdin
        data = b"" if stdin is None else (stdin.encode() if isinstance(stdin, str) else bytes(stdin))
        for at in range(0, len(data), _STDIN_CHUNK):
            if not await self._send(encode_frame(b"i", data[at : at + _STDIN_CHUNK])):
                return
        await self._send(encode_frame(b"c"))

    async def _send(self, frame: bytes, *, queue: bool = False) -> bool:
        """Send one frame to the supervisor (after the send buffer drained, unless ``queue``);
        False when its channel is gone. asyncssh's ``write`` takes a whole frame at once, so frames
        never interleave and a kill request needs no lock to get between two stdin chunks."""
        session = self._session
        if session is None:
            return False
        if not queue:
            await session.writable.wait()
        chan = session.chan
        if session.closed or chan is None:
            return False
        try:
            chan.write(frame)
        except (asyncssh.Error, OSError) as exc:
            log.debug("command %s: writing to the supervisor failed: %s", self._launch.marker, exc)
            return False
        return True

    @property
    def ended(self) -> bool:
        """True once the supervisor's channel closed: it has nothing left to hold (or was killed)."""
        return self._session is None or self._session.closed

    async def signal_all(self, sig: int) -> None:
        if self._records.empty:
            return
        if await self._send(encode_frame(b"K" if sig == signal.SIGKILL else b"T"), queue=True):
            return
        await self._marked.signal_all(sig)

    async def remaining(self) -> list[str]:
        if self._records.empty:
            return []
        if not self.ended:
            return [f"processes under dsh-supervise on {self._pool.where} ({self._launch.marker})"]
        return await self._marked.remaining()

    async def release(self) -> None:
        # The channel stays open until the supervisor exits (leftovers may live until the executor
        # closes): the session reads it and the decoder drops their output.
        self._discard = True
        if self._session is not None:
            self._session.stop_feeding()
        await self._on_release()
