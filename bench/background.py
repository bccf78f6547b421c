"""Background tasks on one backend: 200 at once, and the cost of ``read_output`` as a task's output grows.

Runs in a fresh interpreter per backend (``bench/run.py`` starts it), so the peak RSS growth is this
backend's own. Two measurements on one executor with the backend's default configuration:

* ``--tasks N`` tasks started at once (each prints five lines over about half a second): wall time
  from the first ``start`` to the last task's end, the slowest ``start``, peak RSS growth, and
  every task's output read back and checked.
* A task writes about 8 KiB every 10 ms and is read every 20 ms; after ``--read-seconds`` a second,
  identical task starts, and for a few more seconds both are read in turns: the old one has a large
  total, the fresh one a small total, and both get the same deltas. A read must cost what its delta
  costs, not what the total costs: the figure is the ratio of the median cost per delta byte, old
  task over fresh task.

    python bench/background.py --backend local [--tasks 200] [--read-seconds 15] [--context JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio
from rss import PeakMeter

from dsh_bash import BashExecRequest, BashExecutor, BashTask

TASK_COMMAND = "for i in 1 2 3 4 5; do echo line $i; sleep 0.1; done"
EXPECTED_TASK_OUTPUT = "".join(f"line {i}\n" for i in range(1, 6))
# 8 KiB of 'x' per line (no NULs: busybox tr in the test image), one line every 10 ms.
WRITER_COMMAND = "s=$(head -c 8191 /dev/zero | tr '\\0' x); while :; do echo \"$s\"; sleep 0.01; done"
READ_INTERVAL_S = 0.02


async def _start(ex: BashExecutor, command: str) -> BashTask:
    return await ex.start(ex.resolve(BashExecRequest(command=command)))


async def many_tasks(ex: BashExecutor, count: int) -> dict[str, Any]:
    meter = PeakMeter()
    tasks: list[BashTask] = []
    start_seconds: list[float] = []

    async def start_one() -> None:
        started = time.perf_counter()
        tasks.append(await _start(ex, TASK_COMMAND))
        start_seconds.append(time.perf_counter() - started)

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(start_one)
    for task in tasks:
        await task.wait()
    wall = time.perf_counter() - began
    growth = meter.growth_mib()
    wrong = 0
    for task in tasks:
        read = await ex.read_output(task.id)
        if task.status != "completed" or task.exit_code != 0 or read.delta != EXPECTED_TASK_OUTPUT:
            wrong += 1
    if wrong:
        raise RuntimeError(f"{wrong} of {count} background tasks did not complete with their full output")
    return {
        "tasks": count,
        "wall_s": wall,
        "slowest_start_s": max(start_seconds),
        "median_start_s": statistics.median(start_seconds),
        "rss_growth_mib": growth,
    }


async def read_cost(ex: BashExecutor, seconds: float, window: float) -> dict[str, Any]:
    """Two identical writers: one started ``seconds`` ago (a large total), one fresh (a small total).

    For the last ``window`` seconds both are read in turns, so load on the machine hits both alike.
    """
    old = await _start(ex, WRITER_COMMAND)
    fresh: BashTask | None = None
    # (total so far, cost in seconds, delta bytes) of each task's reads in the window.
    samples: dict[str, list[tuple[int, float, int]]] = {"large": [], "small": []}
    totals = {"large": 0, "small": 0}
    lossy = 0
    turn = 0
    began = time.perf_counter()
    try:
        while (elapsed := time.perf_counter() - began) < seconds + window:
            await anyio.sleep(READ_INTERVAL_S)
            if fresh is None and elapsed >= seconds:
                fresh = await _start(ex, WRITER_COMMAND)
                continue
            pairs = [("large", old)] if fresh is None else [("large", old), ("small", fresh)]
            turn += 1
            if turn % 2:  # who goes first after the sleep may pay for other tasks' wake-ups: take turns
                pairs.reverse()
            for name, task in pairs:
                started = time.perf_counter()
                read = await ex.read_output(task.id)
                cost = time.perf_counter() - started
                delta = len(read.delta)
                totals[name] += delta
                lossy += read.lossy  # a late read (a loaded machine) lost bytes: counted, still a read
                if fresh is not None and delta:
                    samples[name].append((totals[name], cost, delta))
    finally:
        for task in (old, fresh):
            if task is not None:
                await ex.kill(task.id)
                await task.wait()
    large, small = samples["large"], samples["small"]
    if len(small) < 5 or len(large) < 5:
        raise RuntimeError(f"too few reads with output: {len(small)} fresh, {len(large)} old")

    def per_kib(group: list[tuple[int, float, int]]) -> float:
        return statistics.median(cost / (delta / 1024) for _, cost, delta in group) * 1e6

    return {
        "seconds": seconds,
        "window": window,
        "small_total_mib": statistics.median(s[0] for s in small) / 2**20,
        "large_total_mib": statistics.median(s[0] for s in large) / 2**20,
        "small_read_us": statistics.median(s[1] for s in small) * 1e6,
        "large_read_us": statistics.median(s[1] for s in large) * 1e6,
        "small_delta_kib": statistics.median(s[2] for s in small) / 1024,
        "large_delta_kib": statistics.median(s[2] for s in large) / 1024,
        "small_us_per_kib": per_kib(small),
        "large_us_per_kib": per_kib(large),
        "reads": len(small) + len(large),
        "lossy_reads": lossy,
    }


async def measure(backend: str, context: dict[str, Any], tasks: int, seconds: float) -> dict[str, Any]:
    from targets import make_executor  # noqa: PLC0415

    async with make_executor(backend, context) as ex:
        result = {"backend": backend, "many": await many_tasks(ex, tasks)}
    async with make_executor(backend, context) as ex:
        result["read"] = await read_cost(ex, seconds, window=min(3.0, seconds / 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--read-seconds", type=float, default=15.0)
    parser.add_argument("--context", default="{}", help="JSON: image, labels, ssh (see bench/targets.py)")
    args = parser.parse_args()
    context = json.loads(args.context)
    print(json.dumps(anyio.run(measure, args.backend, context, args.tasks, args.read_seconds)))


if __name__ == "__main__":
    main()
