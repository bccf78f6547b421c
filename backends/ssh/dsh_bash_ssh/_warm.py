"""Warm channels: the next commands' channels, opened and logged in ahead of them.

Most of a command's latency over SSH is not the command: it is opening the channel, sshd forking
the session and the login shell starting (its rc files). One spare channel's login shell becomes
WAITER, a bash with an empty environment that waits on stdin for a request (BOOT's arguments with the
command's whole environment, and BOOT itself); the next command takes it and sends the request, so
it pays none of that. Taking a spare starts the next one.

A spare holds one of the pool's command slots. It is only started when a slot is free at that
moment, and whoever needs a slot when none is free reclaims an idle spare (the pool calls
:meth:`WarmChannel.reclaim`), so a spare never keeps a command or helper script waiting. A spare
that died unused (its connection dropped, its login shell was killed) is dropped when a command
finds it so; the command then opens its own channel, as it would without spares.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import anyio

from dsh_bash import BashInfrastructureError

from ._connection import ChannelPool
from ._process import CommandSession
from ._scripts import warm_line

__all__ = ["WarmChannel"]

log = logging.getLogger("dsh_bash.ssh")


#: The most a command waits for a warm channel's login shell before it takes a fresh channel.
_SETTLE_BOUND_S = 1.0


class _Spare:
    def __init__(self) -> None:
        self.session: CommandSession | None = None
        #: Set once the channel opened (``session`` is then set) or failed to.
        self.opened = anyio.Event()
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True
        if self.session is not None:
            self.session.close()  # its slot is freed when the channel has closed


class WarmChannel:
    """Up to ``depth`` spare channels whose login shells wait for the next commands.

    Two by default: a login takes longer than a short command on a busy host, so with one spare a
    command run right after another waited for the spare its predecessor had just started.
    """

    def __init__(
        self,
        pool: ChannelPool,
        start_helper: Callable[..., None],
        *,
        line: Callable[[], str] = warm_line,
        enabled: bool = True,
        depth: int = 2,
    ) -> None:
        self._pool = pool
        #: The command line of the next spare (the supervisor's path and identity may change: a
        #: command can remove it, and the executor installs it again).
        self._line = line
        self._start_helper = start_helper
        #: Oldest first: the one most likely logged in already.
        self._spares: deque[_Spare] = deque()
        self._depth = depth
        self._closed = not enabled

    @property
    def spares(self) -> int:
        """How many spares there are (logged in or logging in)."""
        return len(self._spares)

    def warm(self) -> None:
        """Start spares up to the depth, while a slot is free right now and the connection is up
        (reconnecting is for a command to do, not for a spare)."""
        while not self._closed and len(self._spares) < self._depth and self._pool.connected():
            if not self._pool.try_reserve():
                return
            spare = _Spare()
            self._spares.append(spare)
            self._start_helper(self._open, spare)

    async def _open(self, spare: _Spare) -> None:
        try:
            spare.session = await self._pool.open_session(self._line(), CommandSession, reserved=True)
        except BashInfrastructureError as exc:
            log.debug("a warm channel did not open: %s", exc)
            if spare in self._spares:
                self._spares.remove(spare)
        finally:
            spare.opened.set()
        if spare.discarded and spare.session is not None:
            spare.session.close()

    async def ready(self) -> bool:
        """Start spares up to the depth and wait until every one's login shell waits (or failed).
        False when there is no spare then: disabled, closed, or no slot free."""
        self.warm()
        for spare in list(self._spares):
            await _settled(spare)
        return any(_is_ready(spare) for spare in self._spares)

    async def take(self) -> CommandSession | None:
        """A spare, once its login shell waits for a request (one that waits already, if any, else
        the oldest); None when there is none (or it died)."""
        if not self._spares:
            return None
        spare = next((each for each in self._spares if _is_ready(each)), self._spares[0])
        self._spares.remove(spare)
        try:
            with anyio.move_on_after(_SETTLE_BOUND_S):
                session = await _settled(spare)
                if session is None:
                    spare.discard()
                return session
        except BaseException:
            # Cancelled while the spare warmed up: it is left for the next command.
            if len(self._spares) < self._depth and not self._closed and not spare.discarded:
                self._spares.appendleft(spare)
            else:
                spare.discard()
            raise
        # No word from its login shell: stopped by a command before (same user), say. It is given
        # up (nothing was sent to it: the command gets a fresh channel) and continued, so that it
        # sees its channel closed and ends.
        log.warning(
            "a warm channel on %s did not log in within %g s: not used", self._pool.where, _SETTLE_BOUND_S
        )
        spare.discard()
        self._start_helper(self._pool.thaw)
        return None

    def reclaim(self) -> None:
        """Close an idle spare (the newest), if any, so that its slot serves whoever waits for one."""
        if self._spares:
            self._spares.pop().discard()

    def close(self) -> None:
        self._closed = True
        while self._spares:
            self._spares.pop().discard()


def _is_ready(spare: _Spare) -> bool:
    session = spare.session
    return session is not None and session.ready


async def _settled(spare: _Spare) -> CommandSession | None:
    """The spare's session once its login shell waits for a request; None when it failed or died."""
    await spare.opened.wait()
    session = spare.session
    if session is None:
        return None
    await session.ready_or_closed.wait()
    return session if session.ready else None
