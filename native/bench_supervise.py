#!/usr/bin/env python3
"""The per-command cost of dsh-supervise: `bash -c true` spawned from asyncio, with and without it.

    python native/bench_supervise.py [--runs 200] [--binary PATH]

Each round runs both variants back to back (order alternating), so a busy machine slows both alike:
  raw:        asyncio.create_subprocess_exec("bash", "--noprofile", "--norc", "-c", "true"), then wait()
  supervised: the same under `dsh-supervise --status-fd N --`, with the status records read to EOF
              from a socketpair (as a harness would) and the supervisor waited for.
  framed:     the same under `dsh-supervise --frame --` (protocol version 2), its fds 0 and 1 one
              socketpair, the frames read to EOF and the supervisor waited for.
Prints the medians and the extra latency per command. Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
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


async def framed(binary: str) -> float:
    begin = time.perf_counter()
    harness_sock, child_sock = socket.socketpair()
    try:
        process = await asyncio.create_subprocess_exec(
            binary, "--frame", "--", *BASH, stdin=child_sock.fileno(), stdout=child_sock.fileno()
        )
    finally:
        child_sock.close()
    reader, writer = await asyncio.open_connection(sock=harness_sock)
    frames = await reader.read()
    writer.close()
    await process.wait()
    elapsed = time.perf_counter() - begin
    if not frames.endswith(b"s\0\0\0\x05empty") or process.returncode != 0:
        raise RuntimeError(f"unexpected: {frames!r}, exit status {process.returncode}")
    return elapsed


async def main_async(runs: int, binary: str) -> None:
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "raw": raw,
        "supervised": functools.partial(supervised, binary),
        "framed": functools.partial(framed, binary),
    }
    for _ in range(10):  # warm up every path
        for run in variants.values():
            await run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu = dict.fromkeys(variants, 0.0)  # CPU of the waited children (and their waited children)
    names = list(variants)
    for i in range(runs):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # the order rotates
            before = children_cpu()
            times[name].append(await variants[name]())
            cpu[name] += children_cpu() - before
    ms = {name: statistics.median(values) * 1000 for name, values in times.items()}
    print(f"runs: {runs} each; load average: {os.getloadavg()[0]:.1f}")
    print(f"raw bash -c true:        median {ms['raw']:7.2f} ms")
    print(f"under dsh-supervise:     median {ms['supervised']:7.2f} ms")
    print(f"under --frame:           median {ms['framed']:7.2f} ms")
    for name in ("supervised", "framed"):
        print(f"extra per command ({name}): {ms[name] - ms['raw']:7.2f} ms ({ms[name] / ms['raw']:.2f}x)")
    per = {name: cpu[name] / runs * 1000 for name in variants}
    print(
        f"child CPU per command:   raw {per['raw']:.2f} ms, supervised {per['supervised']:.2f} ms, "
        f"framed {per['framed']:.2f} ms"
    )


def main() -> int:
    # dsh_bash.supervisor._native alone (its parent package imports anyio): this script needs no install.
    spec = importlib.util.spec_from_file_location(
        "dsh_native",
        Path(__file__).resolve().parent.parent / "dsh_bash" / "supervisor" / "_native" / "__init__.py",
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
