"""The verifier of dsh-supervise --detach's signed status file (dsh_bash.supervisor.SignedRecords)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import random

import pytest

from dsh_bash.backend import ExitStatus
from dsh_bash.supervisor import (
    SUPERVISOR_KEY_SIZE,
    SignedRecords,
    SupervisorRecords,
)

KEY = bytes(range(32))
RECORDS = ["supervisor 4242 987654", "started 4243", "exit 3", "signalled 2", "empty"]


def _line(seq: int, record: str, key: bytes = KEY) -> bytes:
    signed = f"{seq} {record}".encode()
    return signed + b" " + hmac.new(key, signed, hashlib.sha256).hexdigest().encode() + b"\n"


def _stream(records: list[str] = RECORDS) -> bytes:
    return b"".join(_line(seq, record) for seq, record in enumerate(records))


def test_good_stream_in_any_split() -> None:
    data = _stream()
    rng = random.Random(7)
    for _ in range(200):
        verifier = SignedRecords(KEY)
        got: list[str] = []
        at = 0
        while at < len(data):
            step = rng.randint(1, 40)
            got += verifier.feed(data[at : at + step])
            at += step
        assert got == RECORDS
        assert verifier.forged == 0
        assert verifier.fed == len(data)
        assert verifier.next_seq == len(RECORDS)
    one_by_one = SignedRecords(KEY)
    assert [r for k in range(len(data)) for r in one_by_one.feed(data[k : k + 1])] == RECORDS


def test_records_feed_supervisor_records() -> None:
    state = SupervisorRecords()
    for record in SignedRecords(KEY).feed(_stream()):
        state.apply(record)
    assert (state.supervisor_pid, state.supervisor_start_time) == (4242, 987654)
    assert state.child == 4243
    assert state.command_exit == ExitStatus(code=3)
    assert state.empty


def test_supervisor_record_unreadable_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    state = SupervisorRecords()
    with caplog.at_level(logging.WARNING, logger="dsh_bash"):
        state.apply("supervisor 12")
    assert state.supervisor_pid is None and state.supervisor_start_time is None
    assert "unreadable" in caplog.text


def test_forged_line_is_rejected_and_the_real_one_still_verifies(caplog: pytest.LogCaptureFixture) -> None:
    fake_mac = os.urandom(32).hex().encode()
    data = _line(0, "supervisor 1 2") + _line(1, "started 3")
    data += b"2 exit 0 " + fake_mac + b"\n"  # what a command appends to claim success
    data += b"2 empty " + hmac.new(os.urandom(32), b"2 empty", hashlib.sha256).hexdigest().encode() + b"\n"
    data += _line(2, "exit 7") + _line(3, "empty")
    verifier = SignedRecords(KEY)
    with caplog.at_level(logging.WARNING, logger="dsh_bash"):
        assert verifier.feed(data) == ["supervisor 1 2", "started 3", "exit 7", "empty"]
    assert verifier.forged == 2
    assert "does not verify" in caplog.text


def test_line_signed_under_another_key_is_rejected() -> None:
    verifier = SignedRecords(KEY)
    assert verifier.feed(_line(0, "exit 0", key=bytes(32))) == []
    assert verifier.forged == 1
    assert verifier.feed(_line(0, "exit 1")) == ["exit 1"]


def test_replayed_and_reordered_lines_are_rejected() -> None:
    verifier = SignedRecords(KEY)
    first = verifier.feed(_line(0, "supervisor 1 2") + _line(1, "started 3"))
    assert first == ["supervisor 1 2", "started 3"]
    # A copy of an earlier real line, then a real line ahead of its turn: both fail the SEQ check.
    assert verifier.feed(_line(1, "started 3") + _line(3, "empty")) == []
    assert verifier.forged == 2
    assert verifier.feed(_line(2, "exit 0")) == ["exit 0"]
    assert verifier.feed(_line(3, "empty")) == ["empty"]
    assert verifier.forged == 2


def test_edited_record_is_rejected() -> None:
    good = _line(0, "exit 3")
    verifier = SignedRecords(KEY)
    assert verifier.feed(good.replace(b"exit 3", b"exit 0")) == []
    assert verifier.feed(good.upper()) == []  # the MAC is lowercase hex, and covers the text
    assert verifier.forged == 2


def test_truncated_line() -> None:
    good = _line(0, "exit 3")
    verifier = SignedRecords(KEY)
    # Without its newline a line is not complete yet: nothing, and nothing forged so far.
    assert verifier.feed(good[:-1]) == []
    assert verifier.forged == 0
    assert verifier.feed(b"\n") == ["exit 3"]
    # A line cut inside its MAC and then ended is rejected.
    cut = SignedRecords(KEY)
    assert cut.feed(good[:-10] + b"\n") == []
    assert cut.forged == 1


def test_record_glued_after_a_partial_line_is_found() -> None:
    # A short write (a full file system) leaves a partial line and the next record takes its SEQ;
    # junk without a newline, from a forger, looks the same. The record at the tail verifies.
    partial = _line(1, "exit 3")[:20]
    data = _line(0, "started 5") + partial + _line(1, "warning dropped 1") + _line(2, "empty")
    verifier = SignedRecords(KEY)
    assert verifier.feed(data) == ["started 5", "warning dropped 1", "empty"]
    assert verifier.forged == 1
    glued = SignedRecords(KEY)
    assert glued.feed(b"x" * 10_000 + _line(0, "exit 0")) == ["exit 0"]


def test_endless_junk_keeps_the_buffer_bounded() -> None:
    verifier = SignedRecords(KEY)
    for _ in range(100):
        assert verifier.feed(b"j" * 100_000) == []
    assert len(verifier._buffer) <= 256
    assert verifier.feed(b"\n" + _line(0, "exit 0")) == ["exit 0"]
    assert verifier.forged == 1


def test_non_ascii_and_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        SignedRecords(b"short")
    assert SUPERVISOR_KEY_SIZE == 32
    verifier = SignedRecords(KEY)
    assert verifier.feed(_line(0, "exit\t3")) == []  # not a record the supervisor writes
    assert verifier.feed(b"\xff\xfe\n") == []
    assert verifier.forged == 2
