"""A kit target built from a backend configuration: what ``dsh-bash conformance --config FILE`` runs.

``make_executor(**overrides)`` is ``dsh_bash.load_executor(source, **overrides)``. What the kit
needs and cannot read from a configuration, the backend tells through the optional methods of
:class:`dsh_bash.backend.ConformanceHooks`, called on an unopened executor made from the
configuration (which is never opened):

``kit_plant_ambient(self, variables) -> AbstractContextManager[Mapping[str, Any]]``
    Make ``variables`` part of the ambient environment of executors created inside the block: the
    mapping it yields is merged into the config fields of every executor made inside the block
    (a check's own overrides win). ``variables`` holds every variable planted by the enclosing
    blocks too, so a hook never has to merge layers itself.
``kit_find_processes(self, marker) -> list[int]``
    Live (non-zombie) processes, where the commands run, whose command line contains ``marker``.
``kit_notes(self) -> list[str]``
    What the checks cannot see or prove with this configuration.

Without ``kit_plant_ambient`` the kit patches ``os.environ``; without ``kit_find_processes`` it
scans this host's ``/proc``; either fallback comes with a note. The kit knows no backend by name.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsh_bash import BashExecutor, load_executor

from ._harness import KitTarget
from ._host import find_host_processes, patch_os_environ

__all__ = ["ConfigTarget", "config_target", "find_namespaced_processes"]

Planter = Callable[[Mapping[str, str]], AbstractContextManager[Mapping[str, Any]]]


@dataclass(frozen=True)
class ConfigTarget:
    """A kit target made from a configuration, and notes on what its checks can and cannot see."""

    target: KitTarget
    #: Why some checks may not prove anything (or fail) against this configuration.
    notes: list[str] = field(default_factory=list)


def find_namespaced_processes(marker: str) -> list[int]:
    """Like :func:`find_host_processes`, but pids as seen inside their own PID namespace.

    For backends whose commands run in a PID namespace on this host (a local Docker engine): the
    last ``NSpid`` entry of ``/proc/PID/status`` is the pid a command there sees.
    """
    found = []
    for pid in find_host_processes(marker):
        try:
            with open(f"/proc/{pid}/status") as handle:
                nspid = next((line.split()[1:] for line in handle if line.startswith("NSpid:")), [])
        except OSError:
            continue  # gone since the scan
        found.append(int(nspid[-1]) if nspid else pid)
    return sorted(found)


class _Planted:
    """The stack of planted blocks: each layer's variables (all layers merged) and its overrides."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layers: list[tuple[dict[str, str], dict[str, Any]]] = []

    def variables(self) -> dict[str, str]:
        with self._lock:
            return dict(self._layers[-1][0]) if self._layers else {}

    def overrides(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._layers[-1][1]) if self._layers else {}

    @contextlib.contextmanager
    def layer(self, variables: dict[str, str], overrides: Mapping[str, Any]) -> Iterator[None]:
        entry = (variables, dict(overrides))
        with self._lock:
            self._layers.append(entry)
        try:
            yield
        finally:
            with self._lock:
                # A hung check's block may outlive later ones: remove this layer wherever it is.
                for index in range(len(self._layers) - 1, -1, -1):
                    if self._layers[index] is entry:
                        del self._layers[index]
                        break


def config_target(
    source: Mapping[str, Any] | str | os.PathLike[str],
    *,
    anyio_backend: str = "asyncio",
    check_timeout_s: float = 30.0,
    name: str | None = None,
) -> ConfigTarget:
    """A kit target for the backend a configuration describes (raises ``ConfigError`` when it is bad)."""
    probe = load_executor(source)
    backend_cls = type(probe)
    notes: list[str] = []
    planted = _Planted()

    def make_executor(**overrides: Any) -> BashExecutor:
        return load_executor(source, **{**planted.overrides(), **overrides})

    tell_notes: Callable[[], list[str]] | None = getattr(probe, "kit_notes", None)
    if tell_notes is not None:
        notes.extend(tell_notes())

    # -- the ambient environment ------------------------------------------------------------
    planter: Planter | None = getattr(probe, "kit_plant_ambient", None)
    plant_ambient: Callable[[Mapping[str, str]], AbstractContextManager[None]]
    if planter is not None:
        hook: Planter = planter

        @contextlib.contextmanager
        def plant_through_hook(variables: Mapping[str, str]) -> Iterator[None]:
            merged = {**planted.variables(), **variables}
            with hook(merged) as overrides, planted.layer(merged, overrides):
                yield

        plant_ambient = plant_through_hook
    else:
        plant_ambient = patch_os_environ
        notes.append(
            f"{backend_cls.__name__} defines no kit_plant_ambient hook: the env-* checks assume its "
            "commands inherit this process's environment (os.environ)"
        )

    # -- finding the commands' processes ----------------------------------------------------
    finder: Callable[[str], list[int]] | None = getattr(probe, "kit_find_processes", None)
    find_processes: Callable[[str], list[int]] = find_host_processes
    if finder is not None:
        find_processes = finder
    elif Path("/proc/self").exists():
        notes.append(
            f"{backend_cls.__name__} defines no kit_find_processes hook: the process checks scan this "
            "host's /proc, which sees the commands' processes only when they run on this host"
        )
    else:
        notes.append("this host has no /proc: the process checks cannot see any process")

    target = KitTarget(
        name=name or f"{backend_cls.__name__}[{anyio_backend}]",
        make_executor=make_executor,
        plant_ambient=plant_ambient,
        find_processes=find_processes,
        anyio_backend=anyio_backend,
        check_timeout_s=check_timeout_s,
    )
    return ConfigTarget(target=target, notes=notes)
