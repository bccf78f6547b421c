"""Shared pieces of the faults and abuse suite (``tests/test_faults_*.py``, ``tests/test_abuse_*.py``).

Loaded as a pytest plugin by ``tests/conftest.py`` (``pytest_plugins``), like ``docker_support`` and
``ssh_support``, so its fixtures are available to every module; modules import the plain helpers.

- :func:`backend` (indirect parametrization, see :func:`backend_params`): one real backend, ``local``,
  ``docker-image``, ``docker-container`` or ``ssh``, as a :class:`Backend` that makes executors.
- :func:`marker`: a unique token to put on a command line (``bash -c '...' MARKER``), so the test can
  find the command's processes from outside (the kit's ``find_host_processes``: every backend here runs
  its processes on this host). Whatever still carries it at the end of the test is SIGKILLed.
- :class:`SecondEngine` / :func:`second_engine`: a private ``dockerd`` (own socket, data and exec roots,
  own bridge interface, no iptables) that a test may restart without disturbing the shared engine.
- :func:`restart_sshd`, :func:`session_sshds`: cutting and restarting the test SSH server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from dsh_bash_conformance import find_host_processes

from dsh_bash import BashExecutor

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "SecondEngine",
    "backend_params",
    "eventually_gone",
    "restart_sshd",
    "session_sshds",
    "wait_for_processes",
]

BACKEND_NAMES = ("local", "docker-image", "docker-container", "ssh")
BACKEND_UNAVAILABLE = "backend unavailable:"
#: Short grace so that kill sequences (SIGTERM, then SIGKILL) stay quick in the suite.
GRACE_MS = 300


@dataclass
class Backend:
    """One backend under test: its name and a factory of unopened executors (budget overrides allowed)."""

    name: str
    make: Callable[..., BashExecutor]

    @property
    def is_docker(self) -> bool:
        return self.name.startswith("docker")


def backend_params(*names: str, xfail: dict[str, str] | None = None) -> list[Any]:
    """Parameters for ``@pytest.mark.parametrize("backend", ..., indirect=True)``.

    ``names`` defaults to every backend, SSH last (its cases run
    after the others). ``xfail`` maps a backend name to the reason of a strict expected failure.
    """
    chosen = names or BACKEND_NAMES
    params = []
    for name in chosen:
        reason = (xfail or {}).get(name)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        if name.startswith("docker"):
            marks.append(pytest.mark.docker)
        if name == "ssh":
            marks.append(pytest.mark.ssh)
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    """The backend named by the parameter; needs the Docker or SSH fixtures only when used."""
    name = str(request.param)
    if name == "local":
        from dsh_bash_local import LocalBashExecutor, LocalConfig  # noqa: PLC0415

        def make_local(**fields: Any) -> BashExecutor:
            return LocalBashExecutor(LocalConfig(**{"grace_ms": GRACE_MS, **fields}))

        return Backend(name, make_local)
    if name == "docker-image":
        from docker_support import SESSION_ID, SESSION_LABEL  # noqa: PLC0415
        from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

        image = request.getfixturevalue("docker_test_image")

        def make_image(**fields: Any) -> BashExecutor:
            fields = {"grace_ms": GRACE_MS, "image": image, **fields}
            fields["labels"] = {SESSION_LABEL: SESSION_ID, **fields.get("labels", {})}
            return DockerBashExecutor(DockerConfig(**fields))

        return Backend(name, make_image)
    if name == "docker-container":
        from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

        container = request.getfixturevalue("docker_session_container")

        def make_container(**fields: Any) -> BashExecutor:
            return DockerBashExecutor(
                DockerConfig(**{"grace_ms": GRACE_MS, "container": container, **fields})
            )

        return Backend(name, make_container)
    if name == "ssh":
        server = request.getfixturevalue("ssh_server")

        def make_ssh(**fields: Any) -> BashExecutor:
            return server.executor(**{"grace_ms": GRACE_MS, **fields})  # type: ignore[no-any-return]

        return Backend(name, make_ssh)
    raise ValueError(f"unknown backend {name!r}; expected one of {BACKEND_NAMES}")


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique token for command lines; every process still carrying it afterwards is SIGKILLed."""
    value = f"dshfault-{os.urandom(6).hex()}"
    yield value
    for pid in find_host_processes(value):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


async def wait_for_processes(marker: str, count: int = 1, within_s: float = 10.0) -> list[int]:
    """Wait until at least ``count`` live processes carry ``marker``; fail the test otherwise."""
    deadline = time.monotonic() + within_s
    while True:
        found = find_host_processes(marker)
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"only {len(found)} of {count} processes marked {marker} started in {within_s}s")
        await anyio.sleep(0.05)


async def eventually_gone(marker: str, within_s: float) -> list[int]:
    """Wait up to ``within_s`` for every process carrying ``marker`` to end; return the survivors."""
    deadline = time.monotonic() + within_s
    while True:
        found = find_host_processes(marker)
        if not found or time.monotonic() > deadline:
            return found
        await anyio.sleep(0.05)


# -- a private Docker engine ----------------------------------------------------------------------------


class SecondEngine:
    """A ``dockerd`` of its own, under a short temporary directory, that a test may restart.

    Containers do not survive its restart (no live-restore): a restart stops them, as a restart of a
    real engine does. The test image is copied in from the shared engine with save/load.
    """

    def __init__(self) -> None:
        # Unix socket paths are limited to ~100 bytes: keep the root short.
        self.root = Path(tempfile.mkdtemp(prefix="dshe-", dir="/tmp"))
        self.socket = self.root / "d.sock"
        self.url = f"unix://{self.socket}"
        self.process: subprocess.Popen[bytes] | None = None
        # A bridge of its own. NOT `--bridge none`: a dockerd started with it deletes the host's
        # `docker0` (moby's removeDefaultBridgeInterface), which breaks the shared engine's default
        # network for everyone until docker0 is made again.
        self.bridge = f"dshe{os.urandom(4).hex()}"  # interface names: at most 15 characters
        self._bridge_made = False

    def _command(self) -> list[str]:
        return [
            "dockerd",
            "--host", self.url,
            "--data-root", str(self.root / "data"),
            "--exec-root", str(self.root / "x"),
            "--pidfile", str(self.root / "pid"),
            "--bridge", self.bridge,
            "--iptables=false",
            "--ip6tables=false",
        ]  # fmt: skip

    def start(self, within_s: float = 30.0) -> None:
        if not self._bridge_made:
            subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
            self._bridge_made = True
        log = open(self.root / "dockerd.log", "ab")  # noqa: SIM115 - the daemon keeps writing to it
        self.process = subprocess.Popen(self._command(), stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + within_s
        while (
            subprocess.run(["docker", "-H", self.url, "version"], capture_output=True, check=False).returncode
            != 0
        ):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "dockerd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"the second dockerd did not come up: {tail}")
            time.sleep(0.2)

    def stop(self, within_s: float = 20.0) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(within_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def load_image(self, tag: str) -> None:
        """Copy ``tag`` from the shared engine into this one (no registry here)."""
        save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
        assert save.stdout is not None
        loaded = subprocess.run(
            ["docker", "-H", self.url, "load", "-q"], stdin=save.stdout, capture_output=True, check=False
        )
        save.stdout.close()
        if save.wait() != 0 or loaded.returncode != 0:
            raise RuntimeError(f"loading {tag} into the second dockerd failed: {loaded.stderr.decode()}")

    def docker(self, *args: str) -> str:
        """Run the docker CLI against this engine; return its stdout."""
        done = subprocess.run(["docker", "-H", self.url, *args], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            ids = self.docker("ps", "-aq").split()
            if ids:
                self.docker("rm", "-f", *ids)
        self.stop()
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], check=False)
            self._bridge_made = False
        # Its overlay mounts are gone once the daemon stopped cleanly; anything left is only files.
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.root)], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def second_engine(docker_test_image: str) -> Iterator[SecondEngine]:
    """A private dockerd with the test image loaded (module-scoped: starting one takes seconds)."""
    if shutil.which("dockerd") is None or shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip(f"{BACKEND_UNAVAILABLE} a second dockerd needs the dockerd and ip binaries, and root")
    engine = SecondEngine()
    engine.start()
    try:
        engine.load_image(docker_test_image)
        yield engine
    finally:
        engine.remove()


# -- the test SSH server ------------------------------------------------------------------------------------


def session_sshds(server: Any) -> list[int]:
    """Every sshd process below ``server``'s listener: one privileged monitor and one session each."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            comm = Path(f"/proc/{name}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "sshd":
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(name))
    found: list[int] = []
    pending = [server.process.pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def restart_sshd(server: Any) -> None:
    """Stop ``server``'s listener and every session below it, then start a listener on the same port."""
    for pid in session_sshds(server):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    command = list(server.process.args)
    server.process.terminate()
    server.process.wait(5)
    server.process = subprocess.Popen(command)
    deadline = time.monotonic() + 10
    import socket  # noqa: PLC0415

    while True:
        try:
            with socket.create_connection((server.host, server.port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline or server.process.poll() is not None:
                raise RuntimeError("the test sshd did not come back on its port") from None
            time.sleep(0.05)
