"""Docker faults: the container killed or removed mid-command and mid-task; the engine restarted.

Image mode recovers with a fresh container; container mode raises until the container is back, then
works again. The engine restart uses a private dockerd (``second_engine`` in fault_support), never
the shared one. See docs/faults.md for each outcome.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import docker
import docker.errors
import pytest
from docker_support import IDLE_COMMAND, SESSION_ID, SESSION_LABEL, start_idle_container
from dsh_bash_docker import DockerBashExecutor, DockerConfig
from fault_support import GRACE_MS, SecondEngine, eventually_gone, wait_for_processes

from dsh_bash import BashExecRequest, BashInfrastructureError

pytestmark = [pytest.mark.faults, pytest.mark.docker, pytest.mark.anyio]

Fault = Literal["kill", "remove"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _image_executor(image: str, **fields: Any) -> DockerBashExecutor:
    return DockerBashExecutor(
        DockerConfig(image=image, grace_ms=GRACE_MS, labels={SESSION_LABEL: SESSION_ID}, **fields)
    )


def _fault(docker_client: docker.DockerClient, container_id: str, fault: Fault) -> Callable[[], None]:
    def act() -> None:
        container = docker_client.containers.get(container_id)
        if fault == "kill":
            container.kill()
        else:
            container.remove(force=True)

    return act


async def _run_fails_when(marker: str, run: Awaitable[Any], fault: Callable[[], None]) -> float:
    """Await ``run`` while ``fault`` strikes once the command runs; return how long ``run`` took to fail."""
    started = time.monotonic()
    failed_at = 0.0

    async def strike() -> None:
        await wait_for_processes(marker)
        await anyio.to_thread.run_sync(fault)

    async with anyio.create_task_group() as tg:
        tg.start_soon(strike)
        with pytest.raises(BashInfrastructureError) as raised:
            await run
        failed_at = time.monotonic()
    print(f"the run was told: {raised.value}")
    return failed_at - started


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["kill", "remove"])
async def test_image_mode_container_lost_mid_command_and_mid_task(
    docker_test_image: str, docker_client: docker.DockerClient, marker: str, fault: Fault
) -> None:
    async with _image_executor(docker_test_image) as ex:
        first = ex.container_id
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"echo task-before; bash -c 'sleep 60; :' {marker}-task"))
        )
        await wait_for_processes(f"{marker}-task")
        took = await _run_fails_when(
            f"{marker}-run",
            ex.exec(f"echo run-before; bash -c 'sleep 60; :' {marker}-run"),
            _fault(docker_client, first, fault),
        )
        assert took < 10, took
        with anyio.fail_after(10):
            await task.wait()
        # The task is told the truth: the backend failed under it; what it printed is still readable.
        assert (task.status, task.end_cause) == ("killed", "lost")
        assert (task.exit_code, task.signal) == (None, None)
        assert (await ex.read_output(task.id)).delta == "task-before\n"
        assert await eventually_gone(marker, 5) == []
        assert await eventually_gone(f"{marker}-task", 5) == []
        # Recovery: the next command runs in a fresh container.
        result = await ex.exec("echo back")
        assert result.stdout.text == "back\n"
        assert ex.container_id != first
        second = ex.container_id
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(second)
    if fault == "kill":  # the killed container is not left behind either
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(first)


_DOOMED_HARNESS = """
import sys, anyio
from dsh_bash import BashExecRequest
from dsh_bash_docker import DockerBashExecutor, DockerConfig

async def main():
    image, label, session, marker = sys.argv[1:5]
    async with DockerBashExecutor(DockerConfig(image=image, labels={label: session})) as ex:
        await ex.start(ex.resolve(BashExecRequest(command=f"bash -c 'sleep 300; :' {marker}")))
        print(ex.container_id, flush=True)
        await anyio.sleep(300)

anyio.run(main)
"""


@pytest.mark.timeout(90)
async def test_a_harness_that_dies_leaves_its_container_ended(
    docker_test_image: str, docker_client: docker.DockerClient, marker: str
) -> None:
    """A harness killed with SIGKILL (no close ran): its command dies (the supervisor's stream
    dropped), and so does its container, whose stdin was its tie to the harness; it is left
    stopped, for ``sweep_orphaned_containers``."""
    argv = [sys.executable, "-c", _DOOMED_HARNESS, docker_test_image, SESSION_LABEL, SESSION_ID, marker]
    harness = await anyio.open_process(argv, stdout=subprocess.PIPE, stderr=None)
    try:
        assert harness.stdout is not None
        said = b""
        with anyio.fail_after(60):
            while not said.endswith(b"\n"):
                said += await harness.stdout.receive()
        container_id = said.decode().strip()
        await wait_for_processes(marker)
    finally:
        harness.kill()
        await harness.aclose()
    container = docker_client.containers.get(container_id)
    try:
        deadline = time.monotonic() + 20
        while container.attrs["State"]["Running"] and time.monotonic() < deadline:
            await anyio.sleep(0.2)
            container.reload()
        assert not container.attrs["State"]["Running"], "the container outlived its harness"
        assert await eventually_gone(marker, 5) == []
    finally:
        container.remove(force=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["kill", "remove"])
async def test_container_mode_raises_until_the_container_is_back(
    docker_test_image: str, docker_client: docker.DockerClient, marker: str, fault: Fault
) -> None:
    name = f"dshfault-{marker[-12:]}"

    def start_container() -> None:
        docker_client.containers.run(
            docker_test_image,
            command=["bash", "-c", IDLE_COMMAND],
            name=name,
            detach=True,
            init=True,
            network_mode="none",
            labels={SESSION_LABEL: SESSION_ID},
        )

    start_container()
    try:
        async with DockerBashExecutor(DockerConfig(container=name, grace_ms=GRACE_MS)) as ex:
            task = await ex.start(
                ex.resolve(BashExecRequest(command=f"echo task-before; bash -c 'sleep 60; :' {marker}-t"))
            )
            await wait_for_processes(f"{marker}-t")
            took = await _run_fails_when(
                f"{marker}-run",
                ex.exec(f"bash -c 'sleep 60; :' {marker}-run"),
                _fault(docker_client, name, fault),
            )
            assert took < 10, took
            with anyio.fail_after(10):
                await task.wait()
            assert (task.status, task.end_cause) == ("killed", "lost")
            assert (await ex.read_output(task.id)).delta == "task-before\n"
            assert await eventually_gone(marker, 5) == []
            # Until the container is back, every call raises and names the problem.
            state = "is not running" if fault == "kill" else "does not exist"
            for _ in range(2):
                with pytest.raises(BashInfrastructureError, match=state):
                    await ex.exec("true")
            with pytest.raises(BashInfrastructureError, match=state):
                await ex.start(ex.resolve(BashExecRequest(command="true")))
            # Back (restarted, or made again under the same name): the executor works again.
            if fault == "kill":
                await anyio.to_thread.run_sync(lambda: docker_client.containers.get(name).start())
            else:
                await anyio.to_thread.run_sync(start_container)
            assert (await ex.exec("echo again")).stdout.text == "again\n"
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.containers.get(name).remove(force=True)


# -- the engine restarted ----------------------------------------------------------------------------


@pytest.mark.timeout(150)
async def test_engine_restart_image_mode_recovers_with_a_fresh_container(
    second_engine: SecondEngine, docker_test_image: str, marker: str
) -> None:
    config = DockerConfig(image=docker_test_image, docker_host=second_engine.url, grace_ms=GRACE_MS)
    async with DockerBashExecutor(config) as ex:
        first = ex.container_id
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"echo task-before; bash -c 'sleep 60; :' {marker}-t"))
        )
        await wait_for_processes(f"{marker}-t")
        took = await _run_fails_when(
            f"{marker}-run",
            ex.exec(f"echo run-before; bash -c 'sleep 60; :' {marker}-run"),
            second_engine.restart,
        )
        print(f"engine restart: the run failed after {took:.1f}s")
        with anyio.fail_after(20):
            await task.wait()
        assert (task.status, task.end_cause) == ("killed", "lost")
        assert (await ex.read_output(task.id)).delta == "task-before\n"
        assert await eventually_gone(marker, 5) == []
        assert await eventually_gone(f"{marker}-t", 5) == []
        result = await ex.exec("echo back")
        assert result.stdout.text == "back\n"
        assert ex.container_id != first
        second = ex.container_id
    # Both containers are gone: the stopped one (removed at recreation) and the fresh one (at close).
    remaining = second_engine.docker("ps", "-aq", "--no-trunc").split()
    assert first not in remaining
    assert second not in remaining


@pytest.mark.timeout(150)
async def test_engine_restart_container_mode_raises_until_restarted(
    second_engine: SecondEngine, docker_test_image: str, marker: str
) -> None:
    container = second_engine.docker(
        "run", "-d", "--init", "--network", "none", docker_test_image, "bash", "-c", IDLE_COMMAND
    )
    config = DockerConfig(container=container, docker_host=second_engine.url, grace_ms=GRACE_MS)
    try:
        async with DockerBashExecutor(config) as ex:
            task = await ex.start(ex.resolve(BashExecRequest(command=f"bash -c 'sleep 60; :' {marker}-t")))
            await wait_for_processes(f"{marker}-t")
            await _run_fails_when(
                f"{marker}-run", ex.exec(f"bash -c 'sleep 60; :' {marker}-run"), second_engine.restart
            )
            with anyio.fail_after(20):
                await task.wait()
            assert (task.status, task.end_cause) == ("killed", "lost")
            assert await eventually_gone(f"{marker}-t", 5) == []
            with pytest.raises(BashInfrastructureError, match="is not running"):
                await ex.exec("true")
            second_engine.docker("start", container)
            assert (await ex.exec("echo again")).stdout.text == "again\n"
    finally:
        second_engine.docker("rm", "-f", container)


@pytest.mark.timeout(60)
async def test_a_command_that_kills_its_supervisor_is_lost_not_forged(
    docker_test_image: str, marker: str
) -> None:
    """The command's parent is its dsh-supervise (same user: it can kill it). The stream then ends
    without the supervisor's last record: the run is ``command_lost`` (never the exit 0 the command
    asks for), and what the supervisor held is killed by marker."""
    async with _image_executor(docker_test_image) as ex:
        assert ex.containment == "subreaper"
        with pytest.raises(BashInfrastructureError) as raised:
            await ex.exec(
                f"(setsid bash -c 'sleep 1000; :' {marker} &); kill -9 $PPID; sleep 0.5; exit 0",
                timeout_ms=10_000,
            )
        assert raised.value.reason == "command_lost", raised.value
        assert await ex.exec("echo still works") is not None
    assert await eventually_gone(marker, 5.0) == []


@pytest.mark.timeout(60)
async def test_a_supervisor_that_dies_without_a_word_leaves_the_outcome_unknown(
    docker_test_image: str,
) -> None:
    """A supervisor killed before the boot verdict was relayed (a command's first `kill -9 $PPID`
    can win that race: a CI run saw it) says nothing and ends by a signal. The command may have
    run: ``command_lost``, never "could not start". The race made certain: root in an attached
    container plants a supervisor that kills itself at once (no warm execs: one started before the
    planting runs the real supervisor)."""
    container = start_idle_container(docker_test_image)
    try:
        config = DockerConfig(container=container.get_wrapped_container().id, grace_ms=GRACE_MS, warm_execs=0)
        async with DockerBashExecutor(config) as ex:
            planted = await ex.exec(
                'p="/.dsh-bash/$(ls /.dsh-bash/)"; rm -f "$p"; '
                'printf "#!/bin/sh\\nkill -9 \\$\\$\\n" > "$p"; chmod 0755 "$p"; echo planted'
            )
            assert planted.stdout.text == "planted\n", planted
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec("echo never relayed")
            assert raised.value.reason == "command_lost", raised.value
    finally:
        container.stop()


@pytest.mark.timeout(60)
async def test_a_removed_supervisor_is_installed_again(docker_test_image: str) -> None:
    """Attached to a container where commands run as root with the engine's default capabilities, a
    command may remove the supervisor's file: the next command puts it back (once per start)
    instead of every later command failing to start."""
    container = start_idle_container(docker_test_image)
    try:
        config = DockerConfig(container=container.get_wrapped_container().id, grace_ms=GRACE_MS)
        async with DockerBashExecutor(config) as ex:
            assert ex.containment == "subreaper"
            removed = await ex.exec("rm -rf /.dsh-bash && ls -a / | grep -c dsh-bash")
            assert removed.stdout.text == "0\n", removed
            result = await ex.exec("kill -TERM $$")
            assert (result.signal, result.exit_code) == ("SIGTERM", None), result
            assert ex.containment == "subreaper"
    finally:
        container.stop()


# Tries every way a root without capabilities has to replace the supervisor's binary, then plants a
# fake that would answer for the next command.
_REPLACE_SUPERVISOR = r"""
p="/.dsh-bash/$(ls /.dsh-bash/)"
printf '#!/bin/sh\necho FORGED\nexit 0\n' > /tmp/fake && chmod 0755 /tmp/fake
replaced() { cmp -s /tmp/fake "$p"; }
replaced || cp /tmp/fake "$p" 2>/dev/null
replaced || { rm -f "$p" && cp /tmp/fake "$p"; } 2>/dev/null
replaced || { mv /.dsh-bash /.moved && mkdir /.dsh-bash && cp /tmp/fake "$p"; } 2>/dev/null
replaced || { chmod 0777 /.dsh-bash && cp /tmp/fake "$p"; } 2>/dev/null
replaced || { umount /.dsh-bash && cp /tmp/fake "$p"; } 2>/dev/null
replaced && echo REPLACED || echo intact
"""


@pytest.mark.timeout(60)
async def test_root_in_an_image_mode_container_cannot_replace_the_supervisor(docker_test_image: str) -> None:
    """Image mode: the binary lives on a tmpfs of a user no command runs as, read-only; root in the
    container (no capabilities) can neither write, remove, rename nor remount it, so the next
    command's outcome is its own (issue 30: before, a fake put there answered ``exit_code=0``)."""
    async with _image_executor(docker_test_image) as ex:
        assert ex.containment == "subreaper"
        attack = await ex.exec(_REPLACE_SUPERVISOR)
        assert attack.stdout.text.endswith("intact\n"), attack
        result = await ex.exec("echo real; kill -TERM $$")
        assert (result.signal, result.exit_code, result.stdout.text) == ("SIGTERM", None, "real\n"), result
