"""Helpers for the security suite (tests/test_security_*.py).

- :func:`other_user`: a second, unprivileged local account that must not read anyone's spill files.
- :class:`CmdlineWatch`: a thread that scans every process's ``/proc/PID/cmdline`` on this host while
  commands run (a local Docker engine's container processes and the SSH host's sessions are this
  host's processes too) and records each one whose command line holds a watched value.
- :class:`PredictableTokens`: replaces ``secrets.token_hex`` in one module so a spill file's name can
  be predicted and a link planted there first.
"""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from dsh_bash import BashExecutor

__all__ = [
    "BACKENDS",
    "OTHER_USER",
    "CmdlineWatch",
    "PredictableTokens",
    "as_other_user",
    "ensure_other_user",
    "make_executor",
    "scan_cmdlines",
    "scan_environs",
]

#: The second account: no home, no login shell, never root.
OTHER_USER = "dshsec_other"


def ensure_other_user() -> pwd.struct_passwd:
    """The unprivileged second user, created (``useradd``) when missing. Needs root to create."""
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(OTHER_USER)


def as_other_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as :data:`OTHER_USER` (``runuser``), capturing its output; never raises on failure."""
    return subprocess.run(
        ["runuser", "-u", OTHER_USER, "--", *argv], capture_output=True, text=True, timeout=20, check=False
    )


def scan_cmdlines(needles: Iterable[bytes]) -> list[tuple[int, bytes, bytes]]:
    """(pid, needle, command line) for every live process whose command line contains a needle."""
    wanted = [needle for needle in needles if needle]
    hits = []
    own = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue  # gone since the listing, or a kernel thread
        for needle in wanted:
            if needle in cmdline:
                hits.append((int(entry.name), needle, cmdline))
    return hits


def scan_environs(needle: bytes) -> list[int]:
    """Pids of live (not zombie) processes whose initial environment contains ``needle``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                environ = handle.read()
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X") and needle in environ:
            found.append(int(entry.name))
    return found


@dataclass
class CmdlineWatch:
    """Scans all command lines on this host every few milliseconds until stopped.

    ``secrets`` must never be seen; ``canary`` is a value deliberately put on a command line, so a
    watch that saw nothing at all (too slow, blind to container processes) fails instead of passing.
    """

    secrets: list[str]
    canary: str
    interval_s: float = 0.002
    leaks: list[tuple[int, str, str]] = field(default_factory=list)
    canary_seen: int = 0
    scans: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        needles = [value.encode() for value in self.secrets]
        canary = self.canary.encode()
        while not self._stop.is_set():
            for pid, needle, cmdline in scan_cmdlines([*needles, canary]):
                if needle == canary:
                    self.canary_seen += 1
                else:
                    self.leaks.append(
                        (pid, needle.decode(), cmdline.replace(b"\0", b" ").decode(errors="replace"))
                    )
            self.scans += 1
            time.sleep(self.interval_s)

    @contextmanager
    def running(self) -> Iterator[CmdlineWatch]:
        self._thread = threading.Thread(target=self._run, name="cmdline-watch", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)


class PredictableTokens:
    """A stand-in for the ``secrets`` module inside one module: ``token_hex`` returns known names.

    ``token_hex(n)`` for the watched width returns ``next_names`` in order (then random names again);
    any other width stays random, so nonces and markers keep working.
    """

    def __init__(self, width: int, names: Iterable[str]) -> None:
        self._width = width
        self._names = list(names)
        self.handed_out: list[str] = []

    def token_hex(self, nbytes: int | None = None) -> str:
        if nbytes == self._width and self._names:
            name = self._names.pop(0)
            self.handed_out.append(name)
            return name
        return secrets.token_hex(nbytes)

    def __getattr__(self, name: str) -> object:
        return getattr(secrets, name)


#: Every backend the security cases run against.
BACKENDS = ["local", "docker", "ssh"]


def make_executor(request: pytest.FixtureRequest, backend: str, **fields: Any) -> BashExecutor:
    """An unopened executor of ``backend``; Docker and SSH fixtures are requested only when needed."""
    fields.setdefault("grace_ms", 300)
    if backend == "local":
        from dsh_bash_local import LocalBashExecutor, LocalConfig  # noqa: PLC0415

        return LocalBashExecutor(LocalConfig(**fields))
    if backend == "docker":
        from docker_support import SESSION_ID, SESSION_LABEL  # noqa: PLC0415
        from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

        image = request.getfixturevalue("docker_test_image")
        fields.setdefault("image", image)
        fields["labels"] = {SESSION_LABEL: SESSION_ID, **fields.get("labels", {})}
        return DockerBashExecutor(DockerConfig(**fields))
    if backend == "ssh":
        server = request.getfixturevalue("ssh_server")
        return server.executor(**fields)  # type: ignore[no-any-return]
    raise ValueError(f"unknown backend {backend!r}")
