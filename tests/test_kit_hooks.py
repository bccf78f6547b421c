"""The conformance-kit hooks of the local and Docker backends (``dsh_bash.backend.ConformanceHooks``),
and what ``config_target`` makes of them (the SSH backend's: ``tests/test_conformance_ssh_container.py``).

The kit calls the hooks on an executor that is never opened, synchronously, from worker threads and
from a check's own thread while its event loop runs; these tests call them the second way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from dsh_bash_conformance import config_target
from dsh_bash_local import LocalBashExecutor

from dsh_bash import BashExecRequest, BashExecutor
from dsh_bash.backend import ConformanceHooks
from dsh_bash.host import find_host_processes

pytestmark = pytest.mark.kit


def _nspid_inner(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^NSpid:\s+(.*)$", status, re.MULTILINE)
    assert found is not None
    return int(found.group(1).split()[-1])


def _finds_its_task(probe: Any, make: Callable[[], BashExecutor], marker: str) -> tuple[list[int], list[int]]:
    """Start a task carrying ``marker`` with an executor from ``make()``; return what ``probe`` finds
    while it runs (checked against this host's view through ``NSpid``: pids as the command's PID
    namespace sees them) and this host's pids of the same processes; check that ``probe`` finds
    nothing once the task is killed."""
    found: list[int] = []
    here: list[int] = []
    host: list[int] = []

    async def main() -> None:
        async with make() as ex:
            task = await ex.start(ex.resolve(BashExecRequest(command=f"sleep 60; : {marker}")))
            # A detached start may return before the command itself runs, and a shell's child is a
            # copy of it (marker included) until it execs: the two views are compared once settled.
            for _ in range(50):
                found[:] = probe.kit_find_processes(marker)
                host[:] = find_host_processes(marker)
                here[:] = sorted(_nspid_inner(pid) for pid in host)
                if found and found == here:
                    break
                await anyio.sleep(0.05)
            assert await ex.kill(task.id) is True
        assert probe.kit_find_processes(marker) == []

    anyio.run(main)
    assert found, "the finder saw no process carrying the marker"
    assert found == here, (found, here)
    return found, host


def test_every_backend_of_this_distribution_has_the_hooks() -> None:
    from dsh_bash_docker import DockerBashExecutor  # noqa: PLC0415
    from dsh_bash_ssh import SshBashExecutor  # noqa: PLC0415

    for cls in (LocalBashExecutor, DockerBashExecutor, SshBashExecutor):
        assert issubclass(cls, ConformanceHooks), cls


def test_local_hooks_are_this_host() -> None:
    probe = LocalBashExecutor()
    found, host = _finds_its_task(probe, LocalBashExecutor, "kitmark-localhook-0a1b2c")
    assert found == host
    with probe.kit_plant_ambient({"KIT_LOCAL_HOOK": "x\ny"}) as overrides:
        assert overrides == {} and os.environ["KIT_LOCAL_HOOK"] == "x\ny"
    assert "KIT_LOCAL_HOOK" not in os.environ
    assert probe.kit_notes() == []
    assert config_target({"backend": "local"}).notes == []


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["image", "container"])
def test_docker_finder_scans_inside_the_container(
    mode: str, docker_test_image: str, request: pytest.FixtureRequest
) -> None:
    """A scan exec'd in the container: pids as it sees them (checked against this host's ``NSpid``)."""
    from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

    if mode == "image":
        fields: dict[str, Any] = {"image": docker_test_image}
    else:
        fields = {"container": request.getfixturevalue("docker_session_container")}
    probe = DockerBashExecutor(DockerConfig(**fields))
    found, host = _finds_its_task(
        probe, lambda: DockerBashExecutor(DockerConfig(**fields, grace_ms=300)), f"kitmark-dockerhook-{mode}"
    )
    assert not set(found) & set(host), f"{found}: this host's pids, not the container's"


@pytest.mark.docker
def test_docker_planting(docker_test_image: str) -> None:
    from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

    image = DockerBashExecutor(DockerConfig(image=docker_test_image, environment={"A": "1"}))
    with image.kit_plant_ambient({"B": "2"}) as overrides:
        assert overrides == {"environment": {"A": "1", "B": "2"}}
    assert image.kit_notes() == []
    container = DockerBashExecutor(DockerConfig(container="some-container"))
    with container.kit_plant_ambient({"B": "2"}) as overrides:
        assert overrides == {}
    [note] = container.kit_notes()
    assert "cannot plant" in note and "env-ambient-passes-through" in note
    built = config_target({"backend": "docker", "container": "some-container"})
    assert built.notes == [note]
