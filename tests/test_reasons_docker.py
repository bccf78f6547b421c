"""The Docker backend names why it failed: ``BashInfrastructureError.reason``, against the real engine.

Each test reaches one cause for real (a missing workdir, an image without bash, a container removed
under a command...) and asserts the reason the backend gives it; the message is for people, and is
looked at only where it must carry the engine's own words.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import docker
import docker.errors
import pytest
from docker_support import BUSYBOX_STATIC, IDLE_COMMAND, SESSION_ID, SESSION_LABEL, start_idle_container
from dsh_bash_docker import MANAGED_LABEL, DockerBashExecutor, DockerConfig
from fault_support import wait_for_processes

from dsh_bash import BashExecRequest, BashInfrastructureError, ExecutorClosedError

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

#: An image without bash: busybox alone (its sh, no bash), built like the test image.
_NO_BASH_DOCKERFILE = """\
FROM scratch
COPY bin/ /bin/
RUN ["/bin/busybox","--install","-s","/bin"]
CMD ["/bin/sleep","infinity"]
"""
_NO_BASH_TAG = "dsh-bash-test-nobash:1"
_build_lock = threading.Lock()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _image(image: str, **fields: object) -> DockerBashExecutor:
    labels = {SESSION_LABEL: SESSION_ID}  # removed at session end even if a test fails
    return DockerBashExecutor(DockerConfig(image=image, grace_ms=300, labels=labels, **fields))  # type: ignore[arg-type]


def _container(container: str, **fields: object) -> DockerBashExecutor:
    return DockerBashExecutor(DockerConfig(container=container, grace_ms=300, **fields))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def no_bash_image(docker_test_image: str) -> str:
    """The tag of a FROM-scratch image holding busybox only (built once, reused across runs)."""
    client = docker.from_env()
    try:
        with _build_lock:
            try:
                client.images.get(_NO_BASH_TAG)
            except docker.errors.ImageNotFound:
                with tempfile.TemporaryDirectory(prefix="dsh-bash-nobash-") as context:
                    (Path(context) / "bin").mkdir()
                    shutil.copy2(BUSYBOX_STATIC, Path(context, "bin", "busybox"))
                    Path(context, "Dockerfile").write_text(_NO_BASH_DOCKERFILE)
                    client.images.build(path=context, tag=_NO_BASH_TAG, pull=False, rm=True)
    finally:
        client.close()
    return _NO_BASH_TAG


@pytest.fixture
def no_bash_container(no_bash_image: str) -> Iterator[str]:
    """A running container of the busybox-only image (its PID 1 is busybox's sleep)."""
    client = docker.from_env()
    container = client.containers.run(
        no_bash_image,
        command=["sleep", "3600"],
        detach=True,
        init=True,
        network_mode="none",
        labels={SESSION_LABEL: SESSION_ID},
    )
    try:
        yield str(container.id)
    finally:
        container.remove(force=True)
        client.close()


async def _reason_of_open(executor: DockerBashExecutor) -> str:
    with pytest.raises(BashInfrastructureError) as raised:
        async with executor:
            pass
    return raised.value.reason


async def test_workdir_missing_and_not_a_directory(docker_session_container: str) -> None:
    async with _container(docker_session_container) as ex:
        for workdir, reason in (
            ("/nonexistent/dsh-bash", "workdir_missing"),
            ("/bin/bash", "workdir_not_directory"),
        ):
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec("true", workdir=workdir)
            assert raised.value.reason == reason, raised.value
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.start(ex.resolve(BashExecRequest(command="true", workdir=workdir)))
            assert raised.value.reason == reason, raised.value
        assert (await ex.exec("echo fine")).stdout.text == "fine\n"  # the executor is still usable


async def test_workdir_not_accessible(
    docker_session_container: str, docker_client: docker.DockerClient, marker: str
) -> None:
    private = f"/tmp/{marker}-private"  # made by root, mode 0700: another user cannot enter it
    made = docker_client.containers.get(docker_session_container).exec_run(["mkdir", "-m", "700", private])
    assert made.exit_code == 0, made.output
    async with _container(docker_session_container, user="65534") as ex:
        assert (await ex.exec("id -u")).stdout.text == "65534\n"
        with pytest.raises(BashInfrastructureError) as raised:
            await ex.exec("true", workdir=private)
        assert raised.value.reason == "workdir_not_accessible", raised.value


async def test_shell_missing_in_image_and_container_mode(no_bash_image: str, no_bash_container: str) -> None:
    assert await _reason_of_open(_image(no_bash_image)) == "shell_missing"
    assert await _reason_of_open(_container(no_bash_container)) == "shell_missing"


async def test_image_missing(docker_test_image: str) -> None:
    executor = _image(f"{docker_test_image.split(':', maxsplit=1)[0]}:no-such-tag", pull="never")
    assert await _reason_of_open(executor) == "image_missing"


async def test_container_missing_at_open() -> None:
    assert await _reason_of_open(_container("dsh-bash-no-such-container")) == "container_missing"


async def test_container_missing_after_open(docker_test_image: str) -> None:
    """Container mode: starting a command in the container once it is gone (nothing was running)."""
    container = start_idle_container(docker_test_image)
    wrapped = container.get_wrapped_container()
    try:
        async with _container(wrapped.id) as ex:
            await anyio.to_thread.run_sync(lambda: wrapped.stop(timeout=0))
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec("true")
            assert raised.value.reason == "container_missing", raised.value
    finally:
        container.stop()


async def _error_of_open(executor: DockerBashExecutor) -> BashInfrastructureError:
    with pytest.raises(BashInfrastructureError) as raised:
        async with executor:
            pass
    return raised.value


async def test_user_unknown_in_image_and_container_mode(
    docker_test_image: str, docker_session_container: str
) -> None:
    for executor in (
        _image(docker_test_image, user="nonexistent"),
        _container(docker_session_container, user="nonexistent"),
    ):
        error = await _error_of_open(executor)
        assert error.reason == "user_unknown", error
        # Issue 16: the engine's own words (it says them on the exec's stdout) reach the message.
        assert "unable to find user nonexistent" in str(error), error
    # A numeric id needs no passwd entry: it is no unknown user, and it works.
    async with _container(docker_session_container, user="4242:4242") as ex:
        assert (await ex.exec("id -u")).stdout.text == "4242\n"


@pytest.mark.parametrize("mode", ["image", "container"])
async def test_a_spec_user_switches_the_exec_user(
    docker_test_image: str, docker_session_container: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    executor = _image(docker_test_image) if mode == "image" else _container(docker_session_container)
    async with executor as ex:
        configured = (await ex.exec("id -u")).stdout.text
        # A numeric id needs no passwd entry; the engine switches the exec to it.
        as_other = await ex.exec("id -u; id -g", user="4242")
        assert as_other.stdout.text.split() == ["4242", "0"], as_other
        # Long commands (a script file of the user's own: the spill directory is not its to enter).
        long = await ex.exec(f": {'x' * 200_000}\nid -u", user="4242")
        assert long.stdout.text == "4242\n", long
        # Background tasks too; the next command runs as the configured user again.
        task = await ex.start(ex.resolve(BashExecRequest(command="id -u", user="4242")))
        await task.wait()
        assert (await ex.read_output(task.id)).delta == "4242\n"
        assert (await ex.exec("id -u")).stdout.text == configured
        caplog.set_level(logging.INFO)
        for verb in ("run", "start"):
            spec = ex.resolve(BashExecRequest(command="true", user="nonexistent"))
            with pytest.raises(BashInfrastructureError) as refused:
                await (ex.run(spec) if verb == "run" else ex.start(spec))
            assert refused.value.reason == "user_unknown", (verb, refused.value)
            # The engine's own words, which come on the exec's stream where frames were expected.
            assert "unable to find user nonexistent" in str(refused.value), (verb, refused.value)
        assert (await ex.exec("printf ok")).stdout.text == "ok"
    # A refused user is no broken stream, and no process of it can run: nothing to warn about.
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings


def _left_by(client: docker.DockerClient, executor: DockerBashExecutor) -> list[str]:
    """Every container (any state) that ``executor`` created: its token is their managed label."""
    found = client.containers.list(all=True, filters={"label": f"{MANAGED_LABEL}={executor._token}"})
    return [f"{container.short_id} ({container.status})" for container in found]


@pytest.mark.timeout(60)
async def test_a_failed_open_in_image_mode_leaves_no_container(
    docker_test_image: str, no_bash_image: str, docker_client: docker.DockerClient
) -> None:
    # Issue 16: a container created (or started) by an open that then fails is removed, whatever
    # failed: the start (an unknown user) or the first exec (an image without bash, whose init ends).
    for executor, reason in (
        (_image(docker_test_image, user="nonexistent"), "user_unknown"),
        (_image(no_bash_image), "shell_missing"),
    ):
        assert (await _error_of_open(executor)).reason == reason
        assert _left_by(docker_client, executor) == []


@pytest.mark.timeout(60)
async def test_a_failed_open_in_container_mode_leaves_no_spill_directory(docker_test_image: str) -> None:
    # Issue 16: the spill directory is made before the supervisor is installed; when the install
    # then fails (a read-only root: no upload, no write as root) and containment = 'subreaper'
    # refuses to open without it, the spill directory is removed again.
    client = docker.from_env()
    container = client.containers.run(
        docker_test_image,
        command=IDLE_COMMAND,
        detach=True,
        init=True,
        network_mode="none",
        read_only=True,
        tmpfs={"/tmp": "rw,mode=1777"},
        labels={SESSION_LABEL: SESSION_ID},
    )
    try:
        error = await _error_of_open(_container(str(container.id), containment="subreaper"))
        assert error.reason == "start_failed" and "subreaper" in str(error), error
        listing = container.exec_run(["bash", "-c", "ls -A /tmp"])
        assert (listing.exit_code, listing.output) == (0, b"")
    finally:
        container.remove(force=True)
        client.close()


async def test_engine_unreachable(docker_test_image: str, tmp_path: Path) -> None:
    # A unix socket path with nothing listening (never another address: the tests stay on loopback).
    executor = _image(docker_test_image, docker_host=f"unix://{tmp_path}/nothing.sock")
    assert await _reason_of_open(executor) == "engine_unreachable"


@pytest.mark.parametrize("mode", ["image", "container"])
async def test_container_gone_under_a_run(
    docker_test_image: str, docker_client: docker.DockerClient, marker: str, mode: str
) -> None:
    idle = start_idle_container(docker_test_image) if mode == "container" else None
    try:
        executor = _image(docker_test_image) if idle is None else _container(idle.get_container_id())
        async with executor as ex:
            container_id = ex.container_id

            async def remove_once_running() -> None:
                await wait_for_processes(marker)
                await anyio.to_thread.run_sync(
                    lambda: docker_client.containers.get(container_id).remove(force=True)
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(remove_once_running)
                with pytest.raises(BashInfrastructureError) as raised:
                    await ex.exec(f"bash -c 'sleep 60; :' {marker}")
            assert raised.value.reason == "container_gone", raised.value
    finally:
        if idle is not None:
            with contextlib.suppress(docker.errors.NotFound):
                idle.stop()


async def test_closed(docker_session_container: str) -> None:
    ex = _container(docker_session_container)
    with pytest.raises(BashInfrastructureError) as raised:
        await ex.exec("true")  # not entered yet
    assert raised.value.reason == "closed"
    async with ex:
        spec = ex.resolve(BashExecRequest(command="true"))
    for call in (ex.run(spec), ex.start(spec)):
        with pytest.raises(ExecutorClosedError) as closed:
            await call
        assert closed.value.reason == "closed"
