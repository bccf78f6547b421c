"""The standard descriptors, made safe before anything else opens a file."""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["CLOSED_AT_START", "claim_standard_fds", "discard_stdout"]

#: The standard descriptors (0, 1, 2) that were closed when the program started (``>&-``). They are
#: held open on /dev/null from then on (:func:`claim_standard_fds`), so that no file, pipe or socket
#: opened later takes their number and receives the command's output; writing "to" them fails.
CLOSED_AT_START: set[int] = set()


def claim_standard_fds() -> None:
    """Hold every closed standard descriptor open on /dev/null and remember it in :data:`CLOSED_AT_START`."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:  # a lower one was free: it is taken by now, so this cannot happen twice
                os.dup2(opened, fd)
                os.close(opened)
            CLOSED_AT_START.add(fd)


def discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null once writing to it failed: what Python still holds for it
    goes nowhere when the interpreter exits, instead of failing again there (a traceback, status 120)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
