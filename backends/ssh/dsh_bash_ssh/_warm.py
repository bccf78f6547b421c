"""A warm channel: the next command's channel, opened and logged in ahead of it.

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
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from dsh_bash import BashInfrastructureError

from ._connection import ChannelPool
from ._process import CommandSession
from ._scripts import warm_line

__all__ = ["WarmChannel"]

log = logging.getLogger("dsh_bash.ssh")


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
    """At most one spare channel whose login shell waits for the next command."""

    def __init__(
        self,
        pool: ChannelPool,
        start_helper: Callable[[Callable[..., Awaitable[Any]], Any], None],
        *,
        enabled: bool = True,
    ) -> None:
        self._pool = pool
        self._start_helper = start_helper
        self._spare: _Spare | None = None
        self._closed = not enabled

    def warm(self) -> None:
        """Start a spare unless there is one, no slot is free right now, or the connection is down
        (reconnecting is for a command to do, not for a spare)."""
        if self._closed or self._spare is not None or not self._pool.connected():
            return
        if not self._pool.try_reserve():
            return
        spare = self._spare = _Spare()
        self._start_helper(self._open, spare)

    async def _open(self, spare: _Spare) -> None:
        try:
            spare.session = await self._pool.open_session(warm_line(), CommandSession, reserved=True)
        except BashInfrastructureError as exc:
            log.debug("a warm channel did not open: %s", exc)
            if self._spare is spare:
                self._spare = None
        finally:
            spare.opened.set()
        if spare.discarded and spare.session is not None:
            spare.session.close()

    async def ready(self) -> bool:
        """Start a spare if there is none and wait until its login shell waits (or it failed).
        False when there is no spare: disabled, closed, or no slot free."""
        self.warm()
        spare = self._spare
        return spare is not None and await _settled(spare) is not None

    async def take(self) -> CommandSession | None:
        """The spare, once its login shell waits for a request; None when there is none (or it died)."""
        spare = self._spare
        if spare is None:
            return None
        self._spare = None
        try:
            session = await _settled(spare)
        except BaseException:
            # Cancelled while the spare warmed up: it is left for the next command.
            if self._spare is None and not self._closed and not spare.discarded:
                self._spare = spare
            else:
                spare.discard()
            raise
        if session is None:
            spare.discard()
        return session

    def reclaim(self) -> None:
        """Close the idle spare, if any, so that its slot serves whoever waits for one."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.discard()

    def close(self) -> None:
        self._closed = True
        self.reclaim()


async def _settled(spare: _Spare) -> CommandSession | None:
    """The spare's session once its login shell waits for a request; None when it failed or died."""
    await spare.opened.wait()
    session = spare.session
    if session is None:
        return None
    await session.ready_or_closed.wait()
    return session if session.ready else None
