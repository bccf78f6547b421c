"""Bash words built from arbitrary text: what goes into a script the harness writes for bash."""

from __future__ import annotations

__all__ = ["ascii_quote"]

_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./=:,+@%-")


def ascii_quote(arg: str) -> str:
    """``arg`` as one bash word in ASCII: plain, or ANSI-C quoted with every other byte escaped.

    Bytes a string carries as surrogates (``surrogateescape``) come back as those bytes, so a value
    read from a non-UTF-8 environment survives the round trip; the result never holds a newline, a
    quote or a byte that a locale could read otherwise."""
    data = arg.encode("utf-8", "surrogateescape")
    if data and all(byte in _PLAIN for byte in data):
        return arg
    return "$'" + "".join(chr(b) if b in _PLAIN or b == 0x20 else f"\\x{b:02x}" for b in data) + "'"
