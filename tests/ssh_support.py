"""SSH test support: a throwaway sshd on a loopback port, its test user, and kit targets.

Loaded as a pytest plugin by the SSH test modules (``pytest_plugins``-style import of the fixture).
The server runs ``/usr/sbin/sshd -D`` with its own config, host key and authorized keys in a temp
dir; commands log in as the non-root user ``dshtest`` (created when missing; its ``.bashrc`` prints
noise on both streams, as real rc files do) or, for the root test, as root. Without root or sshd the
fixture skips with a reason starting ``backend unavailable:`` (which CI turns into a failure).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from dsh_bash_conformance import KitTarget, find_host_processes

if TYPE_CHECKING:
    from dsh_bash_ssh import SshBashExecutor

__all__ = [
    "SSHD",
    "TEST_USER",
    "SshServer",
    "ensure_user",
    "keygen",
    "ssh_server",
    "ssh_target",
    "start_server",
    "stop_server",
]

SSHD = "/usr/sbin/sshd"
#: The login of the SSH tests. The tests rewrite its ``.bashrc`` (:meth:`SshServer.plant`), so no two
#: runs may share one: each pytest-xdist worker logs in as a user of its own (``dshtest-gw0``, ...),
#: and ``DSH_TEST_SSH_USER`` names another base, for two checkouts testing at once. (Not a
#: ``DSH_BASH_`` name: every such variable is read as an executor's config field.)
TEST_USER = os.environ.get("DSH_TEST_SSH_USER", "dshtest") + (
    f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else ""
)
BACKEND_UNAVAILABLE = "backend unavailable:"
#: What the test user's .bashrc always does: rc files may print anything, on both streams.
RC_NOISE = 'echo "dshtest .bashrc noise"; echo "dshtest .bashrc noise on stderr" >&2\n'


@dataclass
class SshServer:
    host: str
    port: int
    directory: Path
    known_hosts: str
    user_key: str
    root_key: str
    process: subprocess.Popen[bytes]
    home: Path
    _planted: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def config(self, *, root: bool = False, **overrides: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "username": "root" if root else TEST_USER,
            "client_keys": [self.root_key if root else self.user_key],
            "known_hosts": self.known_hosts,
        }
        fields.update(overrides)
        return fields

    def executor(self, *, root: bool = False, **overrides: Any) -> SshBashExecutor:
        from dsh_bash_ssh import SshBashExecutor, SshConfig  # noqa: PLC0415

        return SshBashExecutor(SshConfig(**self.config(root=root, **overrides)))

    def _write_bashrc(self) -> None:
        lines = [RC_NOISE]
        lines += [f"export {name}={shlex.quote(value)}\n" for name, value in self._planted.items()]
        bashrc = self.home / ".bashrc"
        bashrc.write_text("".join(lines))
        user = pwd.getpwnam(TEST_USER)
        os.chown(bashrc, user.pw_uid, user.pw_gid)

    @contextlib.contextmanager
    def plant(self, variables: Mapping[str, str]) -> Iterator[None]:
        """The login's environment holds ``variables`` for the block (exported by the user's .bashrc).

        ``~/.ssh/environment`` (PermitUserEnvironment) cannot hold values with newlines, so the
        login shell's rc file exports them; executors made in the block connect after it is written.
        """
        with self._lock:
            saved = {name: self._planted.get(name) for name in variables}
            self._planted.update(variables)
            self._write_bashrc()
        try:
            yield
        finally:
            with self._lock:
                for name, value in saved.items():
                    if value is None:
                        self._planted.pop(name, None)
                    else:
                        self._planted[name] = value
                self._write_bashrc()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the SSH tests start their own sshd and need root (for its host key and the test user)"
    if not os.path.exists(SSHD):
        return f"{SSHD} not found (apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found (apt-get install openssh-client)"
    return None


#: Held while a user is added or changed: useradd and usermod fail at once ("cannot lock
#: /etc/passwd") when another worker's call holds the password file.
_USERS_LOCK = Path(tempfile.gettempdir(), "dsh-bash-test-users.lock")


def ensure_user(name: str, *, groups: tuple[str, ...] = ()) -> Path:
    """The home of login ``name`` (created when missing, with bash and these supplementary groups),
    which key logins may use: with UsePAM no, a '!' password field counts as locked, '*' only
    disables password logins."""
    with open(_USERS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
        subprocess.run(
            ["usermod", "-p", "*", *(["-aG", ",".join(groups)] if groups else []), name], check=True
        )
    home = Path(pwd.getpwnam(name).pw_dir)
    home.mkdir(parents=True, exist_ok=True)
    return home


def keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, capture_output=True
    )


def start_server(extra_config: str = "", *, sftp: bool = True) -> SshServer:
    """Start a test sshd; ``extra_config`` lines are appended to its config (the security suite's
    ``SetEnv``, say; the session server passes none); ``sftp=False`` leaves out the SFTP subsystem."""
    home = ensure_user(TEST_USER)
    directory = Path(tempfile.mkdtemp(prefix="dsh-bash-sshd-"))
    directory.chmod(0o755)  # sshd reads authorized keys as the logging-in user
    for name in ("hostkey", "userkey", "rootkey"):
        keygen(directory / name)
    (directory / f"authorized_keys.{TEST_USER}").write_text((directory / "userkey.pub").read_text())
    (directory / "authorized_keys.root").write_text((directory / "rootkey.pub").read_text())
    for name in (f"authorized_keys.{TEST_USER}", "authorized_keys.root"):
        (directory / name).chmod(0o644)
    port = _free_port()
    (directory / "known_hosts").write_text(f"[127.0.0.1]:{port} {(directory / 'hostkey.pub').read_text()}")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    (directory / "sshd_config").write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        f"HostKey {directory}/hostkey\n"
        f"AuthorizedKeysFile {directory}/authorized_keys.%u\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PermitRootLogin yes\n"
        "PermitUserEnvironment yes\n"
        "MaxSessions 10\n"
        + ("Subsystem sftp internal-sftp\n" if sftp else "")
        + f"PidFile {directory}/sshd.pid\n"
        + extra_config
    )
    process = subprocess.Popen(
        [SSHD, "-D", "-f", str(directory / "sshd_config"), "-E", str(directory / "sshd.log")]
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                log = (directory / "sshd.log").read_text() if (directory / "sshd.log").exists() else ""
                process.kill()
                raise RuntimeError(f"sshd did not start: {log}") from None
            time.sleep(0.05)
    server = SshServer(
        host="127.0.0.1",
        port=port,
        directory=directory,
        known_hosts=str(directory / "known_hosts"),
        user_key=str(directory / "userkey"),
        root_key=str(directory / "rootkey"),
        process=process,
        home=home,
    )
    server._write_bashrc()
    return server


def stop_server(server: SshServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(5)
    except subprocess.TimeoutExpired:
        server.process.kill()
    bashrc = server.home / ".bashrc"
    bashrc.write_text("")
    shutil.rmtree(server.directory, ignore_errors=True)


def ssh_target(
    server: SshServer, anyio_backend: str = "asyncio", *, check_timeout_s: float = 30.0
) -> KitTarget:
    """A kit target logging in to ``server`` as the test user; ``plant_ambient`` goes through its .bashrc."""

    def make_executor(**overrides: Any) -> SshBashExecutor:
        return server.executor(**overrides)

    return KitTarget(
        name=f"ssh[{anyio_backend}]",
        make_executor=make_executor,
        plant_ambient=server.plant,
        find_processes=find_host_processes,
        anyio_backend=anyio_backend,
        check_timeout_s=check_timeout_s,
    )


def _serve(*, sftp: bool) -> Iterator[SshServer]:
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"{BACKEND_UNAVAILABLE} {reason}")
    try:
        import dsh_bash_ssh  # noqa: F401, PLC0415
    except ImportError as exc:
        pytest.skip(
            f"{BACKEND_UNAVAILABLE} dsh_bash_ssh cannot be imported (pip install 'dsh-bash[ssh]'): {exc}"
        )
    server = start_server(sftp=sftp)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def ssh_server() -> Iterator[SshServer]:
    """A running sshd for the session (skips with ``backend unavailable: ...`` without root or sshd)."""
    yield from _serve(sftp=True)


@pytest.fixture(scope="session")
def server_without_sftp() -> Iterator[SshServer]:
    """A running sshd without an SFTP subsystem (the backend runs the host's sftp-server over an exec
    channel, unless ``exec_sftp_server=False``)."""
    yield from _serve(sftp=False)
