"""Unit tests for output accounting: OutputStream, SpillBudget and merge_streams.

No processes and no files: spills go to an in-memory fake that records what it was given.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_bash._output import (
    SpillBudget,
    merge_streams,
)
from dsh_bash.backend import (
    OutputStream,
    prepay_spills,
)


class FakeSpill:
    """An in-memory SpillFile. ``fail_write_on`` makes the n-th write (1-based) raise OSError."""

    def __init__(self, path: str, *, fail_write_on: int | None = None, fail_close: bool = False) -> None:
        self._path = path
        self.data = bytearray()
        self.writes = 0
        self.closed = False
        self.deleted = False
        self.fail_write_on = fail_write_on
        self.fail_close = fail_close

    @property
    def path(self) -> str:
        return self._path

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.deleted, "write after delete"
        assert not self.closed, "write after close"
        self.writes += 1
        if self.fail_write_on is not None and self.writes >= self.fail_write_on:
            raise OSError("No space left on device")
        self.data += bytes(data)  # a real file copies what it is given, so does the fake

    def close(self) -> None:
        if self.fail_close:
            raise OSError("close failed")
        self.closed = True

    def delete(self, gone: Callable[[], None]) -> None:
        self.deleted = True
        gone()

    lost = False
    pending = False


@dataclass
class SpillFactory:
    """``open_spill`` for a stream: makes FakeSpills and remembers them."""

    fail_open: bool = False
    fail_write_on: int | None = None
    fail_close: bool = False
    opened: list[FakeSpill] = field(default_factory=list)
    attempts: int = 0

    def __call__(self) -> FakeSpill:
        self.attempts += 1
        if self.fail_open:
            raise OSError("Permission denied")
        spill = FakeSpill(
            f"/spill/{self.attempts}", fail_write_on=self.fail_write_on, fail_close=self.fail_close
        )
        self.opened.append(spill)
        return spill

    @property
    def only(self) -> FakeSpill:
        assert len(self.opened) == 1, self.opened
        return self.opened[0]


def make_stream(
    max_bytes: int = 10,
    max_spill_bytes: int = 1_000_000,
    budget: SpillBudget | None = None,
    factory: SpillFactory | None = None,
) -> tuple[OutputStream, SpillFactory]:
    factory = factory if factory is not None else SpillFactory()
    stream = OutputStream(
        "stdout",
        max_bytes=max_bytes,
        max_spill_bytes=max_spill_bytes,
        budget=budget if budget is not None else SpillBudget(10**12),
        open_spill=factory,
    )
    return stream, factory


def feed_in_chunks(stream: OutputStream, data: bytes, size: int) -> None:
    for start in range(0, len(data), size):
        stream.feed(data[start : start + size])


ASCII = bytes(ord("a") + i % 26 for i in range(100))
CHUNK_SIZES = [1, 2, 3, 7, 9, 10, 11, 25, 99, 100, 1000]


# -- tail and truncation -------------------------------------------------------------------------


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_tail_keeps_exactly_the_last_max_bytes(size: int) -> None:
    stream, _ = make_stream(max_bytes=10)
    feed_in_chunks(stream, ASCII, size)
    collected = stream.collected()
    assert collected.text == ASCII[-10:].decode()
    assert collected.truncated is True
    assert collected.total_bytes == 100


@pytest.mark.parametrize("size", [1, 3, 10])
def test_output_of_exactly_max_bytes_is_not_truncated_and_opens_no_spill(size: int) -> None:
    stream, factory = make_stream(max_bytes=10)
    feed_in_chunks(stream, ASCII[:10], size)
    stream.close()
    collected = stream.collected()
    assert collected.text == ASCII[:10].decode()
    assert collected.truncated is False
    assert collected.spill_path is None
    assert collected.total_bytes == 10
    assert stream.truncated is False
    assert factory.attempts == 0


def test_one_byte_over_max_bytes_truncates_and_spills() -> None:
    stream, factory = make_stream(max_bytes=10)
    stream.feed(ASCII[:10])
    stream.feed(ASCII[10:11])
    assert stream.truncated is True
    assert stream.spill_path == factory.only.path
    assert bytes(factory.only.data) == ASCII[:11]
    assert stream.collected().text == ASCII[1:11].decode()


def test_short_output_is_kept_whole() -> None:
    stream, factory = make_stream(max_bytes=10)
    stream.feed(b"hi\n")
    collected = stream.collected()
    assert (collected.text, collected.truncated, collected.spill_path, collected.total_bytes) == (
        "hi\n",
        False,
        None,
        3,
    )
    assert factory.attempts == 0


def test_empty_stream_collects_empty() -> None:
    stream, factory = make_stream()
    stream.feed(b"")
    stream.close()
    collected = stream.collected()
    assert (collected.text, collected.truncated, collected.spill_path, collected.total_bytes) == (
        "",
        False,
        None,
        0,
    )
    assert factory.attempts == 0


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_total_bytes_counts_every_byte_fed(size: int) -> None:
    stream, _ = make_stream(max_bytes=10, max_spill_bytes=20)
    for _ in range(3):
        feed_in_chunks(stream, ASCII, size)
        stream.feed(b"")
    assert stream.total_bytes == 300
    assert stream.collected().total_bytes == 300


# -- spill --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_first_overflow_spills_the_whole_stream_so_far_and_later_chunks_append(size: int) -> None:
    stream, factory = make_stream(max_bytes=10)
    data = bytes(range(256)) * 2
    feed_in_chunks(stream, data, size)
    spill = factory.only
    assert bytes(spill.data) == data
    assert stream.spill_path == spill.path
    assert stream.collected().spill_path == spill.path
    stream.close()
    assert spill.closed is True
    assert spill.deleted is False
    assert stream.spill_path == spill.path


def test_first_chunk_larger_than_max_bytes_goes_whole_to_the_spill() -> None:
    stream, factory = make_stream(max_bytes=4)
    stream.feed(b"0123456789")
    assert bytes(factory.only.data) == b"0123456789"
    assert stream.collected().text == "6789"


def test_close_twice_closes_the_spill_once() -> None:
    stream, factory = make_stream(max_bytes=2)
    stream.feed(b"abc")
    stream.close()
    factory.only.fail_close = True  # a second close of the file would now raise and lose it
    stream.close()
    assert stream.closed is True
    assert stream.spill_path == factory.only.path


@pytest.mark.parametrize("size", [1, 7, 50])
def test_stream_of_exactly_max_spill_bytes_keeps_its_spill(size: int) -> None:
    stream, factory = make_stream(max_bytes=10, max_spill_bytes=50)
    feed_in_chunks(stream, ASCII[:50], size)
    stream.close()
    assert bytes(factory.only.data) == ASCII[:50]
    assert factory.only.deleted is False
    assert stream.spill_path == factory.only.path


@pytest.mark.parametrize("size", [1, 7, 51])
def test_stream_one_byte_over_max_spill_bytes_loses_its_spill_for_good(size: int) -> None:
    budget = SpillBudget(1_000)
    stream, factory = make_stream(max_bytes=10, max_spill_bytes=50, budget=budget)
    feed_in_chunks(stream, ASCII[:51], size)
    assert stream.spill_path is None
    assert stream.collected().spill_path is None
    assert all(spill.deleted for spill in factory.opened)
    assert budget.used == 0
    # Later output, however small, never brings a spill back.
    stream.feed(b"x")
    stream.close()
    assert stream.spill_path is None
    assert factory.attempts <= 1
    assert stream.total_bytes == 52
    assert stream.truncated is True
    assert stream.collected().text == (ASCII[:51] + b"x")[-10:].decode()


def test_first_overflow_beyond_max_spill_bytes_opens_no_spill() -> None:
    budget = SpillBudget(1_000)
    stream, factory = make_stream(max_bytes=10, max_spill_bytes=20, budget=budget)
    stream.feed(ASCII[:21])
    assert stream.spill_path is None
    assert factory.attempts == 0
    assert budget.used == 0


def test_spill_budget_reserve_is_inclusive_and_release_never_goes_negative() -> None:
    budget = SpillBudget(10)
    assert budget.reserve(4) is True
    assert budget.reserve(6) is True
    assert budget.used == 10
    assert budget.reserve(1) is False
    assert budget.used == 10
    budget.release(3)
    assert budget.used == 7
    budget.release(100)
    assert budget.used == 0


def test_spill_budget_accounts_every_spilled_byte() -> None:
    budget = SpillBudget(1_000)
    stream, _ = make_stream(max_bytes=10, budget=budget)
    feed_in_chunks(stream, ASCII, 7)
    assert budget.used == 100
    stream.close()
    assert budget.used == 100  # a kept spill file still holds its bytes


def test_second_stream_whose_spill_would_exceed_the_budget_is_refused() -> None:
    budget = SpillBudget(100)
    first, first_factory = make_stream(max_bytes=10, budget=budget)
    first.feed(ASCII[:60])
    assert first.spill_path is not None
    second, second_factory = make_stream(max_bytes=10, budget=budget)
    second.feed(ASCII[:41])
    assert second.truncated is True
    assert second.spill_path is None
    assert second_factory.attempts == 0
    assert budget.used == 60
    # Refused for good: even once room frees up, a stream that already dropped bytes gets no spill.
    first.feed(b"x" * 1_000)
    assert budget.used == 0
    second.feed(b"y")
    assert second.spill_path is None
    assert second_factory.attempts == 0
    assert first_factory.only.deleted is True


def test_stream_whose_append_would_exceed_the_budget_loses_its_spill() -> None:
    budget = SpillBudget(100)
    first, first_factory = make_stream(max_bytes=10, budget=budget)
    first.feed(ASCII[:60])
    second, _ = make_stream(max_bytes=10, budget=budget)
    second.feed(ASCII[:30])
    assert budget.used == 90
    first.feed(ASCII[:11])
    assert first.spill_path is None
    assert first_factory.only.deleted is True
    assert budget.used == 30
    assert second.spill_path is not None


def test_budget_released_by_a_lost_spill_lets_a_new_stream_spill() -> None:
    budget = SpillBudget(100)
    first, first_factory = make_stream(max_bytes=10, max_spill_bytes=80, budget=budget)
    first.feed(ASCII[:80])
    assert budget.used == 80
    first.feed(b"!")  # outgrows its own cap: deleted, budget released
    assert first_factory.only.deleted is True
    assert budget.used == 0
    second, second_factory = make_stream(max_bytes=10, budget=budget)
    second.feed(ASCII[:90])
    assert second.spill_path == second_factory.only.path
    assert budget.used == 90


@pytest.mark.parametrize("fail_write_on", [1, 2, 3, 5])
def test_spill_write_error_loses_the_spill_without_raising(
    fail_write_on: int, caplog: pytest.LogCaptureFixture
) -> None:
    budget = SpillBudget(1_000)
    factory = SpillFactory(fail_write_on=fail_write_on)
    stream, _ = make_stream(max_bytes=10, budget=budget, factory=factory)
    with caplog.at_level(logging.WARNING, logger="dsh_bash"):
        feed_in_chunks(stream, ASCII, 7)  # first overflow writes twice (tail, chunk), then appends
    stream.close()
    assert stream.spill_path is None
    assert factory.only.deleted is True
    assert budget.used == 0
    assert stream.total_bytes == 100
    assert stream.collected().text == ASCII[-10:].decode()
    assert stream.collected().spill_path is None
    assert "spill" in caplog.text


def test_open_spill_error_means_no_spill_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    budget = SpillBudget(1_000)
    factory = SpillFactory(fail_open=True)
    stream, _ = make_stream(max_bytes=10, budget=budget, factory=factory)
    with caplog.at_level(logging.WARNING, logger="dsh_bash"):
        feed_in_chunks(stream, ASCII, 3)
    stream.close()
    assert stream.spill_path is None
    assert stream.truncated is True
    assert factory.attempts == 1
    assert budget.used == 0
    assert stream.collected().text == ASCII[-10:].decode()
    assert "spill" in caplog.text


def test_spill_close_error_loses_the_spill_without_raising() -> None:
    budget = SpillBudget(1_000)
    factory = SpillFactory(fail_close=True)
    stream, _ = make_stream(max_bytes=10, budget=budget, factory=factory)
    stream.feed(ASCII[:20])
    stream.close()
    assert stream.spill_path is None
    assert factory.only.deleted is True
    assert budget.used == 0


# -- feeding views of a reused buffer -------------------------------------------------------------


def test_feed_copies_a_memoryview_of_a_reused_buffer_below_max() -> None:
    stream, _ = make_stream(max_bytes=100)
    buffer = bytearray(b"abcd")
    stream.feed(memoryview(buffer))
    buffer[:] = b"WXYZ"
    stream.feed(memoryview(buffer)[:2])
    buffer[:] = b"????"
    assert stream.collected().text == "abcdWX"
    assert stream.read() == ("abcdWX", 0)


def test_feed_copies_a_memoryview_of_a_reused_buffer_into_tail_and_spill() -> None:
    stream, factory = make_stream(max_bytes=6)
    buffer = bytearray(b"abcd")
    stream.feed(memoryview(buffer))
    buffer[:] = b"efgh"
    stream.feed(memoryview(buffer))  # first overflow: spill gets "abcd" + "efgh"
    buffer[:] = b"ijkl"
    stream.feed(memoryview(buffer))
    buffer[:] = b"????"
    assert bytes(factory.only.data) == b"abcdefghijkl"
    assert stream.collected().text == "ghijkl"
    assert stream.read() == ("ghijkl", 6)


def test_feed_copies_a_memoryview_larger_than_max_bytes() -> None:
    stream, factory = make_stream(max_bytes=3)
    buffer = bytearray(b"abcdefgh")
    stream.feed(memoryview(buffer))
    buffer[:] = b"????????"
    assert stream.collected().text == "fgh"
    assert bytes(factory.only.data) == b"abcdefgh"


def test_feed_accepts_bytearray_and_bytes() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(bytearray(b"ab"))
    stream.feed(b"cd")
    assert stream.read() == ("abcd", 0)


# -- read -------------------------------------------------------------------------------------------


def test_read_is_consuming() -> None:
    stream, _ = make_stream(max_bytes=100)
    assert stream.read() == ("", 0)
    stream.feed(b"abc")
    assert stream.read() == ("abc", 0)
    assert stream.read() == ("", 0)
    stream.feed(b"de")
    stream.feed(b"f")
    assert stream.read() == ("def", 0)
    assert stream.read() == ("", 0)


def test_read_does_not_disturb_collected() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"abc")
    stream.read()
    assert stream.collected().text == "abc"
    assert stream.collected().text == "abc"


def test_collected_does_not_consume() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"abc")
    stream.collected()
    assert stream.read() == ("abc", 0)


def test_read_reports_exactly_the_bytes_the_tail_overran() -> None:
    stream, _ = make_stream(max_bytes=4)
    stream.feed(b"0123456789")
    assert stream.read() == ("6789", 6)
    stream.feed(b"ab")
    assert stream.read() == ("ab", 0)
    stream.feed(b"cdefgh")
    assert stream.read() == ("efgh", 2)
    stream.feed(b"ijkl")
    assert stream.read() == ("ijkl", 0)
    assert stream.read() == ("", 0)


def test_read_after_many_overruns_counts_all_of_them() -> None:
    stream, _ = make_stream(max_bytes=5)
    assert stream.read() == ("", 0)
    for _ in range(10):
        stream.feed(b"0123456789")
    assert stream.read() == ("56789", 95)


def test_read_after_a_gap_resumes_at_a_character_boundary() -> None:
    stream, _ = make_stream(max_bytes=4)
    stream.feed("ab€€".encode())  # 61 62 e2 82 ac e2 82 ac: the tail starts with a continuation byte
    assert stream.read() == ("€", 5)  # a, b, and the first euro (e2 82 ac) are gone


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_read_after_a_gap_counts_skipped_continuation_bytes_as_dropped(char: str) -> None:
    encoded = char.encode()
    stream, _ = make_stream(max_bytes=len(encoded) - 1 + 2)
    stream.feed(b"xy" + encoded + b"zw")  # the tail keeps all of the char but its lead byte, then "zw"
    # Lost: "x", "y", the lead byte (overrun) and the continuation bytes (skipped) = 2 + len(encoded).
    assert stream.read() == ("zw", 2 + len(encoded))


@pytest.mark.parametrize(
    ("max_bytes", "first", "second", "expected"),
    [
        (1, b"0\xf0\x90\x80", b"\x80", [("", 4), ("", 1)]),
        (2, b"a\xf0\x9f\x98", b"\x80b", [("", 4), ("b", 1)]),
    ],
)
def test_read_after_a_gap_inside_a_character_keeps_skipping_its_continuation_bytes(
    max_bytes: int, first: bytes, second: bytes, expected: list[tuple[str, int]]
) -> None:
    stream, _ = make_stream(max_bytes=max_bytes)
    stream.feed(first)
    got = [stream.read()]
    stream.feed(second)
    stream.close()
    got.append(stream.read())
    assert got == expected
    delivered = sum(len(text.encode()) for text, _ in got)
    assert delivered + sum(dropped for _, dropped in got) == len(first + second)


def test_read_after_a_gap_counts_bytes_the_decoder_held_back_as_dropped() -> None:
    stream, _ = make_stream(max_bytes=4)
    stream.feed(b"\xe2")
    assert stream.read() == ("", 0)  # the lead byte waits for the rest of its character
    stream.feed(b"\x82\xacabcdef")  # ... which leaves memory before the next read
    assert stream.read() == ("cdef", 5)  # e2 82 ac a b
    stream.close()
    assert stream.read() == ("", 0)


def test_read_never_splits_a_multibyte_character_across_two_reads() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"\xe2")
    assert stream.read() == ("", 0)
    stream.feed(b"\x82\xac")
    assert stream.read() == ("€", 0)


def test_read_assembles_a_four_byte_character_fed_byte_by_byte() -> None:
    stream, _ = make_stream(max_bytes=100)
    encoded = "a😀b".encode()
    texts = []
    for byte in encoded:
        stream.feed(bytes([byte]))
        texts.append(stream.read())
    assert texts == [("a", 0), ("", 0), ("", 0), ("", 0), ("😀", 0), ("b", 0)]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"a\xffb", "a\ufffdb"),
        (b"\xc3\x28", "\ufffd("),
        (b"\x80abc", "\ufffdabc"),
        (b"\xed\xa0\x80", "\ufffd\ufffd\ufffd"),  # an encoded surrogate is invalid UTF-8
        (b"\xf0\x9f\x98", None),  # incomplete at the end: held back while the stream is open
    ],
)
def test_read_replaces_invalid_bytes(data: bytes, expected: str | None) -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(data)
    text, dropped = stream.read()
    assert dropped == 0
    assert text == (expected if expected is not None else "")
    assert stream.collected().text == data.decode("utf-8", "replace")


def test_close_flushes_a_dangling_partial_character_once() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"x\xe2\x82")
    assert stream.read() == ("x", 0)
    stream.close()
    assert stream.read() == ("\ufffd", 0)
    assert stream.read() == ("", 0)
    assert stream.read() == ("", 0)


def test_close_flushes_a_dangling_partial_character_never_read_before() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"ok\xf0\x9f")
    stream.close()
    assert stream.read() == ("ok\ufffd", 0)
    assert stream.read() == ("", 0)


def test_read_after_close_delivers_the_rest_once() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"abc")
    stream.close()
    assert stream.read() == ("abc", 0)
    assert stream.read() == ("", 0)


# -- collected --------------------------------------------------------------------------------------


def test_collected_skips_leading_continuation_bytes_when_truncated() -> None:
    stream, _ = make_stream(max_bytes=4)
    stream.feed("a€bc".encode())  # 61 e2 82 ac 62 63: the tail is 82 ac 62 63
    collected = stream.collected()
    assert collected.text == "bc"
    assert collected.truncated is True
    assert collected.total_bytes == 6


def test_collected_keeps_a_tail_that_starts_on_a_boundary() -> None:
    stream, _ = make_stream(max_bytes=4)
    stream.feed("ab€".encode() + b"x")  # tail e2 82 ac 78
    assert stream.collected().text == "€x"


def test_collected_does_not_skip_leading_continuation_bytes_when_not_truncated() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"\x82\xacabc")
    assert stream.collected().text == "\ufffd\ufffdabc"


def test_collected_replaces_a_trailing_partial_character() -> None:
    stream, _ = make_stream(max_bytes=100)
    stream.feed(b"ab\xe2\x82")
    stream.close()
    assert stream.collected().text == "ab\ufffd"


def test_collected_reports_spill_path_and_total() -> None:
    stream, factory = make_stream(max_bytes=3)
    stream.feed(b"hello")
    stream.close()
    collected = stream.collected()
    assert collected.text == "llo"
    assert collected.truncated is True
    assert collected.spill_path == factory.only.path
    assert collected.total_bytes == 5


# -- merge_streams ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdout", "stderr", "merged"),
    [
        ("out\n", "err\n", "out\n[stderr]\nerr\n"),
        ("out", "err", "out\n[stderr]\nerr"),
        ("", "err\n", "[stderr]\nerr\n"),
        ("", "err", "[stderr]\nerr"),
        ("out", "", "out"),
        ("out\n", "", "out\n"),
        ("", "", ""),
        ("a\n\n", "b", "a\n\n[stderr]\nb"),
        ("out\r", "err", "out\r\n[stderr]\nerr"),
        ("\n", "\n", "\n[stderr]\n\n"),
    ],
)
def test_merge_streams_follows_the_contract_format(stdout: str, stderr: str, merged: str) -> None:
    assert merge_streams(stdout, stderr) == merged


# -- properties ---------------------------------------------------------------------------------------

SEGMENTS = st.one_of(
    st.binary(max_size=8),
    st.text(max_size=8).map(lambda text: text.encode("utf-8")),
    st.sampled_from(["€", "é", "😀", "中文"]).map(lambda text: text.encode("utf-8")),
)
PAYLOADS = st.lists(SEGMENTS, max_size=30).map(b"".join)
UTF8_PAYLOADS = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from("€é😀中")), max_size=120
).map(lambda text: text.encode("utf-8"))


def draw_chunks(data: st.DataObject, payload: bytes) -> list[bytes]:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(payload)), max_size=20), label="cuts")))
    bounds = [0, *cuts, len(payload)]
    return [payload[start:end] for start, end in itertools.pairwise(bounds)]


def feed_and_read(
    stream: OutputStream, chunks: list[bytes], data: st.DataObject
) -> tuple[list[str], list[int]]:
    """Feed each chunk (as a view of a reused buffer); read at random points, and once after close."""
    reads = data.draw(st.lists(st.booleans(), min_size=len(chunks), max_size=len(chunks)), label="reads")
    texts: list[str] = []
    dropped: list[int] = []
    for chunk, read_now in zip(chunks, reads, strict=True):
        buffer = bytearray(chunk)
        stream.feed(memoryview(buffer))
        buffer[:] = b"\x00" * len(buffer)
        if read_now:
            text, lost = stream.read()
            texts.append(text)
            dropped.append(lost)
    stream.close()
    text, lost = stream.read()
    texts.append(text)
    dropped.append(lost)
    assert stream.read() == ("", 0)
    return texts, dropped


@settings(deadline=None, max_examples=300)
@given(payload=PAYLOADS, data=st.data())
def test_reads_without_loss_concatenate_to_the_decoded_stream(payload: bytes, data: st.DataObject) -> None:
    stream, factory = make_stream(max_bytes=max(len(payload), 1))
    texts, dropped = feed_and_read(stream, draw_chunks(data, payload), data)
    assert "".join(texts) == payload.decode("utf-8", "replace")
    assert dropped == [0] * len(dropped)
    assert stream.total_bytes == len(payload)
    assert stream.collected().text == payload.decode("utf-8", "replace")
    assert factory.attempts == 0


@settings(deadline=None, max_examples=300)
@given(payload=UTF8_PAYLOADS, max_bytes=st.integers(1, 16), data=st.data())
def test_reads_with_loss_account_for_every_byte_exactly(
    payload: bytes, max_bytes: int, data: st.DataObject
) -> None:
    stream, _ = make_stream(max_bytes=max_bytes)
    texts, dropped = feed_and_read(stream, draw_chunks(data, payload), data)
    whole = payload.decode("utf-8")
    # Valid UTF-8 in: every byte was either delivered as its own character or counted as dropped.
    assert sum(len(text.encode("utf-8")) for text in texts) + sum(dropped) == len(payload)
    assert all(lost >= 0 for lost in dropped)
    for text in texts:
        assert "\ufffd" not in text or "\ufffd" in whole
        assert text in whole
    if len(payload) <= max_bytes:
        assert sum(dropped) == 0


@settings(deadline=None, max_examples=200)
@given(payload=PAYLOADS, max_bytes=st.integers(1, 40), data=st.data())
def test_spill_holds_the_whole_stream_for_any_chunking(
    payload: bytes, max_bytes: int, data: st.DataObject
) -> None:
    stream, factory = make_stream(max_bytes=max_bytes)
    _, dropped = feed_and_read(stream, draw_chunks(data, payload), data)
    assert stream.total_bytes == len(payload)
    if len(payload) > max_bytes:
        assert bytes(factory.only.data) == payload
        assert stream.spill_path == factory.only.path
    else:
        assert factory.attempts == 0
        assert stream.spill_path is None
    assert all(lost >= 0 for lost in dropped)
    assert sum(dropped) <= len(payload)
    assert sum(dropped) == 0 or len(payload) > max_bytes
    collected = stream.collected()
    assert collected.truncated == (len(payload) > max_bytes)
    if not collected.truncated:
        assert collected.text == payload.decode("utf-8", "replace")


class _LaterGoneSpill:
    """A spill whose removal is confirmed only when the test says so (a remote file)."""

    path = "/spill/remote.stdout"
    lost = False
    pending = False

    def __init__(self) -> None:
        self.gone: Callable[[], None] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def close(self) -> None:
        pass

    def delete(self, gone: Callable[[], None]) -> None:
        self.gone = gone


def test_a_lost_spill_holds_its_budget_until_its_removal_is_confirmed() -> None:
    spill = _LaterGoneSpill()
    budget = SpillBudget(1_000)
    stream = OutputStream("stdout", max_bytes=10, max_spill_bytes=50, budget=budget, open_spill=lambda: spill)
    stream.feed(b"x" * 40)
    assert budget.used == 40 and stream.spill_path == spill.path
    stream.feed(b"x" * 20)  # past max_spill_bytes: lost, deleted, not gone yet
    assert stream.spill_path is None and spill.gone is not None
    assert budget.used == 40  # the disk still holds them
    spill.gone()
    assert budget.used == 0
    spill.gone()  # a second confirmation changes nothing
    assert budget.used == 0


def test_prepaid_spills_are_granted_at_once_grow_and_come_back_once_gone() -> None:
    budget = SpillBudget(3 << 20)  # runs out before max_spill_bytes is reached
    spills = [_LaterGoneSpill(), _LaterGoneSpill()]
    out, err = (
        OutputStream(name, max_bytes=1000, max_spill_bytes=3 << 20, budget=budget, open_spill=lambda s=s: s)
        for name, s in zip(("stdout", "stderr"), spills, strict=True)
    )
    grant = prepay_spills([out, err])
    assert grant == 256 << 10 and out.prepaid == err.prepaid == grant and budget.used == 2 * grant
    # Feeding within the grant reserves nothing more; past half of it the grant doubles.
    out.feed(b"x" * (200 << 10))
    assert out.spill_path == spills[0].path and out.prepaid == 2 * grant
    assert budget.used == 3 * grant
    # Past what the budget can still give: the spill is lost; its grant stays until the file is gone.
    for _ in range(40):
        out.feed(b"x" * (100 << 10))
    assert out.spill_path is None and budget.used == 3 << 20 and out.prepaid < (3 << 20) + (64 << 10)
    assert spills[0].gone is not None
    spills[0].gone()
    assert budget.used == err.prepaid == grant
    err.prepaid_gone()  # never a spill: its file removed
    assert budget.used == 0
    # A budget that cannot grant the least refuses, reserving nothing.
    small = SpillBudget(100 << 10)
    lone = OutputStream(
        "stdout", max_bytes=1000, max_spill_bytes=1 << 20, budget=small, open_spill=_LaterGoneSpill
    )
    assert prepay_spills([lone]) == 0 and small.used == 0


# -- the on_output tap (R-output-tap) -------------------------------------------------------------


def test_tap_gets_every_chunk_as_its_own_bytes_beyond_the_tail() -> None:
    got: list[tuple[str, bytes]] = []
    stream = OutputStream(
        "stderr",
        max_bytes=10,
        max_spill_bytes=20,
        budget=SpillBudget(10**12),
        open_spill=SpillFactory(),
        tap=lambda name, data: got.append((name, data)),
    )
    buffer = bytearray(ASCII[:7])
    stream.feed(memoryview(buffer))
    buffer[:] = b"reused!"  # a backend may reuse its read buffer: the tap's chunk must be a copy
    feed_in_chunks(stream, ASCII, 9)
    assert stream.tapped
    assert got[0] == ("stderr", ASCII[:7])
    assert all(type(data) is bytes and name == "stderr" for name, data in got)
    assert b"".join(data for _, data in got) == ASCII[:7] + ASCII
    assert stream.collected().total_bytes == 107


def test_a_tap_that_raises_is_logged_and_dropped_while_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[bytes] = []

    def tap(name: str, data: bytes) -> None:
        calls.append(data)
        raise RuntimeError("caller's bug")

    stream = OutputStream(
        "stdout",
        max_bytes=10,
        max_spill_bytes=100,
        budget=SpillBudget(10**12),
        open_spill=SpillFactory(),
        tap=tap,
    )
    with caplog.at_level(logging.ERROR, logger="dsh_bash"):
        feed_in_chunks(stream, ASCII[:30], 10)
    assert calls == [ASCII[:10]]
    assert not stream.tapped
    assert "on_output tap raised" in caplog.text
    assert stream.collected().total_bytes == 30 and stream.collected().text == ASCII[20:30].decode()


def test_an_untapped_stream_says_so() -> None:
    stream, _ = make_stream(max_bytes=10)
    assert not stream.tapped
