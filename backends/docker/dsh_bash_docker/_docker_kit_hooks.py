"""The Docker backend's conformance-kit hooks (see :class:`dsh_bash.backend.ConformanceHooks`).

Processes are found by a scan of ``/proc`` exec'd in the container (pids as the commands see them,
whether the engine is local or not). In image mode that is every running container an executor of
this process created from the configured image (with the configured labels): each executor the kit
makes has its own. Ambient variables are planted, in image mode, through the ``environment`` the
executor gives the containers it creates; an existing container's environment was fixed when it
was created, so in container mode nothing can be planted.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import quote

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import FIND_PROCESSES, parse_pids, run_in_fresh_loop

from ._docker_config import DockerConfig
from ._engine import Endpoint, EngineClient, EngineError
from ._process import run_script

__all__ = ["find_container_processes", "find_open_leftovers", "kit_notes", "plant_in_environment"]


async def _containers(
    engine: EngineClient, config: DockerConfig, labels: Mapping[str, str | None]
) -> list[str]:
    if config.container is not None:
        return [config.container]
    assert config.image is not None
    wanted = [name if value is None else f"{name}={value}" for name, value in labels.items()]
    wanted += [f"{name}={value}" for name, value in config.labels.items()]
    filters = json.dumps({"label": wanted, "ancestor": [config.image], "status": ["running"]})
    listed = await engine.request("GET", f"/containers/json?filters={quote(filters)}")
    return [str(entry["Id"]) for entry in listed or []]


def find_container_processes(
    config: DockerConfig, labels: Mapping[str, str | None], marker: str
) -> list[int]:
    """Pids (in their container) of live processes whose command line contains ``marker``.

    ``labels`` select, in image mode, the containers to look in (a value of None: the label is
    present, whatever its value).
    """
    if "\n" in marker or not marker:
        raise ValueError("a marker is one non-empty line")

    async def scan() -> list[int]:
        found: list[int] = []
        # A dialer placed by another backend (Ray) may lead to any of several engines: all of them.
        for endpoint in await Endpoint.from_config(config).every_place():
            async with EngineClient(endpoint) as engine:
                found += await scan_with(engine)
        return sorted(found)

    async def scan_with(engine: EngineClient) -> list[int]:
        found: list[int] = []
        for container in await _containers(engine, config, labels):
            try:
                code, out, err = await run_script(
                    engine, container, config.user, FIND_PROCESSES, stdin=marker.encode() + b"\n"
                )
            except EngineError as exc:
                if config.image is not None and exc.status in (404, 409):
                    continue  # removed or stopped since it was listed: nothing runs there
                raise
            if code != 0:
                detail = err.decode("utf-8", "replace").strip()
                raise BashInfrastructureError(
                    f"scanning /proc in container {container[:12]} failed (exit {code}): {detail}"
                )
            found += parse_pids(out)
        return sorted(found)

    return run_in_fresh_loop(scan)


def find_open_leftovers(config: DockerConfig, label: tuple[str, str], spill_dir: str) -> list[str]:
    """What a failed open left: in image mode every container (any state) labelled ``label`` (the
    executor's own token), in container mode its spill directory ``spill_dir`` if it still exists."""

    async def look() -> list[str]:
        async with EngineClient(Endpoint.from_config(config)) as engine:
            return await look_with(engine)

    async def look_with(engine: EngineClient) -> list[str]:
        if config.image is not None:
            listed = await engine.containers_labelled(f"{label[0]}={label[1]}")
            return [f"container {entry['Id'][:12]} ({entry.get('State')})" for entry in listed]
        if not spill_dir:
            return []
        assert config.container is not None
        # As the container's default user: the configured one may be what made the open fail.
        code, _, err = await run_script(engine, config.container, None, 'test -e "$1"', spill_dir)
        if code not in (0, 1):
            raise BashInfrastructureError(f"cannot look for {spill_dir}: {err.decode(errors='replace')}")
        return [f"the spill directory {spill_dir} in container {config.container}"] if code == 0 else []

    return run_in_fresh_loop(look)


def plant_in_environment(
    config: DockerConfig, variables: Mapping[str, str]
) -> AbstractContextManager[Mapping[str, Any]]:
    """Image mode: the created container's ``environment``; container mode: nothing (see kit_notes)."""
    if config.image is None:
        return contextlib.nullcontext({})
    return contextlib.nullcontext({"environment": {**config.environment, **variables}})


def kit_notes(config: DockerConfig) -> list[str]:
    if config.image is not None:
        return []
    return [
        "an existing container's environment was fixed when it was created, so the kit cannot plant "
        "ambient variables there: env-ambient-passes-through, env-allow-readmits and "
        "env-scrub-replaces-defaults will fail (and the other env-* checks prove less); run those "
        "against image mode (pid {os.getpid()} plants nothing in container {config.container!r})"
    ]
