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

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncssh

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import CoalescedRuns, Launch
from dsh_bash.supervisor import FramedCommand

from ._connection import ChannelPool
from ._process import CommandSession, RemoteMarked, boot_verdict

__all__ = ["FramedSshProcess"]

log = logging.getLogger("dsh_bash.ssh")


class FramedSshProcess(FramedCommand):
    def __init__(
        self,
        *,
        pool: ChannelPool,
        launch: Launch,
        marked: RemoteMarked,
        on_release: Callable[[], Awaitable[None]],
        wait_writable: Callable[[], Awaitable[None]],
        registry: set[Any],
        continues: CoalescedRuns,
    ) -> None:
        super().__init__(
            launch, fallback=marked, registry=registry, where=f"on {pool.where}", continues=continues
        )
        self._marked = marked
        self._pool = pool
        self._on_release = on_release
        self._wait_writable = wait_writable
        self._session: CommandSession | None = None

    # -- the channel (the session calls feed as data arrives) ------------------------------------------

    def _stream_broken(self) -> None:
        # Nothing more can be read from it: closing the channel makes the supervisor kill all.
        if self._session is not None:
            self._session.close()
        self.stream_ended()

    def _output_finished(self) -> None:
        if self._session is not None:
            self._session.wake.set()

    async def _send_frame(self, frame: bytes, *, urgent: bool) -> bool:
        """asyncssh's ``write`` takes a whole frame at once, so frames never interleave; stdin waits
        until the send buffer drained, a kill request (``urgent``) is queued at once."""
        session = self._session
        if session is None:
            return False
        if not urgent:
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

    async def _lost(self) -> BashInfrastructureError:
        session = self._session
        if session is not None and (session.lost is not None or not self._pool.connected()):
            return BashInfrastructureError(
                f"lost the command: the SSH connection to {self._pool.where} failed"
                + (f" ({session.lost})" if session.lost else ""),
                reason="connection_lost",
            )
        return BashInfrastructureError(
            f"the command's supervisor on {self._pool.where} ended before it reported how the command "
            "ended (killed by the command itself?); its exit status is lost",
            reason="command_lost",
        )

    # -- start ------------------------------------------------------------------------------------------

    def attach(self, session: CommandSession) -> None:
        """The session whose channel runs this command (its ``framed`` hook is :meth:`feed`)."""
        self._session = session
        session.on_closed = self.stream_ended
        if session.closed:
            self.stream_ended()

    async def read_preamble(self) -> None:
        """Wait until the supervisor started the command; raise BashInfrastructureError when it did not."""
        session = self._session
        assert session is not None
        # Continued meanwhile from outside: the command before may have stopped the warm channel's
        # shell, which would leave the boot script (and so this start) waiting for ever.
        await self._continued_until(lambda: boot_verdict(session, self._pool, self._launch))
        if await self.wait_started():
            return
        if session.lost is not None or not self._pool.connected():
            raise BashInfrastructureError(
                f"the connection to {self._pool.where} failed while starting the command",
                reason="connection_lost",
            )
        said = bytes(session.stray_stderr).decode("utf-8", "replace").strip()
        if not said and self._broken is None and session.exit is not None and session.exit.signal:
            # Killed before it reported its child: the child may be the command (its first
            # `kill -9 $PPID` can win that race), so the outcome is unknown, never "did not start".
            raise await self._lost()
        status = session.exit.code if session.exit is not None else None
        raise BashInfrastructureError(
            f"dsh-supervise did not start the command {self._where} (exit status {status}): "
            f"{self._broken or said or 'no output'}",
            reason="start_failed",
        )

    def abandon(self) -> None:
        """A start given up: closing the channel makes the supervisor kill everything."""
        super().abandon()
        if self._session is not None:
            self._session.close()

    # -- the process protocol ---------------------------------------------------------------------------

    async def pump_output(self) -> None:
        session = self._session
        assert session is not None
        try:
            if self._launch.spec.stdin is None:
                # Only the close frame: nothing can hold it back, so no task of its own (a task
                # group costs a short command about a tenth of a millisecond).
                await self.send_stdin()
                await session.follow(self._output_done, self._wait_writable)
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.send_stdin)
                await session.follow(self._output_done, self._wait_writable)
                # Whatever stdin is still unsent has no reader left.
                tg.cancel_scope.cancel()
        finally:
            self._discard = True
            session.stop_feeding()

    async def release(self) -> None:
        # The channel stays open until the supervisor exits (leftovers may live until the executor
        # closes): the session reads it and the decoder drops their output.
        self._discard = True
        if self._session is not None:
            self._session.stop_feeding()
        await self._on_release()
