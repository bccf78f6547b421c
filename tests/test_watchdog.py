"""The kit's watchdog (``watched``, ``call_watched``): values as sent, errors raised, overruns abandoned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from dsh_bash_conformance import Abandoned, call_watched, watched


def test_values_come_as_sent_and_the_iteration_ends_with_the_function() -> None:
    def fn(send: Callable[[int], None]) -> None:
        for n in range(3):
            send(n)

    assert list(watched(fn, name="t", bound=lambda: 5)) == [0, 1, 2]


def test_an_exception_in_the_thread_is_raised_in_the_caller() -> None:
    def fn() -> int:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        call_watched(fn, name="t", timeout_s=5)


def test_an_overrun_is_abandoned_with_where_it_is() -> None:
    release = threading.Event()

    def stuck_here() -> int:
        release.wait(30)
        return 1

    started = time.monotonic()
    with pytest.raises(Abandoned) as caught:
        call_watched(stuck_here, name="stuck", timeout_s=0.2)
    assert time.monotonic() - started < 5
    assert caught.value.thread.daemon and caught.value.thread.is_alive()
    assert "stuck_here" in [frame.name for frame in caught.value.stack()]
    release.set()


def test_the_bound_is_asked_before_each_wait() -> None:
    asked: list[int] = []

    def bound() -> float:
        asked.append(1)
        return 5

    def fn(send: Callable[[str], None]) -> None:
        send("a")
        send("b")

    assert list(watched(fn, name="t", bound=bound)) == ["a", "b"]
    assert len(asked) == 3  # before "a", before "b", before the end
