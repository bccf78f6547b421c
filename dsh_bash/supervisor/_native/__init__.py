"""The native helper dsh-supervise, shipped as package data: one static Linux binary per architecture.

``dsh-supervise`` (source: ``native/supervise.c``, built by ``native/build.py``) runs one command as a
per-command child subreaper, reports its outcome on a status fd the command cannot write (or, with
``--frame``, in frames on its own stdout, next to the command's output; with ``--detach``, as signed
lines in a file), and kills the whole subtree
on request. See the source's header and ``native/README.md`` for the protocol.

    supervisor_binary()            # the host's binary, or None
    supervisor_binary("aarch64")   # for a remote machine of that architecture (``uname -m`` names)
    supervisor_problem("aarch64")  # why supervisor_binary("aarch64") is None, else None
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ARCHITECTURES",
    "PROTOCOL_VERSION",
    "SupervisorPayload",
    "normalize_arch",
    "supervisor_binary",
    "supervisor_payload",
    "supervisor_problem",
]

#: The architectures a binary is built for, named as ``uname -m`` names them on Linux.
ARCHITECTURES = ("x86_64", "aarch64")
#: What ``dsh-supervise --version`` prints after its name.
PROTOCOL_VERSION = 13

_DIR = Path(__file__).resolve().parent
_ALIASES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def normalize_arch(machine: str) -> str | None:
    """The architecture name used here for a ``uname -m`` (or ``platform.machine()``) answer, or None."""
    return _ALIASES.get(machine.strip().lower())


def _resolve(arch: str | None) -> tuple[str | None, str | None]:
    """(architecture, problem): exactly one of them is None."""
    if arch is None:
        if not sys.platform.startswith("linux"):
            return None, f"dsh-supervise runs only on Linux, and this host is {sys.platform}"
        machine = platform.machine()
    else:
        machine = arch
    name = normalize_arch(machine)
    if name is None:
        return None, (
            f"no dsh-supervise for the architecture {machine!r}: it is built for {', '.join(ARCHITECTURES)}"
        )
    return name, None


def _path(arch: str) -> Path:
    return _DIR / f"dsh-supervise-{arch}"


def supervisor_problem(arch: str | None = None) -> str | None:
    """Why :func:`supervisor_binary` gives None for ARCH (None: the host's), or None when it gives a path."""
    name, problem = _resolve(arch)
    if name is None:
        return problem
    path = _path(name)
    if not path.is_file():
        return (
            f"dsh-supervise for {name} is not built ({path} is missing): in a source checkout run "
            f"`python native/build.py` (cross-compiling needs `pip install ziglang`; without it only the "
            f"host's architecture is built, with cc); an installed dsh-bash was built without it"
        )
    if not os.access(path, os.X_OK):
        return f"dsh-supervise for {name} is not executable: {path}"
    return None


def supervisor_binary(arch: str | None = None) -> Path | None:
    """The dsh-supervise binary for ARCH (a ``uname -m`` name; None: the host's), or None when there is
    none (see :func:`supervisor_problem`)."""
    name, _ = _resolve(arch)
    if name is None or supervisor_problem(name) is not None:
        return None
    return _path(name)


@dataclass(frozen=True, slots=True)
class SupervisorPayload:
    """The binary to put where commands run: a file name that changes with its content
    (``dsh-supervise-`` and the first 16 hex digits of its SHA-256), its bytes, its whole SHA-256."""

    name: str
    data: bytes
    sha256: str


def supervisor_payload(machine: str) -> SupervisorPayload | str:
    """The dsh-supervise to install on a machine whose ``uname -m`` is ``machine``, or why there is none."""
    arch = normalize_arch(machine) if machine else None
    binary = supervisor_binary(arch) if arch is not None else None
    if binary is None:
        return supervisor_problem(arch or machine or "unknown") or f"no dsh-supervise for {machine!r}"
    data = binary.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    return SupervisorPayload(f"dsh-supervise-{digest[:16]}", data, digest)
