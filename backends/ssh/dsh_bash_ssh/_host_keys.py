"""Which known_hosts verify a host's key, whatever ``~/.ssh/config`` says (issue 30, "Host keys").

The rule: the config's ``known_hosts`` when given (for every host on the way, jump hosts too);
else, with ``use_user_ssh_config``, the known_hosts files ``~/.ssh/config`` names for that host
when at least one of them is a readable file, else ``~/.ssh/known_hosts``. Nothing in
``~/.ssh/config`` turns checking off: ``UserKnownHostsFile none`` (which would leave asyncssh with
no known_hosts, so that it accepts any key) and names of no readable file are not honoured, and
OpenSSH's ``StrictHostKeyChecking no``/``off``/``accept-new`` never were (asyncssh does not read
it); each is said in a warning and in a host-key error, naming the file and line. Only
``insecure_skip_host_key_check=True`` skips verification.

What ``~/.ssh/config`` says for a host is asyncssh's own reading (its ``Host``/``Match``/``Include``
handling, through :class:`asyncssh.SSHClientConnectionOptions`); the lines quoted in messages come
from a plain scan of the files (:func:`_settings`), which takes a ``Match`` block as applying.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh

__all__ = ["Hop", "HostKeyPlan", "jump_hops", "plan_host_keys"]

#: ``StrictHostKeyChecking`` values with which OpenSSH accepts a key it does not know.
_OFF_VALUES = frozenset({"no", "off", "false", "accept-new"})
#: The settings quoted in messages, by their lower-case keyword.
_WATCHED = {
    "userknownhostsfile": "UserKnownHostsFile",
    "globalknownhostsfile": "GlobalKnownHostsFile",
    "stricthostkeychecking": "StrictHostKeyChecking",
}
_MAX_INCLUDE_DEPTH = 16


@dataclass(frozen=True)
class Hop:
    """One host on the way: the target or a ``ProxyJump`` hop (``None``: the config's own)."""

    host: str
    port: int | None = None
    username: str | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if self.port is not None else self.host


@dataclass(frozen=True)
class HostKeyPlan:
    """How one host's key is verified."""

    #: What asyncssh is given: file names, an empty list of trusted keys, or ``None`` (nothing is
    #: verified: only with ``insecure_skip_host_key_check``).
    known_hosts: str | list[str] | asyncssh.SSHKnownHosts | None
    #: Which files verify the key, as said in messages.
    against: str
    #: Settings of ``~/.ssh/config`` not honoured, each naming its file and line.
    ignored: tuple[str, ...] = ()
    #: The ``ProxyJump`` hops ``~/.ssh/config`` gives this host (opened first, each verified alike).
    jump: str | None = None
    #: Where the host is reached (``HostName``:``Port`` from ``~/.ssh/config``), as said in messages.
    address: str = ""


@dataclass(frozen=True)
class _Setting:
    path: str
    line: int
    keyword: str
    value: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: `{self.keyword} {self.value}`"


def _readable_file(name: str) -> str | None:
    path = os.path.expanduser(name)
    return path if os.path.isfile(path) and os.access(path, os.R_OK) else None


def _user_config() -> Path:
    return Path("~", ".ssh", "config").expanduser()


def _host_matches(patterns: list[str], host: str) -> bool:
    """ssh_config ``Host`` patterns (``*``, ``?``, ``!`` negation; comma-separated lists too)."""
    matched = False
    for pattern in (p for word in patterns for p in word.split(",") if p):
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in body)
        if re.fullmatch(regex, host, re.IGNORECASE):
            if negated:
                return False
            matched = True
    return matched


def _words(line: str) -> list[str]:
    """A config line's keyword and arguments (``Keyword value``, ``Keyword=value``)."""
    try:
        words = shlex.split(line, comments=False)
    except ValueError:
        return []
    if words and "=" in words[0]:
        keyword, _, rest = words[0].partition("=")
        words = [keyword, *([rest] if rest else []), *words[1:]]
    elif len(words) > 1 and words[1].startswith("="):
        words = [words[0], *([words[1][1:]] if words[1] != "=" else []), *words[2:]]
    return words


def _scan(path: Path, host: str, active: bool, depth: int) -> Iterator[_Setting]:
    """The watched settings in ``path`` (and what it includes) under blocks that apply to ``host``."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = _words(line)
        if not words:
            continue
        keyword = words[0].lower()
        if keyword == "host":
            active = _host_matches(words[1:], host)
        elif keyword == "match":
            active = True  # conditions this scan does not judge: quoted in case they apply
        elif keyword == "include" and active and depth < _MAX_INCLUDE_DEPTH:
            for word in words[1:]:
                pattern = os.path.expanduser(word)
                if not os.path.isabs(pattern):  # relative to ~/.ssh, as in ssh_config(5)
                    pattern = str(Path("~", ".ssh").expanduser() / pattern)
                for name in sorted(glob.glob(pattern)):
                    yield from _scan(Path(name), host, True, depth + 1)
        elif keyword in _WATCHED and active and len(words) > 1:
            yield _Setting(str(path), number, _WATCHED[keyword], " ".join(words[1:]))


def _settings(host: str) -> dict[str, _Setting]:
    """The first watched setting of each kind that applies to ``host`` (the first one wins)."""
    found: dict[str, _Setting] = {}
    config = _user_config()
    if config.is_file():
        for setting in _scan(config, host, True, 0):
            found.setdefault(setting.keyword, setting)
    return found


def _asyncssh_view(hop: Hop) -> asyncssh.SSHClientConnectionOptions:
    """What asyncssh makes of ``~/.ssh/config`` for ``hop`` (loads no key, asks no agent)."""
    return asyncssh.SSHClientConnectionOptions(
        config=(),
        host=hop.host,
        port=hop.port if hop.port is not None else (),
        username=hop.username if hop.username is not None else (),
        client_keys=None,
        agent_identities=None,
        x509_trusted_certs=None,
        x509_trusted_cert_paths=[],
    )


def plan_host_keys(
    hop: Hop, *, known_hosts: str | None, insecure: bool, use_user_ssh_config: bool
) -> HostKeyPlan:
    """How ``hop``'s key is verified (reads ``~/.ssh/config`` with ``use_user_ssh_config``)."""
    if not use_user_ssh_config:
        return HostKeyPlan(None if insecure else known_hosts, f"{known_hosts}", address=str(hop))
    view = _asyncssh_view(hop)
    jump = view.tunnel if isinstance(view.tunnel, str) and view.tunnel else None
    address = f"{view.host}:{view.port}"
    if insecure:
        return HostKeyPlan(None, "nothing (insecure_skip_host_key_check=True)", jump=jump, address=address)
    settings = _settings(hop.host)
    ignored: list[str] = []
    strict = settings.get("StrictHostKeyChecking")
    if strict is not None and strict.value.lower() in _OFF_VALUES:
        ignored.append(f"{strict} is never honoured: an unknown host key is refused")
    if known_hosts is not None:
        return HostKeyPlan(known_hosts, known_hosts, tuple(ignored), jump, address)
    named = view.known_hosts  # asyncssh's: UserKnownHostsFile (None for `none`) + GlobalKnownHostsFile
    user_files = settings.get("UserKnownHostsFile")
    if named is None:
        said = user_files if user_files is not None and user_files.value.lower() == "none" else None
        quoted = str(said) if said else f"`UserKnownHostsFile none` in {_user_config()} or what it includes"
        ignored.append(f"{quoted} would turn host-key checking off: not honoured")
    elif isinstance(named, list) and named:
        real = [path for path in (_readable_file(str(name)) for name in named) if path is not None]
        if real:
            return HostKeyPlan(real, " ".join(real), tuple(ignored), jump, address)
        said = user_files or settings.get("GlobalKnownHostsFile")
        quoted = str(said) if said else f"the known_hosts files {' '.join(map(str, named))}"
        ignored.append(f"{quoted} names no readable known_hosts file: not honoured")
    default = str(Path("~", ".ssh", "known_hosts").expanduser())
    if _readable_file(default):
        return HostKeyPlan([default], default, tuple(ignored), jump, address)
    empty = asyncssh.import_known_hosts("")
    return HostKeyPlan(empty, f"{default} (absent: no key is trusted)", tuple(ignored), jump, address)


def jump_hops(jump: str) -> list[Hop]:
    """``ProxyJump``'s ``[user@]host[:port]`` hops, comma-separated, in order."""
    hops = []
    for word in jump.split(","):
        username, _, host = word.strip().removeprefix("ssh://").rpartition("@")
        port: int | None = None
        if host.startswith("[") and "]" in host:  # [v6 address]:port
            address, _, rest = host[1:].partition("]")
            host = address
            port = int(rest[1:]) if rest.startswith(":") else None
        elif host.count(":") == 1:
            host, _, number = host.partition(":")
            port = int(number)
        if not host:
            raise ValueError(f"ProxyJump {jump!r}: a hop names no host")
        hops.append(Hop(host, port, username or None))
    return hops
