"""Text the command line writes: one-line error messages, and writing whatever a stream can hold."""

from __future__ import annotations

from typing import TextIO

__all__ = ["one_line", "write"]


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (white space folded), or its type's name when it has none."""
    return " ".join(str(exc).split()) or type(exc).__name__


def write(stream: TextIO, text: str) -> None:
    """Write ``text`` exactly; fall back to UTF-8 bytes when the stream's encoding cannot hold it."""
    if not text:
        return
    try:
        stream.write(text)
    except UnicodeEncodeError:
        buffer = getattr(stream, "buffer", None)
        if buffer is None:
            encoding = stream.encoding or "ascii"
            stream.write(text.encode(encoding, "replace").decode(encoding))
        else:
            stream.flush()
            buffer.write(text.encode("utf-8", "surrogateescape"))
            buffer.flush()
