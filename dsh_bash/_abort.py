"""A minimal, loop-agnostic abort signal, in the spirit of the DOM's AbortController."""

from __future__ import annotations

import anyio

__all__ = ["AbortController", "AbortSignal"]


class AbortSignal:
    """Read side of an :class:`AbortController`.

    Can be created outside an event loop; waiters are anyio events created lazily inside
    whichever loop awaits :meth:`wait`, so the same signal works under asyncio and trio.
    ``abort()`` must be called from the thread that runs the waiting loop.
    """

    __slots__ = ("_aborted", "_reason", "_waiters")

    def __init__(self) -> None:
        self._aborted = False
        self._reason: object = None
        self._waiters: list[anyio.Event] = []

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def reason(self) -> object:
        return self._reason

    async def wait(self) -> None:
        """Return once the signal is aborted (at once if it already is)."""
        if self._aborted:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        self._waiters.append(event)
        try:
            await event.wait()
        finally:
            if not self._aborted:
                self._waiters.remove(event)

    def _abort(self, reason: object) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._reason = reason
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    def __repr__(self) -> str:
        return f"AbortSignal(aborted={self._aborted}, reason={self._reason!r})"


class AbortController:
    """Owns an :class:`AbortSignal`; ``abort()`` fires it once (later calls are no-ops)."""

    __slots__ = ("_signal",)

    def __init__(self) -> None:
        self._signal = AbortSignal()

    @property
    def signal(self) -> AbortSignal:
        return self._signal

    def abort(self, reason: object = None) -> None:
        self._signal._abort(reason)
