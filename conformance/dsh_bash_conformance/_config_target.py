"""A kit target built from a backend configuration: what ``dsh-bash conformance --config FILE`` runs.

``make_executor(**overrides)`` is ``dsh_bash.load_executor(source, **overrides)``. Two things the
kit needs cannot be read from a configuration, so the executor may tell them (optional methods,
called on an unopened executor made from the configuration, which is never opened):

``kit_plant_ambient(self, variables) -> AbstractContextManager[Mapping[str, Any]]``
    Make ``variables`` part of the ambient environment of executors created inside the block: the
    mapping it yields is merged into the config fields of every executor made inside the block
    (a check's own overrides win). ``variables`` holds every variable planted by the enclosing
    blocks too, so a hook never has to merge layers itself.
``kit_find_processes(self, marker) -> list[int]``
    Live (non-zombie) processes, where the commands run, whose command line contains ``marker``.

Without ``kit_plant_ambient`` the kit patches ``os.environ`` (right for backends whose commands
inherit this process's environment); without ``kit_find_processes`` it scans this host's ``/proc``.
The local and Docker backends of this distribution are handled here, by class, without hooks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsh_bash import BashExecutor, load_executor
from dsh_bash.backend import HostBashExecutor

from ._host import find_host_processes, patch_os_environ
from ._kit import KitTarget

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


def _loaded_class(module: str, name: str) -> type | None:
    """A class of a backend module if that module is already imported (never imports it)."""
    loaded = sys.modules.get(module)
    found = getattr(loaded, name, None) if loaded is not None else None
    return found if isinstance(found, type) else None


def _docker_image_planter(probe: BashExecutor) -> Planter | None:
    """For the Docker backend in image mode: the created container's ``environment``."""
    docker_cls = _loaded_class("dsh_bash_docker", "DockerBashExecutor")
    if docker_cls is None or not isinstance(probe, docker_cls):
        return None
    configured = getattr(probe.config, "environment", None)
    if getattr(probe.config, "image", None) is None or not isinstance(configured, Mapping):
        return None
    base = dict(configured)

    def plant(variables: Mapping[str, str]) -> AbstractContextManager[Mapping[str, Any]]:
        return contextlib.nullcontext({"environment": {**base, **variables}})

    return plant


def _docker_engine_is_local(probe: BashExecutor) -> bool:
    host = getattr(probe.config, "docker_host", None) or os.environ.get("DOCKER_HOST")
    return host is None or host.startswith("unix://")


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

    # -- the ambient environment ------------------------------------------------------------
    planter: Planter | None = getattr(probe, "kit_plant_ambient", None)
    if planter is None:
        planter = _docker_image_planter(probe)
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
        docker_cls = _loaded_class("dsh_bash_docker", "DockerBashExecutor")
        if docker_cls is not None and isinstance(probe, docker_cls):
            notes.append(
                "an existing container's environment was fixed when it was created, so the kit cannot "
                "plant ambient variables there: env-ambient-passes-through, env-allow-readmits and "
                "env-scrub-replaces-defaults will fail (and the other env-* checks prove less); run "
                "those against image mode"
            )
        elif getattr(backend_cls, "_ambient_env", None) is not HostBashExecutor._ambient_env:
            # Commands of a host backend inherit os.environ; a subclass that overrides where the
            # ambient environment comes from gets the caveat too.
            notes.append(
                f"{backend_cls.__name__} defines no kit_plant_ambient hook: the env-* checks assume its "
                "commands inherit this process's environment (os.environ)"
            )

    # -- finding the commands' processes ----------------------------------------------------
    find_processes: Callable[[str], list[int]] = find_host_processes
    finder = getattr(probe, "kit_find_processes", None)
    docker_cls = _loaded_class("dsh_bash_docker", "DockerBashExecutor")
    if finder is not None:
        find_processes = finder
    elif docker_cls is not None and isinstance(probe, docker_cls):
        if _docker_engine_is_local(probe):
            find_processes = find_namespaced_processes
        else:
            notes.append(
                "the Docker engine is not local: this host's /proc cannot see the container's processes, "
                "so the process checks cannot prove anything (most of them will fail)"
            )
    elif not Path("/proc/self").exists():
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
