"""This host's answers to the conformance kit's questions: its processes, and its ``os.environ``.

The fallbacks the kit uses for a backend without :class:`dsh_bash.backend.ConformanceHooks`, and the
hooks of a backend whose commands are processes of this host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ._proc_scan import read_proc_stat

__all__ = ["find_host_processes", "plant_in_os_environ"]


def _is_zombie(pid: str) -> bool:
    stat = read_proc_stat(pid)
    return stat is None or not stat.alive  # gone while we looked, or a zombie


def find_host_processes(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes on this host whose command line contains ``marker``.

    The calling process itself is never listed. Processes of other users whose command line
    cannot be read are skipped.
    """
    needle = marker.encode()
    own = os.getpid()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if needle in cmdline and not _is_zombie(entry):
            found.append(int(entry))
    return sorted(found)


@contextlib.contextmanager
def plant_in_os_environ(variables: Mapping[str, str]) -> Iterator[dict[str, Any]]:
    """Set ``variables`` in ``os.environ`` for the block (yielding no config overrides), then restore
    every one of them: the planting hook of a backend whose commands inherit this process's environment."""
    saved = {name: os.environ.get(name) for name in variables}
    try:
        os.environ.update(variables)
        yield {}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
