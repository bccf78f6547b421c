"""Streaming N MiB of stdout through a backend, side by side with what a user would use instead.

Each measurement runs in a fresh interpreter, so its peak RSS growth (ru_maxrss after minus before)
belongs to that one transfer. Runs alternate; medians; the ratio is the compared figure.

    python bench/throughput.py [--mib 1024] [--runs 3] [--docker-image TAG]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PRELUDE = """
import json, resource, sys, time
size = int(sys.argv[1]); image = sys.argv[2]
command = f"head -c {size} /dev/zero"
"""

# Each program sets `base` after its imports (so the figure is the transfer's growth), `took`, `got`.
_EXECUTOR = """
import anyio
from {module} import {executor}, {config}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
async def go():
    async with {executor}({config}({fields})) as ex:
        t = time.perf_counter()
        r = await ex.exec(command)
        return time.perf_counter() - t, r.stdout.total_bytes
took, got = anyio.run(go)
"""
_CAPTURE = """
import subprocess
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{setup}
try:
    t = time.perf_counter()
    r = subprocess.run({argv}, capture_output=True)
    took = time.perf_counter() - t
    got = len(r.stdout)
finally:
    {teardown}
"""
_SUBJECTS = {
    "local": _EXECUTOR.format(
        module="dsh_bash_local", executor="LocalBashExecutor", config="LocalConfig", fields=""
    ),
    "subprocess.run": _CAPTURE.format(setup="", argv='["bash", "-c", command]', teardown="pass"),
    "docker": _EXECUTOR.format(
        module="dsh_bash_docker", executor="DockerBashExecutor", config="DockerConfig", fields="image=image"
    ),
    "docker exec CLI": _CAPTURE.format(
        setup='run = ["docker", "run", "-d", "--rm", "--init", image, "sleep", "600"]\n'
        "cid = subprocess.run(run, capture_output=True, text=True).stdout.strip()",
        argv='["docker", "exec", cid, "bash", "-c", command]',
        teardown='subprocess.run(["docker", "rm", "-f", cid], capture_output=True)',
    ),
}
_REPORT = """
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps({"seconds": took, "bytes": got, "rss_growth_mib": grown}))
"""


def _measure(subject: str, size: int, image: str) -> dict[str, float]:
    program = _PRELUDE + _SUBJECTS[subject] + _REPORT
    done = subprocess.run(
        [sys.executable, "-c", program, str(size), image], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["bytes"] != size:
        raise SystemExit(f"{subject}: got {result['bytes']} bytes, expected {size}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--docker-image", help="an image with bash and head; omit to skip Docker")
    args = parser.parse_args()
    size = args.mib * 1024 * 1024
    pairs = [("local", "subprocess.run")]
    if args.docker_image:
        pairs.append(("docker", "docker exec CLI"))
    print(f"Streaming {args.mib} MiB of stdout; medians of {args.runs} alternating runs\n")
    print(
        "| subject | baseline | subject MB/s | baseline MB/s | throughput ratio | subject RSS growth (MiB) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for subject, baseline in pairs:
        runs: dict[str, list[dict[str, float]]] = {subject: [], baseline: []}
        for _ in range(args.runs):
            for name in (subject, baseline):
                runs[name].append(_measure(name, size, args.docker_image or ""))
        rate = {
            name: statistics.median(size / r["seconds"] / 1e6 for r in results)
            for name, results in runs.items()
        }
        growth = statistics.median(r["rss_growth_mib"] for r in runs[subject])
        ratio = rate[subject] / rate[baseline]
        cells = [
            subject,
            baseline,
            f"{rate[subject]:.0f}",
            f"{rate[baseline]:.0f}",
            f"{ratio:.2f}",
            f"{growth:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
