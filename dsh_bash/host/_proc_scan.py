"""Finding a command's processes again through /proc, and signalling them without pid-reuse races.

Every command's environment carries ``DSH_BASH_MARK=<executor token>-<n>``; descendants inherit it
even after they leave the process group (``setsid``, double fork). A scan reads each process's
``stat`` (group, state) and ``environ`` (marker). Signals to single pids go through a pidfd opened
*before* the marker is checked again, so a recycled pid is never signalled.

Scans run on the kill path, which must need nothing it may not get (issue 15): no worker thread (a
fork bomb under a pids limit leaves none to start), and no error of the OS read as "process gone".
A scan for one command's processes may skip, before reading a process's environment, every process
that started before the command did (:func:`started_before`): it cannot have inherited the marker.
Only ENOENT and ESRCH mean gone, EACCES and EPERM mean unreadable (a non-dumpable process's environ);
any other error (EMFILE, ENFILE, ENOMEM, EAGAIN, ...) raises :class:`ProcScanError`. A scanner keeps
a small reserve of open descriptors (:class:`FdReserve`), given back to the OS for one retry when
the process runs out of them. Scans run in the event loop, a checkpoint every few dozen processes.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.lowlevel

from .._protocol import MARKER_VAR

__all__ = [
    "FdReserve",
    "InputIdentity",
    "ProcEntry",
    "ProcScanError",
    "ProcScanner",
    "ProcStat",
    "boot_ticks",
    "descendants",
    "input_waiters",
    "read_proc_stat",
    "scan",
    "signal_marked",
    "started_before",
]

_DEAD_STATES = frozenset("ZXx")
#: The errors of a /proc read that mean the process is gone.
_GONE = frozenset({errno.ENOENT, errno.ESRCH})
#: The errors that mean it exists but may not be read (hidepid, a non-dumpable process's environ).
_UNREADABLE = frozenset({errno.EACCES, errno.EPERM})
#: Out of descriptors: the reserve may help.
_NO_FDS = frozenset({errno.EMFILE, errno.ENFILE})
#: How many processes an async scan looks at between two checkpoints.
_SCAN_STEP = 32
#: Clock ticks a start time must lie before a command's start to be skipped: both readings are
#: rounded down, and this keeps every rounding on the side of reading the environment.
_START_SLACK_TICKS = 2

T = TypeVar("T")


class ProcScanError(OSError):
    """A /proc read failed for a reason that says nothing about the process (EMFILE, ENOMEM, ...):
    whether it still lives is unknown. Never read as "gone"."""


def _classify(exc: OSError) -> bool:
    """True for "gone", False for "unreadable"; raises ProcScanError for anything else."""
    if exc.errno in _GONE:
        return True
    if exc.errno in _UNREADABLE:
        return False
    raise ProcScanError(exc.errno or 0, f"cannot read /proc: {exc.strerror or exc}") from exc


class FdReserve:
    """A few descriptors held open ahead of time, handed back to the OS when the process runs out
    (the kill path then still gets the one it needs: a ``/proc`` file, a pidfd). Refilled after."""

    def __init__(self, count: int = 3) -> None:
        self._count = count
        self._fds: list[int] = []
        self._closed = False

    def fill(self) -> None:
        while not self._closed and len(self._fds) < self._count:
            try:
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return  # still short: the next fill tries again

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``; when it fails for lack of descriptors, once more with the reserve given back."""
        try:
            return fn()
        except OSError as exc:
            if exc.errno not in _NO_FDS or not self._fds:
                raise
        self.release()
        try:
            return fn()
        finally:
            self.fill()

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def close(self) -> None:
        self._closed = True
        self.release()


_NO_RESERVE = FdReserve(0)


@dataclass(frozen=True, slots=True)
class ProcEntry:
    pid: int
    pgrp: int
    alive: bool  # False for zombies and dead entries
    marker: str | None  # this executor's marker value, or None


def _read_file(path: str) -> bytes:
    # Unbuffered: a /proc file reads in one pass of growing reads, without a second copy in a buffer
    # (an environment can be megabytes, and a scan reads hundreds).
    with open(path, "rb", buffering=0) as fh:
        return fh.readall()


_ASSIGN = MARKER_VAR.encode() + b"="


def _read_marker(pid: int, prefix: bytes, reserve: FdReserve = _NO_RESERVE) -> str | None:
    """The process's marker value when it starts with ``prefix``; None otherwise, if gone or if
    unreadable. Raises ProcScanError when the read failed for another reason."""
    try:
        environ = reserve.call(lambda: _read_file(f"/proc/{pid}/environ"))
    except OSError as exc:
        _classify(exc)
        return None
    # No concatenation (b"\0" + environ would copy megabytes): the first variable, or one after a NUL.
    wanted = _ASSIGN + prefix
    if environ.startswith(wanted):
        start = len(_ASSIGN)
    else:
        start = environ.find(b"\0" + wanted)
        if start < 0:
            return None
        start += 1 + len(_ASSIGN)
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
    #: When the process started (clock ticks after boot): with the pid, it names one process for good.
    starttime: int = 0
    #: Its controlling terminal's device number (0: none), encoded as ``st_rdev`` is.
    tty_nr: int = 0

    @property
    def alive(self) -> bool:
        """False for zombies and dead entries."""
        return self.state not in _DEAD_STATES


def read_proc_stat(pid: int | str, proc: str = "/proc", reserve: FdReserve = _NO_RESERVE) -> ProcStat | None:
    """``/proc/PID/stat`` parsed, or None when the process is gone or its stat unreadable.

    Raises :class:`ProcScanError` when the read failed for another reason (EMFILE, ENOMEM, ...):
    then nothing is known about the process."""
    try:
        stat = reserve.call(lambda: _read_file(f"{proc}/{pid}/stat"))
    except OSError as exc:
        _classify(exc)
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 4:
        return None
    try:
        start = int(fields[19]) if len(fields) > 19 else 0
        tty = int(fields[4]) if len(fields) > 4 else 0
        return ProcStat(
            int(pid), fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), start, tty
        )
    except ValueError:
        return None


def boot_ticks() -> int:
    """Now, in the unit of a process's start time in ``/proc/PID/stat`` (field 22): clock ticks
    (``SC_CLK_TCK``) since boot, on CLOCK_BOOTTIME, the clock the kernel stamps a new process with."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def started_before(starttime: int, since: int | None) -> bool:
    """Whether a process that started at ``starttime`` (ticks since boot) certainly started before
    ``since`` (:func:`boot_ticks` read before a command's first process was forked): then it did not
    inherit that command's marker, and a scan for the command need not read its environment (which
    can be megabytes: issue 15). Only a process that was already running and later exec'd with the
    marker set is missed; a scan by the executor's prefix (``since`` None) still finds it."""
    return since is not None and starttime + _START_SLACK_TICKS < since


#: A scanner's memory of markers already read: (pid, start time) -> marker. The pair names one
#: process for good, and a process's environment is read once: later scans cost a stat read each.
MarkerCache = dict[tuple[int, int], "str | None"]


def _entry(
    pid: int,
    prefix: bytes,
    reserve: FdReserve,
    cache: MarkerCache | None = None,
    seen: set[tuple[int, int]] | None = None,
    *,
    since: int | None = None,
) -> ProcEntry | None:
    stat = read_proc_stat(pid, reserve=reserve)
    if stat is None:
        return None
    alive = stat.alive
    if not alive or started_before(stat.starttime, since):
        return ProcEntry(pid, stat.pgrp, alive, None)
    key = (pid, stat.starttime)
    if seen is not None:
        seen.add(key)
    if cache is not None and key in cache:
        return ProcEntry(pid, stat.pgrp, alive, cache[key])
    marker = _read_marker(pid, prefix, reserve)
    if cache is not None:
        cache[key] = marker
    return ProcEntry(pid, stat.pgrp, alive, marker)


def _pids(reserve: FdReserve) -> list[int]:
    try:
        names = reserve.call(lambda: os.listdir("/proc"))
    except OSError as exc:
        raise ProcScanError(exc.errno or 0, f"cannot list /proc: {exc.strerror or exc}") from exc
    own = os.getpid()
    return [int(name) for name in names if name.isdigit() and int(name) != own]


def scan(prefix: bytes, reserve: FdReserve = _NO_RESERVE, since: int | None = None) -> list[ProcEntry]:
    """Every process whose stat is readable, with its marker if it belongs to ``prefix``.

    ``since`` (:func:`boot_ticks` taken before a command started, for a scan by that command's own
    marker): processes that started before it are listed without a marker, their environment unread.

    Raises :class:`ProcScanError` when /proc could not be read for a reason other than a process
    being gone or unreadable: a partial scan must not pass for a complete one."""
    return [
        entry for pid in _pids(reserve) if (entry := _entry(pid, prefix, reserve, since=since)) is not None
    ]


async def scan_async(
    prefix: bytes, reserve: FdReserve = _NO_RESERVE, cache: MarkerCache | None = None
) -> list[ProcEntry]:
    """:func:`scan` in the event loop, a checkpoint every few dozen processes (no worker thread).

    With ``cache``, each process's environment is read once (the first scan that sees it); entries
    of processes no longer there are dropped from it."""
    entries = []
    seen: set[tuple[int, int]] = set()
    for index, pid in enumerate(_pids(reserve)):
        if index % _SCAN_STEP == _SCAN_STEP - 1:
            await anyio.lowlevel.checkpoint()
        entry = _entry(pid, prefix, reserve, cache, seen)
        if entry is not None:
            entries.append(entry)
    if cache is not None:
        for key in cache.keys() - seen:
            del cache[key]
    return entries


def signal_marked(pid: int, marker: str, sig: int, exact: bool, reserve: FdReserve = _NO_RESERVE) -> None:
    """Signal ``pid`` if it still carries ``marker`` (exactly, or as a prefix).

    Raises OSError (:class:`ProcScanError` for /proc) when it could not tell: never a silent skip."""
    try:
        pidfd: int | None = reserve.call(lambda: os.pidfd_open(pid))
    except ProcessLookupError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EPERM):
            raise
        pidfd = None
    try:
        value = _read_marker(pid, marker.encode(), reserve)
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
        #: Descriptors held for the kill path (see :class:`FdReserve`): filled by :meth:`prepare`.
        self.reserve = FdReserve()
        self.prefix = token + "-"
        self._prefix_bytes = self.prefix.encode()
        self._max_age_s = max_age_s
        self._entries: list[ProcEntry] = []
        self._taken_at = -1.0
        self._started_at = -1.0
        self._lock = anyio.Lock()
        #: Markers read so far: a process that changes its environment in place after the first read
        #: is not seen to (which only a kill by marker cares about, and it re-reads before signalling).
        self._markers: MarkerCache = {}

    async def entries(self) -> list[ProcEntry]:
        asked_at = time.monotonic()
        async with self._lock:
            # A scan that started after this call began saw every signal its caller sent before:
            # reuse it. Without this, N commands killed at once (aclose) would queue N full scans
            # behind the lock, one per invalidation, and outlast every kill bound.
            fresh = self._started_at >= asked_at or time.monotonic() - self._taken_at <= self._max_age_s
            if not fresh:
                self._started_at = time.monotonic()
                self._entries = await scan_async(self._prefix_bytes, self.reserve, self._markers)
                self._taken_at = time.monotonic()
            return self._entries

    def invalidate(self) -> None:
        self._taken_at = -1.0

    def prepare(self) -> None:
        """Take the descriptor reserve (at the executor's open, while descriptors are there)."""
        self.reserve.fill()

    def close(self) -> None:
        """Give the reserve back (at the executor's release)."""
        self.reserve.close()


# -- who waits for input ----------------------------------------------------------------------------

#: System call numbers, per machine, of the reads a process blocked on its input makes: ``read``,
#: ``readv``, ``pread64`` (arg0: the fd) and ``select``/``pselect6`` (arg0: nfds). Other machines:
#: nothing is reported (a false negative, never a false positive).
_INPUT_SYSCALLS: dict[str, tuple[frozenset[int], frozenset[int]]] = {
    "x86_64": (frozenset({0, 19, 17}), frozenset({23, 270})),
    "aarch64": (frozenset({63, 65, 67}), frozenset({72})),
}


#: ``/dev/tty``'s device number (5, 0): an fd on it reads the process's controlling terminal.
_DEV_TTY = os.makedev(5, 0)


@dataclass(frozen=True, slots=True)
class InputIdentity:
    """What a command's input is, as ``stat`` of an fd shows it: a pipe (its device and inode) or a
    terminal (its device number, ``st_rdev``; any fd a program opened on ``/dev/tty`` matches too)."""

    kind: str  # "pipe" or "terminal"
    dev: int
    ino: int = 0

    @classmethod
    def of_fd(cls, fd: int, *, terminal: bool) -> InputIdentity:
        info = os.fstat(fd)
        if terminal:
            return cls("terminal", info.st_rdev)
        return cls("pipe", info.st_dev, info.st_ino)

    def matches(self, info: os.stat_result, tty_nr: int = 0) -> bool:
        """Whether an fd's ``stat`` is this input; ``tty_nr``: the process's controlling terminal."""
        if self.kind == "terminal":
            if info.st_rdev == _DEV_TTY:  # /dev/tty: its controlling terminal, whichever that is
                return tty_nr == self.dev and self.dev != 0
            return info.st_rdev == self.dev and info.st_rdev != 0
        return (info.st_dev, info.st_ino) == (self.dev, self.ino)


def _blocked_read_fd(pid: int, reads: frozenset[int], selects: frozenset[int]) -> tuple[int, ProcStat] | None:
    """The fd ``pid`` is blocked reading (state S in a read, or a select on fd 0 alone) and its stat,
    else None."""
    stat = read_proc_stat(pid)
    if stat is None or stat.state != "S":
        return None
    try:
        fields = _read_file(f"/proc/{pid}/syscall").split()
    except OSError:
        return None  # gone, or not ours to look at (another uid): not reported
    if len(fields) < 4 or not fields[0].isdigit():
        return None  # "running" or "-1 ...": not in a system call
    number = int(fields[0])
    try:
        args = [int(field, 16) for field in fields[1:5]]
    except ValueError:
        return None
    if number in reads:
        return args[0], stat
    # select(nfds, readfds, writefds, exceptfds): with nfds 1 only fd 0 can be in the read set.
    if number in selects and args[0] == 1 and args[2] == 0 and args[3] == 0:
        return 0, stat
    return None


def descendants(root: int, limit: int) -> list[int]:
    """``root`` and its descendants (children, theirs, ...), breadth first, at most ``limit``, from
    ``/proc/PID/task/TID/children``: reads only the tree's own files, whatever else runs here."""
    found = [root]
    at = 0
    while at < len(found) and len(found) < limit:
        pid = found[at]
        at += 1
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone
        for tid in threads:
            try:
                children = _read_file(f"/proc/{pid}/task/{tid}/children").split()
            except OSError:
                continue
            found += [int(child) for child in children if child.isdigit()]
    return found[:limit]


def input_waiters(pids: list[int], identity: InputIdentity, machine: str | None = None) -> list[int]:
    """The processes among ``pids`` blocked, at this moment, reading the input ``identity`` names.

    One sample: a process in state S in ``read``/``readv``/``pread64`` of an fd that is that input, or
    in ``select``/``pselect6`` with fd 0 alone, fd 0 being it. Reading ``/proc/PID/syscall`` needs
    ptrace rights over the process (the same user, or root); others are never reported. Readers that
    wait in ``poll`` or ``epoll_wait`` are not recognised (a false negative).
    """
    calls = _INPUT_SYSCALLS.get(machine or os.uname().machine)
    if calls is None:
        return []
    found = []
    for pid in pids:
        blocked = _blocked_read_fd(pid, *calls)
        if blocked is None:
            continue
        fd, stat = blocked
        try:
            info = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if identity.matches(info, stat.tty_nr):
            found.append(pid)
    return found
