"""The remote-engine fixtures (``tests/remote_engines.py``) really do what the Docker backend's tests
will count on, checked with the docker CLI and the standard library only (not the backend)."""

from __future__ import annotations

import socket
import ssl
import subprocess
from pathlib import Path

import pytest
from remote_engines import DOCKER_LOGIN, PING_REQUEST, SshEngine, TlsEngine, http_ping, tls_cli_environment

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def _docker(engine: TlsEngine, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *engine.cli_args(), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=tls_cli_environment(engine),
    )


def _host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def test_tls_engine_answers_a_client_with_its_certificate(tls_engine: TlsEngine) -> None:
    result = _docker(tls_engine, "version", "--format", "{{.Server.Version}}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert tls_engine.url.startswith("tcp://127.0.0.1:")


def test_tls_engine_runs_and_execs_the_test_image(tls_engine: TlsEngine) -> None:
    run = _docker(tls_engine, "run", "--rm", "--network", "none", tls_engine.image, "echo", "hi")
    assert (run.returncode, run.stdout) == (0, "hi\n"), run.stderr
    exec_ = _docker(tls_engine, "exec", tls_engine.container, "echo", "hi")
    assert (exec_.returncode, exec_.stdout) == (0, "hi\n"), exec_.stderr


def test_tls_engine_is_another_engine(tls_engine: TlsEngine) -> None:
    """Its container is not on the main engine: the backend would really be talking to another one."""
    main = subprocess.run(
        ["docker", "inspect", tls_engine.container], check=False, capture_output=True, text=True, timeout=30
    )
    assert main.returncode != 0
    remote = _docker(
        tls_engine,
        "inspect",
        "--format",
        "{{.HostConfig.Init}} {{.HostConfig.NetworkMode}}",
        tls_engine.container,
    )
    assert remote.stdout.split() == ["true", "none"], remote.stderr


def test_tls_engine_cert_dir_is_a_docker_cert_path(tls_engine: TlsEngine, tmp_path: Path) -> None:
    for name in ("ca.pem", "cert.pem", "key.pem"):
        assert (Path(tls_engine.cert_dir) / name).is_file()
    result = subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=tls_cli_environment(tls_engine, {"DOCKER_CONFIG": str(tmp_path)}),
    )
    assert result.returncode == 0, result.stderr


def test_tls_engine_refuses_a_client_without_a_certificate(tls_engine: TlsEngine, tmp_path: Path) -> None:
    # An empty DOCKER_CERT_PATH, so that no default client certificate is picked up either.
    env = tls_cli_environment(tls_engine, {"DOCKER_CERT_PATH": str(tmp_path), "DOCKER_CONFIG": str(tmp_path)})
    del env["DOCKER_TLS_VERIFY"]
    del env["DOCKER_HOST"]
    no_cert = subprocess.run(
        ["docker", "--tls", "--tlscacert", tls_engine.ca_cert, "-H", tls_engine.url, "version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert no_cert.returncode != 0
    assert "certificate" in no_cert.stderr.lower(), no_cert.stderr
    plain = subprocess.run(
        ["docker", "-H", tls_engine.url, "version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert plain.returncode != 0
    assert "HTTPS" in plain.stderr, plain.stderr


def test_tls_engine_verifies_the_client_certificate_at_the_tls_layer(tls_engine: TlsEngine) -> None:
    """The same raw ``/_ping`` is answered with the client certificate and refused without it."""
    host, port = _host_port(tls_engine.url)

    def ping(with_certificate: bool) -> bytes:
        context = ssl.create_default_context(cafile=tls_engine.ca_cert)
        if with_certificate:
            context.load_cert_chain(tls_engine.client_cert, tls_engine.client_key)
        with (
            socket.create_connection((host, port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=host) as sock,
        ):
            return http_ping(sock)

    assert ping(with_certificate=True).endswith(b"\r\n\r\nOK")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        ping(with_certificate=False)


@pytest.mark.ssh
def test_ssh_engine_dial_stdio_answers_ping(ssh_engine: SshEngine) -> None:
    process = subprocess.Popen(
        [
            "ssh", "-i", ssh_engine.client_key, "-o", f"UserKnownHostsFile={ssh_engine.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
            "-p", ssh_engine.url.rpartition(":")[2], f"{DOCKER_LOGIN}@127.0.0.1",
            "docker", "system", "dial-stdio",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = process.communicate(PING_REQUEST, timeout=60)
    assert stdout.startswith(b"HTTP/1.1 200 OK"), stderr
    assert stdout.endswith(b"\r\n\r\nOK"), stderr


@pytest.mark.ssh
def test_ssh_engine_image_and_container_are_on_the_main_engine(ssh_engine: SshEngine) -> None:
    assert ssh_engine.url.startswith(f"ssh://{DOCKER_LOGIN}@127.0.0.1:")
    running = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Running}} {{.Config.Image}}", ssh_engine.container],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert running.stdout.split() == ["true", ssh_engine.image], running.stderr
