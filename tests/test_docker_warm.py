"""Warm execs on Docker: supervisors started ahead of the next commands (``DockerConfig.warm_execs``).

A command that takes a spare must be indistinguishable from one that had a fresh exec: the same
environment, outcome and containment; no value waits in a spare; dead spares are replaced; a burst
takes spares and fresh execs alike; close leaves no waiting exec.
"""

from __future__ import annotations

import logging

import anyio
import docker
import pytest
from docker_support import SESSION_ID, SESSION_LABEL
from dsh_bash_docker import DockerBashExecutor, DockerConfig

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.timeout(90)]

WARM_LOG = "in warm exec"
#: Everything of the command's environment but what differs per command by design.
ENV = "env | grep -v -e '^DSH_BASH_MARK=' -e '^_=' -e '^SHLVL=' | sort"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _config(image: str, **fields: object) -> DockerConfig:
    labels = {SESSION_LABEL: SESSION_ID}
    return DockerConfig(image=image, grace_ms=300, labels=labels, **fields)  # type: ignore[arg-type]


def _warm_runs(caplog: pytest.LogCaptureFixture) -> int:
    return sum(WARM_LOG in record.getMessage() for record in caplog.records)


async def _spares_waiting_within(container_id: str, count: int, seconds: float = 5.0) -> bool:
    """Whether ``count`` spares wait in the container within ``seconds``: ``ready()`` returns once the
    engine started each spare's exec, a moment before its process shows the supervisor's command
    line (seen under a loaded CI run)."""
    with anyio.move_on_after(seconds):
        while _waiting_spares(container_id) != count:  # noqa: ASYNC110 - a count seen from outside: nothing notifies it
            await anyio.sleep(0.05)
        return True
    return False


def _waiting_spares(container_id: str) -> int:
    """Waiting spares in a container, counted from outside: supervisors whose command line still
    says --spec (cleared once a command came). The pattern does not match the looking bash's own."""
    client = docker.from_env()
    try:
        listing = client.containers.get(container_id).exec_run(
            ["bash", "-c", "grep -l -e 'sp[e]c' /proc/[0-9]*/cmdline || true"]
        )
    finally:
        client.close()
    return len(listing.output.split())


async def test_a_warm_command_sees_what_a_fresh_one_sees(
    docker_test_image: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dsh_bash")
    environment = {"GREETING": "plain value", "EMPTY_ONE": ""}
    async with DockerBashExecutor(_config(docker_test_image, environment=environment, warm_execs=0)) as fresh:
        cold = await fresh.exec(ENV, env={"EXPLICIT_ONE": "x y"}, workdir="/tmp")
    assert _warm_runs(caplog) == 0
    async with DockerBashExecutor(_config(docker_test_image, environment=environment, warm_execs=2)) as ex:
        assert await ex._warm.ready()
        warm = await ex.exec(ENV, env={"EXPLICIT_ONE": "x y"}, workdir="/tmp")
        assert _warm_runs(caplog) == 1
        stdin = await ex.exec("cat; exit 3", stdin="piped\n")
        assert (stdin.exit_code, stdin.stdout.text) == (3, "piped\n")
        killed = await ex.exec("kill -TERM $$")
        assert killed.signal == "SIGTERM"
    host = [line for line in cold.stdout.text.splitlines() if not line.startswith("HOSTNAME=")]
    assert [line for line in warm.stdout.text.splitlines() if not line.startswith("HOSTNAME=")] == host
    assert {"GREETING=plain value", "EMPTY_ONE=", "EXPLICIT_ONE=x y", "PWD=/tmp"} <= set(host)


async def test_a_dead_spare_is_replaced_and_the_next_command_works(
    docker_test_image: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dsh_bash")
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        assert await ex._warm.ready()
        assert await _spares_waiting_within(ex.container_id, 2)
        # A command of the same user kills every waiting spare.
        await ex.exec("pkill -9 -f -- '--frame --spec'; sleep 0.3")
        runs = _warm_runs(caplog)
        for _ in range(3):
            result = await ex.exec("echo ok")
            assert (result.exit_code, result.stdout.text) == (0, "ok\n")
        assert _warm_runs(caplog) > runs  # replaced spares served again
        assert await ex._warm.ready() and await _spares_waiting_within(ex.container_id, 2)


async def test_a_burst_takes_spares_and_fresh_execs(docker_test_image: str) -> None:
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        await ex._warm.ready()
        results: dict[int, str] = {}

        async def one(n: int) -> None:
            results[n] = (await ex.exec(f"echo {n}", timeout_ms=30_000)).stdout.text

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for n in range(50):
                    tg.start_soon(one, n)
        assert results == {n: f"{n}\n" for n in range(50)}
        assert await ex._warm.ready() and await _spares_waiting_within(ex.container_id, 2)


async def test_close_leaves_no_waiting_exec(
    docker_session_container: str,
) -> None:
    async with DockerBashExecutor(DockerConfig(container=docker_session_container, grace_ms=300)) as ex:
        assert await ex._warm.ready()
        assert await _spares_waiting_within(docker_session_container, 2)
    # The supervisors read end of file when their streams close and exit at once; a moment to go.
    for _ in range(50):
        if not _waiting_spares(docker_session_container):
            break
        await anyio.sleep(0.1)
    assert _waiting_spares(docker_session_container) == 0


async def test_no_warm_exec_when_disabled(docker_test_image: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dsh_bash")
    async with DockerBashExecutor(_config(docker_test_image, warm_execs=0)) as ex:
        assert not await ex._warm.ready()
        assert (await ex.exec("echo ok")).stdout.text == "ok\n"
        assert _waiting_spares(ex.container_id) == 0
    assert _warm_runs(caplog) == 0
