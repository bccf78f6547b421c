"""Where the Docker backend finds its engine: the one parser of ``docker_host`` and its TLS and SSH settings.

Pure: nothing here talks to an engine (tests/test_docker_remote.py does, over TLS and SSH).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from dsh_bash_docker import DockerConfig
from dsh_bash_docker._docker_config import memory_bytes
from dsh_bash_docker._docker_executor import mounted_at
from dsh_bash_docker._engine import EngineClient
from dsh_bash_docker._transport import Endpoint, TlsFiles

from dsh_bash import ConfigError


@pytest.fixture(autouse=True)
def _no_docker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"):
        monkeypatch.delenv(name, raising=False)


def _config(**fields: object) -> DockerConfig:
    return DockerConfig(**{"container": "c", **fields})  # type: ignore[arg-type]


def test_no_setting_is_the_local_socket() -> None:
    endpoint = Endpoint.parse(None)
    assert (endpoint.scheme, endpoint.path) == ("unix", "/var/run/docker.sock")
    assert endpoint.on_this_host


def test_the_environment_is_read_as_the_docker_cli_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://engine.example:2376")
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", "/certs")
    endpoint = Endpoint.from_config(_config())
    assert (endpoint.scheme, endpoint.host, endpoint.port) == ("tcp", "engine.example", 2376)
    assert endpoint.tls == TlsFiles("/certs/ca.pem", "/certs/cert.pem", "/certs/key.pem")
    assert not endpoint.on_this_host
    assert endpoint.url("/v1.41/_ping").scheme == b"https"


def test_an_explicit_docker_host_ignores_the_environments_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    endpoint = Endpoint.from_config(_config(docker_host="tcp://127.0.0.1:2375"))
    assert endpoint.tls is None
    assert endpoint.url("/x").scheme == b"http"


def test_tls_fields_turn_tls_on() -> None:
    endpoint = Endpoint.from_config(
        _config(docker_host="tcp://h:1", tls_ca_cert="/ca", tls_client_cert="/c", tls_client_key="/k")
    )
    assert endpoint.tls == TlsFiles("/ca", "/c", "/k")
    assert endpoint.describe() == "tcp://h:1 (TLS)"


def test_a_client_certificate_needs_its_key() -> None:
    with pytest.raises(ConfigError, match="tls_client_key"):
        _config(docker_host="tcp://h:1", tls_client_cert="/c")


@pytest.mark.parametrize("host", ["unix:///var/run/docker.sock", "ssh://me@h", None])
def test_tls_settings_need_a_tcp_engine(host: str | None) -> None:
    with pytest.raises(ConfigError, match="tcp://"):
        Endpoint.from_config(_config(docker_host=host, tls_ca_cert="/ca"))


def test_an_ssh_engine() -> None:
    endpoint = Endpoint.from_config(
        _config(docker_host="ssh://deploy@build.example:2222", ssh_client_keys=["/k"], ssh_known_hosts="/kh")
    )
    assert (endpoint.scheme, endpoint.user, endpoint.host, endpoint.port) == (
        "ssh",
        "deploy",
        "build.example",
        2222,
    )
    assert endpoint.ssh_client_keys == ("/k",)
    assert endpoint.ssh_known_hosts == "/kh"
    assert not endpoint.on_this_host
    assert Endpoint.parse("ssh://h").port == 22


@pytest.mark.parametrize(
    ("host", "complaint"),
    [
        ("ftp://h", "unsupported"),
        ("ssh://h/path", "no path"),
        ("tcp://:2375", "no host"),
        ("tcp://h:port", "bad port"),
    ],
)
def test_a_bad_docker_host_is_named(host: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        Endpoint.parse(host)


def test_unreadable_certificates_are_a_config_error(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="cannot load the TLS certificates"):
        TlsFiles("/nonexistent/ca.pem", None, None).context()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(4096, 4096), ("512m", 512 * 1024**2), ("1g", 1024**3), ("12kb", 12 * 1024), ("100", 100), ("7b", 7)],
)
def test_memory_sizes_read_as_the_docker_cli_reads_them(value: str | int, expected: int) -> None:
    assert memory_bytes(value) == expected


@pytest.mark.parametrize("value", ["12x", "", "m", "0", "-5m", 0])
def test_a_bad_memory_size_is_named(value: str | int) -> None:
    with pytest.raises(ConfigError, match="mem_limit"):
        DockerConfig(image="i", mem_limit=value)


class _LateExit(EngineClient):
    """An engine that records the exec's exit only at the ``recorded_at``-th inspect, as a loaded
    engine does when the exec's stream ended before containerd's exit event reached it."""

    def __init__(self, recorded_at: int) -> None:
        super().__init__(Endpoint.parse(None))
        self.recorded_at = recorded_at
        self.inspected = 0

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        self.inspected += 1
        if self.inspected < self.recorded_at:
            return {"ID": exec_id, "Running": True, "ExitCode": None}
        return {"ID": exec_id, "Running": False, "ExitCode": 3}


@pytest.mark.anyio
async def test_an_exit_recorded_after_the_stream_ended_is_waited_for() -> None:
    engine = _LateExit(recorded_at=4)
    assert await engine.exec_exit_code("e") == 3
    assert engine.inspected == 4


@pytest.mark.anyio
async def test_an_exit_never_recorded_is_none_within_the_bound() -> None:
    engine = _LateExit(recorded_at=10**9)
    with anyio.fail_after(2):
        assert await engine.exec_exit_code("e", within_s=0.3) is None
    assert engine.inspected > 1


def test_egress_directory_is_for_an_attached_container_and_absolute() -> None:
    with pytest.raises(ValueError, match="egress_directory only applies to an attached container"):
        DockerConfig(image="x", egress_directory="/srv/egress")
    with pytest.raises(ValueError, match="egress_directory must be an absolute path"):
        DockerConfig(container="c", egress_directory="srv/egress")
    assert DockerConfig(container="c", egress_directory="/srv/egress").egress_directory == "/srv/egress"


def test_the_egress_directory_is_found_beneath_the_mount_that_holds_it(tmp_path: Any) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    mounts = [
        {"Source": "/elsewhere", "Destination": "/x"},
        {"Source": str(tmp_path / "a"), "Destination": "/mnt/a"},
    ]
    assert mounted_at(str(tmp_path / "a"), mounts, "c1") == "/mnt/a"
    assert mounted_at(str(tmp_path / "a" / "b"), mounts, "c1") == "/mnt/a/b"
    (tmp_path / "ab").mkdir()  # a sibling whose name begins with the mount's: not beneath it
    with pytest.raises(ValueError, match=r"is not mounted in container c1: start it with -v "):
        mounted_at(str(tmp_path / "ab"), mounts, "c1")
    with pytest.raises(ValueError, match="is no directory of this host"):
        mounted_at(str(tmp_path / "missing"), mounts, "c1")
