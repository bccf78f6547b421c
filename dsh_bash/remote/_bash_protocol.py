"""Bash scripts and in-band markers for backends whose commands run under a bash they reach remotely.

A backend that starts commands through an API (Docker's exec) or a channel (SSH) uses the same
mechanics on the far side: a boot wrapper reports "started" before the command runs and its exit
status after, in-band on stdout; kills find a command's processes by the marker in their initial
environment; spill files are written by a ``cat`` that refuses existing paths. Scripts carry names,
never secret values.
"""

from __future__ import annotations

import logging
import secrets
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import anyio

from .._errors import (
    INFRA_REASONS,
    BashInfrastructureError,
)

__all__ = [
    "BOOT_AT",
    "BOOT_FAIL",
    "BOOT_OK",
    "EXIT_PREFIX",
    "KILL",
    "SPILL_DIR",
    "SPILL_HIGH_WATER_BYTES",
    "SPILL_WRITER",
    "CommandSpills",
    "CommandStart",
    "ExitTrailerFilter",
    "QueuedSpillFile",
    "SpillWriter",
    "boot_failure",
    "boot_ok_undecided",
    "find_boot_ok",
    "kill_args",
    "spill_file_path",
]

log = logging.getLogger("dsh_bash")

#: Preamble markers written to stdout by a boot script before the command starts. A failure report
#: is BOOT_FAIL, a machine-readable kind (an infrastructure error reason, see :func:`boot_failure`),
#: optionally ``:`` and a detail for people, then NUL: ``\0dsh-bash-boot-fail:workdir_missing\0``.
BOOT_OK = b"\0dsh-bash-boot-ok\0"
BOOT_FAIL = b"\0dsh-bash-boot-fail:"
#: The trailer a boot script writes once the command's shell exited: nonce and a 3-digit status.
EXIT_PREFIX = b"\0dsh-bash-exit:"

#: Written by a boot script right before BOOT_OK (one write with it), when the command's kills may
#: skip older processes: when the command started on its host's clock, as ``/proc/uptime`` gave it
#: (seconds since boot, two decimals) before the command's first process was forked, and the pid of
#: the process that becomes the command's shell by ``exec`` (0 when that shell is a new child):
#: ``\0dsh-bash-boot-at:12345.67:4242\0``. Its bash: ``read -r up _ < /proc/uptime`` (no fork).
BOOT_AT = b"\0dsh-bash-boot-at:"
#: The longest BOOT_AT record a reader waits for (uptime and pid are short numbers).
_MAX_BOOT_AT = len(BOOT_AT) + 48


@dataclass(frozen=True, slots=True)
class CommandStart:
    """When a command started, on the clock of the host it runs on (see :data:`BOOT_AT`)."""

    #: Hundredths of a second since that host booted, read before the command's first process.
    uptime_cs: int
    #: The process that became the command by ``exec`` (it started earlier), or 0.
    pid: int = 0


def _parse_boot_at(body: bytes) -> CommandStart | None:
    """``12345.67:4242`` -> CommandStart; None when it is not that (an empty uptime: unreadable)."""
    uptime, _, pid = body.partition(b":")
    whole, dot, cents = uptime.partition(b".")
    if not (whole.isdigit() and pid.isdigit() and (not dot or cents.isdigit())):
        return None
    # /proc/uptime has two decimals; more or fewer are cut or padded (both round down).
    return CommandStart(int(whole) * 100 + int((cents + b"00")[:2]), int(pid))


def find_boot_ok(buf: bytes | bytearray) -> tuple[int, int, CommandStart | None] | None:
    """Where BOOT's "started" report is in ``buf``: (its start, the index right after BOOT_OK, the
    command's start from a BOOT_AT record right before BOOT_OK, if there is one); None while no
    BOOT_OK is in ``buf``. The start is the record's when there is one, else BOOT_OK's."""
    ok = buf.find(BOOT_OK)
    if ok < 0:
        return None
    end = ok + len(BOOT_OK)
    # The record ends with its NUL right where BOOT_OK begins (BOOT_OK starts with a NUL too).
    at = buf.rfind(BOOT_AT, max(0, ok - _MAX_BOOT_AT), ok)
    if at >= 0 and ok > at + len(BOOT_AT) and buf[ok - 1] == 0:
        start = _parse_boot_at(bytes(buf[at + len(BOOT_AT) : ok - 1]))
        if start is not None:
            return at, end, start
    return ok, end, None


def boot_ok_undecided(head: bytes | bytearray) -> bool:
    """Whether ``head``, the start of a boot script's output, may still become its "started"
    report: too short to tell, or a BOOT_AT record whose BOOT_OK has not come yet."""
    if len(head) < len(BOOT_OK):
        return True
    return head.startswith(BOOT_AT) and BOOT_OK not in head and len(head) < _MAX_BOOT_AT + len(BOOT_OK)


# $1: "signal" or "list", $2: signal name, $3: marker value or prefix, $4: 1 for an exact match,
# $5: the command's start (CommandStart.uptime_cs, 0 for none), $6: the pid that became the command
# by exec (0 for none).
# A process belongs when its initial environment carries the marker; a process group is signalled
# only while a marked process is in it (so a recycled group id is never signalled), which also
# reaches members that cleared their environment.
KILL = r"""
mode=$1 sig=$2 want=$3 exact=$4 since=${5:-0} own=${6:-0}
declare -A groups=() hit=() iscand=()
# Any marker variable of a process counts, not only the first (getenv's): a decoy put before the
# real one must not hide a process, as it does not from the host scan.
ours() { { [ "$exact" = 1 ] && [ "$1" = "$want" ]; } || { [ "$exact" != 1 ] && [ "${1#"$want"}" != "$1" ]; }; }
marked=() all_pid=() all_pgrp=() cand=()
# For one command (an exact marker) whose start is known: a process that started before it cannot
# have inherited its marker, so its environment (maybe megabytes: issue 15) is not read. Start
# times (stat field 22) are in CLK_TCK ticks since boot; `since` is in hundredths of a second. Two
# ticks of slack keep the roundings on the side of reading. The process that became the command
# by exec started earlier: it is read whatever its start.
limit=0 hz=100
case $since in ''|*[!0-9]*) since=0 ;; esac
if [ "$exact" = 1 ] && [ "$since" -gt 0 ]; then
  limit=1
  t=$(getconf CLK_TCK 2>/dev/null)
  case $t in ''|*[!0-9]*|0) ;; *) hz=$t ;; esac
fi
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  read -r stat 2>/dev/null < "$d/stat" || continue
  rest=${stat##*) }
  # Numbers and one state letter: word splitting, without a here-string's temporary file.
  fld=($rest)
  state=${fld[0]} pgrp=${fld[2]}
  [ "$state" = Z ] || [ "$state" = X ] && continue
  all_pid+=("$p"); all_pgrp+=("$pgrp")
  if [ "$limit" = 1 ] && [ "$p" != "$own" ]; then
    case ${fld[19]} in ''|*[!0-9]*) ;; *) (( (fld[19] + 2) * 100 < since * hz )) && continue ;; esac
  fi
  cand+=("$p"); iscand[$p]=1
done
# The markers of the candidates in one pass of grep (-z: one NUL-terminated variable a line): bash
# splitting each whole environment cost about 30 ms a process beside 1.4 MB environments (300 of
# them: a 10 s scan, issue 15). A fixed string, not an
# anchored pattern (busybox's -E took 60 times longer); a variable that only contains the text is
# passed over here. Without a grep that does this (tried on a known text first), each environment
# is split in bash.
everyone=1
if printf 'x\0DSH_BASH_MARK=a\0' | grep -z -q -F -e 'DSH_BASH_MARK=a' 2>/dev/null; then
  everyone=0
  files=()
  for p in "${cand[@]}"; do files+=("/proc/$p/environ"); done
  # No file at all would make grep read its stdin.
  [ "${#files[@]}" -gt 0 ] && while IFS= read -r -d '' rec; do
    f=${rec%%:*}; f=${f#/proc/}; f=${f%/environ}; line=${rec#*:}
    [ "${line#DSH_BASH_MARK=}" != "$line" ] || continue
    ours "${line#DSH_BASH_MARK=}" && hit[$f]=1
  done < <(grep -z -H -s -F -e 'DSH_BASH_MARK=' "${files[@]}" 2>/dev/null)
fi
for i in "${!all_pid[@]}"; do
  p=${all_pid[$i]}
  if [ "$everyone" = 1 ] && [ -n "${iscand[$p]+x}" ]; then
    mapfile -d '' -t env 2>/dev/null < "/proc/$p/environ" || continue
    for e in "${env[@]}"; do
      case $e in DSH_BASH_MARK=*) ours "${e#DSH_BASH_MARK=}" && { hit[$p]=1; break; } ;; esac
    done
  fi
  [ -n "${hit[$p]+x}" ] || continue
  marked+=("$p"); groups[${all_pgrp[$i]}]=1
done
if [ "$mode" = list ]; then
  for i in "${!all_pid[@]}"; do
    if [ -n "${groups[${all_pgrp[$i]}]+x}" ]; then echo "${all_pid[$i]}"; fi
  done
  for p in "${marked[@]}"; do echo "$p"; done
else
  for g in "${!groups[@]}"; do kill -s "$sig" -- "-$g" 2>/dev/null; done
  for p in "${marked[@]}"; do kill -s "$sig" "$p" 2>/dev/null; done
fi
exit 0
"""


def kill_args(
    mode: Literal["signal", "list"],
    sig: int,
    marker: str,
    *,
    exact: bool,
    start: CommandStart | None = None,
) -> tuple[str, ...]:
    """The arguments of :data:`KILL`: ``signal`` the marked processes (and their groups) with ``sig``,
    or ``list`` their pids (``sig`` ignored). ``exact``: the marker is a whole value, not a prefix.
    ``start`` (an exact marker's command, from its BOOT_AT record): processes that started before it
    are skipped unread, but for the one that became the command by exec."""
    name = signal.Signals(sig).name if mode == "signal" else "0"
    since, own = (str(start.uptime_cs), str(start.pid)) if exact and start is not None else ("0", "0")
    return (mode, name, marker, "1" if exact else "0", since, own)


# $1: path. Any existing path is refused, links (dangling too), FIFOs and devices included: bash's
# noclobber alone refuses only regular files and dangling links, and would open a planted link to a
# FIFO or a device. Creation itself is O_EXCL (noclobber on a missing path), so nothing planted
# between the test and the open is followed either (but for a non-regular file planted exactly then,
# which only the directory's owner can do).
#: $1: the new file. It prints one "." once the file exists (so that no spill path is named before
#: a command could open it), then copies stdin into it.
SPILL_WRITER = r"""umask 077; set -C
if [ -e "$1" ] || [ -L "$1" ]; then echo "dsh-bash: refusing existing spill path $1" >&2; exit 1; fi
exec 3> "$1" || exit 1
printf .
exec cat >&3 3>&-"""

SPILL_DIR = r"""umask 077; mktemp -d "${TMPDIR:-/tmp}/dsh-bash-XXXXXX" """

#: Bytes a spill file may hold queued (received, not yet sent to its writer) before the command's
#: output pump stops reading until the writer caught up. Without it the queue grows as fast as the
#: transport delivers output, up to ``max_spill_bytes`` of memory per stream.
SPILL_HIGH_WATER_BYTES = 1024 * 1024


#: How the message words each workdir failure a boot script reports.
_WORKDIR_FAILURES = {
    "workdir_missing": "does not exist",
    "workdir_not_directory": "is not a directory",
    "workdir_not_accessible": "cannot be entered",
}


def boot_failure(report: str, *, workdir: str, where: str) -> BashInfrastructureError:
    """The error for a boot script's failure report (what followed BOOT_FAIL, without the NUL).

    The report's kind becomes the error's reason; a kind this version does not know (a newer
    script's) is ``unclassified``, with the whole report in the message.
    """
    kind, _, detail = report.partition(":")
    reason = next((known for known in INFRA_REASONS if known == kind), None)
    if reason is None:
        return BashInfrastructureError(f"the command could not start {where}: {report or 'no detail'}")
    phrase = _WORKDIR_FAILURES.get(reason)
    if phrase is not None:
        return BashInfrastructureError(f"workdir {workdir!r} {phrase}", reason=reason)
    return BashInfrastructureError(f"the command could not start {where}: {detail or kind}", reason=reason)


class ExitTrailerFilter:
    """Passes stdout on while taking out the boot script's exit trailer, which may span two chunks.

    Only a tail that could be the start of the trailer is held back, so ordinary output (which has
    no NUL bytes) is never delayed.
    """

    __slots__ = ("_held", "_prefix", "_sink", "_size", "exit_code")

    def __init__(self, nonce: str, sink: Callable[[bytes | memoryview], None]) -> None:
        self._sink = sink
        self._prefix = EXIT_PREFIX + nonce.encode() + b":"
        self._size = len(self._prefix) + 4  # three digits and a NUL
        self._held = b""
        self.exit_code: int | None = None

    def feed(self, data: bytes | memoryview) -> None:
        if self.exit_code is not None:
            self._sink(data)
            return
        held = self._held + bytes(data) if self._held else bytes(data)
        self._held = b""
        if held.find(b"\0") < 0:  # one memchr: ordinary output has no NUL, so no trailer either
            self._sink(held)
            return
        index = self._find_prefix(held)
        if index >= 0 and len(held) >= index + self._size:
            trailer = held[index : index + self._size]
            self.exit_code = int(trailer[len(self._prefix) : -1])
            if index:
                self._sink(held[:index])
            if len(held) > index + self._size:
                self._sink(held[index + self._size :])
            return
        # Hold back a tail that may be the trailer's start. Only the last NUL within the trailer's
        # length of the end can begin one: the prefix holds no other NUL, and a complete trailer
        # (which does end in one) was found above.
        keep = 0
        start = held.rfind(b"\0", max(0, len(held) - self._size))
        if start >= 0 and self._prefix.startswith(held[start : start + len(self._prefix)]):
            keep = len(held) - start
        if keep < len(held):
            self._sink(held[: len(held) - keep] if keep else held)
        self._held = held[len(held) - keep :] if keep else b""

    def _find_prefix(self, held: bytes) -> int:
        """Where the trailer's prefix first starts in ``held``, or -1.

        Anchored on the prefix's second byte (one memchr per candidate): ``bytes.find`` with the
        whole prefix pays a fixed set-up of several microseconds per call, and in NUL-heavy
        output (``/dev/zero``) it advances a byte at a time. After a few false candidates the
        whole-prefix search takes over, so binary output full of that byte stays linear.
        """
        prefix = self._prefix
        second = prefix[1:2]
        at = held.find(second, 1)
        for _ in range(8):
            if at < 0:
                return -1
            if held[at - 1] == 0 and held.startswith(prefix, at - 1):
                return at - 1
            at = held.find(second, at + 1)
        # Output full of that byte (binary data): let the C search take the rest.
        return -1 if at < 0 else held.find(prefix, at - 1)

    def flush(self) -> None:
        """The stream ended: whatever was held back was output after all."""
        if self._held:
            self._sink(self._held)
            self._held = b""


class SpillWriter(Protocol):
    """A backend's open channel into a spill file on the far side (a ``cat`` running SPILL_WRITER)."""

    async def send(self, data: bytes) -> None:
        """Write ``data`` to the file, waiting while the transport is full."""

    async def finish(self) -> None:
        """No more data: end the input and wait until the file is complete.

        Raise ``OSError`` when the writer reports a failure (it refused an existing path, say)."""

    async def aclose(self) -> None:
        """Release the channel (also after a failure)."""


class QueuedSpillFile(ABC):
    """A spill file where the commands run, fed through a queue by a writer started lazily.

    A spill exists only for streams that outgrow ``max_output_bytes``, so most commands never pay
    for one. The :class:`dsh_bash.SpillFile` methods are synchronous (output accounting calls them
    for every chunk): they queue, and :meth:`run`, started by the backend as a helper task, sends
    the queue through the backend's writer. The queue is kept small by the backend's output pump,
    which awaits :meth:`wait_drained` (through :meth:`CommandSpills.wait_writable`) after feeding
    each chunk it read. A backend's release waits for :attr:`done`, so the next command can read
    the complete file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._queue: list[bytes] = []
        #: Bytes written and not yet sent (including those :meth:`run` took off the queue).
        self._queued_bytes = 0
        self._wake = anyio.Event()
        #: Set (and replaced) whenever the backlog may have fallen under the high-water mark.
        self._drained = anyio.Event()
        self._closed = False
        self._deleted = False
        #: True once the writer failed or was refused: the file is incomplete or was never made.
        self.lost = False
        #: True until the writer made the file: until then the stream names no spill path.
        self.pending = True
        self.done = anyio.Event()
        #: From :meth:`delete`: called once the removal was confirmed (the stream's budget is free).
        self._gone: Callable[[], None] | None = None
        #: Starts a helper task (set by :meth:`CommandSpills.add`): for a removal after :meth:`run` ended.
        self.start_helper: Callable[..., None] | None = None

    @abstractmethod
    async def _open_writer(self) -> SpillWriter:
        """Start the writer (the SPILL_WRITER script) for :attr:`path`; return once the file exists
        (the script's "." on its stdout), raise ``OSError`` when it was not made."""

    @abstractmethod
    async def _remove(self) -> None:
        """Remove the file (``rm -f -- PATH``) where the commands run; raise ``OSError`` unless the
        removal was confirmed (the remover's exit status 0)."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.done.is_set():  # the writer ended: nothing more reaches the file, queueing would only grow
            return
        self._queue.append(bytes(data))
        self._queued_bytes += len(data)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def delete(self, gone: Callable[[], None]) -> None:
        """Stop writing and remove the file; ``gone`` is called once its removal was confirmed, after
        the writer ended (a writer still running could write on into the removed file's blocks)."""
        already = self._deleted
        self._deleted = True
        self._closed = True
        self._gone = gone
        self._queue.clear()
        self._queued_bytes = 0
        self._wake.set()
        self._signal_drained()
        # The writer ended before (it failed: the file may hold part of the stream): :meth:`run`
        # will not remove it any more. Untracked (no helper starter): left for the directory's
        # removal at close, and its budget with it.
        if self.done.is_set() and not already and self.start_helper is not None:
            self.start_helper(self._remove_confirmed)

    async def _remove_confirmed(self) -> None:
        """Remove the file (bounded); call ``gone`` only when that was confirmed."""
        if self.pending:
            # The writer never made it: what is at the path (a link planted there) is not ours
            # to remove, and none of the stream's bytes are on the disk.
            if self._gone is not None:
                self._gone()
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self._remove()
            except Exception as exc:  # each transport has its own errors; the budget stays held
                log.warning("spill file %s: removing failed: %s", self.path, exc)
                return
            if self._gone is not None:
                self._gone()

    @property
    def backlogged(self) -> bool:
        """More than :data:`SPILL_HIGH_WATER_BYTES` wait to be sent, and the writer may still send them."""
        return self._queued_bytes >= SPILL_HIGH_WATER_BYTES and not self._deleted and not self.done.is_set()

    async def wait_drained(self) -> None:
        """Return once the backlog is under the high-water mark, or the spill is done, failed or deleted."""
        while self.backlogged:
            await self._drained.wait()

    def _signal_drained(self) -> None:
        self._drained.set()
        self._drained = anyio.Event()

    async def run(self) -> None:
        """Send queued bytes into the file; on delete, stop and remove it. Sets :attr:`done` at the end.

        Any failure of the writer (or a cancellation before the file was complete) sets :attr:`lost`.
        """
        complete = False
        try:
            writer = await self._open_writer()
            self.pending = False
            try:
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    queue, self._queue = self._queue, []
                    for chunk in queue:
                        if self._deleted:
                            break
                        await writer.send(chunk)
                        if self._deleted:  # delete() forgot the whole backlog already
                            break
                        self._queued_bytes -= len(chunk)
                        if self._queued_bytes < SPILL_HIGH_WATER_BYTES:
                            self._signal_drained()
                    if self._closed and not self._queue:
                        break
                await writer.finish()
                complete = True
            finally:
                with anyio.CancelScope(shield=True):
                    await writer.aclose()
        except Exception as exc:  # each transport has its own errors; the spill is just incomplete
            log.warning("spill file %s: writing failed: %s", self.path, exc)
        finally:
            self.lost = not complete and not self._deleted
            if self._deleted:
                # The writer ended (finish() waited for it, or its transport is closed): remove.
                await self._remove_confirmed()
            self._queue.clear()
            self._queued_bytes = 0
            self.done.set()
            self._signal_drained()


def spill_file_path(directory: str, stream: str) -> str:
    """A new spill file's path in the private directory: 24 random hex digits nobody can predict."""
    return f"{directory}/{secrets.token_hex(12)}.{stream}"


class CommandSpills:
    """The spill files each command opened, so its release can wait until they are complete."""

    def __init__(self, start_helper: Callable[..., None], flush_bound_s: float = 30.0) -> None:
        self._start_helper = start_helper
        self._flush_bound_s = flush_bound_s
        self._by_marker: dict[str, list[QueuedSpillFile]] = {}

    def add(self, marker: str, spill: QueuedSpillFile) -> QueuedSpillFile:
        """Track ``spill`` for the command ``marker`` and start its writer."""
        self._by_marker.setdefault(marker, []).append(spill)
        spill.start_helper = self._start_helper
        self._start_helper(spill.run)
        return spill

    def backlogged(self, marker: str) -> bool:
        """Whether :meth:`wait_writable` would wait (for a pump fed by callbacks, which pauses)."""
        return any(spill.backlogged for spill in self._by_marker.get(marker, ()))

    async def wait_writable(self, marker: str) -> None:
        """Backpressure for the command's output pump: await after feeding each chunk it read.

        Returns at once while every spill of the command holds less than
        :data:`SPILL_HIGH_WATER_BYTES` unsent, else waits until its writer drained it below that;
        never waits on a spill that is done, failed or deleted.
        """
        for spill in self._by_marker.get(marker, ()):
            if spill.backlogged:
                await spill.wait_drained()

    async def wait_complete(self, marker: str) -> None:
        """Wait (bounded) until every spill file of the command is complete; forget them."""
        with anyio.move_on_after(self._flush_bound_s):
            for spill in self._by_marker.pop(marker, []):
                await spill.done.wait()
