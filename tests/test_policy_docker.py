"""The sandbox policy on Docker beyond the kit's policy-* checks (which run in test_conformance_docker,
as root and as uid 65534): without the supervisor (containment = marker) there is no step to apply it,
so an active policy is refused at open, and best_effort runs without it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from docker_support import EGRESS_DIRECTORIES, docker_config, start_idle_container
from dsh_bash_docker import DockerBashExecutor, DockerConfig
from dsh_bash_docker._docker_executor import EGRESS_MOUNT

from dsh_bash import BashExecRequest, BashInfrastructureError, SandboxPolicy
from dsh_bash.backend import PROXY_KEY_VAR

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


async def test_the_egress_directory_is_mounted_read_only_and_removed_at_close(docker_test_image: str) -> None:
    """Image mode on an engine on this host: the proxies' directory is in the container read-only
    and unlistable to a user other than root; the allow-list's proxy file works for that user too;
    the host directory is gone after aclose."""
    policy = SandboxPolicy(network="allow-list", allow_hosts=("127.0.0.1:1",))
    async with DockerBashExecutor(docker_config(docker_test_image)) as ex:
        egress_dir = ex._egress_dir  # the host side of the mount is what is checked
        assert egress_dir is not None and os.path.isdir(egress_dir)
        looked = await ex.exec(
            f"ls {EGRESS_MOUNT} >/dev/null 2>&1 && echo listed; "
            f"touch {EGRESS_MOUNT}/x 2>/dev/null && echo wrote; echo done",
            user="65534",
        )
        confined = await ex.exec(
            'printf "CONNECT 10.0.0.1:80 HTTP/1.1\\r\\n\\r\\n" | nc 127.0.0.1 3128 | head -n 1',
            user="65534",
            policy=policy,
        )
    assert looked.stdout.text == "done\n", looked
    assert confined.stdout.text.startswith("HTTP/1.1 403 Forbidden"), confined
    assert not os.path.exists(egress_dir)


async def test_a_session_keeps_nothing_of_what_the_allow_list_step_set(docker_test_image: str) -> None:
    """The session compares what a command ends with against what it started with. The allow-list's
    step takes the proxy's key out of the environment and sets the proxy variables to its forwarder:
    neither is the command's change (the next command of the session may run under another rule, or
    in it the key's name would be replayed as unset), unless the command changed a variable itself."""
    policy = SandboxPolicy(network="allow-list", allow_hosts=("127.0.0.1:1",))
    async with DockerBashExecutor(docker_config(docker_test_image)) as ex:
        session = ex.session()
        states = []
        for command in ("export KEPT=1", "export NO_PROXY=corp.example"):
            done = await ex.run(ex.resolve(BashExecRequest(command=command, session=session, policy=policy)))
            assert done.exit_code == 0 and done.session is not None and not done.session.kept_previous, done
            states.append(ex._session_for(session, None).state)
        after = await ex.exec("echo ${HTTPS_PROXY-unset} $NO_PROXY", session=session)
    ambient = {"HOME", "HOSTNAME"}  # the image's, which the container's commands start with
    assert {k: v for k, v in states[0].env.items() if k not in ambient} == {"KEPT": "1"}, states[0]
    assert {k: v for k, v in states[1].env.items() if k not in ambient} == {
        "KEPT": "1",
        "NO_PROXY": "corp.example",
    }, states[1]
    assert all(PROXY_KEY_VAR not in state.unset for state in states), states
    assert after.stdout.text == "unset corp.example\n", after


async def test_an_attached_container_serves_the_allow_list_through_its_egress_directory(
    docker_test_image: str, tmp_path: Path
) -> None:
    """Container mode: the proxies' files go to the config's ``egress_directory``, which the container
    has mounted; a container without it mounted is refused at open, saying what to mount; aclose
    removes the files it made there and nothing else of the user's directory."""
    policy = SandboxPolicy(network="allow-list", allow_hosts=("127.0.0.1:1",))
    unmounted = start_idle_container(docker_test_image)
    try:
        elsewhere = tmp_path / "not-mounted"
        elsewhere.mkdir()
        config = DockerConfig(container=unmounted.get_container_id(), egress_directory=str(elsewhere))
        with pytest.raises(BashInfrastructureError) as refused:
            async with DockerBashExecutor(config):
                pass
    finally:
        unmounted.stop()
    assert refused.value.reason == "policy_unenforceable" and "is not mounted in container" in str(
        refused.value
    )

    attached = start_idle_container(docker_test_image)
    try:
        directory = EGRESS_DIRECTORIES[attached.get_container_id()]
        Path(directory, "users-own").write_text("kept")
        config = DockerConfig(container=attached.get_container_id(), egress_directory=directory, grace_ms=300)
        async with DockerBashExecutor(config) as ex:
            asked = await ex.exec(
                'printf "CONNECT 10.0.0.1:80 HTTP/1.1\\r\\n\\r\\n" | nc 127.0.0.1 3128 | head -n 1',
                policy=policy,
            )
            made = sorted(os.listdir(directory))
        left = sorted(os.listdir(directory))
    finally:
        attached.stop()
    assert asked.stdout.text.startswith("HTTP/1.1 403 Forbidden"), asked
    assert len(made) == 2 and "users-own" in made and left == ["users-own"], (made, left)
