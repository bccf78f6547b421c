"""The Ray backend (issue 34) beside the local one, in one run, on a two-node local Ray cluster.

- Latency: ``await ex.exec("true")`` through a Ray executor whose node is the cluster's second node
  (every command crosses from this driver to another raylet's worker), alternating with the same on a
  local executor, median of ``--runs``; reported as the milliseconds Ray adds (target: at most 3 ms)
  and as a ratio; beside them, in turn with them, Ray's own round trip to an async actor on that
  node that does nothing (the floor under any command through an actor).
- Scale: ``--sandboxes`` (200) Ray executors opened at once, spread over both nodes, then a ``true``
  in each at once; beside ``--sandboxes`` local executors doing the same, and one local executor
  running as many ``true`` at once. The open and the commands are timed apart (an executor's open is
  its sandbox's start; the commands, what a harness then waits for).
- With ``--docker IMAGE``: the latency of ``true`` in a container of IMAGE through Ray (``inner =
  "docker"``: the engine's connections relayed by the second node) beside the Docker backend on
  the same engine directly, alternating, median of ``--runs``.

    python bench/cluster.py [--runs N] [--sandboxes N] [--docker IMAGE] [--json]

Needs the ``ray`` extra; starts and stops its own cluster (a head and one more node, 3-15 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio

from dsh_bash import BashExecutor

#: The custom resource only the second node has.
SECOND = "dsh_bench_second"


def _local(**fields: Any) -> BashExecutor:
    from dsh_bash_local import LocalBashExecutor  # noqa: PLC0415

    return LocalBashExecutor.from_fields(**fields)


def _ray(**fields: Any) -> BashExecutor:
    from dsh_bash_ray import RayBashExecutor  # noqa: PLC0415

    return RayBashExecutor.from_fields(**fields)


async def _medians(
    runs: int,
    executors: dict[str, BashExecutor],
    others: dict[str, Callable[[], Awaitable[Any]]] | None = None,
) -> dict[str, float]:
    """The median milliseconds of ``true`` on each executor (opened), and of each of ``others``,
    taken in turn, after a warm-up (the first commands pay imports and spares)."""
    steps: dict[str, Callable[[], Awaitable[Any]]] = {
        name: partial(_true, ex) for name, ex in executors.items()
    }
    steps.update(others or {})
    for step in steps.values():
        for _ in range(10):
            await step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, step in steps.items():
            started = time.perf_counter()
            await step()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(each) for name, each in times.items()}


async def _true(ex: BashExecutor) -> None:
    result = await ex.exec("true")
    assert result.exit_code == 0, result


class _Echo:
    """An async actor that does nothing: Ray's own round trip, the floor under any actor call."""

    async def ping(self) -> None:
        return None


async def latency(runs: int) -> dict[str, Any]:
    import ray  # noqa: PLC0415

    async with _ray(resources={SECOND: 1}) as through_ray, _local() as local:
        # On the second node, as the Ray executor's node host is.
        echo = ray.remote(_Echo).options(num_cpus=0, resources={SECOND: 0.001}).remote()

        async def call() -> None:
            await echo.ping.remote()

        medians = await _medians(runs, {"ray": through_ray, "local": local}, {"call": call})
        ray.kill(echo)
    ray_ms, local_ms, call_ms = medians["ray"], medians["local"], medians["call"]
    return {
        "runs": runs,
        "ray_ms": ray_ms,
        "local_ms": local_ms,
        "added_ms": ray_ms - local_ms,
        "ratio": ray_ms / local_ms,
        "bare_call_ms": call_ms,
        "target_added_ms": 3.0,
        "verdict": "pass" if ray_ms - local_ms <= 3.0 else "miss",
    }


async def docker_latency(runs: int, image: str) -> dict[str, Any]:
    from dsh_bash import load_executor  # noqa: PLC0415

    through_ray = load_executor(
        {"backend": "ray", "inner": "docker", "image": image, "resources": {SECOND: 1}}
    )
    direct = load_executor({"backend": "docker", "image": image})
    async with through_ray, direct:
        medians = await _medians(runs, {"ray": through_ray, "direct": direct})
    ray_ms, direct_ms = medians["ray"], medians["direct"]
    return {"runs": runs, "ray_ms": ray_ms, "direct_ms": direct_ms, "added_ms": ray_ms - direct_ms}


async def scale(count: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, make in (("ray", _ray), ("local", _local)):
        results[f"{name}_executors"] = await _many(make, count)
    async with _local() as ex:
        await ex.exec("true")
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(ex.exec, "true")
        results["local_one_executor"] = {"commands_s": time.perf_counter() - started}
    return results


async def _many(make: Any, count: int) -> dict[str, Any]:
    """``count`` executors opened at once; once all are open, ``true`` in each at once."""
    stack_opened: list[BashExecutor] = []
    where: Counter[str] = Counter()
    all_open = anyio.Event()
    go = anyio.Event()
    finish = anyio.Event()
    ended: list[float] = []

    async def one() -> None:
        async with make() as ex:
            stack_opened.append(ex)
            node = getattr(ex, "node", None)
            where[str(getattr(node, "node_id", "this host"))[:12]] += 1
            if len(stack_opened) == count:
                all_open.set()
            await go.wait()
            result = await ex.exec("true")
            assert result.exit_code == 0, result
            ended.append(time.perf_counter())
            if len(ended) == count:
                finish.set()
            await finish.wait()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(one)
        await all_open.wait()
        open_s = time.perf_counter() - started
        go_at = time.perf_counter()
        go.set()
        await finish.wait()
        commands_s = max(ended) - go_at
    return {"open_s": open_s, "commands_s": commands_s, "per_node": dict(where)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--docker", metavar="IMAGE", help="also Docker through Ray beside Docker directly")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray  # noqa: PLC0415
    from ray.cluster_utils import Cluster  # noqa: PLC0415

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={SECOND: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        figures = {
            "latency": anyio.run(latency, args.runs),
            "scale": anyio.run(scale, args.sandboxes),
            **({"docker": anyio.run(docker_latency, args.runs, args.docker)} if args.docker else {}),
            "load": os.getloadavg()[0],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return
    lat = figures["latency"]
    print(
        f"latency of true, median of {lat['runs']}: "
        f"Ray {lat['ray_ms']:.2f} ms, local {lat['local_ms']:.2f} ms: "
        f"{lat['added_ms']:+.2f} ms ({lat['ratio']:.2f}x); target at most +3 ms: {lat['verdict']}"
    )
    print(
        f"  Ray's own round trip to an async actor on that node that does nothing: "
        f"{lat['bare_call_ms']:.2f} ms (a command through Ray is at least one such call)"
    )
    if "docker" in figures:
        dock = figures["docker"]
        print(
            f"latency of true in a container, median of {dock['runs']}: through Ray {dock['ray_ms']:.2f} ms, "
            f"Docker directly {dock['direct_ms']:.2f} ms: {dock['added_ms']:+.2f} ms"
        )
    sc = figures["scale"]
    for name in ("ray_executors", "local_executors"):
        row = sc[name]
        print(
            f"{args.sandboxes} {name.replace('_', ' ')}: open {row['open_s']:.2f} s, "
            "then true in each at once "
            f"{row['commands_s']:.2f} s; per node {row['per_node']}"
        )
    print(
        f"one local executor, {args.sandboxes} true at once: {sc['local_one_executor']['commands_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
