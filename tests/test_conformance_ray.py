"""The Ray backend against a two-node local Ray cluster (``tests/ray_support.py``), asyncio only.

The whole kit through ``dsh-bash conformance --config ray.toml`` (a driver process of its own,
connecting to the cluster this test process started), and what only a cluster can show: a node
that dies under a running command, executors spread over nodes, placement that fits no node, a
cluster that cannot be reached, and ``doctor`` naming the node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from cli_support import console_script
from dsh_bash_conformance import CHECKS
from fault_support import eventually_gone, wait_for_processes
from kit_targets import expected_outcome
from ray_support import SECOND, RayCluster

from dsh_bash import BashExecRequest, BashInfrastructureError

pytestmark = [pytest.mark.ray, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Ray's object refs are asyncio futures


TESTS_DIR = Path(__file__).resolve().parent

#: The kit in three runs of the command, which workers may take in parallel (the whole kit through
#: Ray is about five minutes of test time).
_THIRD = -(-len(CHECKS) // 3)
KIT_PARTS = [list(CHECKS)[start : start + _THIRD] for start in range(0, len(CHECKS), _THIRD)]


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
    assert [name for part in KIT_PARTS for name in part] == list(CHECKS)


@pytest.mark.kit
@pytest.mark.timeout(420)
@pytest.mark.parametrize("part", range(len(KIT_PARTS)), ids=lambda index: f"part{index + 1}")
def test_cli_conformance_passes_every_check(ray_cluster: RayCluster, tmp_path: Path, part: int) -> None:
    checks = KIT_PARTS[part]
    done = _cli("conformance", "--config", str(_toml(tmp_path / "ray.toml", ray_cluster)), "--json",
                "--check", *checks, timeout=400)  # fmt: skip
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}): {done.stdout!r} {done.stderr[-3000:]!r}")
    failed = [
        (r["name"], r["outcome"], r["message"])
        for r in report["results"]
        if r["outcome"] != expected_outcome("ray", r["name"])
    ]
    assert failed == []
    assert [r["name"] for r in report["results"]] == checks
    assert (done.returncode, report["contract_ok"]) == (0, True)
    # The kit found processes and planted variables through the backend's hooks, on the node.
    notes = [line for line in done.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and "every node that fits" in notes[0], done.stderr


@pytest.mark.timeout(180)
async def test_a_node_that_dies_ends_its_commands_once_as_lost(ray_cluster: RayCluster) -> None:
    """Killing the node under a running command and a running task: each ends once, as lost
    (``node_lost``); a later call says so; ``aclose`` is quick; nothing of theirs runs on."""
    node = ray_cluster.add_node(dsh_doomed=1)
    ended: list[str] = []
    async with ray_cluster.executor(resources={"dsh_doomed": 1}) as ex:
        ex.on_task_done(lambda task: ended.append(task.id))
        task = await ex.start(ex.resolve(BashExecRequest(command="sleep 3131")))
        failure: list[BaseException] = []

        async def foreground() -> None:
            try:
                await ex.exec("sleep 3132")
            except BashInfrastructureError as exc:
                failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(foreground)
            await wait_for_processes("3131", within_s=20)
            await wait_for_processes("3132", within_s=20)
            await anyio.to_thread.run_sync(ray_cluster.cluster.remove_node, node, False)
        assert [getattr(exc, "reason", None) for exc in failure] == ["node_lost"], failure
        with anyio.fail_after(30):
            await task.wait()
        assert (task.status, task.end_cause) == ("killed", "lost"), task
        with pytest.raises(BashInfrastructureError) as raised:
            await ex.exec("true")
        assert raised.value.reason == "node_lost"
        closing = time.monotonic()
    assert time.monotonic() - closing < 15
    assert ended == [task.id]
    assert await eventually_gone("3131", within_s=20) == []
    assert await eventually_gone("3132", within_s=20) == []


async def test_executors_spread_over_the_nodes(ray_cluster: RayCluster) -> None:
    """Executors with no placement go to the node where this process has the fewest."""
    from dsh_bash_ray import RayBashExecutor  # noqa: PLC0415

    nodes: set[str] = set()
    async with anyio.create_task_group() as tg:
        for _ in range(4):

            async def one() -> None:
                async with RayBashExecutor.from_fields() as ex:
                    result = await ex.exec("echo $$")
                    assert result.exit_code == 0
                    nodes.add(ex.node.node_id)
                    await anyio.sleep(1)  # held while the others open

            tg.start_soon(one)
    assert len(nodes) >= 2, nodes


async def test_no_node_fits(ray_cluster: RayCluster) -> None:
    with pytest.raises(BashInfrastructureError) as raised:
        async with ray_cluster.executor(resources={"dsh_no_such_resource": 1}, placement_timeout_ms=300):
            pass
    assert raised.value.reason == "no_node_fits"
    assert "dsh_no_such_resource" in str(raised.value)


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
