"""Before and after a change, in the same run: this checkout against another revision of it.

For a change that must not cost anything (moves, renames, a split of the supervisor's source), the
baseline is the code before it. Both trees run the same probe in fresh interpreters, alternating
(before, after, after, before, ...) so that the machine's drift and the order hit both alike; each
probe reports medians, and the table gives the ratio after/before of the medians of those. Absolute
times are context only; ``--before HEAD`` (the checkout against itself) shows the noise.

    python bench/compare.py --before REV [--rounds 6] [--calls 60] [--docker-image TAG]

REV's tree is exported (``git archive``) to a temporary directory and its ``dsh-supervise`` built
there from its own sources (``native/build.py``), so both sides run their own native code.
Measured per backend (local, and Docker in image mode when ``--docker-image`` is given): the latency
of ``true``, the wall time of 16 MiB of stdout, and of 20 background tasks started at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Where each tree keeps its importable packages (the checkout is not installed in the probe).
PACKAGE_ROOTS = (".", "backends/local", "backends/docker", "backends/ssh", "conformance")

PROBE = r"""
import json, statistics, sys, time
import anyio
import dsh_bash
from dsh_bash import BashExecRequest
sys.path.insert(0, sys.argv[3])
from targets import make_executor

backend, calls = sys.argv[1], int(sys.argv[2])
context = json.loads(sys.argv[4])

async def main():
    ex = make_executor(backend, context)
    async with ex:
        for _ in range(5):
            await ex.exec("true")
        latency = []
        for _ in range(calls):
            t = time.perf_counter()
            await ex.exec("true")
            latency.append((time.perf_counter() - t) * 1000)
        stream = []
        for _ in range(3):
            t = time.perf_counter()
            result = await ex.exec("head -c 16777216 /dev/zero")
            stream.append((time.perf_counter() - t) * 1000)
            assert result.exit_code == 0, result
        t = time.perf_counter()
        request = BashExecRequest(command="sleep 0.2; echo done")
        tasks = [await ex.start(ex.resolve(request)) for _ in range(20)]
        for task in tasks:
            await task.wait()
        background = (time.perf_counter() - t) * 1000
    print(json.dumps({
        "where": dsh_bash.__file__,
        "latency_ms": statistics.median(latency),
        "stream_16mib_ms": statistics.median(stream),
        "background_20_ms": background,
    }))

anyio.run(main)
"""

MEASURES = ("latency_ms", "stream_16mib_ms", "background_20_ms")


def export(rev: str, into: Path) -> Path:
    """REV's tracked files in ``into`` (no worktree to clean up in the repository)."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev], check=True)
    tree = into / "tree"
    tree.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def build_native(tree: Path) -> None:
    """The tree's dsh-supervise for this machine, from its own sources (when missing or stale)."""
    arch = platform.machine()
    command = [sys.executable, str(tree / "native" / "build.py"), "--if-stale", "--arch", arch]
    subprocess.run(command, check=True, cwd=tree)


def probe(tree: Path, backend: str, calls: int, context: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / root) for root in PACKAGE_ROOTS)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, backend, str(calls), str(ROOT / "bench"), json.dumps(context)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"the probe failed in {tree} ({backend}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    where = Path(result["where"]).resolve()
    if not where.is_relative_to(tree.resolve()):
        raise SystemExit(f"the probe of {tree} imported dsh_bash from {where}, not from the tree")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare against (e.g. HEAD~3)")
    parser.add_argument("--rounds", type=int, default=6, help="probes per side, alternating")
    parser.add_argument("--calls", type=int, default=60, help="`true` calls per probe")
    parser.add_argument("--docker-image", help="an image with bash: Docker in image mode too")
    args = parser.parse_args()
    backends = ["local"] + (["docker"] if args.docker_image else [])
    context = {"image": args.docker_image, "labels": {"dsh-bash-bench": "compare"}}
    with tempfile.TemporaryDirectory(prefix="dsh-compare-") as scratch:
        before = export(args.before, Path(scratch))
        build_native(before)
        build_native(ROOT)
        sides = {"before": before, "after": ROOT}
        rows = []
        for backend in backends:
            runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for round_number in range(args.rounds):
                # ABBA: whoever goes first in a round (a warmer cache, a quieter moment) alternates too.
                order = list(sides.items())
                for side, tree in order if round_number % 2 == 0 else reversed(order):
                    runs[side].append(probe(tree, backend, args.calls, context))
            for measure in MEASURES:
                medians = {side: statistics.median(r[measure] for r in runs[side]) for side in sides}
                rows.append((backend, measure, medians["before"], medians["after"]))
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"before: {args.before}; after: this checkout ({head}, with its uncommitted changes)")
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{args.rounds} alternating probes per side, {args.calls} calls of `true` each; load {load}")
    print()
    print("| backend | measure | before | after | after/before |")
    print("|---|---|---:|---:|---:|")
    for backend, measure, old, new in rows:
        print(f"| {backend} | {measure} | {old:.2f} | {new:.2f} | {new / old:.2f}x |")


if __name__ == "__main__":
    main()
