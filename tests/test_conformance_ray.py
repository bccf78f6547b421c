"""The Ray backend against a two-node local Ray cluster (``tests/ray_support.py``), asyncio only.

The whole kit through ``dsh-bash conformance --config ray.toml`` (a driver process of its own,
connecting to the cluster this test process started), and what only a cluster can show: a node
that dies under a running command, executors spread over nodes, placement that fits no node, a
cluster that cannot be reached, and ``doctor`` naming the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from cli_support import console_script
from dsh_bash_conformance import CHECKS
from fault_support import eventually_gone, wait_for_processes
from kit_targets import BUSYBOX_NOT_APPLICABLE, expected_outcome
from ray_support import SECOND, RayCluster

from dsh_bash import BashExecRequest, BashInfrastructureError

pytestmark = [pytest.mark.ray, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Ray's object refs are asyncio futures


TESTS_DIR = Path(__file__).resolve().parent


def _parts(count: int) -> list[list[str]]:
    size = -(-len(CHECKS) // count)
    return [list(CHECKS)[start : start + size] for start in range(0, len(CHECKS), size)]


#: The kit in runs of the command that workers may take in parallel: three with the local backend
#: inside (about 1.5 min of test time in all), six with Docker inside (about 6 min: a container per
#: executor, every connection to its engine relayed), each well within its time limit on a busy
#: machine.
KIT_PARTS = _parts(3)
DOCKER_PARTS = _parts(6)


def _env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("DSH_BASH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    return env


def _toml(path: Path, cluster: RayCluster, **fields: str) -> Path:
    extra = "".join(f"{name} = {value}\n" for name, value in fields.items())
    path.write_text(
        f'backend = "ray"\naddress = "{cluster.address}"\n[resources]\n{SECOND} = 1\n'
        if not extra
        else f'backend = "ray"\n{extra}'
    )
    return path


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), *args], capture_output=True, text=True, timeout=timeout, check=False, env=_env()
    )


def test_the_parts_are_the_whole_kit() -> None:
    for parts in (KIT_PARTS, DOCKER_PARTS):
        assert [name for part in parts for name in part] == list(CHECKS)


@pytest.mark.kit
@pytest.mark.timeout(420)
@pytest.mark.parametrize("part", range(len(KIT_PARTS)), ids=lambda index: f"part{index + 1}")
def test_cli_conformance_passes_every_check(ray_cluster: RayCluster, tmp_path: Path, part: int) -> None:
    checks = KIT_PARTS[part]
    done = _cli("conformance", "--config", str(_toml(tmp_path / "ray.toml", ray_cluster)), "--json",
                "--check", *checks, timeout=400)  # fmt: skip
    _assert_report(done, checks, lambda name: expected_outcome("ray", name))
    # The kit found processes and planted variables through the backend's hooks, on the node.
    notes = [line for line in done.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and "every node that fits" in notes[0], done.stderr


def _docker_toml(path: Path, cluster: RayCluster, image: str) -> Path:
    path.write_text(
        f'backend = "ray"\naddress = "{cluster.address}"\ninner = "docker"\nimage = "{image}"\n'
        f"[resources]\n{SECOND} = 1\n"
    )
    return path


@pytest.mark.kit
@pytest.mark.docker
@pytest.mark.timeout(420)
@pytest.mark.parametrize("part", range(len(DOCKER_PARTS)), ids=lambda index: f"part{index + 1}")
def test_cli_conformance_with_docker_inside(
    ray_cluster: RayCluster, docker_test_image: str, tmp_path: Path, part: int
) -> None:
    """``inner = "docker"``: the Docker backend's executor on the second node's engine, every
    connection to it relayed by that node, the allow-list's proxies served by the node host there.
    The checks the busybox image has no tool for are not applicable, as on Docker directly."""
    checks = DOCKER_PARTS[part]
    config = _docker_toml(tmp_path / "ray-docker.toml", ray_cluster, docker_test_image)
    done = _cli("conformance", "--config", str(config), "--json", "--check", *checks, timeout=400)
    _assert_report(
        done,
        checks,
        lambda name: "not_applicable" if name in BUSYBOX_NOT_APPLICABLE else expected_outcome("docker", name),
    )


def _assert_report(
    done: subprocess.CompletedProcess[str], checks: list[str], expected: Callable[[str], str]
) -> None:
    """``dsh-bash conformance --json`` ran ``checks`` in order, each with the ``expected`` outcome."""
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}): {done.stdout!r} {done.stderr[-3000:]!r}")
    failed = [
        (r["name"], r["outcome"], r["message"])
        for r in report["results"]
        if r["outcome"] != expected(r["name"])
    ]
    assert failed == []
    assert [r["name"] for r in report["results"]] == checks
    assert (done.returncode, report["contract_ok"]) == (0, True)


@pytest.mark.docker
@pytest.mark.timeout(180)
async def test_a_node_that_dies_ends_its_container_commands_once_as_lost(
    ray_cluster: RayCluster, docker_test_image: str
) -> None:
    """``inner = "docker"``: killing the node that relays the engine under a running command and a
    running task ends each once, as lost; a later call says ``node_lost``; the commands in the
    container die (their execs' input closed with the node host's connections), and so does the
    container (its stdin, its tie to the executor, was one of them). ``aclose`` cannot reach the
    engine any more to remove it (the engine outlives the node host here, on this machine): it
    says so."""
    from dsh_bash import load_executor  # noqa: PLC0415

    node = ray_cluster.add_node(dsh_doomed_docker=1)
    fields = {"backend": "ray", "inner": "docker", "image": docker_test_image}
    ended: list[str] = []
    ex = load_executor({**fields, "resources": {"dsh_doomed_docker": 1}})
    await ex.__aenter__()
    try:
        await _doomed(ex, ended, ray_cluster, node)
        assert await _container_ends(getattr(ex, "container_id", ""), within_s=20)
    finally:
        closing = time.monotonic()
        try:
            with pytest.raises(BashInfrastructureError, match="could not kill") as at_close:
                await ex.aclose()
        finally:
            _remove_container(getattr(ex, "container_id", ""))
    assert "is gone" in str(at_close.value), at_close.value
    assert time.monotonic() - closing < 15
    assert len(ended) == 1
    # Long markers: a short one ("3133") matched the command lines of other tests' Ray processes
    # (their ports), once.
    assert await eventually_gone("31339127", within_s=20) == []
    assert await eventually_gone("31349127", within_s=20) == []


async def _container_ends(container_id: str, within_s: float) -> bool:
    import docker  # noqa: PLC0415

    container = docker.from_env().containers.get(container_id)
    deadline = time.monotonic() + within_s
    while container.attrs["State"]["Running"]:
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.2)
        await anyio.to_thread.run_sync(container.reload)
    return True


def _remove_container(container_id: str) -> None:
    """The container a lost node could not remove (its engine is this machine's here)."""
    if container_id:
        import docker  # noqa: PLC0415

        with contextlib.suppress(docker.errors.NotFound):
            docker.from_env().containers.get(container_id).remove(force=True)


async def _doomed(ex: Any, ended: list[str], ray_cluster: RayCluster, node: Any) -> None:
    """The body of the test above: a task and a run, then the node killed under them."""
    ex.on_task_done(lambda task: ended.append(task.id))
    task = await ex.start(ex.resolve(BashExecRequest(command="sleep 31339127")))
    failure: list[BaseException] = []

    async def foreground() -> None:
        try:
            await ex.exec("sleep 31349127")
        except BashInfrastructureError as exc:
            failure.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(foreground)
        await wait_for_processes("31339127", within_s=20)
        await wait_for_processes("31349127", within_s=20)
        await anyio.to_thread.run_sync(ray_cluster.cluster.remove_node, node, False)
    assert len(failure) == 1, failure
    with anyio.fail_after(30):
        await task.wait()
    assert (task.status, task.end_cause) == ("killed", "lost"), task
    with pytest.raises(BashInfrastructureError) as raised:
        await ex.exec("true")
    assert raised.value.reason == "node_lost", raised.value
    assert ended == [task.id]


async def test_executors_spread_over_the_nodes(ray_cluster: RayCluster) -> None:
    """Executors with no placement go to the node where this process has the fewest."""
    from dsh_bash_ray import RayBashExecutor  # noqa: PLC0415

    nodes: set[str] = set()
    opened = 0
    all_open = anyio.Event()

    async def one() -> None:
        nonlocal opened
        async with RayBashExecutor.from_fields() as ex:
            result = await ex.exec("echo $$")
            assert result.exit_code == 0
            nodes.add(ex.node.node_id)
            opened += 1
            if opened == 4:
                all_open.set()
            with anyio.fail_after(60):
                await all_open.wait()  # held until all are open (a second was too short under load)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert len(nodes) >= 2, nodes


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.1)
    return True


async def test_a_node_host_waits_for_the_next_executor_then_ends_itself(ray_cluster: RayCluster) -> None:
    """The node host outlives this process's last executor on its node by ``node_host_idle_ms``:
    the next one opened meanwhile uses it; after it, it is gone, and the next starts another.
    With 0 it goes with the last executor."""
    async with ray_cluster.executor(node_host_idle_ms=2000) as ex:
        first = ex.node.pid
    async with ray_cluster.executor(node_host_idle_ms=2000) as ex:
        assert ex.node.pid == first
        assert (await ex.exec("echo again")).stdout.text == "again\n"
    assert _alive(first)
    assert await _gone(first, within_s=20), "the idle node host did not end itself"
    async with ray_cluster.executor(node_host_idle_ms=0) as ex:
        second = ex.node.pid
        assert second != first
        assert (await ex.exec("echo anew")).stdout.text == "anew\n"
    assert await _gone(second, within_s=10), "a node host with node_host_idle_ms = 0 outlived its executor"


@pytest.mark.docker
async def test_a_node_host_without_an_idle_wait_removes_the_proxies_directory(
    ray_cluster: RayCluster, docker_test_image: str
) -> None:
    """``inner = "docker"`` with ``node_host_idle_ms = 0``: the allow-list's proxies live in a
    directory of the node host's that the container mounts; the last executor's close releases it,
    and the node host, ending at once, ends after that release (a kill from the harness could come
    first and leave the directory on the node). Each round a fresh node host."""
    from dsh_bash import SandboxPolicy, load_executor  # noqa: PLC0415

    policy = SandboxPolicy(network="allow-list", allow_hosts=("example.com",))
    for _ in range(3):
        ex: Any = load_executor(
            {
                "backend": "ray",
                "inner": "docker",
                "image": docker_test_image,
                "resources": {SECOND: 1},
                "node_host_idle_ms": 0,
            }
        )
        async with ex:
            done = await ex.run(ex.resolve(BashExecRequest(command="true", policy=policy)))
            assert done.exit_code == 0, done
            directory = await ex.config.engine_dialer.egress_directory()
            assert os.path.isdir(directory), directory
        assert await _removed(directory, within_s=10), f"{directory} outlived its node host"


async def _removed(path: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.1)
    return True


async def test_executors_opened_as_the_idle_node_host_ends_all_open(ray_cluster: RayCluster) -> None:
    """Opens that meet a node host at the end of its idle wait (ending, or just gone) get a new one
    on the same node: never an error, never another node (the placement pins the second node, so
    a node host taken for a dead node would end in ``no_node_fits``)."""
    for gap_ms in (0, 60, 120, 180, 240):
        async with ray_cluster.executor(node_host_idle_ms=150, placement_timeout_ms=3000) as ex:
            assert (await ex.exec("true")).exit_code == 0
        await anyio.sleep(gap_ms / 1000)
        async with anyio.create_task_group() as tg:
            for _ in range(2):

                async def one() -> None:
                    async with ray_cluster.executor(node_host_idle_ms=150, placement_timeout_ms=3000) as ex:
                        assert (await ex.exec("true")).exit_code == 0

                tg.start_soon(one)


async def test_no_node_fits(ray_cluster: RayCluster) -> None:
    with pytest.raises(BashInfrastructureError) as raised:
        async with ray_cluster.executor(resources={"dsh_no_such_resource": 1}, placement_timeout_ms=300):
            pass
    assert raised.value.reason == "no_node_fits"
    assert "dsh_no_such_resource" in str(raised.value)


#: A driver connected by the backend, then a message of the cluster to every driver (as when a node
#: is marked dead, sent again until it comes), waited for where the backend sends it (Ray's
#: listening thread takes seconds to pass it on under load), then a line of the harness's own.
_CLUSTER_MESSAGE = """
import logging, sys, threading
import ray
from ray._private.utils import publish_error_to_driver
from dsh_bash_ray import RayConfig
from dsh_bash_ray._node import connect

seen = threading.Event()
class Seen(logging.Handler):
    def emit(self, record):
        if "a node was marked dead" in record.getMessage():
            seen.set()
logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
logging.getLogger("dsh_bash.ray").addHandler(Seen())
connect(RayConfig(address=sys.argv[1]))
# Sent again every 2 s: one published before the driver's listener subscribed is never delivered
# (a whole run's load delayed that subscription past the first one, once).
gcs = ray._private.worker.global_worker.gcs_client
for _ in range(30):
    publish_error_to_driver("dsh_test", "a node was marked dead", gcs)
    if seen.wait(2):
        break
else:
    sys.exit("the message did not come to the log within 60 s")
print("the harness's own line")
"""


def test_the_clusters_messages_stay_out_of_the_harnesss_stdout(ray_cluster: RayCluster) -> None:
    """Ray prints the cluster's messages on a driver's stdout from a thread, whenever they come: in
    the middle of a CLI's JSON report (seen in this file's kit runs) or an MCP server's stdio."""
    done = subprocess.run(
        [sys.executable, "-c", _CLUSTER_MESSAGE, ray_cluster.address],
        capture_output=True, text=True, timeout=120, check=False, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the harness's own line\n"
    assert "dsh_bash.ray: Ray: a node was marked dead" in done.stderr


def test_doctor_names_the_node_and_an_unreachable_cluster(ray_cluster: RayCluster, tmp_path: Path) -> None:
    done = _cli("doctor", "--config", str(_toml(tmp_path / "ray.toml", ray_cluster)), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "commands run on Ray node" in done.stdout, done.stdout
    # A port where nothing listens: refused at once (ray.init itself waits for minutes).
    with_nothing = _toml(tmp_path / "gone.toml", ray_cluster, address='"127.0.0.1:9"')
    started = time.monotonic()
    done = _cli("doctor", "--config", str(with_nothing), timeout=60)
    assert done.returncode != 0
    assert "cluster_unreachable" in done.stdout + done.stderr or "cannot reach the Ray cluster" in done.stdout
    assert time.monotonic() - started < 30


async def test_a_supervisor_has_a_parent_of_its_own(ray_cluster: RayCluster) -> None:
    """Each supervisor's parent is a keeper of its own, a child of the node host: not the node host
    (a Ray worker that exits SIGKILLs its children, which would leave the command running), and not
    init (a command may stop every process that shares its supervisor's parent: the kit's
    stopped-spares check did, and froze the machine's Docker engine while the supervisors were
    orphaned at their start)."""
    probe = (
        "read -r s < /proc/$PPID/stat; f=(${s##*) }); keeper=${f[1]}; "
        'read -r s < /proc/$keeper/stat; name=${s#*(}; f=(${s##*) }); echo "$keeper ${name%%)*} ${f[1]}"'
    )
    async with ray_cluster.executor() as ex:
        result = await ex.exec(probe)
        keeper, name, keeper_parent = result.stdout.text.split()
        assert int(keeper) not in (1, ex.node.pid), result.stdout.text
        assert (name, int(keeper_parent)) == ("bash", ex.node.pid), result.stdout.text


@pytest.fixture
def stopped_stranger(tmp_path: Path) -> Iterator[int]:
    """A stopped process named like a supervisor, of no executor here (this test's user's)."""
    stranger = tmp_path / "dsh-supervise-stranger"
    stranger.write_bytes(Path("/bin/sleep").read_bytes())
    stranger.chmod(0o755)
    other = subprocess.Popen([str(stranger), "300"])
    try:
        os.kill(other.pid, signal.SIGSTOP)
        yield other.pid
    finally:
        other.kill()
        other.wait()


async def test_continuing_supervisors_reaches_only_the_node_hosts_own(
    ray_cluster: RayCluster, stopped_stranger: int
) -> None:
    """A command may stop its supervisor; the node host continues its own then, and nothing else:
    the node's user may be root, and a continue of every stopped ``dsh-supervise*`` of the user
    rescued another harness's supervisors on the machine (a broken backend of the kit's table,
    meant to be caught leaving them stopped, passed while the Ray kit ran beside it)."""
    async with ray_cluster.executor() as ex:
        await ex.exec("true")
        await ex._continue_supervisors()  # what a kill runs when the supervisor does not answer
    state = Path(f"/proc/{stopped_stranger}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "T", "the node host continued a supervisor of another harness"


# -- inner = "docker": what the config says (no cluster) --------------------------------------------


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"docker_host": "tcp://10.0.0.5:2375"}, "docker_host: with inner = 'docker' the node's own engine"),
        ({"spill_parent": "/tmp"}, "spill_parent"),
        ({"image": None}, "give exactly one of 'image'"),
        ({"placement_timeout_ms": 0}, "placement_timeout_ms must be positive"),
    ],
)
def test_docker_inside_config_errors_name_the_field(fields: dict[str, Any], said: str) -> None:
    from dsh_bash import ConfigError, load_executor  # noqa: PLC0415

    base = {"backend": "ray", "inner": "docker", "image": "debian"}
    with pytest.raises(ConfigError) as raised:
        load_executor({**base, **fields})
    assert said in str(raised.value)


def test_docker_inside_is_the_docker_backends_executor() -> None:
    """The Ray fields place it; every other field reaches the Docker backend's config, whose
    connections the dialer makes (no ``docker_host`` of its own)."""
    from dsh_bash_ray import RayBashExecutor, RayDialer  # noqa: PLC0415

    from dsh_bash import ConfigError, load_executor  # noqa: PLC0415

    ex = load_executor(
        {"backend": "ray", "inner": "docker", "image": "debian", "user": "nobody", "resources": {"x": 1}}
    )
    assert type(ex).__name__ == "DockerBashExecutor"
    config: Any = ex.config
    assert (config.image, config.user, config.docker_host) == ("debian", "nobody", None)
    assert isinstance(config.engine_dialer, RayDialer)
    assert "chosen at open" in config.engine_dialer.describe()
    with pytest.raises(ConfigError, match="inner = 'local'"):
        RayBashExecutor.from_fields(inner="docker")
