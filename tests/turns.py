"""Turns between pytest-xdist workers: a test that must run alone, and the tests that may share.

Two ``flock``ed files in one directory. Every shared turn takes the gate, then a shared lock on
``running``, and lets the gate go. A turn alone keeps the gate, so no shared turn starts behind it,
and waits for an exclusive lock on ``running``, which it gets once the shared turns under way end.
Without the gate, shared turns that keep overlapping would hold ``running`` for ever (``flock`` does
not prefer a waiting exclusive lock). The locks go with the files' descriptors, so a worker that dies
lets its turn go.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

__all__ = ["LOCK_DIR_VARIABLE", "turn"]

#: The environment variable that names the run's lock directory (the workers inherit it).
LOCK_DIR_VARIABLE = "DSH_TEST_LOCK_DIR"


@contextlib.contextmanager
def turn(directory: str | None, *, alone: bool) -> Iterator[None]:
    """Hold a turn in ``directory`` for the block: alone, or beside other shared turns.

    Without a directory (or one that is gone) the block runs at once: one process, nobody to wait for.
    """
    if directory is None or not os.path.isdir(directory):
        yield
        return
    with (
        open(os.path.join(directory, "gate"), "a") as gate,
        open(os.path.join(directory, "running"), "a") as running,
    ):
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files lets both locks go
