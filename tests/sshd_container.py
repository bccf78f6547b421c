"""An SSH server that is really elsewhere: sshd in a Debian container with its own PID namespace and users.

The image is :mod:`debian_image`'s (the Debian test image, which the Docker tests use too): a Debian
userland made by ``mmdebstrap`` and ``docker import``, tagged by a hash of its recipe. ``.ci/run``
builds it before the tests (``python3 tests/debian_image.py``) so that no test waits for it there;
elsewhere the fixture builds it when it is missing.

The server container (:func:`start_container`) runs with ``network_mode="host"`` and sshd listening
on ``127.0.0.1:<free port>`` only, so the client never talks to anything but loopback (a bridge
address would be off limits). Its processes live in their own PID namespace, its users in its own
``/etc/passwd``: this host's ``/proc`` shows the commands the SSH backend starts there only under
other pids than theirs, which is what makes the kit's ``kit_find_processes`` hook necessary. The
test user :data:`USER` (shadow field ``*``: no password, not locked) logs in with a key generated per
container; its ``.bashrc`` prints noise on both streams (as real rc files do) before Debian's default
one, which returns early when not interactive. The host key is generated here too and pinned in a
known_hosts file.

Skips with a reason starting ``backend unavailable:`` (a failure when ``CI=true``) when no Docker
engine answers, or the image is missing and cannot be built (no ``mmdebstrap``, not root), or
``ssh-keygen`` is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import debian_image
import pytest

__all__ = [
    "USER",
    "SshdContainer",
    "sshd_container",
    "start_container",
    "stop_container",
    "unavailable",
]

BACKEND_UNAVAILABLE = "backend unavailable:"
USER = "dshtest"
#: What the test user's .bashrc prints before Debian's own (which returns early when not interactive).
RC_NOISE = 'echo "dshtest .bashrc noise"; echo "dshtest .bashrc noise on stderr" >&2\n'
#: Label on the server containers (value: the pid of the process that started them): containers left
#: by a process that is gone (a killed pytest) are removed when the next fixture starts.
LABEL = "dsh-bash-test.sshd"

# Run as the container's command (PID 1 is docker-init): the user, its key and rc file, then sshd.
_START = r"""set -eu
useradd -m -s /bin/bash "$DSH_USER"
usermod -p '*' "$DSH_USER"
home=/home/$DSH_USER
install -d -m 700 -o "$DSH_USER" -g "$DSH_USER" "$home/.ssh"
install -m 600 -o "$DSH_USER" -g "$DSH_USER" /dsh-setup/userkey.pub "$home/.ssh/authorized_keys"
{ cat /dsh-setup/rc-noise; cat /etc/skel/.bashrc; } > "$home/.bashrc"
chown "$DSH_USER:$DSH_USER" "$home/.bashrc"
install -m 600 /dsh-setup/hostkey /etc/ssh/dsh_host_key
mkdir -p /run/sshd
cat > /etc/ssh/dsh_sshd_config <<EOF
Port $DSH_PORT
ListenAddress 127.0.0.1
HostKey /etc/ssh/dsh_host_key
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin no
Subsystem sftp internal-sftp
PidFile /run/sshd.pid
EOF
exec /usr/sbin/sshd -D -e -f /etc/ssh/dsh_sshd_config
"""


def unavailable() -> str | None:
    """Why the container server cannot run here, or None."""
    from docker_support import docker_available  # noqa: PLC0415

    reason = docker_available() or debian_image.unavailable()
    if reason is not None:
        return reason
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found (apt-get install openssh-client)"
    return None


@dataclass
class SshdContainer:
    """A running server container, and what a client needs to log in to it as :data:`USER`."""

    container_id: str
    port: int
    directory: Path
    known_hosts: str
    user_key: str
    host: str = "127.0.0.1"

    def config(self, **overrides: Any) -> dict[str, Any]:
        """The SSH backend's config fields for logging in to this server as :data:`USER`."""
        return {
            "host": self.host,
            "port": self.port,
            "username": USER,
            "client_keys": [self.user_key],
            "known_hosts": self.known_hosts,
            **overrides,
        }

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the container as root (``docker exec``), for the tests' own looks."""
        return subprocess.run(
            ["docker", "exec", self.container_id, *argv], capture_output=True, text=True, check=False
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, capture_output=True
    )


def start_container(image: str) -> SshdContainer:
    """Start a server container of ``image`` and wait until its sshd answers on loopback."""
    import docker  # noqa: PLC0415
    import docker.errors  # noqa: PLC0415

    directory = Path(tempfile.mkdtemp(prefix="dsh-bash-sshd-container-"))
    directory.chmod(0o755)
    setup = directory / "setup"
    setup.mkdir(mode=0o755)
    _keygen(directory / "userkey")
    _keygen(setup / "hostkey")
    shutil.copy(directory / "userkey.pub", setup / "userkey.pub")
    (setup / "rc-noise").write_text(RC_NOISE)
    port = _free_port()
    (directory / "known_hosts").write_text(f"[127.0.0.1]:{port} {(setup / 'hostkey.pub').read_text()}")
    client = docker.from_env()
    try:
        for stale in client.containers.list(all=True, filters={"label": LABEL}):
            owner = stale.labels.get(LABEL, "")
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(docker.errors.APIError):
                    stale.remove(force=True)
        container = client.containers.run(
            image,
            command=["/bin/bash", "-c", _START],
            environment={"DSH_USER": USER, "DSH_PORT": str(port)},
            detach=True,
            init=True,
            network_mode="host",
            volumes={str(setup): {"bind": "/dsh-setup", "mode": "ro"}},
            labels={LABEL: str(os.getpid())},
        )
    finally:
        client.close()
    server = SshdContainer(
        container_id=str(container.id),
        port=port,
        directory=directory,
        known_hosts=str(directory / "known_hosts"),
        user_key=str(directory / "userkey"),
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.settimeout(2)
                if sock.recv(64).startswith(b"SSH-2.0-"):
                    return server
        except OSError:
            pass
        container.reload()
        if container.status != "running" or time.monotonic() > deadline:
            logs = container.logs().decode("utf-8", "replace")
            stop_container(server)
            raise RuntimeError(f"the sshd container did not start ({container.status}): {logs}")
        time.sleep(0.1)


def stop_container(server: SshdContainer) -> None:
    import docker  # noqa: PLC0415
    import docker.errors  # noqa: PLC0415

    client = docker.from_env()
    try:
        with contextlib.suppress(docker.errors.NotFound):
            client.containers.get(server.container_id).remove(force=True)
    finally:
        client.close()
    shutil.rmtree(server.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def sshd_container() -> Iterator[SshdContainer]:
    """A server container for the session; builds the image first when it is missing (about a minute,
    which is why its users carry a longer ``timeout`` mark)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"{BACKEND_UNAVAILABLE} {reason}")
    try:
        import dsh_bash_ssh  # noqa: F401, PLC0415
    except ImportError as exc:
        pytest.skip(f"{BACKEND_UNAVAILABLE} dsh_bash_ssh cannot be imported: {exc}")
    try:
        tag = debian_image.build_image()
    except Exception as exc:
        pytest.fail(f"building the Debian test image failed: {type(exc).__name__}: {exc}")
    server = start_container(tag)
    try:
        yield server
    finally:
        stop_container(server)
