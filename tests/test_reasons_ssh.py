"""The SSH backend names why it failed: ``BashInfrastructureError.reason``, against a real sshd.

Each test reaches one cause for real (a missing workdir, a refused key, a wrong host key, a cut
connection...) and asserts the reason the backend gives it; the message is for people and is not
looked at.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from fault_support import GRACE_MS, session_sshds, wait_for_processes
from ssh_support import SshServer, keygen

from dsh_bash import BashExecRequest, BashInfrastructureError, ExecutorClosedError

pytestmark = [pytest.mark.ssh, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _reason_of_open(server: SshServer, **overrides: object) -> str:
    with pytest.raises(BashInfrastructureError) as raised:
        async with server.executor(**overrides):
            pass
    return raised.value.reason


@pytest.fixture
def private_dir() -> Iterator[str]:
    """A directory owned by root, mode 0700, in /tmp: the test user sees it but cannot enter it."""
    path = tempfile.mkdtemp(prefix="dsh-bash-private-", dir="/tmp")
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_workdir_reasons(ssh_server: SshServer, private_dir: str, warm: bool) -> None:
    cases = (
        ("/nonexistent/dsh-bash", "workdir_missing"),
        ("/etc/passwd", "workdir_not_directory"),
        (private_dir, "workdir_not_accessible"),
    )
    async with ssh_server.executor(warm_channel=warm, grace_ms=GRACE_MS) as ex:
        for workdir, reason in cases:
            await ex.warm_up()
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec("true", workdir=workdir)
            assert raised.value.reason == reason, raised.value
            # A background task (detached on the host) checks its workdir the same way.
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.start(ex.resolve(BashExecRequest(command="true", workdir=workdir)))
            assert raised.value.reason == reason, raised.value
        assert (await ex.exec("echo fine")).stdout.text == "fine\n"  # the executor is still usable


async def test_user_unsupported(ssh_server: SshServer) -> None:
    async with ssh_server.executor(grace_ms=GRACE_MS) as ex:
        login = (await ex.exec("id -un")).stdout.text.strip()
        assert (await ex.exec("id -un", user=login)).stdout.text == f"{login}\n"
        for user in ("root", "dsh-bash-no-such-user"):
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec(f"touch /tmp/{login}-ran-as-{user}", user=user)
            assert raised.value.reason == "user_unsupported", raised.value
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.start(ex.resolve(BashExecRequest(command="true", user=user)))
            assert raised.value.reason == "user_unsupported", raised.value
        assert (await ex.exec(f"ls /tmp/{login}-ran-as-* 2>/dev/null | wc -l")).stdout.text == "0\n"


async def test_auth_failed(ssh_server: SshServer, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger")  # a key the server does not accept
    assert await _reason_of_open(ssh_server, client_keys=[str(tmp_path / "stranger")]) == "auth_failed"


async def test_host_key_rejected(ssh_server: SshServer, tmp_path: Path) -> None:
    keygen(tmp_path / "other")
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{ssh_server.port} {(tmp_path / 'other.pub').read_text()}")
    assert await _reason_of_open(ssh_server, known_hosts=str(known)) == "host_key_rejected"


async def test_host_unreachable(ssh_server: SshServer) -> None:
    with socket.socket() as sock:  # a loopback port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert await _reason_of_open(ssh_server, port=port, connect_timeout_ms=5000) == "host_unreachable"


async def test_a_server_that_never_answers_names_the_setting_that_waits(ssh_server: SshServer) -> None:
    """Issue 29: a listener that accepts and never speaks SSH ended in an empty 'TimeoutError:'."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()  # the kernel accepts; nobody ever answers
        port = sock.getsockname()[1]
        with pytest.raises(BashInfrastructureError) as raised:
            async with ssh_server.executor(port=port, connect_timeout_ms=500):
                pass
    assert raised.value.reason == "host_unreachable"
    message = str(raised.value)
    assert f"127.0.0.1:{port} within 0.5 s" in message and "connect_timeout_ms" in message, message


def _cutter(server: SshServer, cut: str) -> Callable[[], None]:
    def reset_tcp() -> None:
        # SOCK_DESTROY on this host's client sockets to the server's port (loopback only).
        subprocess.run(
            ["ss", "-K", "dst", server.host, "dport", "=", str(server.port)], check=True, capture_output=True
        )

    def kill_sessions() -> None:
        for pid in session_sshds(server):
            os.kill(pid, signal.SIGKILL)

    return {"tcp-reset": reset_tcp, "session-killed": kill_sessions}[cut]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", ["tcp-reset", "session-killed"])
async def test_connection_lost_under_a_run(ssh_server: SshServer, marker: str, cut: str) -> None:
    strike = _cutter(ssh_server, cut)
    async with ssh_server.executor(grace_ms=GRACE_MS) as ex:

        async def cut_once_running() -> None:
            await wait_for_processes(marker)
            await anyio.to_thread.run_sync(strike)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cut_once_running)
            with pytest.raises(BashInfrastructureError) as raised:
                await ex.exec(f"bash -c 'sleep 60; :' {marker}")
        assert raised.value.reason == "connection_lost", raised.value


async def test_closed(ssh_server: SshServer) -> None:
    ex = ssh_server.executor()
    with pytest.raises(BashInfrastructureError) as raised:
        await ex.exec("true")  # not entered yet
    assert raised.value.reason == "closed"
    async with ex:
        spec = ex.resolve(BashExecRequest(command="true"))
    with pytest.raises(ExecutorClosedError) as closed:
        await ex.run(spec)
    assert closed.value.reason == "closed"
    with pytest.raises(ExecutorClosedError) as closed:
        await ex.start(spec)
    assert closed.value.reason == "closed"
