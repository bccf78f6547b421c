"""Docker engines "on other machines" for the Docker backend's tests: one over TCP with mutual TLS,
one over SSH (``docker system dial-stdio``).

Loaded as a pytest plugin by ``tests/conftest.py`` (``pytest_plugins``), like ``docker_support``.

``tls_engine`` starts a second dockerd on this machine, reachable only at ``tcp://127.0.0.1:PORT``
with ``--tlsverify`` (a throwaway CA, server and client certificates made with the ``openssl`` CLI),
plus a private unix socket the tests themselves may use. It has its own data root, exec root, pid
file and its own (dockerd-managed) containerd, and runs in a network namespace of its own
(``unshare --net``): ``--bridge=none`` makes a dockerd delete the ``docker0`` interface at start,
which in the host's namespace would break the main engine's bridge. Its TCP listener is bound here,
in the host's namespace, and handed over by socket activation (``-H fd://``, ``LISTEN_FDS``), so
the port is also free of a bind race. The test image is copied over from the main engine
(``docker save | docker load``), and an idle container of it is started for container mode.

Its own containerd rather than the main engine's (``--containerd`` with a namespace of its own):
measured here, both answer in about 0.2 s and the whole fixture is up in 1.0-1.5 s either way
(certificates 0.1 s, dockerd 0.2 s, image copy 0.45 s, idle container 0.3 s); sharing only stops
1 s faster at session end, but it ties this engine to the main one's containerd, whose socket path
depends on how that engine was started and which goes away whenever the main dockerd restarts.

``fault_support.SecondEngine`` is a private dockerd too, one a test may restart; it keeps the host's
network namespace and so needs a bridge interface of its own instead of ``--bridge=none``.

``ssh_engine`` is the main engine reached through the session's test sshd (``ssh_support``): the
login :data:`DOCKER_LOGIN`, a member of the ``docker`` group (which may use the engine's socket),
logs in with the root key and runs ``docker system dial-stdio``, which talks to this machine's
default engine. Not root: bash runs the login's ``~/.bashrc`` for every SSH command, every engine
connection is one, and root's here (pyenv's init) costs about 150 ms of CPU each time, which made
this transport the costliest row of the suite; this login's rc file is empty. Debian's sshd gives
its sessions ``/usr/local/bin:/usr/bin:/bin:/usr/games``, so ``docker`` (``/usr/local/bin/docker``
or docker.io's ``/usr/bin/docker``) is found without any SetEnv; the fixture checks a ``/_ping``
through that path before handing it out, and fails (not skips) with what ssh printed when it does
not answer.

When something they need is missing (root, dockerd, openssl, unshare, the docker CLI) or the engine
does not start, the fixtures skip with a reason starting ``backend unavailable:`` (a failure in CI,
see ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from docker_support import IDLE_COMMAND, SESSION_ID, SESSION_LABEL
from ssh_support import SshServer, ensure_user

__all__ = [
    "DOCKER_LOGIN",
    "PING_REQUEST",
    "SshEngine",
    "TlsEngine",
    "http_ping",
    "make_certificates",
    "running_tls_engine",
    "ssh_engine",
    "tls_cli_environment",
    "tls_engine",
]

BACKEND_UNAVAILABLE = "backend unavailable:"
#: The login ``ssh_engine`` uses: in group ``docker``, an empty ``.bashrc`` (one for every worker).
DOCKER_LOGIN = "dshdocker"

#: An HTTP request to the engine API's health check; the answer's body is ``OK``.
PING_REQUEST = b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n"

#: How long the second dockerd may take to answer (it takes about 0.2 s here).
START_TIMEOUT_S = 60.0
#: How long it may take to stop at SIGTERM before it is killed.
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class TlsEngine:
    """A second Docker engine, reached over TCP with mutual TLS.

    ``cert_dir`` holds ``ca.pem``, ``cert.pem`` and ``key.pem`` (the client's), as the docker CLI's
    ``DOCKER_CERT_PATH`` expects; ``ca_cert``, ``client_cert`` and ``client_key`` are those files.
    ``image`` is the test image, loaded into this engine; ``container`` the id of an idle container
    of it on this engine (container mode). ``local_url`` is the engine's private unix socket, without
    TLS: for a test's own look at the engine, not for the backend under test.

    docker-py (through requests) verifies against ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE`` when
    either is set, as it is on these machines, instead of the ``ca_cert`` it is given, and so fails
    with "unable to get local issuer certificate": unset both for a docker-py client of this engine.
    """

    url: str
    cert_dir: str
    ca_cert: str
    client_cert: str
    client_key: str
    image: str
    container: str
    local_url: str

    def cli_args(self) -> list[str]:
        """The docker CLI's global options that reach this engine over TLS."""
        return [
            "--tlsverify",
            "--tlscacert",
            self.ca_cert,
            "--tlscert",
            self.client_cert,
            "--tlskey",
            self.client_key,
            "-H",
            self.url,
        ]

    def environment(self) -> dict[str, str]:
        """The variables that point a docker CLI or docker-py at this engine."""
        return {"DOCKER_HOST": self.url, "DOCKER_TLS_VERIFY": "1", "DOCKER_CERT_PATH": self.cert_dir}

    def start_container(self, image: str, environment: Mapping[str, str]) -> tuple[str, Callable[[], None]]:
        """An idle container of ``image`` on this engine with ``environment`` (the kit's planted
        variables, container mode); returns its id and how to remove it."""
        options = [part for name, value in environment.items() for part in ("--env", f"{name}={value}")]
        result = _docker_at(
            self.local_url,
            "run", "--detach", "--init", "--network", "none", "--label", f"{SESSION_LABEL}={SESSION_ID}",
            *options, image, *shlex.split(IDLE_COMMAND),
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"starting a container on {self.url} failed: {result.stderr.strip()}")
        container = result.stdout.strip()

        def remove() -> None:
            _docker_at(self.local_url, "rm", "--force", container)

        return container, remove


@dataclass(frozen=True)
class SshEngine:
    """The main engine, reached over SSH as :data:`DOCKER_LOGIN` on the session's test sshd.

    ``client_key`` is that login's private key there (the server's root key), ``known_hosts`` holds
    the server's host key; ``image`` and ``container`` (an idle container of it) are on the main
    engine, which the remote ``docker system dial-stdio`` talks to.
    """

    url: str
    client_key: str
    known_hosts: str
    image: str
    container: str

    def ssh_args(self, *command: str) -> list[str]:
        """An ``ssh`` command line that logs in to the server and runs ``command`` there."""
        rest = self.url.removeprefix("ssh://")
        user, _, address = rest.partition("@")
        host, _, port = address.rpartition(":")
        return [
            "ssh",
            "-i",
            self.client_key,
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-p",
            port,
            f"{user}@{host}",
            *command,
        ]


def _unavailable(reason: str) -> str:
    return f"{BACKEND_UNAVAILABLE} {reason}"


def http_ping(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Send :data:`PING_REQUEST` on a connected socket and return all it answers, to EOF."""
    sock.settimeout(timeout_s)
    sock.sendall(PING_REQUEST)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _unix_ping(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(str(path))
            return http_ping(sock, 2.0).endswith(b"\r\n\r\nOK")
    except OSError:
        return False


# -- certificates -----------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *args], cwd=cwd, check=False, capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed ({result.returncode}): {result.stderr.strip()}")


def _ec_key_request(directory: Path, name: str, subject: str) -> None:
    # P-256: a key in milliseconds, and both Go's and Python's TLS take it.
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}-key.pem", "-out", f"{name}.csr", "-subj", subject,
        cwd=directory,
    )  # fmt: skip


def _sign(directory: Path, name: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
        "-set_serial", f"0x{secrets.token_hex(8)}", "-days", "7", "-extfile", f"{name}.ext",
        "-out", f"{name}-cert.pem",
        cwd=directory,
    )  # fmt: skip


def make_certificates(directory: Path) -> tuple[Path, Path]:
    """Make a throwaway CA, a server and a client certificate in ``directory``.

    Returns ``(server_dir, client_dir)``, each holding ``ca.pem``, ``cert.pem`` and ``key.pem``:
    the server's for dockerd's ``--tlscacert/--tlscert/--tlskey``, the client's as a
    ``DOCKER_CERT_PATH``. The server certificate names ``IP:127.0.0.1`` and ``DNS:localhost``.
    """
    work = directory / "ca"
    work.mkdir(mode=0o700)
    _openssl(
        "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "7", "-subj", "/CN=dsh-bash test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=work,
    )  # fmt: skip
    _ec_key_request(work, "server", "/CN=localhost")
    _sign(
        work,
        "server",
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    _ec_key_request(work, "client", "/CN=dsh-bash test client")
    _sign(
        work,
        "client",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
    )
    result = []
    for name in ("server", "client"):
        target = directory / name
        target.mkdir(mode=0o700)
        shutil.copyfile(work / "ca.pem", target / "ca.pem")
        shutil.copyfile(work / f"{name}-cert.pem", target / "cert.pem")
        shutil.copyfile(work / f"{name}-key.pem", target / "key.pem")
        (target / "key.pem").chmod(0o600)
        result.append(target)
    return result[0], result[1]


# -- the second dockerd -----------------------------------------------------------------------------


def _tls_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the TLS engine starts its own dockerd and needs root"
    for tool, package in (
        ("dockerd", "docker.io"),
        ("docker", "docker.io"),
        ("openssl", "openssl"),
        ("unshare", "util-linux"),
    ):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install {package})"
    return None


def _log_tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


@dataclass
class _Daemon:
    """A running second dockerd and the paths it owns."""

    root: Path
    process: subprocess.Popen[bytes]
    port: int

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    def docker(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this engine's private unix socket."""
        return subprocess.run(
            ["docker", "-H", f"unix://{self.socket}", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_cli_environment(),
        )


def _docker_at(url: str, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "-H", url, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_cli_environment(),
    )


def _cli_environment() -> dict[str, str]:
    # A DOCKER_HOST or DOCKER_CONTEXT of the caller must not redirect the fixture's own CLI calls.
    return {name: value for name, value in os.environ.items() if not name.startswith("DOCKER_")}


def _start_daemon(root: Path, server_certs: Path) -> _Daemon:
    """Start dockerd in a network namespace of its own, its TLS listener bound here on loopback."""
    for name in ("data", "exec"):
        (root / name).mkdir(mode=0o711)
    # An empty config, so that this machine's /etc/docker/daemon.json does not reach it.
    (root / "daemon.json").write_text("{}\n")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = int(listener.getsockname()[1])
        # Socket activation wants the listener at fd 3; a copy at 10 or above cannot be fd 3 already.
        high = fcntl.fcntl(listener.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
        try:
            dockerd = [
                "dockerd",
                "-H", "fd://",
                "-H", f"unix://{root}/docker.sock",
                "--tlsverify",
                "--tlscacert", str(server_certs / "ca.pem"),
                "--tlscert", str(server_certs / "cert.pem"),
                "--tlskey", str(server_certs / "key.pem"),
                "--data-root", str(root / "data"),
                "--exec-root", str(root / "exec"),
                "--pidfile", str(root / "dockerd.pid"),
                "--config-file", str(root / "daemon.json"),
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
            ]  # fmt: skip
            # LISTEN_PID must be dockerd's own pid: bash's $$ stays it through both execs (unshare
            # without --fork execs dockerd in place).
            script = (
                "export LISTEN_PID=$$ LISTEN_FDS=1; "
                f"exec unshare --net -- {shlex.join(dockerd)} 3<&{high} {high}<&-"
            )
            with (root / "dockerd.log").open("wb") as log:
                process = subprocess.Popen(
                    ["bash", "-c", script],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(high,),
                    env=_cli_environment(),
                    # Out of the terminal's process group: a Ctrl-C stops the tests, whose teardown
                    # then removes the containers before it stops the engine.
                    start_new_session=True,
                )
        finally:
            os.close(high)
    finally:
        listener.close()
    return _Daemon(root=root, process=process, port=port)


def _wait_until_up(daemon: _Daemon) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _unix_ping(daemon.socket):
        if daemon.process.poll() is not None:
            raise RuntimeError(f"dockerd exited ({daemon.process.returncode}):\n{_log_tail(daemon.log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"dockerd did not answer within {START_TIMEOUT_S:.0f} s:\n{_log_tail(daemon.log)}"
            )
        time.sleep(0.05)


def _tls_ping(url: str, client_certs: Path) -> bytes:
    """What ``/_ping`` answers over TLS with the client certificate (the listener really verifies)."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    context = ssl.create_default_context(cafile=str(client_certs / "ca.pem"))
    context.load_cert_chain(str(client_certs / "cert.pem"), str(client_certs / "key.pem"))
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as sock,
    ):
        return http_ping(sock)


def _load_image(daemon: _Daemon, image: str) -> None:
    """Copy ``image`` from the main engine into ``daemon`` (no registry to pull from here)."""
    # The main engine as docker_support reaches it (DOCKER_HOST and all); the second one by its socket.
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        load = subprocess.run(
            ["docker", "-H", f"unix://{daemon.socket}", "load", "--quiet"],
            stdin=save.stdout,
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env=_cli_environment(),
        )
    finally:
        assert save.stdout is not None
        save.stdout.close()
        save_stderr = save.communicate(timeout=120)[1].decode(errors="replace")
    if save.returncode != 0 or load.returncode != 0:
        raise RuntimeError(
            f"copying {image} failed: docker save ({save.returncode}): {save_stderr.strip()}; "
            f"docker load ({load.returncode}): {load.stderr.strip()}"
        )


def _start_idle_container(daemon: _Daemon, image: str) -> str:
    """Like ``docker_support.start_idle_container``: tini as PID 1, no network, the session's label."""
    result = daemon.docker(
        "run", "--detach", "--init", "--network", "none", "--label", f"{SESSION_LABEL}={SESSION_ID}",
        image, *shlex.split(IDLE_COMMAND),
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"starting the idle container failed: {result.stderr.strip()}")
    return result.stdout.strip()


def _engine_processes(root: Path) -> list[int]:
    """The engine's leftover processes: those whose command line names a path under ``root`` (its
    containerd and shims), and all their descendants (the containers' processes, which outlive a
    killed shim: its children are reparented, not killed)."""
    marker = str(root).encode()
    parents: dict[int, int] = {}
    roots = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone since the listing
        # The command name in field 2 may hold spaces and parentheses: the ppid follows the last ')'.
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
        if marker in cmdline:
            roots.append(int(entry.name))
    found = set(roots)
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return sorted(found)


def _remove_container_cgroups(containers: Path, timeout_s: float = 5.0) -> None:
    """Remove the cgroups of the engine's containers (cgroupfs driver, v1 or v2): a shim that was
    killed leaves them behind, empty, once their processes are reaped."""
    try:
        ids = [entry.name for entry in containers.iterdir()]
    except OSError:
        return
    cgroups = [path for cid in ids for path in Path("/sys/fs/cgroup").glob(f"*/docker/{cid}")]
    cgroups += [path for cid in ids if (path := Path("/sys/fs/cgroup/docker", cid)).is_dir()]
    deadline = time.monotonic() + timeout_s
    for path in cgroups:
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                # Busy until the killed processes are reaped.
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)


def _unmount_under(root: Path) -> None:
    """Unmount whatever is still mounted under ``root`` (overlay layers, shm, netns), deepest first."""
    prefix = str(root) + "/"
    mounts = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            # Field 5 is the mount point, with spaces and the like written as octal escapes.
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True, timeout=30)


def _stop_daemon(daemon: _Daemon) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        listed = daemon.docker("ps", "--all", "--quiet", timeout_s=30)
        if listed.returncode == 0 and listed.stdout.split():
            daemon.docker("rm", "--force", "--volumes", *listed.stdout.split(), timeout_s=60)
    if daemon.process.poll() is None:
        daemon.process.send_signal(signal.SIGTERM)
        try:
            daemon.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait(10)
    # A killed dockerd can leave shims and their containers running: ours, found by our paths.
    leftovers = _engine_processes(daemon.root)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if leftovers:
        _remove_container_cgroups(daemon.root / "data" / "containers")
    _unmount_under(daemon.root)
    shutil.rmtree(daemon.root, ignore_errors=True)


@contextlib.contextmanager
def running_tls_engine(image: str) -> Iterator[TlsEngine]:
    """A second dockerd with mutual TLS on loopback, ``image`` loaded and an idle container of it
    running; everything removed when the block ends. Raises RuntimeError when it cannot be set up."""
    # Short: the exec root holds containerd's unix sockets (108-byte path limit).
    root = Path(tempfile.mkdtemp(prefix="dsh-tls-engine-"))
    daemon: _Daemon | None = None
    try:
        certs = root / "certs"
        certs.mkdir(mode=0o700)
        server_certs, client_certs = make_certificates(certs)
        daemon = _start_daemon(root, server_certs)
        _wait_until_up(daemon)
        url = f"tcp://127.0.0.1:{daemon.port}"
        answer = _tls_ping(url, client_certs)
        if not answer.endswith(b"\r\n\r\nOK"):
            raise RuntimeError(f"/_ping over TLS answered {answer[:200]!r}")
        _load_image(daemon, image)
        container = _start_idle_container(daemon, image)
        yield TlsEngine(
            url=url,
            cert_dir=str(client_certs),
            ca_cert=str(client_certs / "ca.pem"),
            client_cert=str(client_certs / "cert.pem"),
            client_key=str(client_certs / "key.pem"),
            image=image,
            container=container,
            local_url=f"unix://{daemon.socket}",
        )
    finally:
        if daemon is not None:
            _stop_daemon(daemon)
        else:
            shutil.rmtree(root, ignore_errors=True)


# -- SSH --------------------------------------------------------------------------------------------


def _dial_stdio_ping(engine: SshEngine, timeout_s: float = 30.0) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        engine.ssh_args("docker", "system", "dial-stdio"),
        input=PING_REQUEST,
        check=False,
        capture_output=True,
        timeout=timeout_s,
    )


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tls_engine(docker_test_image: str) -> Iterator[TlsEngine]:
    """A second Docker engine at ``tcp://127.0.0.1:PORT`` that only takes mutually authenticated TLS,
    with the test image and an idle container of it; stopped and removed at session end.

    Skips with ``backend unavailable: ...`` when root, dockerd, the docker CLI, openssl or unshare is
    missing, or the engine cannot be set up (the message carries dockerd's log).
    """
    reason = _tls_unavailable()
    if reason is not None:
        pytest.skip(_unavailable(reason))
    with contextlib.ExitStack() as stack:
        try:
            engine = stack.enter_context(running_tls_engine(docker_test_image))
        except Exception as exc:
            pytest.skip(_unavailable(f"the TLS engine could not be set up: {type(exc).__name__}: {exc}"))
        yield engine


@pytest.fixture(scope="session")
def ssh_engine(ssh_server: SshServer, docker_test_image: str, docker_session_container: str) -> SshEngine:
    """The main engine over SSH: ``ssh://dshdocker@127.0.0.1:PORT`` on the session's test sshd (the
    login made when missing, in group ``docker``, with an empty ``.bashrc``), with the server's root
    key and known_hosts; ``image`` and ``container`` are the main engine's session ones.

    Checked before it is handed out: the login there runs ``docker system dial-stdio`` and a
    ``/_ping`` through it answers ``OK``; if not, the fixture fails with what ssh printed.
    """
    if shutil.which("ssh") is None:
        pytest.skip(_unavailable("ssh not found (apt-get install openssh-client)"))
    try:
        grp.getgrnam("docker")
    except KeyError:
        pytest.skip(_unavailable("no group 'docker' here, whose members may use the engine's socket"))
    home = ensure_user(DOCKER_LOGIN, groups=("docker",))
    (home / ".bashrc").write_text("")
    authorized = ssh_server.directory / f"authorized_keys.{DOCKER_LOGIN}"
    authorized.write_text(Path(f"{ssh_server.root_key}.pub").read_text())
    authorized.chmod(0o644)
    engine = SshEngine(
        url=f"ssh://{DOCKER_LOGIN}@{ssh_server.host}:{ssh_server.port}",
        client_key=ssh_server.root_key,
        known_hosts=ssh_server.known_hosts,
        image=docker_test_image,
        container=docker_session_container,
    )
    result = _dial_stdio_ping(engine)
    if not result.stdout.endswith(b"\r\n\r\nOK"):
        pytest.fail(
            f"docker system dial-stdio over ssh did not answer /_ping (exit {result.returncode}): "
            f"stdout {result.stdout[-300:]!r}, stderr {result.stderr[-500:]!r}"
        )
    return engine


def tls_cli_environment(engine: TlsEngine, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without DOCKER_* variables, plus ``engine``'s and ``extra``."""
    return {**_cli_environment(), **engine.environment(), **(extra or {})}
