"""The Docker backend against engines "on other machines": ``tcp://`` with TLS, and ``ssh://``.

Both are real and on loopback (``tests/remote_engines.py``): a second dockerd that listens only on
TLS with certificates the fixture made (client certificate required), and ``ssh://dshdocker@127.0.0.1``
through the test sshd, whose ``docker system dial-stdio`` reaches this machine's engine. Neither is
taken for a local engine: nothing is read from this host's ``/proc`` for them, although here it
could be. Over each, the kit's checks that a transport can break
(``kit_targets.REMOTE_ENGINE_CHECKS``; ``DSH_TEST_REMOTE_KIT=all``: the whole kit in both modes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import pytest
from docker_support import DockerMode, docker_target
from dsh_bash_conformance import CHECKS, run_kit
from dsh_bash_docker import DockerBashExecutor, DockerConfig
from kit_targets import REMOTE_ENGINE_CHECKS, expected_outcome, reused_target
from remote_engines import SshEngine, TlsEngine
from ssh_support import TEST_USER

from dsh_bash import BashExecRequest, BashInfrastructureError, ConfigError

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


RemoteKind = str  # "tls" or "ssh"
#: Over each transport, in one mode each (TLS in image mode: the container's create and removal go
#: over it too; ssh:// in container mode), the checks a transport and a host whose /proc is not read
#: can break (``kit_targets.REMOTE_ENGINE_CHECKS``); the whole kit runs on the local engine in both
#: modes. The mode and the transport are independent, and every row of the full matrix (both modes
#: over both, the whole kit) passed when this was built; DSH_TEST_REMOTE_KIT=all runs it.
_FULL_MATRIX = os.environ.get("DSH_TEST_REMOTE_KIT") == "all"
_MODES: dict[RemoteKind, tuple[DockerMode, ...]] = (
    {"tls": ("image", "container"), "ssh": ("image", "container")}
    if _FULL_MATRIX
    else {"tls": ("image",), "ssh": ("container",)}
)
_CHECKS = list(CHECKS) if _FULL_MATRIX else list(REMOTE_ENGINE_CHECKS)
CASES: list[tuple[str, DockerMode, RemoteKind]] = [
    (name, mode, kind) for kind in ("tls", "ssh") for mode in _MODES[kind] for name in _CHECKS
]


def test_the_remote_subset_names_real_checks() -> None:
    assert set(REMOTE_ENGINE_CHECKS) <= set(CHECKS)
    assert len(set(REMOTE_ENGINE_CHECKS)) == len(REMOTE_ENGINE_CHECKS)


def tls_connection(engine: TlsEngine) -> dict[str, Any]:
    return {
        "docker_host": engine.url,
        "tls_ca_cert": engine.ca_cert,
        "tls_client_cert": engine.client_cert,
        "tls_client_key": engine.client_key,
    }


def ssh_connection(engine: SshEngine) -> dict[str, Any]:
    return {
        "docker_host": engine.url,
        "ssh_client_keys": [engine.client_key],
        "ssh_known_hosts": engine.known_hosts,
    }


def _remote(
    kind: RemoteKind, request: pytest.FixtureRequest
) -> tuple[
    TlsEngine | SshEngine,
    dict[str, Any],
    Callable[[str, Mapping[str, str]], tuple[str, Callable[[], None]]] | None,
]:
    if kind == "tls":
        tls: TlsEngine = request.getfixturevalue("tls_engine")
        return tls, tls_connection(tls), tls.start_container
    ssh: SshEngine = request.getfixturevalue("ssh_engine")
    return ssh, ssh_connection(ssh), None  # its containers are this machine's engine's


@pytest.mark.kit
@pytest.mark.parametrize(("name", "mode", "kind"), CASES, ids=[f"{k}-{m}-{n}" for n, m, k in CASES])
def test_check(name: str, mode: DockerMode, kind: RemoteKind, request: pytest.FixtureRequest) -> None:
    engine, connection, start_container = _remote(kind, request)
    target = reused_target(
        ("docker-remote", kind, mode, engine.url),
        lambda: docker_target(
            mode,
            "asyncio",
            engine.image,
            engine.container if mode == "container" else None,
            connection=connection,
            start_container=start_container,
            name=f"docker-{kind}",
        ),
    )
    [result] = run_kit(target, only=[name]).results
    print(f"{target.name} {result.name} ({result.kind}) {result.outcome} in {result.duration_s:.2f}s")
    if result.message:
        print(result.message)
    expected = expected_outcome("docker", name, "docker-remote")
    assert result.outcome == expected, f"{result.name} ({result.kind}) {result.outcome}: {result.message}"


@pytest.mark.parametrize("kind", ["tls", "ssh"])
async def test_a_remote_engine_is_never_read_through_this_hosts_proc(
    kind: RemoteKind, request: pytest.FixtureRequest
) -> None:
    """Here the engines are local, so the host's /proc would show their processes: it is not used."""
    engine, connection, _ = _remote(kind, request)
    async with DockerBashExecutor(DockerConfig(container=engine.container, **connection)) as ex:
        assert not ex._host_sees_processes()  # the decision itself is what is tested
        # A command with more than the side pipe's first MiB: all of it, by the engine's stream.
        result = await ex.exec("head -c 3000000 /dev/zero | tr '\\0' x; echo; echo done >&2")
        assert result.exit_code == 0
        assert result.stdout.total_bytes == 3_000_001
        assert result.stdout.data.endswith(b"x" * 1000 + b"\n")
        assert result.stderr.text == "done\n"


async def test_stdin_ends_over_tls(tls_engine: TlsEngine) -> None:
    """TLS half-close: the exec's stdin ends (``close_notify``) while its output is still read."""
    async with DockerBashExecutor(
        DockerConfig(container=tls_engine.container, **tls_connection(tls_engine))
    ) as ex:
        result = await ex.exec("wc -c; echo after", stdin="x" * 100_000)
        assert result.stdout.text.split() == ["100000", "after"]


async def test_the_docker_cli_environment_reaches_a_tls_engine(
    tls_engine: TlsEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No docker_host in the config: DOCKER_HOST, DOCKER_TLS_VERIFY and DOCKER_CERT_PATH, as the CLI."""
    for name, value in tls_engine.environment().items():
        monkeypatch.setenv(name, value)
    async with DockerBashExecutor(DockerConfig(container=tls_engine.container)) as ex:
        assert (await ex.exec("echo over-tls")).stdout.text == "over-tls\n"


async def test_tls_without_a_client_certificate_is_refused(tls_engine: TlsEngine) -> None:
    config = DockerConfig(
        container=tls_engine.container, docker_host=tls_engine.url, tls_ca_cert=tls_engine.ca_cert
    )
    with pytest.raises(BashInfrastructureError) as caught:
        async with DockerBashExecutor(config):
            pass
    assert caught.value.reason in ("engine_unreachable", "connection_lost")
    assert tls_engine.url.removeprefix("tcp://") in str(caught.value)


async def test_tls_with_another_ca_is_refused(tls_engine: TlsEngine) -> None:
    """The engine's certificate is verified: the system's trust store does not know the test CA."""
    config = DockerConfig(
        container=tls_engine.container,
        docker_host=tls_engine.url,
        tls_client_cert=tls_engine.client_cert,
        tls_client_key=tls_engine.client_key,
    )
    with pytest.raises(BashInfrastructureError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        async with DockerBashExecutor(config):
            pass


async def test_dial_stdio_failing_says_why(ssh_engine: SshEngine, request: pytest.FixtureRequest) -> None:
    """The non-root test user may log in but not reach the engine: its stderr is in the error."""
    server = request.getfixturevalue("ssh_server")
    config = DockerConfig(
        container=ssh_engine.container,
        docker_host=f"ssh://{TEST_USER}@127.0.0.1:{server.port}",
        ssh_client_keys=[server.user_key],
        ssh_known_hosts=server.known_hosts,
    )
    with pytest.raises(BashInfrastructureError, match="dial-stdio") as caught:
        async with DockerBashExecutor(config):
            pass
    assert "permission denied" in str(caught.value).lower()


async def test_an_unknown_host_key_is_refused(ssh_engine: SshEngine, tmp_path: Any) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = DockerConfig(
        container=ssh_engine.container, **{**ssh_connection(ssh_engine), "ssh_known_hosts": str(empty)}
    )
    with pytest.raises(BashInfrastructureError) as caught:
        async with DockerBashExecutor(config):
            pass
    assert caught.value.reason == "engine_unreachable"


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_ssh_engines_need_asyncio(ssh_engine: SshEngine, anyio_backend: str) -> None:
    with pytest.raises(ConfigError, match="asyncio"):
        async with DockerBashExecutor(
            DockerConfig(container=ssh_engine.container, **ssh_connection(ssh_engine))
        ):
            pass


@pytest.mark.parametrize("kind", ["tls", "ssh"])
async def test_many_commands_at_once(kind: RemoteKind, request: pytest.FixtureRequest) -> None:
    """Fifty at once: each holds a connection (TLS) or a channel of the one SSH connection."""
    engine, connection, _ = _remote(kind, request)
    async with DockerBashExecutor(DockerConfig(container=engine.container, **connection)) as ex:
        outputs: dict[int, str] = {}

        async def one(index: int) -> None:
            outputs[index] = (await ex.run(ex.resolve(BashExecRequest(command=f"echo {index}")))).stdout.text

        async with anyio.create_task_group() as tg:
            for index in range(50):
                tg.start_soon(one, index)
        assert outputs == {index: f"{index}\n" for index in range(50)}
