"""Checks of background reads: the merged format, consuming reads, lossy reads, decoding."""

from __future__ import annotations

import time

import anyio

from dsh_bash import BashExecRequest, BashExecutor, BashTask

from ._harness import CheckContext, check
from ._support import elapsed, read_to_end, repeat, sh, wait_task


async def _start(ex: BashExecutor, command: str) -> BashTask:
    return await ex.start(ex.resolve(BashExecRequest(command=command)))


@check(
    "read-merge-format",
    kind="contract",
    clause="R-read-merge",
    rule="A background read gives the stdout delta, then, if stderr produced anything, a line `[stderr]` "
    "and the stderr delta, with one newline before `[stderr]` only when the stdout delta is non-empty "
    "and does not end in one.",
)
async def merge_format(ctx: CheckContext) -> None:
    cases = {
        "printf 'out\\n'; printf 'err\\n' >&2": "out\n[stderr]\nerr\n",
        "printf out; printf 'err\\n' >&2": "out\n[stderr]\nerr\n",
        "printf 'err\\n' >&2": "[stderr]\nerr\n",
        "printf 'out\\n'": "out\n",
        "printf out": "out",
        "true": "",
    }
    async with ctx.executor() as ex:
        for command, expected in cases.items():
            task = await _start(ex, command)
            await wait_task(task, ctx.allowance_s)
            delta = await read_to_end(ctx, ex, task.id)
            ctx.expect(delta == expected, f"`{command}` read as {delta!r}, expected {expected!r}")


@check(
    "read-consuming",
    kind="contract",
    clause="R-read-consuming",
    rule="read_output returns whatever arrived since the previous read; two reads never deliver the same "
    'bytes; after the task ended it delivers the rest once, then "".',
)
async def read_consuming(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start(ex, "printf 'one\\n'; sleep 0.3; printf 'two\\n'; sleep 0.3; printf 'three\\n'")
        deltas: list[str] = []
        while_running: list[str] = []
        deadline = time.monotonic() + 5.0
        while task.end_cause is None and time.monotonic() < deadline:
            read = await ex.read_output(task.id)
            deltas.append(read.delta)
            if read.task.end_cause is None:
                while_running.append(read.delta)
            await anyio.sleep(0.05)
        await wait_task(task, ctx.allowance_s)
        deltas.append(await read_to_end(ctx, ex, task.id))
        again = await ex.read_output(task.id)
        ctx.expect(again.delta == "", f"a third read after the end delivered {again.delta!r}")
        joined = "".join(deltas)
        ctx.expect(
            joined == "one\ntwo\nthree\n",
            f"the reads together delivered {joined!r} (deltas {[d for d in deltas if d]}), "
            "expected 'one\\ntwo\\nthree\\n' exactly once",
        )
        ctx.expect(
            "one\n" in "".join(while_running),
            "output was not readable while the task ran (nothing arrived before it ended)",
        )


@check(
    "read-returns-at-once",
    kind="contract",
    clause="R-read-at-once",
    rule='read_output returns at once, with whatever arrived since the previous read (possibly "").',
)
async def read_at_once(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start(ex, "while :; do sleep 0.05; done")
        await anyio.sleep(0.1)
        fastest = float("inf")
        for _ in range(5):
            started = time.monotonic()
            read = await ex.read_output(task.id)
            took = elapsed(started)
            fastest = min(fastest, took)
            ctx.expect(
                took < ctx.prompt_s,
                f"read_output of a silent running task took {took:.3f} s (bound {ctx.prompt_s:.3f} s)",
            )
            ctx.expect(
                read.delta == "" and not read.lossy and read.dropped_bytes == 0,
                f"a silent task's read: delta={read.delta!r} lossy={read.lossy} dropped={read.dropped_bytes}",
            )
            ctx.expect(
                read.stdout_spill_path is None and read.stderr_spill_path is None,
                "a silent task's read names spill files",
            )
        # Each read's bound grows with the measured latency (ten round trips): on a loaded machine it
        # passes half a second, and a read that waits that long for output would pass it. The fastest
        # of five reads that return at once takes at most one round trip, whatever the load.
        fastest_bound = 0.1 + 2 * ctx.latency_s
        ctx.expect(
            fastest < fastest_bound,
            f"the fastest of five reads of a silent running task took {fastest:.3f} s "
            f"(bound {fastest_bound:.3f} s: 0.1 s + 2 x {ctx.latency_s * 1000:.0f} ms measured latency)",
        )


@check(
    "read-lossy-exact",
    kind="contract",
    clause="R-read-lossy",
    rule="`dropped_bytes` counts this reader's unread output lost from memory since the previous read; "
    "`lossy` is true when it is above 0; the delta is the kept tail and the spill file holds the whole "
    "stream.",
)
async def read_lossy(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000) as ex:
        tmp = await ctx.tempdir(ex)
        go = f"{tmp}/go"
        command = (
            f"{repeat('x', 500)}; while [ ! -e {go} ]; do sleep 0.02; done; "
            f"{repeat('y', 2990)}; printf 'ENDOFDATA\\n'"
        )
        task = await _start(ex, command)
        first = ""
        deadline = time.monotonic() + 5.0
        while len(first) < 500 and time.monotonic() < deadline:
            read = await ex.read_output(task.id)
            ctx.expect(
                not read.lossy and read.dropped_bytes == 0,
                f"nothing was lost yet, but the read says {read!r}",
            )
            first += read.delta
            await anyio.sleep(0.02)
        ctx.expect(first == "x" * 500, f"the first 500 bytes read as {first[:80]!r}... ({len(first)} chars)")
        await sh(ex, f": > {go}")
        await wait_task(task, ctx.allowance_s)
        read = await ex.read_output(task.id)
        expected = ("y" * 2990 + "ENDOFDATA\n")[-1000:]
        ctx.expect(
            read.delta == expected,
            f"the lossy read should deliver the last 1000 bytes; got {len(read.delta)} chars ending "
            f"{read.delta[-20:]!r}",
        )
        ctx.expect(
            read.dropped_bytes == 2000 and read.lossy,
            f"3000 unread bytes with 1000 kept: expected dropped_bytes=2000, lossy=True; got "
            f"dropped_bytes={read.dropped_bytes}, lossy={read.lossy}",
        )
        path = read.stdout_spill_path
        ctx.expect(path is not None, "a lossy read gives no stdout spill path")
        ctx.expect(
            read.stderr_spill_path is None, f"stderr spilled without output: {read.stderr_spill_path!r}"
        )
        assert path is not None
        size = (await sh(ex, f"wc -c < '{path}'")).strip()
        ctx.expect(size == "3500", f"the spill file holds {size} bytes, not the whole 3500-byte stream")
        head = await sh(ex, f"head -c 500 '{path}'")
        ctx.expect(
            head == "x" * 500, f"the spill file does not start with the stream's first bytes: {head[:40]!r}"
        )
        after = await ex.read_output(task.id)
        ctx.expect(
            after.delta == "" and not after.lossy and after.dropped_bytes == 0,
            f"the read after the lossy one: delta={after.delta[:40]!r} lossy={after.lossy} "
            f"dropped={after.dropped_bytes}",
        )


@check(
    "finished-tasks-stay-readable",
    kind="contract",
    clause="R-read-finished",
    rule="Finished tasks stay readable until `aclose`.",
)
async def finished_readable(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        first = await _start(ex, "printf 'first\\n'; printf 'first-err\\n' >&2")
        await wait_task(first, ctx.allowance_s)
        for i in range(3):
            other = await _start(ex, f"printf 'other-{i}'")
            await wait_task(other, ctx.allowance_s)
            await read_to_end(ctx, ex, other.id)
            await ex.exec("true")
        await anyio.sleep(0.3)
        delta = await read_to_end(ctx, ex, first.id)
        ctx.expect(
            delta == "first\n[stderr]\nfirst-err\n",
            f"a finished, unread task later read as {delta!r}",
        )


@check(
    "read-multibyte-split",
    kind="contract",
    clause="R-output-utf8-split",
    rule="A multi-byte character split across two chunks or two reads is never mangled.",
)
async def read_multibyte(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        go = f"{tmp}/go"
        task = await _start(
            ex, f"printf 'a\\xe2\\x82'; while [ ! -e {go} ]; do sleep 0.02; done; printf '\\xac\\n'"
        )
        await anyio.sleep(0.3)
        first = await ex.read_output(task.id)
        await sh(ex, f": > {go}")
        await wait_task(task, ctx.allowance_s)
        rest = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            first.delta in ("a", "") and first.delta + rest == "a€\n",
            f"a euro sign split across two reads came out as {first.delta!r} + {rest!r}, "
            "expected 'a' + '€\\n'",
        )
