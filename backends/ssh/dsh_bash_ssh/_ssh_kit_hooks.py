"""The SSH backend's conformance-kit hooks (see :class:`dsh_bash.backend.ConformanceHooks`).

Each call logs in over a connection of its own (opened and closed within the call, on an event
loop of its own: the hooks are synchronous) with the executor's configuration.

Processes are found by a scan of ``/proc`` on the SSH host (pids as the commands see them there),
the marker fed on stdin so the scan never shows it on a command line.

The ambient environment of the SSH backend's commands is the login's: what sshd sets, then what
the login shell's startup files export (learned when an executor connects). The one place a user
can put arbitrary values (newlines included) there is the login shell's rc file; for bash under
sshd that is ``~/.bashrc``, which Debian's default returns from early when not interactive. So a
planting block writes a managed block, delimited by :data:`BEGIN` and :data:`END`, at the top of
the remote user's ``~/.bashrc``; leaving the block puts back whatever block was there before it
(none, or an enclosing one). A fresh login is checked to see the planted values, else planting
fails with the reason (a login shell that is not bash, a home that is not writable).
``~/.ssh/environment`` is no alternative: sshd reads it only with ``PermitUserEnvironment`` (off
by default) and it cannot hold a newline.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import FIND_PROCESSES, parse_pids, run_in_fresh_loop

from ._connection import ChannelPool, ScriptResult
from ._ssh_config import SshConfig

__all__ = [
    "BEGIN",
    "END",
    "find_open_leftovers",
    "find_remote_processes",
    "kit_notes",
    "plant_in_bashrc",
    "with_block",
]

BEGIN = "# >>> dsh-bash conformance kit: planted ambient variables (removed when its check ends) >>>\n"
END = "# <<< dsh-bash conformance kit <<<\n"
_BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Variables the backend never takes from the login (its scripts' own shell sets them).
_NOT_SEEN = frozenset({"_", "BASH_ENV", "ENV"})

# $1: "read" (prints "1" and the file, or "0" when there is none), "write" (the file becomes stdin)
# or "remove". The rc file is the one in the home directory of the passwd entry: $HOME may be planted.
_RC_FILE = r"""
home=$(getent passwd "$(id -u)" 2>/dev/null | cut -d: -f6)
[ -n "$home" ] || home=$(pwd -P)
rc=$home/.bashrc
case $1 in
  read) if [ -e "$rc" ]; then printf 1; cat -- "$rc"; else printf 0; fi ;;
  write) cat > "$rc" ;;
  remove) rm -f -- "$rc" ;;
  *) exit 2 ;;
esac
"""

_DUMP_ENV = r"""for v in $(compgen -e); do printf '%s=%s\0' "$v" "${!v}"; done"""


async def _run(config: SshConfig, script: str, *args: str, stdin: bytes | None = None) -> ScriptResult:
    pool = ChannelPool(config)
    try:
        return await pool.run_script(script, *args, stdin=stdin)
    finally:
        await pool.aclose()


def _script(config: SshConfig, script: str, *args: str, stdin: bytes | None = None, what: str) -> bytes:
    code, out, err = run_in_fresh_loop(partial(_run, config, script, *args, stdin=stdin))
    if code != 0:
        detail = err.decode("utf-8", "replace").strip()
        raise BashInfrastructureError(
            f"{what} on {config.username}@{config.host}:{config.port} failed (exit {code}): "
            f"{detail or 'no error output'}"
        )
    return out


def find_remote_processes(config: SshConfig, marker: str) -> list[int]:
    """Pids (on the SSH host) of live processes whose command line contains ``marker``."""
    if "\n" in marker or not marker:
        raise ValueError("a marker is one non-empty line")
    out = _script(config, FIND_PROCESSES, stdin=marker.encode() + b"\n", what="scanning /proc")
    return parse_pids(out)


def find_open_leftovers(config: SshConfig, connected: bool, spill_dir: str) -> list[str]:
    """What a failed open left: its connection (``connected``: still open), and the spill directory
    ``spill_dir`` on the SSH host if the setup made one and it still exists (looked for over a
    connection of its own, with ``config``: a configuration that logs in)."""
    left = ["its SSH connection is still open"] if connected else []
    if spill_dir.startswith("/"):
        out = _script(
            config, 'if test -e "$1"; then echo yes; fi', spill_dir, what="looking for the spill directory"
        )
        if out.strip() == b"yes":
            left.append(f"the spill directory {spill_dir} on {config.host}")
    return left


def _block(variables: Mapping[str, str]) -> str:
    for name in variables:
        if not _NAME.fullmatch(name):
            raise ValueError(f"cannot plant {name!r}: not a variable name")
    return BEGIN + "".join(f"export {name}={shlex.quote(value)}\n" for name, value in variables.items()) + END


def with_block(text: str, block: str | None) -> str:
    """``text`` without its managed block, with ``block`` (if any) at the top instead."""
    rest = _BLOCK.sub("", text)
    return (block or "") + rest


def _read_rc(config: SshConfig) -> str | None:
    out = _script(config, _RC_FILE, "read", what="reading ~/.bashrc")
    return out[1:].decode("utf-8", "surrogateescape") if out[:1] == b"1" else None


def _write_rc(config: SshConfig, text: str | None) -> None:
    if text is None:
        _script(config, _RC_FILE, "remove", what="removing ~/.bashrc")
    else:
        _script(
            config, _RC_FILE, "write", stdin=text.encode("utf-8", "surrogateescape"), what="writing ~/.bashrc"
        )


def _login_env(config: SshConfig) -> dict[str, str]:
    out = _script(config, _DUMP_ENV, what="reading the login's environment")
    env: dict[str, str] = {}
    for entry in out.split(b"\0"):
        name, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if sep:
            env[name] = value
    return env


@contextlib.contextmanager
def plant_in_bashrc(config: SshConfig, variables: Mapping[str, str]) -> Iterator[Mapping[str, Any]]:
    """Export ``variables`` from a managed block at the top of the remote user's ``~/.bashrc``."""
    before = _read_rc(config)
    previous = _BLOCK.search(before or "")
    _write_rc(config, with_block(before or "", _block(variables)))
    try:
        seen = _login_env(config)
        missing = sorted(
            name for name, value in variables.items() if name not in _NOT_SEEN and seen.get(name) != value
        )
        if missing:
            raise BashInfrastructureError(
                f"planted {', '.join(missing)} in ~/.bashrc of {config.username}@{config.host}, but a fresh "
                "login does not see them (is the login shell bash, and does it read ~/.bashrc under sshd?)"
            )
        yield {}
    finally:
        now = _read_rc(config) or ""
        restored = with_block(now, previous.group(0) if previous else None)
        _write_rc(config, None if before is None and not restored else restored)


def kit_notes(config: SshConfig) -> list[str]:
    return [
        f"the env-* checks plant ambient variables in a managed block at the top of ~/.bashrc of "
        f"{config.username}@{config.host} (between the lines {BEGIN.strip()!r} and {END.strip()!r}), "
        "and put the file back after each check: run the kit with a test account; a run killed midway "
        "leaves the block behind"
    ]
