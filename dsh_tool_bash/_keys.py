"""The escape notation of ``bash_input``: what the model writes, decoded to the bytes a task reads.

The input is literal text (sent as UTF-8) except for these escapes:

- ``\\n`` LF, ``\\r`` CR, ``\\t`` tab, ``\\\\`` a backslash, ``\\e`` ESC, ``\\xHH`` the byte ``HH`` (two hex
  digits, any byte value: the notation the tools' output uses for control characters);
- ``\\^X``, a control key in caret notation: ``\\^C`` (Ctrl-C, 0x03), ``\\^D`` (0x04), ``\\^@`` (NUL),
  ``\\^[`` (ESC), ``\\^\\``, ``\\^]``, ``\\^^``, ``\\^_`` and ``\\^?`` (DEL); letters in either case;
- ``\\<name>``, a named key: ``up``, ``down``, ``right``, ``left`` (the ANSI cursor keys, ``ESC [ A``..``D``),
  ``enter`` (CR), ``tab``, ``backspace`` (DEL, 0x7f, what the key sends), ``esc``; names in either case.

Any other backslash sequence, or one cut short, is refused with :class:`KeyNotationError`, which names it
and its position: a model that meant a literal backslash learns to write ``\\\\`` instead of having its
input guessed.
"""

from __future__ import annotations

__all__ = ["NAMED_KEYS", "KeyNotationError", "decode_keys"]

_SIMPLE: dict[str, bytes] = {"n": b"\n", "r": b"\r", "t": b"\t", "\\": b"\\", "e": b"\x1b"}

#: The named keys of ``\<name>`` and the bytes each sends.
NAMED_KEYS: dict[str, bytes] = {
    "up": b"\x1b[A",
    "down": b"\x1b[B",
    "right": b"\x1b[C",
    "left": b"\x1b[D",
    "enter": b"\r",
    "tab": b"\t",
    "backspace": b"\x7f",
    "esc": b"\x1b",
}

_CARET = "@[\\]^_?"
_HEX = frozenset("0123456789abcdefABCDEF")
#: Longest name looked for before ``>``: a stray ``\<`` is reported without quoting the rest of the input.
_LONGEST_NAME = max(map(len, NAMED_KEYS))


class KeyNotationError(ValueError):
    """An escape of the input notation that is unknown or cut short; ``position`` is its index."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


def _refuse(kind: str, escape: str, position: int, hint: str) -> KeyNotationError:
    return KeyNotationError(f'{kind} escape "{escape}" at position {position} ({hint})', position)


def _literal(text: str, start: int) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        position = start + exc.start
        raise KeyNotationError(
            f"character U+{ord(text[exc.start]):04X} at position {position} has no UTF-8 form "
            "(a lone surrogate); send a byte as \\xHH",
            position,
        ) from None


def decode_keys(text: str) -> bytes:
    """The bytes ``text`` stands for in the notation above; :class:`KeyNotationError` for a bad escape.

    Positions count characters of ``text`` from 0.
    """
    out = bytearray()
    start = 0  # where the literal text not yet copied begins
    index = text.find("\\")
    while index != -1:
        out += _literal(text[start:index], start)
        kind = text[index + 1 : index + 2]
        if kind in _SIMPLE:
            out += _SIMPLE[kind]
            end = index + 2
        elif kind == "x":
            digits = text[index + 2 : index + 4]
            if len(digits) < 2 or not set(digits) <= _HEX:
                raise _refuse("incomplete", text[index : index + 4], index, "\\x takes two hex digits")
            out.append(int(digits, 16))
            end = index + 4
        elif kind == "^":
            key = text[index + 2 : index + 3]
            if key.isascii() and key.isalpha():
                out.append(ord(key.upper()) ^ 0x40)
            elif key and key in _CARET:
                out.append(ord(key) ^ 0x40)
            else:
                raise _refuse(
                    "unknown" if key else "incomplete",
                    text[index : index + 3],
                    index,
                    "a control key is \\^ and a letter, or one of @[\\]^_?",
                )
            end = index + 3
        elif kind == "<":
            close = text.find(">", index + 2, index + 3 + _LONGEST_NAME)
            name = text[index + 2 : close].lower() if close != -1 else ""
            if name not in NAMED_KEYS:
                escape = text[index : close + 1] if close != -1 else text[index : index + 2]
                raise _refuse(
                    "unknown" if close != -1 else "incomplete",
                    escape,
                    index,
                    "named keys: " + ", ".join(f"\\<{key}>" for key in NAMED_KEYS),
                )
            out += NAMED_KEYS[name]
            end = close + 1
        else:
            raise _refuse(
                "unknown" if kind else "incomplete",
                text[index : index + 2],
                index,
                "write \\\\ for a backslash",
            )
        start = end
        index = text.find("\\", start)
    out += _literal(text[start:], start)
    return bytes(out)
