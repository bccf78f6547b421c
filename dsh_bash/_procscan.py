"""Finding a command's processes again through /proc, and signalling them without pid-reuse races.

Every command's environment carries ``DSH_BASH_MARK=<executor token>-<n>``; descendants inherit it
even after they leave the process group (``setsid``, double fork). A scan reads each process's
``stat`` (group, state) and ``environ`` (marker). Signals to single pids go through a pidfd opened
*before* the marker is checked again, so a recycled pid is never signalled.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

import anyio
import anyio.to_thread

from ._backend import MARKER_VAR

__all__ = ["ProcEntry", "ProcScanner", "ProcStat", "read_proc_stat", "scan", "signal_marked"]

_NEEDLE = b"\0" + MARKER_VAR.encode() + b"="
_DEAD_STATES = frozenset("ZXx")


@dataclass(frozen=True, slots=True)
class ProcEntry:
    pid: int
    pgrp: int
    alive: bool  # False for zombies and dead entries
    marker: str | None  # this executor's marker value, or None


def _read_marker(pid: int, prefix: bytes) -> str | None:
    """The process's marker value when it starts with ``prefix``; None otherwise or if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = b"\0" + fh.read()
    except OSError:
        return None
    start = environ.find(_NEEDLE + prefix)
    if start < 0:
        return None
    start += len(_NEEDLE)
    end = environ.find(b"\0", start)
    return environ[start : end if end >= 0 else len(environ)].decode("ascii", "replace")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` a backend needs."""

    pid: int
    state: str  # one letter: R, S, D, Z, T, ...
    ppid: int
    pgrp: int
    session: int

    @property
    def alive(self) -> bool:
        """False for zombies and dead entries."""
        return self.state not in _DEAD_STATES


def read_proc_stat(pid: int | str, proc: str = "/proc") -> ProcStat | None:
    """``/proc/PID/stat`` parsed, or None when the process is gone or its stat unreadable."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 4:
        return None
    try:
        return ProcStat(int(pid), fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]))
    except ValueError:
        return None


def scan(prefix: bytes) -> list[ProcEntry]:
    """Every process whose stat is readable, with its marker if it belongs to ``prefix``."""
    entries = []
    own = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == own:
            continue
        stat = read_proc_stat(pid)
        if stat is None:
            continue
        alive = stat.alive
        entries.append(ProcEntry(pid, stat.pgrp, alive, _read_marker(pid, prefix) if alive else None))
    return entries


def signal_marked(pid: int, marker: str, sig: int, exact: bool) -> None:
    """Signal ``pid`` if it still carries ``marker`` (exactly, or as a prefix)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EPERM):
            raise
        pidfd = None
    try:
        value = _read_marker(pid, marker.encode())
        if value is None or (exact and value != marker):
            return
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)


class ProcScanner:
    """Scans /proc for one executor's processes; concurrent callers share a recent scan."""

    def __init__(self, token: str, max_age_s: float = 0.02) -> None:
        self.prefix = token + "-"
        self._prefix_bytes = self.prefix.encode()
        self._max_age_s = max_age_s
        self._entries: list[ProcEntry] = []
        self._taken_at = -1.0
        self._started_at = -1.0
        self._lock = anyio.Lock()

    async def entries(self) -> list[ProcEntry]:
        asked_at = time.monotonic()
        async with self._lock:
            # A scan that started after this call began saw every signal its caller sent before:
            # reuse it. Without this, N commands killed at once (aclose) would queue N full scans
            # behind the lock, one per invalidation, and outlast every kill bound.
            fresh = self._started_at >= asked_at or time.monotonic() - self._taken_at <= self._max_age_s
            if not fresh:
                self._started_at = time.monotonic()
                self._entries = await anyio.to_thread.run_sync(scan, self._prefix_bytes)
                self._taken_at = time.monotonic()
            return self._entries

    def invalidate(self) -> None:
        self._taken_at = -1.0
