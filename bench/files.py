"""Files moved without a shell (issue 32): 50 MiB written and read back, side by side in one run.

For Docker and SSH, side by side, alternating (seam, provider, base64, CLI, seam, ...), medians:

- the seam: ``await ex.write_file(path, data)`` then ``await ex.read_file(path)``;
- through ``exec`` as the inspect provider did before the seam (the issue's baseline): the bytes on a
  command's stdin (``cat > FILE``), read back in base64 in chunks of 3 MiB (``dd | base64``, one command
  each, under inspect's 10 MiB output limit);
- through ``exec`` with base64 in one command each way (``base64 -d > FILE``, ``base64 FILE``, the output
  budget raised to hold it all): the fastest a harness gets without the seam; context, no target;
- the CLI a user would reach for: ``docker cp`` in and out of the executor's container, ``scp`` to and
  from the same sshd (a new connection each way, as a user's ``scp`` makes).

Every round trip is checked byte for byte, untimed. The CLI's local files are written and read
outside its timing (the seam takes and gives bytes in memory): the comparison favours the CLI.

    python bench/files.py [--mib N] [--runs N] [--backends docker,ssh] [--docker-image TAG]

Needs root for the throwaway sshd (tests/ssh_support.py) and a running Docker engine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from dsh_bash import BashExecutor

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")

RoundTrip = Callable[[], Awaitable[None]]
#: Where the file goes on the other side: a directory every backend's commands may write.
REMOTE_PATH = "/tmp/dsh-bench-file"
SEAM = "the seam: write_file + read_file"
PROVIDER = "exec as the inspect provider did (stdin in, base64 out in 3 MiB chunks)"
BASE64 = "exec with base64, one command each way"
#: The provider's chunk: 256 blocks of 12 KiB (a multiple of 3: no padding inside the file).
_BLOCK, _BLOCKS = 12_288, 256
CLI = {"docker": "docker cp in and out", "ssh": "scp in and out (new connection each way)"}


async def _cli(*argv: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({process.returncode}): {err.decode(errors='replace')}")


async def _round_trips(
    ex: BashExecutor, data: bytes, cli_in: list[str], cli_out: list[str], local_out: Path
) -> dict[str, RoundTrip]:
    """The three round trips; each compares what came back with ``data`` (a memory compare, about
    10 ms for 50 MiB, the same in all three timings)."""

    async def seam() -> None:
        await ex.write_file(REMOTE_PATH, data)
        if await ex.read_file(REMOTE_PATH) != data:
            raise AssertionError("the seam gave other bytes back")

    encoded = base64.b64encode(data)

    async def through_base64() -> None:
        wrote = await ex.exec(f"base64 -d > {REMOTE_PATH}", stdin=encoded)
        if wrote.exit_code != 0:
            raise RuntimeError(f"base64 -d failed: {wrote.stderr.text}")
        read = await ex.exec(f"base64 {REMOTE_PATH}")
        if read.exit_code != 0 or base64.b64decode(read.stdout.data) != data:
            raise AssertionError(f"base64 gave other bytes back ({read.stdout.total_bytes} bytes of output)")

    async def as_the_provider_did() -> None:
        wrote = await ex.exec(f"cat > {REMOTE_PATH}", stdin=data)
        if wrote.exit_code != 0:
            raise RuntimeError(f"cat failed: {wrote.stderr.text}")
        parts: list[bytes] = []
        while not parts or len(parts[-1]) == _BLOCK * _BLOCKS:
            chunk = await ex.exec(
                f"dd if={REMOTE_PATH} bs={_BLOCK} skip={len(parts) * _BLOCKS} count={_BLOCKS} 2>/dev/null"
                " | base64"
            )
            parts.append(base64.b64decode(chunk.stdout.data))
        if b"".join(parts) != data:
            raise AssertionError("the provider's path gave other bytes back")

    async def through_cli() -> None:
        await _cli(*cli_in)
        await _cli(*cli_out)
        if await anyio.Path(local_out).read_bytes() != data:
            raise AssertionError(f"{cli_out[0]} gave other bytes back")

    return {"seam": seam, "provider": as_the_provider_did, "base64": through_base64, "cli": through_cli}


async def _alternate(runs: int, calls: dict[str, RoundTrip]) -> dict[str, float]:
    """Median seconds of each, alternating, after one untimed warm-up round."""
    for call in calls.values():
        await call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            started = time.perf_counter()
            await call()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


async def bench_docker(mib: int, runs: int, image: str, labels: dict[str, str]) -> dict[str, Any]:
    from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

    data = os.urandom(mib * 2**20)
    # The base64 read's output is 4/3 of the file: the output budget must hold it all.
    config = DockerConfig(image=image, labels=labels, max_output_bytes=2 * len(data))
    with tempfile.TemporaryDirectory() as scratch:
        local_in, local_out = Path(scratch, "in"), Path(scratch, "out")
        await anyio.Path(local_in).write_bytes(data)
        async with DockerBashExecutor(config) as ex:
            where = f"{ex.container_id}:{REMOTE_PATH}"
            calls = await _round_trips(
                ex, data, ["docker", "cp", str(local_in), where], ["docker", "cp", where, str(local_out)],
                local_out,
            )  # fmt: skip
            medians = await _alternate(runs, calls)
    return {"backend": "docker", "mib": mib, "runs": runs, "median_s": medians}


async def bench_ssh(mib: int, runs: int, server: Any) -> dict[str, Any]:
    data = os.urandom(mib * 2**20)
    options = server.config()
    login = f"{options['username']}@{server.host}"
    scp = [
        "scp", "-q", "-F", "/dev/null", "-P", str(server.port), "-i", server.user_key,
        "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "BatchMode=yes",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        local_in, local_out = Path(scratch, "in"), Path(scratch, "out")
        await anyio.Path(local_in).write_bytes(data)
        async with server.executor(max_output_bytes=2 * len(data)) as ex:
            remote = f"{login}:{REMOTE_PATH}"
            calls = await _round_trips(
                ex, data, [*scp, str(local_in), remote], [*scp, remote, str(local_out)], local_out
            )
            medians = await _alternate(runs, calls)
            await ex.exec(f"rm -f {REMOTE_PATH}")
    return {"backend": "ssh", "mib": mib, "runs": runs, "median_s": medians}


def rows(result: dict[str, Any]) -> list[tuple[str, str, float, float, str, float | None]]:
    """(backend, baseline, seam s, baseline s, target text, target ratio) for each baseline."""
    medians, backend = result["median_s"], result["backend"]
    return [
        (backend, PROVIDER, medians["seam"], medians["provider"], "≤ 0.1x (10x faster)", 0.1),
        (backend, BASE64, medians["seam"], medians["base64"], "-", None),
        (backend, CLI[backend], medians["seam"], medians["cli"], "≤ 1.5x", 1.5),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="docker,ssh")
    parser.add_argument("--docker-image", help="an image with bash and base64 (default: the test image)")
    args = parser.parse_args()
    sys.path.insert(0, _TESTS)
    results = []
    backends = args.backends.split(",")
    if "docker" in backends:
        import docker_support  # noqa: PLC0415

        image = args.docker_image or docker_support.build_test_image()
        labels = {docker_support.SESSION_LABEL: docker_support.SESSION_ID}
        try:
            results.append(asyncio.run(bench_docker(args.mib, args.runs, image, labels)))
        finally:
            docker_support.remove_session_containers()
    if "ssh" in backends:
        import ssh_support  # noqa: PLC0415

        server = ssh_support.start_server()
        try:
            results.append(asyncio.run(bench_ssh(args.mib, args.runs, server)))
        finally:
            ssh_support.stop_server(server)
    print("| backend | baseline | seam s | baseline s | ratio | target |")
    print("|---|---|---:|---:|---:|---|")
    for result in results:
        for backend, baseline, subject, other, target, at_most in rows(result):
            ratio = subject / other
            verdict = "" if at_most is None else "pass" if ratio <= at_most else "miss"
            figures = f"{subject:.3f} | {other:.3f} | {ratio:.3f}x"
            print(f"| {backend} | {baseline} | {figures} | {target} {verdict} |")


if __name__ == "__main__":
    main()
