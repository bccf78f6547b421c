"""The framed channel's codec (dsh_bash.supervisor._frames: FrameDecoder, encode_frame) and status records."""

from __future__ import annotations

import random
import struct

import pytest

from dsh_bash.backend import ExitStatus
from dsh_bash.supervisor import (
    SupervisorRecords,
    encode_frame,
)
from dsh_bash.supervisor._frames import (
    MAX_FRAME_PAYLOAD,
    FrameDecoder,
    FrameError,
)


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + struct.pack(">I", len(payload)) + payload


class _Collect:
    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()
        self.status: list[str] = []
        self.eof: list[str] = []
        self.order: list[str] = []
        self.decoder = FrameDecoder(
            on_stdout=self._out, on_stderr=self._err, on_status=self._status, on_eof=self._eof
        )

    def _out(self, data: memoryview) -> None:
        self.out += data
        self.order.append("o")

    def _err(self, data: memoryview) -> None:
        self.err += data
        self.order.append("e")

    def _status(self, record: str) -> None:
        self.status.append(record)
        self.order.append("s")

    def _eof(self, stream: str) -> None:
        self.eof.append(stream)


STREAM = (
    _frame(b"s", b"started 42")
    + _frame(b"o", bytes(range(256)) * 3)
    + _frame(b"e", b"\0dsh-bash-exit:x:000\0")
    + _frame(b"o", b"tail")
    + _frame(b"s", b"exit 3")
    + _frame(b"o")
    + _frame(b"e")
    + _frame(b"s", b"empty")
)


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_same_records(seed: int) -> None:
    rng = random.Random(seed)
    sink = _Collect()
    at = 0
    while at < len(STREAM):
        step = rng.randint(1, 9) if seed % 2 else rng.randint(1, 400)
        sink.decoder.feed(memoryview(STREAM)[at : at + step])
        at += step
    assert bytes(sink.out) == bytes(range(256)) * 3 + b"tail"
    assert bytes(sink.err) == b"\0dsh-bash-exit:x:000\0"  # a trailer in the output is only output
    assert sink.status == ["started 42", "exit 3", "empty"]
    assert sink.eof == ["stdout", "stderr"]
    assert not sink.decoder.mid_frame


def test_whole_stream_at_once_keeps_the_order() -> None:
    sink = _Collect()
    sink.decoder.feed(STREAM)
    assert sink.order == ["s", "o", "e", "o", "s", "s"]


def test_a_cut_inside_a_frame_is_seen() -> None:
    sink = _Collect()
    sink.decoder.feed(STREAM[:12])
    assert sink.decoder.mid_frame
    sink.decoder.feed(STREAM[12:])
    assert not sink.decoder.mid_frame


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (_frame(b"x", b"hi"), "unknown frame type"),
        (b"o" + struct.pack(">I", MAX_FRAME_PAYLOAD + 1), r"bytes \(at most"),
    ],
)
def test_a_stream_that_is_not_a_supervisor_s_is_refused(data: bytes, words: str) -> None:
    sink = _Collect()
    with pytest.raises(FrameError, match=words):
        sink.decoder.feed(data)


def test_framed_says_whether_a_frame_header_was_read() -> None:
    sink = _Collect()
    sink.decoder.feed(STREAM[:3])  # part of the first header only
    assert not sink.decoder.framed
    sink.decoder.feed(STREAM[3:])
    assert sink.decoder.framed
    text = _Collect()
    with pytest.raises(FrameError):
        text.decoder.feed(b"unable to find user x\n")
    assert not text.decoder.framed


def test_encode_frame() -> None:
    assert encode_frame(b"i", b"abc") == b"i\0\0\0\x03abc"
    assert encode_frame(b"K") == b"K\0\0\0\0"
    with pytest.raises(ValueError, match="one byte"):
        encode_frame(b"TK")


@pytest.mark.parametrize(
    ("records", "child", "exit_status", "empty"),
    [
        (["started 7", "exit 0"], 7, ExitStatus(code=0), False),
        (["started 7", "signal 15", "empty"], 7, ExitStatus(code=None, signal=15), True),
        (["started 7", "signal 11 core"], 7, ExitStatus(code=None, signal=11), False),
        (["started x", "exit"], None, None, False),  # unreadable: ignored
        (["warning proc-scan 24", "signalled 3"], None, None, False),
    ],
)
def test_supervisor_records(
    records: list[str], child: int | None, exit_status: ExitStatus | None, empty: bool
) -> None:
    seen = SupervisorRecords()
    for record in records:
        seen.apply(record)
    assert (seen.child, seen.command_exit, seen.empty) == (child, exit_status, empty)


def test_execfail_record() -> None:
    seen = SupervisorRecords()
    seen.apply("execfail 2")
    assert seen.exec_failed == 2


# ---- input records (protocol 5) -----------------------------------------------------------------


def test_input_records_start_unknown() -> None:
    seen = SupervisorRecords()
    assert (seen.input_drained, seen.input_broken, seen.input_waiting) == (0, None, None)


def test_input_waiting_is_the_last_sample() -> None:
    seen = SupervisorRecords()
    seen.apply("started 7")
    seen.apply("input busy 0")
    assert seen.input_waiting == (False, 0)
    seen.apply("input waiting 0")
    assert seen.input_waiting == (True, 0)
    seen.apply("input busy 5000000000")
    assert seen.input_waiting == (False, 5_000_000_000)
    seen.apply("input waiting 5000000002")
    assert seen.input_waiting == (True, 5_000_000_002)
    assert (seen.input_drained, seen.input_broken) == (0, None)


def test_input_drained_is_the_last_count() -> None:
    seen = SupervisorRecords()
    for record in ["started 7", "input drained 5", "input drained 70005"]:
        seen.apply(record)
    assert seen.input_drained == 70005
    # Cumulative and 64-bit in the supervisor: past 2**32 it is still one exact number.
    seen.apply("input drained 5000000000")
    assert seen.input_drained == 5_000_000_000
    assert seen.input_broken is None


def test_input_broken_keeps_the_errno() -> None:
    seen = SupervisorRecords()
    seen.apply("input drained 10")
    seen.apply("input broken 32")
    assert (seen.input_drained, seen.input_broken) == (10, 32)
    seen.apply("input broken 12")  # sent once; were there another, the first failure stands
    assert seen.input_broken == 32


@pytest.mark.parametrize(
    "record",
    [
        "input drained",
        "input drained x",
        "input drained -3",
        "input drained 1.5",
        "input broken",
        "input broken pipe",
        "input broken -32",
        "input waiting",
        "input waiting x",
        "input waiting -1",
        "input busy",
        "input busy +2",
        "input busy 1_000",
    ],
)
def test_unreadable_input_records_change_nothing(record: str, caplog: pytest.LogCaptureFixture) -> None:
    seen = SupervisorRecords()
    seen.apply("input drained 4")
    seen.apply("input busy 4")
    with caplog.at_level("WARNING", logger="dsh_bash"):
        seen.apply(record)
    assert (seen.input_drained, seen.input_broken, seen.input_waiting) == (4, None, (False, 4))
    assert "unreadable record" in caplog.text, record


def test_an_unknown_input_record_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    seen = SupervisorRecords()
    with caplog.at_level("WARNING", logger="dsh_bash"):
        seen.apply("input paused 3")  # a later version's: not this version's business
        seen.apply("input")
    assert (seen.input_drained, seen.input_broken, seen.input_waiting) == (0, None, None)
    assert caplog.text == ""
