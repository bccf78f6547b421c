"""The in-band exit trailer filter shared by remote backends."""

from __future__ import annotations

import pytest

from dsh_bash.remote._bash_protocol import (
    EXIT_PREFIX,
    ExitTrailerFilter,
)

NONCE = "0123456789abcdef"


def _trailer(status: int, nonce: str = NONCE) -> bytes:
    return EXIT_PREFIX + nonce.encode() + b":" + b"%03d" % status + b"\0"


def _run(chunks: list[bytes]) -> tuple[bytes, int | None]:
    out = bytearray()
    filt = ExitTrailerFilter(NONCE, out.extend)
    for chunk in chunks:
        filt.feed(chunk)
    filt.flush()
    return bytes(out), filt.exit_code


@pytest.mark.parametrize("split", range(len(_trailer(0)) + 11))
def test_a_trailer_split_anywhere_is_found_and_removed(split: int) -> None:
    stream = b"before\n" + _trailer(143) + b"after"
    stream_at = 3 + split
    assert _run([stream[:stream_at], stream[stream_at:]]) == (b"before\nafter", 143)


def test_byte_by_byte() -> None:
    stream = b"x\0y" + _trailer(7) + b"\0z"
    assert _run([bytes([b]) for b in stream]) == (b"x\0y\0z", 7)


def test_a_trailer_with_another_nonce_is_output() -> None:
    forged = _trailer(0, nonce="f" * 16)
    assert _run([b"a", forged, b"b"]) == (b"a" + forged + b"b", None)


def test_nul_bytes_that_only_look_like_a_start_are_released_at_the_end() -> None:
    assert _run([b"data\0", b"\0dsh"]) == (b"data\0\0dsh", None)


def test_output_after_the_trailer_passes_straight_through() -> None:
    out, code = _run([_trailer(0), b"late", b"\0dsh-bash-exit:"])
    assert (out, code) == (b"late\0dsh-bash-exit:", 0)


@pytest.mark.parametrize("split", range(0, 140, 3))
def test_a_trailer_inside_nul_bytes_split_anywhere(split: int) -> None:
    """/dev/zero-like output: every byte is a NUL, as is the trailer's first."""
    stream = b"\0" * 100 + _trailer(3) + b"\0" * 5
    assert _run([stream[:split], stream[split:]]) == (b"\0" * 105, 3)


NEAR_MISSES = [b"d\0x", b"\0d", b"\0dsh-bash-exit:", b"\0dsh-bash-exit:" + NONCE.encode()]


@pytest.mark.parametrize("filler", NEAR_MISSES)
def test_a_trailer_after_many_false_starts_is_found(filler: bytes) -> None:
    """Near misses of the prefix (more than the filter checks one by one) neither hide nor fake it."""
    before = filler * 50
    assert _run([before + _trailer(42) + b"tail"]) == (before + b"tail", 42)
    assert _run([before, _trailer(42)[:9], _trailer(42)[9:]]) == (before, 42)


def test_output_ending_in_a_partial_prefix_is_output_at_flush() -> None:
    partial = b"\0\0" + _trailer(0)[:10]
    assert _run([b"abc", partial]) == (b"abc" + partial, None)
