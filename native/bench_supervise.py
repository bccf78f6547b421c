#!/usr/bin/env python3
"""The per-command cost of dsh-supervise: `bash -c true` spawned from asyncio, with and without it.

    python native/bench_supervise.py [--runs 200] [--binary PATH]

Each round runs both variants back to back (order alternating), so a busy machine slows both alike:
  raw:        asyncio.create_subprocess_exec("bash", "--noprofile", "--norc", "-c", "true"), then wait()
  supervised: the same under `dsh-supervise --status-fd N --`, with the status records read to EOF
              from a socketpair (as a harness would) and the supervisor waited for.
Prints the medians and the extra latency per command. Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

BASH = ("bash", "--noprofile", "--norc", "-c", "true")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def raw() -> float:
    begin = time.perf_counter()
    process = await asyncio.create_subprocess_exec(*BASH, stdin=asyncio.subprocess.DEVNULL)
    await process.wait()
    return time.perf_counter() - begin


async def supervised(binary: str) -> float:
    begin = time.perf_counter()
    reader_sock, child_sock = socket.socketpair()
    fd = child_sock.fileno()
    try:
        process = await asyncio.create_subprocess_exec(
            binary, "--status-fd", str(fd), "--", *BASH, pass_fds=(fd,), stdin=asyncio.subprocess.DEVNULL
        )
    finally:
        child_sock.close()
    reader, writer = await asyncio.open_connection(sock=reader_sock)
    records = await reader.read()
    writer.close()
    await process.wait()
    elapsed = time.perf_counter() - begin
    if not records.endswith(b"empty\n") or process.returncode != 0:
        raise RuntimeError(f"unexpected: {records!r}, exit status {process.returncode}")
    return elapsed


async def main_async(runs: int, binary: str) -> None:
    for _ in range(10):  # warm up both paths
        await raw()
        await supervised(binary)
    plain: list[float] = []
    wrapped: list[float] = []
    cpu = {"raw": 0.0, "supervised": 0.0}  # CPU of the waited children (and their waited children)
    for i in range(runs):
        for variant in ("raw", "supervised") if i % 2 else ("supervised", "raw"):
            before = children_cpu()
            if variant == "raw":
                plain.append(await raw())
            else:
                wrapped.append(await supervised(binary))
            cpu[variant] += children_cpu() - before
    raw_ms = statistics.median(plain) * 1000
    sup_ms = statistics.median(wrapped) * 1000
    print(f"runs: {runs} each; load average: {os.getloadavg()[0]:.1f}")
    print(f"raw bash -c true:        median {raw_ms:7.2f} ms")
    print(f"under dsh-supervise:     median {sup_ms:7.2f} ms")
    print(f"extra per command:       {sup_ms - raw_ms:7.2f} ms ({sup_ms / raw_ms:.2f}x)")
    raw_cpu, sup_cpu = (cpu[v] / runs * 1000 for v in ("raw", "supervised"))
    print(f"child CPU per command:   raw {raw_cpu:.2f} ms, supervised {sup_cpu:.2f} ms")


def main() -> int:
    # dsh_bash._native alone (its parent package imports anyio): this script needs no install.
    spec = importlib.util.spec_from_file_location(
        "dsh_native", Path(__file__).resolve().parent.parent / "dsh_bash" / "_native" / "__init__.py"
    )
    assert spec is not None and spec.loader is not None
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--binary", help="dsh-supervise to measure (default: this checkout's, host arch)")
    args = parser.parse_args()
    binary = args.binary or native.supervisor_binary()
    if binary is None:
        print(native.supervisor_problem(), file=sys.stderr)
        return 1
    asyncio.run(main_async(args.runs, str(binary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
