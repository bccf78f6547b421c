"""Docker-backend behaviour the conformance kit cannot see: containers, faults, inspection, limits."""

from __future__ import annotations

import json
import time

import anyio
import docker
import docker.errors
import pytest
from docker_support import SESSION_ID, SESSION_LABEL, start_idle_container
from dsh_bash_docker import MANAGED_LABEL, DockerBashExecutor, DockerConfig, sweep_orphaned_containers
from dsh_bash_docker._engine import Endpoint, EngineClient, EngineError

from dsh_bash import BashExecRequest, BashInfrastructureError
from dsh_bash.host._proc_scan import scan

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _config(image: str, **fields: object) -> DockerConfig:
    labels = {SESSION_LABEL: SESSION_ID}  # removed at session end even if a test fails
    return DockerConfig(image=image, grace_ms=300, labels=labels, **fields)  # type: ignore[arg-type]


def _marked(token: str) -> int:
    return len([entry for entry in scan(token.encode()) if entry.alive and entry.marker])


async def test_image_mode_leaves_no_container(
    docker_test_image: str, docker_client: docker.DockerClient
) -> None:
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        await ex.exec("sleep 30 > /dev/null 2>&1 &")
        container_id = ex.container_id
        labels = docker_client.containers.get(container_id).labels
        assert labels[MANAGED_LABEL] == ex._token
        config = docker_client.containers.get(container_id).attrs["HostConfig"]
        assert config["CapDrop"] == ["ALL"]
        assert "no-new-privileges" in config["SecurityOpt"]
        assert config["NetworkMode"] == "none"
        assert config["Init"] is True
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(container_id)


async def test_container_mode_keeps_the_container_and_leaves_no_process(
    docker_session_container: str, docker_client: docker.DockerClient
) -> None:
    async with DockerBashExecutor(DockerConfig(container=docker_session_container, grace_ms=300)) as ex:
        token = ex._token
        # A finished task's leftover (a foreground run's are killed when it ends).
        leaver = await ex.start(ex.resolve(BashExecRequest(command="sleep 30 > /dev/null 2>&1 &")))
        with anyio.fail_after(10):
            await leaver.wait()
        await ex.start(ex.resolve(BashExecRequest(command="trap '' TERM; sleep 30")))
        spill = (await ex.exec("head -c 100000 /dev/zero", timeout_ms=5000)).stdout.spill_path
        assert spill is not None
        assert _marked(token) >= 2
    assert _marked(token) == 0
    assert docker_client.containers.get(docker_session_container).status == "running"
    # The spill directory is gone too: aclose started its removal and did not wait for it to end.
    check = docker_client.containers.get(docker_session_container).exec_run(
        [
            "bash",
            "-c",
            f"for _ in $(seq 50); do test -e {spill} || break; sleep 0.1; done; test -e {spill}; echo $?",
        ],
    )
    assert check.output.strip() == b"1"


async def test_removed_container_fails_runs_promptly_and_image_mode_recreates(
    docker_test_image: str, docker_client: docker.DockerClient
) -> None:
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        task = await ex.start(ex.resolve(BashExecRequest(command="sleep 30")))
        first = ex.container_id

        async def remove() -> None:
            await anyio.sleep(0.5)
            await anyio.to_thread.run_sync(lambda: docker_client.containers.get(first).remove(force=True))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(remove)
            with pytest.raises(BashInfrastructureError):
                await ex.exec("sleep 30")
        assert time.monotonic() - started < 3
        with anyio.fail_after(5):
            await task.wait()
        assert (task.status, task.end_cause) == ("killed", "lost")
        result = await ex.exec("echo back")
        assert result.stdout.text == "back\n"
        assert ex.container_id != first


async def test_container_mode_raises_while_stopped_and_works_again(docker_test_image: str) -> None:
    container = start_idle_container(docker_test_image)
    try:
        wrapped = container.get_wrapped_container()
        async with DockerBashExecutor(DockerConfig(container=wrapped.id, grace_ms=300)) as ex:
            await anyio.to_thread.run_sync(lambda: wrapped.stop(timeout=0))
            with pytest.raises(BashInfrastructureError, match="is not running"):
                await ex.exec("true")
            await anyio.to_thread.run_sync(wrapped.start)
            assert (await ex.exec("echo again")).stdout.text == "again\n"
    finally:
        container.stop()


async def test_a_stopped_container_is_named_stopped_whichever_engine_call_failed(
    docker_test_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine drops a stopped container's execs: a call on one answers 404 ("no such exec").
    That says nothing of the container, which still exists and is named as stopped, not missing
    (a loaded CI run said "does not exist" of a container it went on to start again)."""
    container = start_idle_container(docker_test_image)
    try:
        wrapped = container.get_wrapped_container()
        async with DockerBashExecutor(DockerConfig(container=wrapped.id, grace_ms=300)) as ex:
            await anyio.to_thread.run_sync(lambda: wrapped.stop(timeout=0))

            async def exec_dropped(*args: object, **kwargs: object) -> str:
                raise EngineError("No such exec instance", 404)

            monkeypatch.setattr(ex._engine, "exec_create", exec_dropped)
            with pytest.raises(BashInfrastructureError, match="is not running; the executor never starts"):
                await ex.exec("true")
    finally:
        container.stop()


async def test_unreachable_engine_and_missing_image_are_named(docker_test_image: str) -> None:
    with pytest.raises(BashInfrastructureError, match=r"unix:///nonexistent\.sock is unreachable"):
        async with DockerBashExecutor(_config(docker_test_image, docker_host="unix:///nonexistent.sock")):
            pass
    with pytest.raises(BashInfrastructureError, match=r"not present locally.*pull"):
        async with DockerBashExecutor(_config("dsh-bash-no-such-image:never")):
            pass
    with pytest.raises(BashInfrastructureError, match="does not exist"):
        async with DockerBashExecutor(DockerConfig(container="dsh-bash-no-such-container")):
            pass


async def test_env_values_never_reach_inspect_output(
    docker_test_image: str, docker_client: docker.DockerClient
) -> None:
    secret = "kit-secret-value-8c1f"
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        task = await ex.start(ex.resolve(BashExecRequest(command="sleep 2", env={"MY_SECRET": secret})))
        await anyio.sleep(0.3)
        async with EngineClient(Endpoint.parse(None)) as engine:
            info = await engine.container_inspect(ex.container_id)
            assert secret not in json.dumps(info)
            assert info["ExecIDs"]
            for exec_id in info["ExecIDs"]:
                assert secret not in json.dumps(await engine.exec_inspect(exec_id))
        await ex.kill(task.id)


async def test_read_only_container_keeps_spill_files_on_a_tmpfs(docker_test_image: str) -> None:
    async with DockerBashExecutor(_config(docker_test_image, read_only=True, max_output_bytes=10)) as ex:
        denied = await ex.exec("touch /not-writable")
        assert denied.exit_code != 0
        result = await ex.exec("printf '%050d' 0")
        assert result.stdout.spill_path is not None
        size = await ex.exec(f"wc -c < {result.stdout.spill_path}")
        assert size.stdout.text.strip() == "50"


async def test_kill_works_when_the_pids_limit_is_exhausted(docker_test_image: str) -> None:
    async with DockerBashExecutor(_config(docker_test_image, pids_limit=24)) as ex:
        token = ex._token
        fill = "for i in $(seq 40); do sleep 300 & done 2>/dev/null; exec sleep 300"
        task = await ex.start(ex.resolve(BashExecRequest(command=fill)))
        # The loop forks until the limit refuses it; on a loaded machine that takes a while.
        with anyio.fail_after(10):
            while _marked(token) < 15:  # noqa: ASYNC110 - processes are polled
                await anyio.sleep(0.1)
        assert await ex.kill(task.id) is True
        with anyio.fail_after(5):
            await task.wait()
        assert task.status == "killed"
        for _ in range(50):
            if _marked(token) == 0:
                break
            await anyio.sleep(0.05)
        assert _marked(token) == 0


async def test_sweep_removes_containers_whose_creator_is_gone(
    docker_test_image: str, docker_client: docker.DockerClient
) -> None:
    dead_pid = 999_999_999  # above any pid_max: no process can have it
    orphan = docker_client.containers.run(
        docker_test_image,
        command=["sleep", "300"],
        detach=True,
        labels={MANAGED_LABEL: "orphan", "dsh-bash.owner-pid": str(dead_pid), SESSION_LABEL: SESSION_ID},
    )
    alive = docker_client.containers.run(
        docker_test_image,
        command=["sleep", "300"],
        detach=True,
        labels={MANAGED_LABEL: "alive", "dsh-bash.owner-pid": "1", SESSION_LABEL: SESSION_ID},
    )
    try:
        removed = await sweep_orphaned_containers()
        assert orphan.id in removed
        assert alive.id not in removed
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(orphan.id)
    finally:
        alive.remove(force=True)
