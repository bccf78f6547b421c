"""The signed status file of ``dsh-supervise --detach``: records only the supervisor could have written.

A detached task outlives the harness's channel, so its supervisor appends its status records to a
file, which the command (same user) can append to as well. Each line is ``SEQ RECORD MAC``: SEQ
counts from 0, MAC is the lowercase hex HMAC-SHA256, under a 32-byte key only the harness and the
supervisor know, of the line's bytes before its last space (``f"{SEQ} {RECORD}"``).
:class:`SignedRecords` takes the file's bytes as they are read and returns the records that verify,
in order; feed them to a :class:`~dsh_bash.supervisor.SupervisorRecords`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re

__all__ = ["KEY_SIZE", "SignedRecords"]

log = logging.getLogger("dsh_bash")

#: Bytes of key the supervisor reads on its fd 0.
KEY_SIZE = 32
# The longest line the supervisor writes: a 20-digit SEQ, a record of at most 126 bytes, a MAC of 64
# hex digits, three separators. Only the last this many bytes of a bad line can hold a real record.
_MAX_LINE = 256
_MAC = re.compile(rb"[0-9a-f]{64}")
_RECORD = re.compile(rb"[\x20-\x7e]*")


class SignedRecords:
    """Verifies a ``dsh-supervise --detach`` status file, fed incrementally.

    ``feed(data)`` takes the file's next bytes (in any split; a partial last line is kept for the
    next call) and returns the texts of the records that verified: the MAC is right under the key
    and SEQ is exactly the next one expected. Anything else (a forged line, a replayed or
    reordered real one, a truncated one) is counted in :attr:`forged`, logged, and skipped: the
    records after it are still read, but only those that verify in sequence. When a line fails as
    a whole, its tail is tried as well: a record the supervisor appended after bytes without a
    newline (a partial write, or junk a forger left) is still found.
    """

    __slots__ = ("_buffer", "_key", "fed", "forged", "next_seq")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a dsh-supervise key is {KEY_SIZE} bytes, not {len(key)}")
        self._key = bytes(key)
        self._buffer = b""
        #: The SEQ of the next record to accept (how many were accepted so far).
        self.next_seq = 0
        #: Lines (or parts of lines) that failed verification.
        self.forged = 0
        #: Bytes fed so far: the offset in the status file to read from next.
        self.fed = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[str]:
        chunk = bytes(data)
        self.fed += len(chunk)
        lines = (self._buffer + chunk).split(b"\n")
        rest = lines.pop()
        # An unfinished line longer than any record is junk but for its tail, which may be the start
        # of a real record glued to it: keep that much only, so a forger cannot grow the buffer.
        self._buffer = rest[-_MAX_LINE:]
        accepted = []
        for line in lines:
            record = self._verify_line(line)
            if record is not None:
                accepted.append(record)
        return accepted

    def _verify_line(self, line: bytes) -> str | None:
        record = self._verify(line)
        if record is not None:
            return record
        self.forged += 1
        log.warning("dsh-supervise status file: a line that does not verify (forged?): %r", line[-_MAX_LINE:])
        prefix = f"{self.next_seq} ".encode()
        # Position 0 was the whole line; a glued record starts later, within the last _MAX_LINE bytes.
        at = line.find(prefix, max(1, len(line) - _MAX_LINE))
        while at != -1:
            record = self._verify(line[at:])
            if record is not None:
                return record
            at = line.find(prefix, at + 1)
        return None

    def _verify(self, line: bytes) -> str | None:
        """The record's text when LINE is the next record, signed; else None (nothing changes)."""
        if len(line) > _MAX_LINE:
            return None
        signed, _, mac = line.rpartition(b" ")
        prefix = f"{self.next_seq} ".encode()
        if not signed.startswith(prefix) or not _MAC.fullmatch(mac):
            return None
        expected = hmac.new(self._key, signed, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(expected, mac):
            return None
        text = signed[len(prefix) :]
        if not _RECORD.fullmatch(text):
            return None
        self.next_seq += 1
        return text.decode("ascii")
