"""Output accounting, written once for every backend.

A backend pushes raw chunks into an :class:`OutputStream`; the stream keeps the tail in memory,
counts every byte, decides when a spill file is needed and when it must be given up, and serves
consuming reads that never split a UTF-8 character.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Callable
from typing import Literal, Protocol

from ._types import CollectedOutput, OutputTap

__all__ = ["PREPAID_SLACK", "OutputStream", "SpillBudget", "SpillFile", "merge_streams", "prepay_spills"]

log = logging.getLogger("dsh_bash")

StreamName = Literal["stdout", "stderr"]

#: A prepaid file's writer stops one block short of its cap (block rounding): a spill in it may hold
#: this much less than the cap, so that it is given up before its writer blocks (see prepay_spills).
PREPAID_SLACK = 64 * 1024
#: The least a prepaid file may be granted: room for the kept tail, and for progress when its
#: bytes are only passing through (a lost spill, whose read part the backend frees).
_PREPAID_LEAST = 256 * 1024


class SpillFile(Protocol):
    """A file holding a whole stream, where the backend's commands run.

    ``write`` appends (a backend whose commands write the file themselves may make it a no-op);
    ``close`` ends writing and keeps the file; ``delete`` removes it and calls ``gone`` once its
    bytes are really gone from the disk (at once for a file removed synchronously; for a remote
    file, after its writer stopped and the removal was confirmed; never when the removal failed).
    The stream hands the file's budget back only then, so the budget bounds the disk at every
    moment. Errors are ``OSError``.

    ``lost`` is for files written behind the scenes (a remote writer fed from a queue), which learn
    of a failure only later: it turns true then, and the stream reports no spill path from that
    moment on (the file is incomplete, or was never created: a refused path). A file whose errors
    surface as ``OSError`` from its methods keeps it false. ``pending`` is true while such a file is
    not created yet: the stream names no path a command could not open. A file created when it is
    opened keeps it false.
    """

    @property
    def path(self) -> str: ...

    @property
    def lost(self) -> bool: ...

    @property
    def pending(self) -> bool: ...

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def close(self) -> None: ...

    def delete(self, gone: Callable[[], None]) -> None: ...


class SpillBudget:
    """The executor-wide cap on bytes held in spill files (``max_spill_total_bytes``)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def reserve(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        self.used = max(0, self.used - size)


def prepay_spills(streams: list[OutputStream]) -> int:
    """Grant each of ``streams`` (one command's) a file of the same size, reserved at once from their
    budget, for a backend whose command writes its output files itself, through a writer that
    stops at that size (a detached task's supervisor, ``dsh-supervise --cap-bytes``): the files'
    disk use then stays within the reservation at every moment, whatever the command writes.

    The first grant is small: room for the kept tail and some (most files never become a spill).
    Returns it, or 0 (nothing reserved) when the budget has not that much left. A stream whose
    spill outgrows half its grant asks the budget for more as it goes (doubling, up to
    ``max_spill_bytes`` plus :data:`PREPAID_SLACK`): the backend reads :attr:`OutputStream.prepaid`
    after each chunk it fed and raises its writer's cap to it.

    Each stream's spill holds at most its grant less the slack (past it, when the budget gives no
    more, the spill is lost and its file only passes bytes through); the grant comes back when the
    backend confirms the file removed: :meth:`OutputStream.prepaid_gone` for a file that never
    became the spill, the spill's ``gone`` for one given up. A kept spill keeps its whole grant
    until the executor closes.
    """
    if not streams:
        return 0
    budget = streams[0]._budget
    grant = max(_PREPAID_LEAST, *(stream.max_bytes + 2 * PREPAID_SLACK for stream in streams))
    grant += -grant % 4096
    if not budget.reserve(grant * len(streams)):
        return 0
    for stream in streams:
        stream._prepaid = stream._spill_reserved = grant
    return grant


def _skip_continuation(buffer: bytearray | bytes, start: int, limit: int = 3) -> int:
    """Index of the first byte at or after ``start`` that does not continue a UTF-8 sequence."""
    end = min(len(buffer), start + limit)
    index = start
    while index < end and (buffer[index] & 0xC0) == 0x80:
        index += 1
    return index


class OutputStream:
    """One stream of one command: bounded tail, exact counts, spill policy and a read cursor."""

    __slots__ = (
        "_budget",
        "_decoder",
        "_open_spill",
        "_prepaid",
        "_read_pos",
        "_skip_left",
        "_spill",
        "_spill_reserved",
        "_spill_state",
        "_tail",
        "_tap",
        "closed",
        "max_bytes",
        "max_spill_bytes",
        "name",
        "total_bytes",
    )

    def __init__(
        self,
        name: StreamName,
        *,
        max_bytes: int,
        max_spill_bytes: int,
        budget: SpillBudget,
        open_spill: Callable[[], SpillFile],
        tap: OutputTap | None = None,
    ) -> None:
        self.name: StreamName = name
        self.max_bytes = max_bytes
        self.max_spill_bytes = max_spill_bytes
        self.total_bytes = 0
        self.closed = False
        self._budget = budget
        self._open_spill = open_spill
        self._tail = bytearray()
        self._spill: SpillFile | None = None
        self._spill_reserved = 0
        #: Granted at once by prepay_spills (0: reserved chunk by chunk as bytes come).
        self._prepaid = 0
        # "none": not needed yet; "active": holds the whole stream; "lost": deleted or refused, for good.
        self._spill_state: Literal["none", "active", "lost"] = "none"
        self._read_pos = 0
        # After a gap the reader resumes at a character boundary; when the kept tail ended inside
        # the character's continuation bytes, this many more may still have to be skipped.
        self._skip_left = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        #: The spec's ``on_output``: every chunk fed goes to it too (R-output-tap).
        self._tap = tap

    # -- writing -----------------------------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Account for one chunk. The chunk may be a view into a reused buffer: it is copied."""
        size = len(data)
        if not size:
            return
        self.total_bytes += size
        if self._tap is not None:
            self._to_tap(data)
        if self._spill_state == "active":
            if self._spill_failed():
                # The writer gave up behind the scenes: stop queueing into it and free its budget.
                self._lose_spill()
            else:
                self._spill_append(data, size)
        elif self._spill_state == "none" and self.total_bytes > self.max_bytes:
            # First overflow: nothing was dropped yet, so the tail plus this chunk is the whole stream.
            self._spill_begin(data)
        tail = self._tail
        if size >= self.max_bytes:
            tail[:] = data[size - self.max_bytes :]
        else:
            tail += data
            excess = len(tail) - self.max_bytes
            if excess > 0:
                del tail[:excess]

    @property
    def tapped(self) -> bool:
        """Whether a caller takes every byte as it comes (``on_output``): a backend must then feed
        the real bytes of the whole stream, never skip what the kept tail would drop anyway."""
        return self._tap is not None

    def _to_tap(self, data: bytes | bytearray | memoryview) -> None:
        tap = self._tap
        assert tap is not None
        try:
            tap(self.name, bytes(data))
        except Exception:
            # The caller's bug must not break the backend's reader, nor the result: it gets no more.
            self._tap = None
            log.exception("the on_output tap raised; it gets no more %s output", self.name)

    def close(self) -> None:
        """The stream ended (EOF, or the drain bound passed): no more chunks will come."""
        if self.closed:
            return
        self.closed = True
        if self._spill is not None:
            try:
                self._spill.close()
            except OSError as exc:
                log.warning("closing %s spill file %s failed: %s", self.name, self._spill.path, exc)
                self._lose_spill()

    @property
    def prepaid(self) -> int:
        """The bytes granted to this stream's prepaid file (0: not prepaid; see prepay_spills)."""
        return self._prepaid

    def _grow_prepaid(self) -> None:
        """A spill in a prepaid file past half its grant asks the budget for more: double, up to what
        a spill may need; what the budget has left when less than that."""
        most = self.max_spill_bytes + PREPAID_SLACK
        if self._prepaid >= most or self.total_bytes <= self._prepaid // 2:
            return
        want = min(most, max(2 * self._prepaid, self.total_bytes + 2 * PREPAID_SLACK))
        extra = min(want - self._prepaid, self._budget.limit - self._budget.used)
        extra -= extra % 4096
        if extra > 0 and self._budget.reserve(extra):
            self._prepaid += extra
            self._spill_reserved += extra

    def prepaid_gone(self) -> None:
        """The backend removed this stream's prepaid file, which never became its spill: its grant
        is free again. (A spill given up returns it through ``gone``; a kept one keeps it.)"""
        if self._prepaid and self._spill is None:
            self._budget.release(self._spill_reserved)
            self._spill_reserved = self._prepaid = 0

    def _spill_limit(self) -> int:
        if self._prepaid:
            return min(self.max_spill_bytes, self._prepaid - PREPAID_SLACK)
        return self.max_spill_bytes

    def _spill_begin(self, data: bytes | bytearray | memoryview) -> None:
        if self._prepaid:
            self._prepaid_spill_begin()
            return
        if self.total_bytes > self.max_spill_bytes or not self._budget.reserve(self.total_bytes):
            self._spill_state = "lost"
            return
        self._spill_reserved = self.total_bytes
        try:
            spill = self._open_spill()
        except OSError as exc:
            log.warning("cannot create a spill file for %s: %s", self.name, exc)
            self._budget.release(self._spill_reserved)
            self._spill_reserved = 0
            self._spill_state = "lost"
            return
        self._spill = spill
        self._spill_state = "active"
        try:
            if self._tail:
                spill.write(self._tail)
            spill.write(data)
        except OSError as exc:
            log.warning("writing %s spill file %s failed: %s", self.name, spill.path, exc)
            self._lose_spill()

    def _prepaid_spill_begin(self) -> None:
        """The prepaid file already holds the whole stream (its writer is the command's side): it
        becomes the spill, or, past the limit, is given up (its grant comes back once it is gone)."""
        try:
            self._spill = self._open_spill()
        except OSError as exc:
            log.warning("cannot name a spill file for %s: %s", self.name, exc)
            self._spill_state = "lost"  # the grant stays with the file, until prepaid_gone
            return
        self._spill_state = "active"
        self._grow_prepaid()
        if self.total_bytes > self._spill_limit():
            self._lose_spill()

    def _spill_append(self, data: bytes | bytearray | memoryview, size: int) -> None:
        if self._prepaid:
            self._grow_prepaid()
            if self.total_bytes > self._spill_limit():
                self._lose_spill()
            return
        if self.total_bytes > self.max_spill_bytes or not self._budget.reserve(size):
            self._lose_spill()
            return
        self._spill_reserved += size
        assert self._spill is not None
        try:
            self._spill.write(data)
        except OSError as exc:
            log.warning("writing %s spill file %s failed: %s", self.name, self._spill.path, exc)
            self._lose_spill()

    def _lose_spill(self) -> None:
        spill, self._spill = self._spill, None
        self._spill_state = "lost"
        reserved, self._spill_reserved = self._spill_reserved, 0
        if spill is None:
            self._budget.release(reserved)
            return
        released = False

        def gone() -> None:
            # The bytes left the disk: only now may another spill have their budget. A file whose
            # removal failed keeps holding it (the disk still does) until the executor closes.
            nonlocal released
            if not released:
                released = True
                self._budget.release(reserved)

        try:
            spill.delete(gone)
        except OSError as exc:
            log.warning("deleting %s spill file %s failed: %s", self.name, spill.path, exc)

    # -- reading -----------------------------------------------------------------------------

    @property
    def truncated(self) -> bool:
        return self.total_bytes > self.max_bytes

    @property
    def spill_path(self) -> str | None:
        """The whole stream's file, once the tail no longer holds it all and while the file exists
        (from its writer's making it, for one written behind the scenes)."""
        spill = self._spill
        if self._spill_state == "active" and spill is not None and not spill.lost and not spill.pending:
            return spill.path
        return None

    def _spill_failed(self) -> bool:
        return self._spill is not None and self._spill.lost

    def collected(self) -> CollectedOutput:
        """The foreground view: the whole kept tail, decoded."""
        tail = self._tail
        start = _skip_continuation(tail, 0) if self.truncated else 0
        data = bytes(tail)
        return CollectedOutput(
            text=(data[start:] if start else data).decode("utf-8", errors="replace"),
            truncated=self.truncated,
            spill_path=self.spill_path,
            total_bytes=self.total_bytes,
            data=data,
        )

    def read(self) -> tuple[str, int]:
        """Consume what arrived since the previous read: (text, bytes lost from memory unread)."""
        tail = self._tail
        tail_start = self.total_bytes - len(tail)
        dropped = 0
        if self._read_pos < tail_start:
            # A gap: unread bytes left memory. Bytes the decoder held back belong to a character
            # whose remaining bytes are gone, so they are lost too; resume at a character boundary.
            dropped = tail_start - self._read_pos + len(self._decoder.getstate()[0])
            self._decoder.reset()
            self._read_pos = tail_start
            self._skip_left = 3
        if self._skip_left:
            offset = self._read_pos - tail_start
            resume = _skip_continuation(tail, offset, self._skip_left)
            skipped = resume - offset
            dropped += skipped
            self._read_pos += skipped
            reached_end = resume == len(tail)
            self._skip_left = self._skip_left - skipped if reached_end and skipped < self._skip_left else 0
        chunk = bytes(tail[self._read_pos - tail_start :])
        self._read_pos = self.total_bytes
        text = self._decoder.decode(chunk, final=self.closed)
        return text, dropped


def merge_streams(stdout_delta: str, stderr_delta: str) -> str:
    """The background read's one text: stdout, then a ``[stderr]`` line and stderr if it said anything."""
    if not stderr_delta:
        return stdout_delta
    separator = "\n" if stdout_delta and not stdout_delta.endswith("\n") else ""
    return f"{stdout_delta}{separator}[stderr]\n{stderr_delta}"
