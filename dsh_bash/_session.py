"""Shell sessions: the state one owner's commands carry from one to the next (``R-session``).

The state is held here, in the harness, never where the commands run: a file there would be
writable by every command of that user, so any command could plant state (a function named ``ls``)
in another session. It changes only through the capture of that session's own command, which could
have set the same state by running ``cd`` or ``export`` itself.

Each command still runs as its own ``bash`` under its backend's containment. Its text is wrapped:
a prologue replays the state (directory, exported variables, ``set``/``shopt`` options, functions,
aliases, umask) into the fresh shell, and an ``EXIT`` trap writes the state at the shell's exit to
the capture descriptor :data:`SESSION_FD`, which the backend reads back (the supervisor's capture
stream, or a file of the harness's host). The capture counts only when the shell exited by itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, StrictStr, StringConstraints

from ._bash_words import ascii_quote
from ._env import is_scrubbed

__all__ = [
    "MAX_SESSION_BYTES",
    "SESSION_FD",
    "CaptureError",
    "SessionCapture",
    "SessionState",
    "defined_names",
    "leaves_state_as_is",
    "parse_capture",
    "session_replay",
    "state_after",
    "wrap_in_session",
]

#: The descriptor a session command's bash writes its state to at exit (its ``EXIT`` trap). High
#: enough that scripts rarely touch it (``{var}`` redirections start at 10 and count up; fd 63 is
#: process substitution's); a command that closes or reuses it only loses its own state change.
SESSION_FD = 19

#: The most bytes of one capture the harness keeps; a larger state is refused (the previous one is
#: kept, and the result says why).
MAX_SESSION_BYTES = 256 * 1024

_HEADER = b"\0dsh-session-2\0"
#: The capture's sections and how many NUL-ended fields each has.
_SECTIONS = (("cwd", 1), ("env", 1), ("options", 4), ("umask", 1), ("functions", 1), ("aliases", 1))
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Variables bash sets for itself, or that name the directory (the state's own field). The harness's
#: marker is the caller's to leave out (it scrubs it).
_BASH_OWN = frozenset(
    {
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "SHELLOPTS",
        "BASHOPTS",
        "BASHPID",
        "BASH_VERSINFO",
        "EUID",
        "UID",
        "PPID",
    }
)
#: `set -o` options that would stop the wrapper itself from running the command (or that bash
#: cannot take back): never replayed.
_OPTIONS_NOT_REPLAYED = frozenset({"noexec", "onecmd", "history", "interactive-comments"})
#: `shopt` options bash keeps read-only.
_SHOPT_NOT_REPLAYED = frozenset({"login_shell", "restricted_shell"})
_CAPTURE_ID = re.compile(r"[A-Za-z0-9]*\Z")
_OPTION_NAME = re.compile(r"[a-z][a-z_0-9-]*\Z")
_UMASK = re.compile(r"[0-7]{3,4}\Z")


class SessionState(BaseModel):
    """One session's shell state, as the next command of it gets it replayed.

    ``env`` holds the exported variables the session set or changed (against the environment its
    commands start with), ``unset`` those it removed; ``options`` and ``shopt`` are bash's own
    ``set -o``/``shopt -s`` lines, ``functions`` and ``aliases`` bash's ``declare -f`` and
    ``alias -p`` text. An empty state replays nothing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cwd: StrictStr | None = None
    env: dict[str, str] = {}
    unset: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    shopt: tuple[str, ...] = ()
    umask: Annotated[str, StringConstraints(pattern=r"^[0-7]{3,4}$")] | None = None
    functions: StrictStr = ""
    aliases: StrictStr = ""


class CaptureError(ValueError):
    """A capture that is no session state (cut short, too large, or not bash's own words)."""


class SessionCapture:
    """The bytes one command wrote to its capture descriptor, as its backend reads them back.

    A backend whose commands get :data:`SESSION_FD` from their supervisor feeds the capture stream
    here (``feed``); what is past :data:`MAX_SESSION_BYTES` is counted, not kept. ``file``: the file
    of the harness's host the command's bash opens as that descriptor instead (the executor's
    ``_session_capture_file``), which a sandbox must let it write; None when the backend hands the
    descriptor over."""

    __slots__ = ("_data", "_limit", "file", "id", "overflowed")

    def __init__(
        self, limit: int = MAX_SESSION_BYTES, *, file: str | None = None, capture_id: str = ""
    ) -> None:
        self._data = bytearray()
        self._limit = limit
        self.file = file
        #: What the command's capture starts with (``wrap_in_session``'s ``capture_id``).
        self.id = capture_id
        self.overflowed = False

    def feed(self, data: bytes | memoryview) -> None:
        room = self._limit - len(self._data)
        if len(data) > room:
            self.overflowed = True
            data = data[: max(room, 0)]
        self._data += data

    @property
    def data(self) -> bytes:
        return bytes(self._data)


# -- the wrapper --------------------------------------------------------------------------------------

#: The EXIT trap: every part of the state, each after a NUL-framed name, through builtins only, with
#: its own stderr (a session's `set -x` would trace it) thrown away.
_CAPTURE = (
    '{ builtin printf "\\0dsh-session-2\\0%s\\0cwd\\0" "${_dsh_capture-}"; builtin pwd -P; '
    'builtin printf "\\0env\\0"; builtin export -p; '
    'builtin printf "\\0options\\0%s\\0%s\\0%s\\0%s\\0umask\\0" '
    '"$SHELLOPTS" "$BASHOPTS" "${_dsh_fresh_so-}" "${_dsh_fresh_bo-}"; builtin umask; '
    'builtin printf "\\0functions\\0"; builtin declare -f; '
    'builtin printf "\\0aliases\\0"; builtin alias -p; '
    'builtin printf "\\0end\\0"; } >&' + str(SESSION_FD) + " 2>/dev/null"
)
#: The options a fresh shell starts with, kept before the prologue changes any: the capture says
#: which options differ from them (two variables read, where `set +o` and `shopt -p` would print
#: some eighty lines that the next prologue would replay one by one).
_FRESH = "_dsh_fresh_so=$SHELLOPTS _dsh_fresh_bo=$BASHOPTS _dsh_capture="

_TRAP = f"builtin trap {ascii_quote(_CAPTURE)} EXIT"


def _grouped(on: str, off: str, lines: tuple[str, ...]) -> str:
    """``shopt -s``/``-u`` lines as (at most) two builtins."""
    names: dict[bool, list[str]] = {True: [], False: []}
    for line in lines:
        words = line.split()
        names[words[1] == "-s"].append(words[2])
    parts = [
        f"builtin {verb} {' '.join(names[flag])}" for verb, flag in ((on, True), (off, False)) if names[flag]
    ]
    return "{ " + "; ".join(parts) + "; } 2>/dev/null"


def _set_options(lines: tuple[str, ...]) -> str:
    """``set -o``/``set +o`` lines as one ``set`` builtin."""
    flags = " ".join(f"{line.split()[1]} {line.split()[2]}" for line in lines)
    return "{ builtin set " + flags + "; } 2>/dev/null"


def session_replay(
    state: SessionState, *, explicit_env: Iterable[str] = (), explicit_cwd: bool = False
) -> str:
    """The lines that replay ``state`` into a fresh bash (empty for an empty state), for
    :func:`wrap_in_session`. ``explicit_env``: names the request set itself (they win over the
    session's values). ``explicit_cwd``: the request named a directory (the session's is not
    entered). Depends on nothing else: an executor keeps it while its session's state stands."""
    lines: list[str] = []
    if state.cwd is not None and not explicit_cwd:
        where = ascii_quote(state.cwd)
        lines.append(
            f"builtin cd -- {where} 2>/dev/null || builtin printf "
            f"'dsh-bash: the session directory %s is gone; running in %s\\n' {where} \"$PWD\" >&2"
        )
    skip = set(explicit_env)
    exports = [f"{name}={ascii_quote(value)}" for name, value in state.env.items() if name not in skip]
    if exports:
        lines.append("builtin export " + " ".join(exports))
    unsets = [name for name in state.unset if name not in skip]
    if unsets:
        lines.append("builtin unset -v " + " ".join(unsets))
    if state.umask is not None:
        lines.append(f"builtin umask {state.umask}")
    if state.shopt:
        # Before the functions: a body that uses extglob patterns parses only with extglob on. One
        # builtin per direction, not one per option: bash pays for every command it parses.
        lines.append(_grouped("shopt -s", "shopt -u", state.shopt))
    if state.aliases:
        lines.append("builtin shopt -s expand_aliases")
        lines.append(state.aliases.rstrip("\n"))
    if state.functions:
        lines.append(state.functions.rstrip("\n"))
    if state.options:
        # Last: errexit, nounset or xtrace of the session apply to the command, not to this prologue.
        lines.append(_set_options(state.options))
    return "".join(line + "\n" for line in lines)


def wrap_in_session(
    command: str,
    replay: str,
    *,
    capture: bool = True,
    capture_id: str = "",
    capture_file: str | None,
) -> str:
    """``command`` as a session's command: the trap that captures the state at exit, the
    ``replay`` of the state (:func:`session_replay`), then the command's own text, unchanged, from a
    line of its own.

    ``capture_file``: a path the command's bash opens as :data:`SESSION_FD` first (a backend whose
    commands run on the harness's host); None when the backend hands the command that descriptor.
    ``capture``: False for a background task, which starts from the state and changes nothing.
    ``capture_id``: written first in the capture (``[A-Za-z0-9]``), so that a capture file used
    again for the next command is never read as that command's when it did not get so far."""
    head = ""
    if capture:
        if not _CAPTURE_ID.match(capture_id):
            raise ValueError(f"a capture id is letters and digits, not {capture_id!r}")
        if capture_file is not None:
            # A plain exec: a redirection of `builtin exec` lasts only while that builtin runs. Opened
            # for reading and writing, not truncated: a file used again is overwritten in place (what
            # an earlier command left past this capture's end is never read, and the id tells an old
            # capture from this one), which on ext4 saves a truncate and a block allocation a command.
            head = f"exec {SESSION_FD}<>{ascii_quote(capture_file)}\n"
        head += f"{_FRESH}{capture_id}\n{_TRAP}\n"
    return head + replay + command


# -- commands that cannot change the state ------------------------------------------------------------

#: Builtins that change nothing a session keeps (directory, exported variables, options, functions,
#: aliases, umask). Not ``printf`` or ``read`` (``-v``/a name may set an exported variable), not
#: ``command`` or ``builtin`` (either runs ``cd``).
_STATELESS_BUILTINS = frozenset({"true", "false", ":", "echo", "pwd", "test", "type", "kill", "exit"})
#: bash 5.2's builtins (``compgen -b``) and reserved words (``compgen -k``): a command named by one
#: of them, but the stateless ones, may change the state (``tests/test_session.py`` holds this list
#: to the bash the tests run with).
SHELL_WORDS = frozenset(
    (  # noqa: SIM905 - as `compgen` prints them
        ". : [ alias bg bind break builtin caller cd command compgen complete compopt continue declare "
        "dirs disown echo enable eval exec exit export false fc fg getopts hash help history jobs kill "
        "let local logout mapfile popd printf pushd pwd read readarray readonly return set shift shopt "
        "source suspend test times trap true type typeset ulimit umask unalias unset wait "
        "if then else elif fi case esac for select while until do done in function time { } ! [[ ]] coproc"
    ).split()
)
#: One simple command of plain words: no quoting, expansion, redirection, assignment before the
#: name, list or pipeline, comment or second line (globs only after the name).
_PLAIN_COMMAND = re.compile(r"[ \t]*([A-Za-z0-9_./:@%+,-]+)(?:[ \t]+[A-Za-z0-9_./:@%+,=*?-]+)*[ \t]*\n?\Z")
_FUNCTION_NAME = re.compile(r"^(?:function )?(\S+) \(\) $", re.MULTILINE)
_ALIAS_NAME = re.compile(r"^alias (?:-- )?([^=\s]+)=", re.MULTILINE)


def defined_names(state: SessionState) -> frozenset[str]:
    """The names of the functions and aliases ``state`` defines (a command of such a name runs the
    session's own code, which may change anything)."""
    return frozenset(_FUNCTION_NAME.findall(state.functions)) | frozenset(_ALIAS_NAME.findall(state.aliases))


def leaves_state_as_is(command: str, defined: frozenset[str]) -> bool:
    """Whether ``command`` cannot change a session's state, whatever it does: one simple command of
    plain words that runs a program, or a builtin that changes nothing a session keeps, and is no
    function or alias of the session (``defined``). Such a command needs no capture: the state it
    started from is the state it leaves. Conservative: False says only that it might change it."""
    plain = _PLAIN_COMMAND.match(command)
    if plain is None:
        return False
    name = plain.group(1)
    if name in defined:
        return False
    return name not in SHELL_WORDS or name in _STATELESS_BUILTINS


# -- reading a capture back ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Captured:
    cwd: str | None
    env: dict[str, str]
    options: tuple[str, ...]
    shopt: tuple[str, ...]
    umask: str | None
    functions: str
    aliases: str


def parse_capture(data: bytes, capture_id: str = "") -> _Captured:
    """The state a session command's trap wrote; :class:`CaptureError` when ``data`` is none.

    The last capture in ``data`` with ``capture_id`` counts (anything the command itself wrote to
    the descriptor before is ignored); it must run to its end marker."""
    header = _HEADER + capture_id.encode() + b"\0"
    start = data.rfind(header)
    if start < 0:
        raise CaptureError(
            "no state came back (the command replaced the EXIT trap, exec'd another program, "
            f"or closed fd {SESSION_FD})"
        )
    parts = data[start + len(header) :].split(b"\0")
    sections: dict[str, list[bytes]] = {}
    at = 0
    for name, count in _SECTIONS:
        if at + count >= len(parts) or parts[at] != name.encode():
            raise CaptureError(f"the state that came back is cut short or garbled (at {name!r})")
        sections[name] = parts[at + 1 : at + 1 + count]
        at += 1 + count
    if at >= len(parts) or parts[at] != b"end":
        raise CaptureError("the state that came back is cut short")
    text = {
        name: [field.decode("utf-8", "surrogateescape") for field in fields]
        for name, fields in sections.items()
    }
    now_set, now_shopt, fresh_set, fresh_shopt = text["options"]
    umask = text["umask"][0].strip()
    return _Captured(
        cwd=text["cwd"][0].rstrip("\n") or None,
        env=parse_exports(sections["env"][0]),
        options=_changed_options(now_set, fresh_set, "set -o", "set +o", _OPTIONS_NOT_REPLAYED),
        shopt=_changed_options(now_shopt, fresh_shopt, "shopt -s", "shopt -u", _SHOPT_NOT_REPLAYED),
        umask=umask if _UMASK.match(umask) else None,
        functions=text["functions"][0],
        aliases=text["aliases"][0],
    )


def _changed_options(now: str, fresh: str, on: str, off: str, never: frozenset[str]) -> tuple[str, ...]:
    """The lines that turn a fresh shell's options (``fresh``, as ``$SHELLOPTS`` or ``$BASHOPTS``
    list them) into ``now``'s."""
    enabled = {name for name in now.split(":") if _OPTION_NAME.match(name) and name not in never}
    default = {name for name in fresh.split(":") if _OPTION_NAME.match(name) and name not in never}
    return tuple(
        [f"{on} {name}" for name in sorted(enabled - default)]
        + [f"{off} {name}" for name in sorted(default - enabled)]
    )


def state_after(
    captured: _Captured,
    started_with: Mapping[str, str],
    *,
    previous: SessionState,
    explicit: Iterable[str],
    scrub: Iterable[str],
    allow: Iterable[str],
) -> SessionState:
    """The session's state once a command that started with the environment ``started_with`` (as
    its backend launched it, before the prologue) exited with ``captured``: the exported variables
    as changes against that environment, without the names the env policy scrubs, bash's own and
    the harness's marker. A name the request set (``explicit``) held for that command alone: the
    session keeps its own value of it (``previous``) unless the command changed it itself."""
    scrub, allow = tuple(scrub), tuple(allow)

    def kept(name: str) -> bool:
        return bool(_NAME.match(name)) and name not in _BASH_OWN and not is_scrubbed(name, scrub, allow)

    # The cheap test first: most names are unchanged, and the policy's globs are regular expressions.
    env = {
        name: value for name, value in captured.env.items() if started_with.get(name) != value and kept(name)
    }
    unset = [name for name in started_with if name not in captured.env and kept(name)]
    for name in explicit:
        if name in env or name in unset or not kept(name):
            continue
        if name in previous.env:
            env[name] = previous.env[name]
        elif name in previous.unset:
            unset.append(name)
    return SessionState(
        cwd=captured.cwd,
        env=env,
        unset=tuple(unset),
        options=captured.options,
        shopt=captured.shopt,
        umask=captured.umask,
        functions=captured.functions,
        aliases=captured.aliases,
    )


# -- `export -p`, as every bash since 4 prints it -----------------------------------------------------

_ESCAPES = {
    ord("a"): 7,
    ord("b"): 8,
    ord("e"): 27,
    ord("E"): 27,
    ord("f"): 12,
    ord("n"): 10,
    ord("r"): 13,
    ord("t"): 9,
    ord("v"): 11,
    ord("\\"): 92,
    ord("'"): 39,
    ord('"'): 34,
    ord("?"): 63,
}
_OCTAL = b"01234567"
_HEX = b"0123456789abcdefABCDEF"


def parse_exports(data: bytes) -> dict[str, str]:
    """``export -p``'s output as names and values: ``declare -x NAME="VALUE"`` (bash's double
    quotes: ``\\`` before ``"``, ``\\``, ``$`` and a backquote), ``declare -x NAME=$'VALUE'`` (ANSI-C,
    bash 5.2 for values with control bytes), ``declare -x NAME`` (exported, no value: left out), and
    ``export NAME=...`` in POSIX mode. Values are bytes as bash holds them, surrogate-escaped."""
    out: dict[str, str] = {}
    at, end = 0, len(data)
    while at < end:
        if data.startswith(b"declare -", at):
            space = data.find(b" ", at + 9)
            if space < 0:
                raise CaptureError("export -p: a line cut short")
            at = space + 1
        elif data.startswith(b"export ", at):
            at += 7
        else:
            raise CaptureError("export -p: a line that is no declaration")
        name_end = at
        while name_end < end and data[name_end] not in b"=\n":
            name_end += 1
        name = data[at:name_end].decode("ascii", "replace")
        at = name_end
        if at >= end or data[at] == 0x0A:
            at += 1
            continue  # exported without a value
        at += 1  # '='
        value, at = _quoted(data, at)
        if at < end and data[at] != 0x0A:
            raise CaptureError(f"export -p: junk after the value of {name}")
        at += 1
        out[name] = value.decode("utf-8", "surrogateescape")
    return out


def _quoted(data: bytes, at: int) -> tuple[bytes, int]:
    if data.startswith(b'"', at):
        return _double_quoted(data, at + 1)
    if data.startswith(b"$'", at):
        return _ansi_c(data, at + 2)
    raise CaptureError("export -p: a value that is not quoted")


def _double_quoted(data: bytes, at: int) -> tuple[bytes, int]:
    value = bytearray()
    while True:
        quote = data.find(b'"', at)
        if quote < 0:
            raise CaptureError("export -p: a double-quoted value runs to the end")
        backslash = data.find(b"\\", at, quote)
        if backslash < 0:  # the usual case: no escape before the closing quote
            value += data[at:quote]
            return bytes(value), quote + 1
        value += data[at:backslash]
        if backslash + 1 < len(data) and data[backslash + 1] in b'"\\$`':
            value.append(data[backslash + 1])
        else:
            value += data[backslash : backslash + 2]
        at = backslash + 2


def _ansi_c(data: bytes, at: int) -> tuple[bytes, int]:
    value = bytearray()
    n = len(data)
    while at < n:
        byte = data[at]
        if byte == 0x27:  # '
            return bytes(value), at + 1
        if byte != 0x5C or at + 1 >= n:
            value.append(byte)
            at += 1
            continue
        kind = data[at + 1]
        at += 2
        if kind in _ESCAPES:
            value.append(_ESCAPES[kind])
        elif kind in _OCTAL:
            digits = bytes([kind])
            while len(digits) < 3 and at < n and data[at] in _OCTAL:
                digits += data[at : at + 1]
                at += 1
            value.append(int(digits, 8) & 0xFF)
        elif kind in b"xuU":
            most = {ord("x"): 2, ord("u"): 4, ord("U"): 8}[kind]
            digits = b""
            while len(digits) < most and at < n and data[at] in _HEX:
                digits += data[at : at + 1]
                at += 1
            if not digits:
                value += b"\\" + bytes([kind])
            elif kind == ord("x"):
                value.append(int(digits, 16))
            else:
                value += chr(int(digits, 16)).encode("utf-8", "surrogatepass")
        elif kind == ord("c") and at < n:
            value.append(data[at] & 0x1F)
            at += 1
        else:
            value += b"\\" + bytes([kind])
    raise CaptureError("export -p: an ANSI-C quoted value runs to the end")
