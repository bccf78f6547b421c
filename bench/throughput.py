"""Streaming N MiB of stdout through a backend, side by side with what a user would use instead.

Each measurement runs in a fresh interpreter (this file, ``--child``), so its peak RSS growth
(bench/rss.py: the high-water mark after the transfer minus the RSS before it, taken once the
executor, connection or container is ready) belongs to that one transfer. Runs alternate; medians;
the ratio is the compared figure.

    python bench/throughput.py [--mib 1024] [--runs 3] [--docker-image TAG]

SSH needs a server: ``bench/run.py`` starts one and passes it here (``--context``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rss import PeakMeter

#: subject -> the baseline it is compared with.
PAIRS = {"local": "subprocess.run", "docker": "docker exec CLI", "ssh": "asyncssh conn.run"}
#: How each baseline is named in the table.
BASELINE_LABELS = {
    "subprocess.run": "`subprocess.run(capture_output=True)`",
    "docker exec CLI": "`docker exec` CLI, `subprocess.run` capturing",
    "asyncssh conn.run": "asyncssh `conn.run` capturing (reused connection)",
}
#: Bytes an SSH login's rc file may add to a raw ``conn.run`` (the executor takes them out).
_RC_NOISE_ALLOWANCE = 4096


def _executor_transfer(backend: str, command: str, context: dict[str, Any]) -> tuple[float, int, PeakMeter]:
    import anyio  # noqa: PLC0415
    from targets import make_executor  # noqa: PLC0415

    async def go() -> tuple[float, int, PeakMeter]:
        async with make_executor(backend, context) as ex:
            meter = PeakMeter()
            started = time.perf_counter()
            result = await ex.exec(command)
            return time.perf_counter() - started, result.stdout.total_bytes, meter

    return anyio.run(go)


def _capture_transfer(argv: list[str]) -> tuple[float, int, PeakMeter]:
    meter = PeakMeter()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=True)
    return time.perf_counter() - started, len(done.stdout), meter


def _docker_cli_transfer(command: str, context: dict[str, Any]) -> tuple[float, int, PeakMeter]:
    run = ["docker", "run", "-d", "--rm", "--init", "--network", "none"]
    for name, value in context.get("labels", {}).items():
        run += ["--label", f"{name}={value}"]
    container = subprocess.run(
        [*run, context["image"], "sleep", "600"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        return _capture_transfer(["docker", "exec", container, "bash", "-c", command])
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, check=False)


def _asyncssh_transfer(command: str, context: dict[str, Any]) -> tuple[float, int, PeakMeter]:
    import asyncio  # noqa: PLC0415

    import asyncssh  # noqa: PLC0415

    fields = context["ssh"]

    async def go() -> tuple[float, int, PeakMeter]:
        async with asyncssh.connect(
            fields["host"],
            port=fields["port"],
            username=fields["username"],
            client_keys=fields["client_keys"],
            known_hosts=fields["known_hosts"],
            config=None,
        ) as conn:
            await conn.run("true")  # the first channel's setup is not part of the transfer
            meter = PeakMeter()
            started = time.perf_counter()
            result = await conn.run(command, encoding=None, check=True)
            took = time.perf_counter() - started
            stdout = result.stdout
            assert isinstance(stdout, bytes)
            return took, len(stdout), meter

    return asyncio.run(go())


def child(subject: str, size: int, context: dict[str, Any]) -> dict[str, float]:
    """One transfer in this interpreter: seconds, bytes received, peak RSS growth in MiB."""
    command = f"head -c {size} /dev/zero"
    transfers: dict[str, Callable[[], tuple[float, int, PeakMeter]]] = {
        "local": lambda: _executor_transfer("local", command, context),
        "docker": lambda: _executor_transfer("docker", command, context),
        "ssh": lambda: _executor_transfer("ssh", command, context),
        "subprocess.run": lambda: _capture_transfer(["bash", "-c", command]),
        "docker exec CLI": lambda: _docker_cli_transfer(command, context),
        "asyncssh conn.run": lambda: _asyncssh_transfer(command, context),
    }
    took, got, meter = transfers[subject]()
    return {"seconds": took, "bytes": got, "rss_growth_mib": meter.growth_mib()}


def _measure(subject: str, size: int, context: dict[str, Any]) -> dict[str, float]:
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            subject,
            "--bytes",
            str(size),
            "--context",
            json.dumps(context),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"throughput of {subject} failed:\n{done.stderr.strip()}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    extra = result["bytes"] - size
    allowed = _RC_NOISE_ALLOWANCE if subject == "asyncssh conn.run" else 0
    if not 0 <= extra <= allowed:
        raise RuntimeError(f"{subject}: got {result['bytes']} bytes, expected {size}")
    return result


def measure_pair(subject: str, size: int, runs: int, context: dict[str, Any]) -> dict[str, Any]:
    """Alternating runs of ``subject`` and its baseline: medians of MB/s and of peak RSS growth."""
    baseline = PAIRS[subject]
    results: dict[str, list[dict[str, float]]] = {subject: [], baseline: []}
    for _ in range(runs):
        for name in (subject, baseline):
            results[name].append(_measure(name, size, context))
    rate = {name: statistics.median(size / r["seconds"] / 1e6 for r in rs) for name, rs in results.items()}
    growth = {name: statistics.median(r["rss_growth_mib"] for r in rs) for name, rs in results.items()}
    return {
        "subject": subject,
        "baseline": baseline,
        "mib": size / 2**20,
        "runs": runs,
        "subject_mb_s": rate[subject],
        "baseline_mb_s": rate[baseline],
        "subject_rss_growth_mib": growth[subject],
        "baseline_rss_growth_mib": growth[baseline],
        "raw": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--docker-image", help="an image with bash and head; omit to skip Docker")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--context", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    context: dict[str, Any] = json.loads(args.context)
    if args.child:
        print(json.dumps(child(args.child, args.bytes, context)))
        return
    size = args.mib * 1024 * 1024
    subjects = ["local"]
    if args.docker_image:
        context["image"] = args.docker_image
        subjects.append("docker")
    print(f"Streaming {args.mib} MiB of stdout; medians of {args.runs} alternating runs\n")
    print("| subject | baseline | subject MB/s | baseline MB/s | ratio | subject RSS growth (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    for subject in subjects:
        row = measure_pair(subject, size, args.runs, context)
        ratio = row["subject_mb_s"] / row["baseline_mb_s"]
        print(
            f"| {subject} | {BASELINE_LABELS[row['baseline']]} | {row['subject_mb_s']:.0f} | "
            f"{row['baseline_mb_s']:.0f} | {ratio:.2f} | {row['subject_rss_growth_mib']:.1f} |"
        )


if __name__ == "__main__":
    main()
