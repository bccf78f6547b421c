"""The sandbox policy on Docker beyond the kit's policy-* checks (which run in test_conformance_docker,
as root and as uid 65534): without the supervisor (containment = marker) there is no step to apply it,
so an active policy is refused at open, and best_effort runs without it."""

from __future__ import annotations

import logging

import pytest
from docker_support import docker_config
from dsh_bash_docker import DockerBashExecutor

from dsh_bash import BashInfrastructureError, SandboxPolicy

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_without_the_supervisor_a_policy_is_refused_or_run_without(
    docker_test_image: str, caplog: pytest.LogCaptureFixture
) -> None:
    required = docker_config(docker_test_image, containment="marker", policy="workspace-write")
    with pytest.raises(BashInfrastructureError) as refused:
        async with DockerBashExecutor(required):
            pass
    assert refused.value.reason == "policy_unenforceable"
    assert "no confinement step" in str(refused.value)
    weaker = SandboxPolicy.workspace_write(enforcement="best_effort")
    async with DockerBashExecutor(
        docker_config(docker_test_image, containment="marker", policy=weaker)
    ) as ex:
        with caplog.at_level(logging.WARNING):
            done = await ex.exec("echo x > /etc/written && cat /etc/written", workdir="/tmp")
    assert done.stdout.text == "x\n"  # unconfined, as it said
    assert any("without their sandbox policy" in record.getMessage() for record in caplog.records)
