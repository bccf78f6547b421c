"""Running code in a daemon thread that the caller abandons when it overruns its bound.

The kit runs each check this way, and ``dsh-bash doctor`` its steps: a backend that blocks its event
loop or swallows cancellation then costs a bounded wait and a report, never a hang of the caller.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar, cast

__all__ = ["Abandoned", "call_watched", "watched"]

T = TypeVar("T")


class Abandoned(TimeoutError):
    """Nothing came from the watched thread within the bound; the thread was left running (a daemon)."""

    def __init__(self, thread: threading.Thread, waited_s: float) -> None:
        super().__init__(f"no answer within {waited_s:g} s from thread {thread.name!r}")
        self.thread = thread
        self.waited_s = waited_s

    def stack(self) -> traceback.StackSummary:
        """Where the abandoned thread is now (empty once it has ended)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        return traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()


def watched(
    fn: Callable[[Callable[[T], None]], None], *, name: str, bound: Callable[[], float]
) -> Iterator[T]:
    """Run ``fn(send)`` in a new daemon thread named ``name``; yield each value it sends, as it comes.

    The iteration ends when ``fn`` returns, and raises what ``fn`` raised. Each wait for the next value
    lasts at most ``bound()`` seconds (asked anew before each wait); past it, :class:`Abandoned` is
    raised and the thread is left to itself (a daemon thread does not keep the process alive).
    """
    box: queue.Queue[tuple[Literal["value", "raised", "done"], object]] = queue.Queue()

    def run() -> None:
        try:
            fn(lambda value: box.put(("value", value)))
        except BaseException as exc:
            box.put(("raised", exc))
        else:
            box.put(("done", None))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while True:
        wait = bound()
        try:
            kind, value = box.get(timeout=wait)
        except queue.Empty:
            raise Abandoned(thread, wait) from None
        if kind == "done":
            return
        if kind == "raised":
            raise cast(BaseException, value)
        yield cast(T, value)


def call_watched(fn: Callable[[], T], *, name: str, timeout_s: float) -> T:
    """``fn()`` in a new daemon thread: its value or exception, or :class:`Abandoned` after ``timeout_s``."""

    def call(send: Callable[[T], None]) -> None:
        send(fn())

    for value in watched(call, name=name, bound=lambda: timeout_s):
        return value
    raise AssertionError("unreachable: the watched function returned without sending")
