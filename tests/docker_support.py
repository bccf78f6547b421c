"""Docker test support: engine probe, the test image, long-lived containers and kit targets.

Loaded as a pytest plugin by ``tests/conftest.py`` (``pytest_plugins``), so its fixtures are
available to every test module; test modules import the plain helpers (``docker_target``,
``docker_available``) directly.

No image can be pulled here, so the test image is built ``FROM scratch`` out of Debian's static
binaries (packages ``bash-static`` and ``busybox-static``), tagged by a hash of its content so a
rerun reuses it: 4 MB, built in a few seconds (``docker_test_image``). A real userland is the Debian
test image of ``tests/debian_image.py`` (``docker_debian_image``, ``docker_debian_container``): a
minbase bookworm made by ``mmdebstrap`` and ``docker import`` (coreutils, GNU grep, procps, python3,
a non-root user ``dshuser`` in ``/etc/passwd``), tagged by a hash of its recipe, built once (28-43 s
here; ``.ci/run`` builds it before the tests) and reused while the recipe holds. Both
images have no init of their own: image-mode executors and :func:`start_idle_container` give
``--init`` and an idle bash loop as PID 1's command.

Containers this module starts carry the label :data:`SESSION_LABEL` (value: this process's session
id) and are removed at the end of the session, also when a hung check abandoned one; image-mode
executors get the same label on the containers they create.

When no engine answers, or the static binaries are missing, the fixtures skip with a reason
starting ``backend unavailable:`` (which CI turns into a failure, see ``tests/conftest.py``); the
Debian fixtures skip so too when the Debian image is missing and cannot be built here (no
``mmdebstrap``, not root).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

# testcontainers would start its "Ryuk" reaper, an image that cannot be pulled here; this module
# removes what it starts itself. Must be set before testcontainers reads its configuration.
os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"

import debian_image
import pytest
from dsh_bash_conformance import KitTarget, find_host_processes

if TYPE_CHECKING:
    from docker import DockerClient
    from dsh_bash_docker import DockerBashExecutor
    from testcontainers.core.container import DockerContainer

__all__ = [
    "BASH_STATIC",
    "BUSYBOX_STATIC",
    "IDLE_COMMAND",
    "SESSION_LABEL",
    "DockerMode",
    "build_test_image",
    "docker_available",
    "docker_debian_container",
    "docker_debian_image",
    "docker_session_container",
    "docker_target",
    "docker_test_image",
    "find_container_processes",
    "remove_session_containers",
    "start_idle_container",
]

DockerMode = Literal["image", "container"]

#: Debian's statically linked bash (package ``bash-static``) and busybox (package ``busybox-static``).
BASH_STATIC = Path("/bin/bash-static")
BUSYBOX_STATIC = Path("/bin/busybox")

#: Label on every container this session starts or has an executor create; value: :data:`SESSION_ID`.
SESSION_LABEL = "dsh-bash-test.session"
SESSION_ID = f"{os.getpid()}-{secrets.token_hex(4)}"

#: Repository of the test image's tags (``dsh-bash-test:<content hash>``).
IMAGE_REPOSITORY = "dsh-bash-test"

#: PID 1 of a long-lived container (with ``init``, tini runs it): idles, and exits at SIGTERM.
IDLE_COMMAND = "bash --noprofile --norc -c 'trap \"exit 0\" TERM; while :; do sleep 3600 & wait $!; done'"

_DOCKERFILE = """\
FROM scratch
COPY bin/ /bin/
RUN ["/bin/busybox","--install","-s","/bin"]
RUN ["/bin/bash","-c","mkdir -p /tmp && chmod 1777 /tmp"]
CMD ["/bin/sleep","infinity"]
"""

_build_lock = threading.Lock()

#: The skip-reason prefix that CI turns into a failure (``tests/conftest.py``).
BACKEND_UNAVAILABLE = "backend unavailable:"


def _unavailable(reason: str) -> str:
    return f"{BACKEND_UNAVAILABLE} {reason}"


def docker_available() -> str | None:
    """None when a Docker engine answers (``docker.from_env().ping()``), else the reason it does not."""
    try:
        import docker  # noqa: PLC0415 - optional: the suite runs without the docker extra
    except ImportError:
        return "docker-py is not installed (pip install 'dsh-bash[test]')"
    try:
        client = docker.from_env()
    except Exception as exc:
        return f"no Docker engine configured or reachable: {type(exc).__name__}: {exc}"
    try:
        client.ping()
    except Exception as exc:
        return f"the Docker engine does not answer: {type(exc).__name__}: {exc}"
    finally:
        client.close()
    return None


def _missing_binaries() -> str | None:
    missing = [str(path) for path in (BASH_STATIC, BUSYBOX_STATIC) if not path.is_file()]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not found: the test image is built from Debian's static binaries "
        "(apt-get install bash-static busybox-static)"
    )


def _image_tag() -> str:
    digest = hashlib.sha256(_DOCKERFILE.encode())
    for path in (BASH_STATIC, BUSYBOX_STATIC):
        digest.update(path.read_bytes())
    return f"{IMAGE_REPOSITORY}:{digest.hexdigest()[:12]}"


def build_test_image() -> str:
    """Build (or reuse) the test image and return its tag; raises when it cannot be built."""
    import docker  # noqa: PLC0415
    import docker.errors  # noqa: PLC0415

    with _build_lock:
        tag = _image_tag()
        client = docker.from_env()
        try:
            try:
                client.images.get(tag)
                return tag
            except docker.errors.ImageNotFound:
                pass
            with tempfile.TemporaryDirectory(prefix="dsh-bash-image-") as context:
                bin_dir = Path(context, "bin")
                bin_dir.mkdir()
                shutil.copy2(BASH_STATIC, bin_dir / "bash")
                shutil.copy2(BUSYBOX_STATIC, bin_dir / "busybox")
                Path(context, "Dockerfile").write_text(_DOCKERFILE)
                client.images.build(path=context, tag=tag, pull=False, rm=True)
            return tag
        finally:
            client.close()


#: A directory of this host that each idle container has mounted (read-only, at
#: ``EGRESS_TEST_MOUNT``), by container id: container mode's ``egress_directory``, for the network
#: allow-list. All of them beneath one directory of the session's, removed at its end.
EGRESS_DIRECTORIES: dict[str, str] = {}
EGRESS_TEST_MOUNT = "/run/dsh-test-egress"
_egress_root: list[str] = []


def _egress_directory() -> str:
    if not _egress_root:
        _egress_root.append(tempfile.mkdtemp(prefix="dsh-test-egress-"))
        os.chmod(_egress_root[0], 0o711)
    directory = tempfile.mkdtemp(dir=_egress_root[0])
    os.chmod(directory, 0o711)  # the container's users reach a file by its name, and list none
    return directory


def start_idle_container(image: str, environment: Mapping[str, str] | None = None) -> DockerContainer:
    """Start a long-lived container of ``image`` with testcontainers (tini as PID 1, no network), with
    a directory of its own mounted for the network allow-list (:data:`EGRESS_DIRECTORIES`)."""
    from testcontainers.core.container import DockerContainer  # noqa: PLC0415

    egress = _egress_directory()
    container = (
        DockerContainer(image, env=dict(environment or {}))
        .with_command(IDLE_COMMAND)
        .with_volume_mapping(egress, EGRESS_TEST_MOUNT, "ro")
        .with_kwargs(init=True, network="none", labels={SESSION_LABEL: SESSION_ID})
    )
    started = container.start()
    EGRESS_DIRECTORIES[started.get_container_id()] = egress
    return started


def remove_session_containers() -> list[str]:
    """Force-remove every container labelled with this session's id; return their short ids."""
    import docker  # noqa: PLC0415
    import docker.errors  # noqa: PLC0415

    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        # No engine answers (the Docker tests skipped, on a machine without one): it holds no container.
        return []
    removed = []
    try:
        for container in client.containers.list(all=True, filters={"label": f"{SESSION_LABEL}={SESSION_ID}"}):
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                continue
            except docker.errors.APIError as exc:
                # An executor's aclose gave up waiting for the engine's answer (bounded; the engine
                # finishes the removal it asked for): that removal is still under way.
                if exc.status_code == 409 and "in progress" in str(exc):
                    continue
                raise
            removed.append(str(container.short_id))
    finally:
        client.close()
    return removed


def find_container_processes(marker: str) -> list[int]:
    """Like the kit's host scan, but pids as seen inside their own PID namespace (the container's).

    The engine is local, so container processes are visible in this host's ``/proc``; the last
    ``NSpid`` entry of ``/proc/PID/status`` is the pid a command in that container sees.
    """
    found = []
    for pid in find_host_processes(marker):
        try:
            with open(f"/proc/{pid}/status") as handle:
                nspid = next((line.split()[1:] for line in handle if line.startswith("NSpid:")), [])
        except OSError:
            continue  # gone since the scan
        found.append(int(nspid[-1]) if nspid else pid)
    return sorted(found)


# -- kit targets ------------------------------------------------------------------------------------


@dataclass
class _Planted:
    """Ambient variables planted by the kit, stacked (a block may be entered inside another)."""

    variables: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def layer(self, variables: Mapping[str, str]) -> Iterator[dict[str, str]]:
        """Add ``variables`` for the block; yield the whole planted set as it is inside it."""
        with self.lock:
            saved = {name: self.variables.get(name) for name in variables}
            self.variables.update(variables)
            current = dict(self.variables)
        try:
            yield current
        finally:
            with self.lock:
                for name, value in saved.items():
                    if value is None:
                        self.variables.pop(name, None)
                    else:
                        self.variables[name] = value

    def snapshot(self) -> dict[str, str]:
        with self.lock:
            return dict(self.variables)


def docker_config(image: str, **fields: Any) -> Any:
    """A ``DockerConfig`` of ``image`` for a test: a short grace, and this session's label (the session
    removes every container it made)."""
    from dsh_bash_docker import DockerConfig  # noqa: PLC0415

    return DockerConfig(image=image, grace_ms=300, labels={SESSION_LABEL: SESSION_ID}, **fields)


def docker_target(
    mode: DockerMode,
    anyio_backend: str,
    image: str,
    container: str | None = None,
    *,
    check_timeout_s: float = 30.0,
    containment: str = "auto",
    connection: Mapping[str, Any] | None = None,
    start_container: Callable[[str, Mapping[str, str]], tuple[str, Callable[[], None]]] | None = None,
    name: str = "docker",
) -> KitTarget:
    """A kit target for the Docker backend (``containment``: the config's, ``auto`` by default).

    ``connection``: config fields of every executor that say where the engine is (``docker_host``,
    ``tls_*``, ``ssh_*``); ``start_container(image, environment)`` starts an idle container on that
    engine and returns its id and how to remove it (default: the local engine, by testcontainers).

    ``mode="image"``: every executor creates (and removes) its own container from ``image``; the
    variables planted by ``plant_ambient`` become that container's environment (``environment``).

    ``mode="container"``: executors attach to the existing ``container`` (id or name). A container's
    ambient environment is fixed when it is created, so inside a ``plant_ambient`` block a fresh
    container of ``image`` is started with the planted variables and executors made in the block
    attach to it; it is removed when the block ends.
    """
    from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

    planted = _Planted()
    labels = {SESSION_LABEL: SESSION_ID}

    if mode == "image":

        def make_image_executor(**overrides: Any) -> DockerBashExecutor:
            fields: dict[str, Any] = {
                "image": image,
                "environment": planted.snapshot(),
                "containment": containment,
                **(connection or {}),
                **overrides,
            }
            fields["labels"] = {**labels, **fields.get("labels", {})}
            return DockerBashExecutor(DockerConfig(**fields))

        @contextlib.contextmanager
        def plant_in_config(variables: Mapping[str, str]) -> Iterator[None]:
            with planted.layer(variables):
                yield

        return KitTarget(
            name=f"{name}-image[{anyio_backend}]",
            make_executor=make_image_executor,
            plant_ambient=plant_in_config,
            find_processes=find_container_processes,
            anyio_backend=anyio_backend,
            check_timeout_s=check_timeout_s,
        )

    if mode != "container":
        raise ValueError(f"mode must be 'image' or 'container', not {mode!r}")
    if container is None:
        raise ValueError("mode 'container' needs the id or name of a running container")
    session_container: str = container
    # The container executors attach to: the session's, or the one of the innermost plant block.
    current: list[str] = [session_container]
    current_lock = threading.Lock()

    def make_container_executor(**overrides: Any) -> DockerBashExecutor:
        with current_lock:
            target_container = current[-1]
        # A container started here has a directory mounted for the allow-list's proxies (one on a
        # remote engine, started by ``start_container``, has none: the allow-list is refused there).
        egress = {} if connection else {"egress_directory": EGRESS_DIRECTORIES.get(target_container)}
        return DockerBashExecutor(
            DockerConfig(
                container=target_container,
                **{"containment": containment, **egress, **(connection or {}), **overrides},
            )
        )

    def start_locally(image: str, environment: Mapping[str, str]) -> tuple[str, Callable[[], None]]:
        fresh = start_idle_container(image, environment)
        return fresh.get_container_id(), fresh.stop

    start = start_container or start_locally

    @contextlib.contextmanager
    def plant_in_new_container(variables: Mapping[str, str]) -> Iterator[None]:
        with planted.layer(variables) as environment:
            fresh_id, remove = start(image, environment)
            try:
                with current_lock:
                    current.append(fresh_id)
                try:
                    yield
                finally:
                    with current_lock:
                        current.remove(fresh_id)
            finally:
                remove()

    return KitTarget(
        name=f"docker-container[{anyio_backend}]",
        make_executor=make_container_executor,
        plant_ambient=plant_in_new_container,
        find_processes=find_container_processes,
        anyio_backend=anyio_backend,
        check_timeout_s=check_timeout_s,
    )


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def _docker_session_cleanup() -> Iterator[None]:
    """At session end, removes every container still labelled with this session's id.

    One fixture under both image fixtures, so that it is torn down after everything that uses either
    image: were the sweep in each image fixture's own teardown, the one torn down first would remove
    the other image's session container before that fixture stops it (a 404 at teardown).
    """
    try:
        yield
    finally:
        remove_session_containers()
        if _egress_root:
            shutil.rmtree(_egress_root.pop(), ignore_errors=True)


@pytest.fixture(scope="session")
def docker_test_image(_docker_session_cleanup: None) -> str:
    """The tag of the test image, built once per session (reused across runs while its content holds).

    Skips with ``backend unavailable: ...`` when no engine answers or the static binaries are missing.
    At session end, every container still labelled with this session's id is removed.
    """
    reason = docker_available() or _missing_binaries()
    if reason is not None:
        pytest.skip(_unavailable(reason))
    try:
        return build_test_image()
    except Exception as exc:
        pytest.fail(f"building the Docker test image failed: {type(exc).__name__}: {exc}")


@pytest.fixture
def docker_client() -> Iterator[DockerClient]:
    """A docker-py client for the engine the tests use (from the environment), closed afterwards."""
    import docker  # noqa: PLC0415

    handle = docker.from_env()
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def docker_session_container(docker_test_image: str) -> Iterator[str]:
    """The id of a long-lived container of the test image (for ``container`` mode), removed at session end."""
    container = start_idle_container(docker_test_image)
    try:
        yield container.get_container_id()
    finally:
        container.stop()


@pytest.fixture(scope="session")
def docker_debian_image(_docker_session_cleanup: None) -> str:
    """The tag of the Debian test image (``tests/debian_image.py``), built when missing (28-43 s here,
    mirror permitting: the tests that may be first to use it carry a longer ``timeout`` mark).

    Skips with ``backend unavailable: ...`` when no engine answers, or the image is missing and cannot
    be built here (no ``mmdebstrap``, not root). At session end, this session's containers are removed.
    """
    reason = docker_available() or debian_image.unavailable()
    if reason is not None:
        pytest.skip(_unavailable(reason))
    try:
        return debian_image.build_image()
    except Exception as exc:
        pytest.fail(f"building the Debian test image failed: {type(exc).__name__}: {exc}")


@pytest.fixture(scope="session")
def docker_debian_container(docker_debian_image: str) -> Iterator[str]:
    """The id of a long-lived container of the Debian test image (for ``container`` mode)."""
    container = start_idle_container(docker_debian_image)
    try:
        yield container.get_container_id()
    finally:
        container.stop()
