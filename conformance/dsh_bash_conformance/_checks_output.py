"""Checks of foreground output: separation, truncation, spill files and their caps, decoding."""

from __future__ import annotations

import hashlib
import posixpath
import time

import anyio

from dsh_bash import BashExecRequest, BashExecutor, CollectedOutput

from ._harness import CheckContext, check
from ._support import SETUP_S, differing_chars, elapsed, exists, read_to_end, repeat, sh, show, wait_task


def _show(stream: CollectedOutput) -> str:
    return (
        f"text={stream.text[:60]!r}{'...' if len(stream.text) > 60 else ''} ({len(stream.text)} chars) "
        f"truncated={stream.truncated} spill_path={stream.spill_path!r} total_bytes={stream.total_bytes}"
    )


async def _spill_size(ex: BashExecutor, path: str) -> int:
    return int((await sh(ex, f"wc -c < '{path}'")).strip())


@check(
    "streams-separate-exact",
    kind="contract",
    clause="R-output-streams",
    rule="stdout and stderr are collected apart, exactly, with `total_bytes` counting every byte.",
)
async def streams_separate(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        result = await ex.exec("printf 'a\\nb'; printf 'c\\n' >&2; printf 'd'; printf 'é' >&2")
        out, err = result.stdout, result.stderr
        ctx.expect(
            out.text == "a\nbd" and out.total_bytes == 4 and not out.truncated and out.spill_path is None,
            f"stdout should be 'a\\nbd', 4 bytes, untruncated: {_show(out)}",
        )
        ctx.expect(
            err.text == "c\né" and err.total_bytes == 4 and not err.truncated and err.spill_path is None,
            f"stderr should be 'c\\né', 4 bytes, untruncated: {_show(err)}",
        )
        empty = await ex.exec("true")
        ctx.expect(
            empty.stdout.text == "" and empty.stdout.total_bytes == 0 and empty.stderr.text == "",
            f"`true` produced output: {show(empty)}",
        )


@check(
    "truncation-keeps-tail",
    kind="contract",
    clause="R-output-tail",
    rule="Each stream keeps at most `max_output_bytes` in memory, the tail; beyond that `truncated` is "
    "true, `total_bytes` counts every byte and the whole stream is in the spill file.",
)
async def truncation_tail(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000) as ex:
        command = "for ((i=0;i<500;i++)); do printf 'line-%05d\\n' $i; printf 'err-%05d\\n' $i >&2; done"
        out_full = "".join(f"line-{i:05d}\n" for i in range(500))
        err_full = "".join(f"err-{i:05d}\n" for i in range(500))
        result = await ex.exec(command)
        for name, stream, full in (("stdout", result.stdout, out_full), ("stderr", result.stderr, err_full)):
            ctx.expect(
                stream.text == full[-1000:] and stream.truncated and stream.total_bytes == len(full),
                f"{name} should keep exactly the last 1000 of {len(full)} bytes, truncated: {_show(stream)}",
            )
            path = stream.spill_path
            ctx.expect(path is not None, f"a truncated {name} has no spill file: {_show(stream)}")
            assert path is not None
            size = await _spill_size(ex, path)
            ctx.expect(size == len(full), f"the {name} spill file holds {size} bytes, not {len(full)}")
            digest = (await sh(ex, f"md5sum < '{path}'")).split()[0]
            ctx.expect(
                digest == hashlib.md5(full.encode()).hexdigest(),
                f"the {name} spill file does not hold the whole stream (md5 differs)",
            )
        ctx.expect(
            result.stdout.spill_path != result.stderr.spill_path, "stdout and stderr share one spill file"
        )


@check(
    "flood-bounded-and-timed-out",
    kind="contract",
    clause="R-output-flood",
    rule="Each stream keeps at most `max_output_bytes` in memory, the tail, and counts every byte; a "
    "flood of output neither stops the timeout nor the reads.",
)
async def flood(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000, max_spill_bytes=1_000_000) as ex:
        started = time.monotonic()
        result = await ex.exec("yes", timeout_ms=500)
        took = elapsed(started)
        out = result.stdout
        ctx.expect(result.timed_out, f"`yes` under a 500 ms timeout was not timed out: {show(result)}")
        bound = 0.5 + 2 * 0.3 + ctx.allowance_s
        ctx.expect(
            took <= bound, f"`yes` under a 500 ms timeout returned after {took:.2f} s (bound {bound:g})"
        )
        ctx.expect(
            out.truncated
            and out.text == "y\n" * 500
            and out.total_bytes > 1_000_000
            and out.spill_path is None,
            f"a flood should keep exactly the last 1000 bytes, count more than the 1 MB spill cap and lose "
            f"its spill file: {_show(out)}",
        )
        task = await ex.start(ex.resolve(BashExecRequest(command="yes")))
        await anyio.sleep(0.3)
        started = time.monotonic()
        read = await ex.read_output(task.id)
        took = elapsed(started)
        # Twice the prompt bound: the executor is busy taking in the flood while it answers.
        bound = 2 * ctx.prompt_s
        ctx.expect(took < bound, f"read_output during a flood took {took:.2f} s (bound {bound:.2f} s)")
        ctx.expect(
            read.lossy
            and read.dropped_bytes > 0
            and len(read.delta) == 1000
            and set(read.delta) == {"y", "\n"},
            f"a read during a flood: lossy={read.lossy} dropped_bytes={read.dropped_bytes} "
            f"delta={read.delta[:20]!r}... ({len(read.delta)} chars); expected the 1000-byte tail, lossy",
        )
        ctx.expect(await ex.kill(task.id) is True, "kill of a flooding task did not return True")
        await wait_task(task, 0.3 + ctx.allowance_s, "a flooding task after kill")


@check(
    "exact-limit-not-truncated",
    kind="contract",
    clause="R-output-exact-limit",
    rule="Output of exactly `max_output_bytes` is not truncated; one byte more is.",
)
async def exact_limit(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000) as ex:
        result = await ex.exec(repeat("z", 1000))
        out = result.stdout
        ctx.expect(
            out.text == "z" * 1000
            and not out.truncated
            and out.spill_path is None
            and out.total_bytes == 1000,
            f"exactly 1000 bytes under max_output_bytes=1000 must be whole and unspilled: {_show(out)}",
        )
        result = await ex.exec(repeat("z", 1001))
        out = result.stdout
        ctx.expect(
            out.text == "z" * 1000
            and out.truncated
            and out.spill_path is not None
            and out.total_bytes == 1001,
            f"1001 bytes under max_output_bytes=1000 must keep 1000, with a spill file: {_show(out)}",
        )


@check(
    "spill-cap-inclusive",
    kind="contract",
    clause="R-output-spill-cap",
    rule="A stream stays in its spill file as long as it is within `max_spill_bytes` (inclusive); one "
    "that outgrows it loses the file (deleted) and every later `spill_path` for it is None.",
)
async def spill_cap(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=100, max_spill_bytes=1000) as ex:
        result = await ex.exec(repeat("s", 1000))
        path = result.stdout.spill_path
        ctx.expect(
            path is not None,
            f"a 1000-byte stream under max_spill_bytes=1000 lost its spill: {_show(result.stdout)}",
        )
        assert path is not None
        size = await _spill_size(ex, path)
        ctx.expect(size == 1000, f"the spill file holds {size} bytes, not 1000")
        result = await ex.exec(repeat("s", 1001))
        out = result.stdout
        ctx.expect(
            out.spill_path is None and out.truncated and out.total_bytes == 1001 and out.text == "s" * 100,
            f"a 1001-byte stream over max_spill_bytes=1000 must have no spill path: {_show(out)}",
        )
        tmp = await ctx.tempdir(ex)
        go = f"{tmp}/go"
        task = await ex.start(
            ex.resolve(
                BashExecRequest(
                    command=f"{repeat('b', 500)}; while [ ! -e {go} ]; do sleep 0.02; done; "
                    f"{repeat('c', 600)}"
                )
            )
        )
        early: str | None = None
        deadline = time.monotonic() + 5.0
        while early is None and time.monotonic() < deadline:
            early = (await ex.read_output(task.id)).stdout_spill_path
            await anyio.sleep(0.02)
        ctx.expect(
            early is not None, "a running task with 500 bytes over max_output_bytes=100 showed no spill path"
        )
        assert early is not None
        ctx.expect(await exists(ex, early), f"the spill path {early} a read gave does not exist")
        await sh(ex, f": > {go}")
        await wait_task(task, SETUP_S)
        read = await ex.read_output(task.id)
        ctx.expect(
            read.stdout_spill_path is None,
            f"after 1100 bytes over max_spill_bytes=1000, the read still names {read.stdout_spill_path!r}",
        )
        ctx.expect(
            not await exists(ex, early), f"the spill file {early} of a stream past the cap was not deleted"
        )


@check(
    "spill-total-cap",
    kind="contract",
    clause="R-output-spill-total",
    rule="The executor's spill files together stay within `max_spill_total_bytes`: past it, new spills "
    "are refused the same way.",
)
async def spill_total(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=100, max_spill_total_bytes=1500) as ex:
        first = await ex.exec(repeat("f", 1000))
        path = first.stdout.spill_path
        ctx.expect(path is not None, f"the first 1000-byte stream did not spill: {_show(first.stdout)}")
        assert path is not None
        second = await ex.exec(repeat("g", 1000))
        ctx.expect(
            second.stdout.spill_path is None
            and second.stdout.truncated
            and second.stdout.total_bytes == 1000,
            f"a 1000-byte spill past max_spill_total_bytes=1500 was not refused: {_show(second.stdout)}",
        )
        size = await _spill_size(ex, path)
        ctx.expect(size == 1000, f"the first spill file lost bytes: it holds {size}")


@check(
    "spill-file-private",
    kind="contract",
    clause="R-output-spill-private",
    rule="A spill file is created 0600 in a directory only the owner can enter (0700).",
)
async def spill_private(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=100) as ex:
        result = await ex.exec(f"{repeat('p', 500)}; {repeat('q', 500)} >&2")
        for name, stream in (("stdout", result.stdout), ("stderr", result.stderr)):
            path = stream.spill_path
            ctx.expect(path is not None, f"{name} did not spill: {_show(stream)}")
            assert path is not None
            mode = (await sh(ex, f"stat -c %a '{path}'")).strip()
            ctx.expect(mode == "600", f"the {name} spill file {path} has mode {mode}, not 600")
            directory = posixpath.dirname(path)
            mode = (await sh(ex, f"stat -c %a '{directory}'")).strip()
            ctx.expect(mode == "700", f"the spill directory {directory} has mode {mode}, not 700")


@check(
    "spill-names-unpredictable",
    kind="contract",
    clause="R-output-spill-unpredictable",
    rule="A spill file has a name nobody can predict.",
)
async def spill_names(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=100) as ex:
        names: list[str] = []
        for _ in range(2):
            result = await ex.exec(f"{repeat('n', 300)}; {repeat('m', 300)} >&2")
            for stream in (result.stdout, result.stderr):
                ctx.expect(stream.spill_path is not None, f"no spill file: {_show(stream)}")
                names.append(posixpath.basename(stream.spill_path or ""))
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ctx.expect(
                    differing_chars(a, b) >= 8,
                    f"spill names {a!r} and {b!r} differ in fewer than 8 characters: they are predictable",
                )


@check(
    "invalid-utf8-replaced",
    kind="contract",
    clause="R-output-utf8",
    rule="Text is UTF-8 with invalid bytes replaced (U+FFFD); binary output (NUL) never raises.",
)
async def invalid_utf8(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        command = "printf 'a\\xffb\\x00c'; printf '\\xfe\\n' >&2"
        result = await ex.exec(command)
        ctx.expect(
            result.stdout.text == "a\ufffdb\x00c" and result.stdout.total_bytes == 5,
            f"stdout of 'a\\xffb\\x00c' should be 'a\\ufffdb\\x00c' (5 bytes): {_show(result.stdout)}",
        )
        ctx.expect(result.stderr.text == "\ufffd\n", f"stderr of '\\xfe\\n': {_show(result.stderr)}")
        task = await ex.start(ex.resolve(BashExecRequest(command=command)))
        await wait_task(task, SETUP_S)
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            delta == "a\ufffdb\x00c\n[stderr]\n\ufffd\n",
            f"the background read of invalid UTF-8 is {delta!r}",
        )
        every_byte = "".join(f"\\x{b:02x}" for b in range(256))
        result = await ex.exec(f"printf '{every_byte}'")
        text = result.stdout.text
        ctx.expect(
            result.stdout.total_bytes == 256 and text[:128] == "".join(map(chr, range(128))),
            f"all 256 byte values: total_bytes={result.stdout.total_bytes}, ASCII part {text[:128]!r}",
        )
        ctx.expect(
            set(text[128:]) == {"\ufffd"},
            f"bytes 0x80-0xff (never valid UTF-8 in that order) decoded to {text[128:]!r}",
        )
        result = await ex.exec("printf 'x\\xe2\\x82'")
        ctx.expect(
            result.stdout.text.startswith("x")
            and result.stdout.text[1:]
            and set(result.stdout.text[1:]) == {"\ufffd"},
            f"a character cut off at the end of the stream: {_show(result.stdout)}",
        )


@check(
    "output-bytes-exact",
    kind="contract",
    clause="R-output-bytes",
    rule="`data` is the kept tail exactly as the command wrote it: invalid UTF-8, NUL, all 256 byte "
    "values, and a character cut at the truncation boundary.",
)
async def output_bytes(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000) as ex:
        every_byte = bytes(range(256))
        escaped = "".join(f"\\x{b:02x}" for b in every_byte)
        result = await ex.exec(f"printf '{escaped}'; printf 'a\\xffb\\x00c' >&2")
        ctx.expect(result.stdout.data == every_byte, f"all 256 byte values: data={result.stdout.data!r}")
        ctx.expect(result.stderr.data == b"a\xffb\x00c", f"stderr data={result.stderr.data!r}")
        # 1001 bytes, the last 1000 kept: the first kept bytes are the end of a cut 3-byte character.
        result = await ex.exec("printf '\\xe2\\x82\\xac%.0s' {1..333}; printf 'xy'")
        full = "\u20ac".encode() * 333 + b"xy"
        ctx.expect(
            result.stdout.data == full[-1000:] and result.stdout.truncated,
            f"the kept tail of a truncated stream: {len(result.stdout.data)} bytes, "
            f"starting {result.stdout.data[:6]!r} (expected {full[-1000:][:6]!r})",
        )
        ctx.expect(
            result.stdout.text == result.stdout.data[2:].decode(),
            f"text is not data decoded past the cut character: {result.stdout.text[:8]!r}",
        )


@check(
    "utf8-split-never-mangled",
    kind="contract",
    clause="R-output-utf8-split",
    rule="A multi-byte character split across two chunks is never mangled, nor cut at the truncation "
    "boundary.",
)
async def utf8_split(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=10) as ex:
        result = await ex.exec("printf '\\xe2\\x82'; sleep 0.1; printf '\\xac'")
        ctx.expect(result.stdout.text == "€", f"a euro sign written in two chunks: {_show(result.stdout)}")
        result = await ex.exec("printf '€€€€€'")
        text = result.stdout.text
        ctx.expect(
            "\ufffd" not in text
            and "€€€€€".endswith(text)
            and len(text.encode()) >= 7
            and result.stdout.total_bytes == 15
            and result.stdout.truncated,
            f"15 bytes of euro signs kept in 10 must be whole characters of the tail: {_show(result.stdout)}",
        )


@check(
    "aclose-removes-spill-files",
    kind="contract",
    clause="R-life-aclose-releases",
    rule="aclose releases the spill directories the executor owns: its spill files are gone afterwards.",
)
async def aclose_removes_spills(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=100) as ex:
        result = await ex.exec(repeat("r", 500))
        path = result.stdout.spill_path
        ctx.expect(
            path is not None, f"500 bytes over max_output_bytes=100 did not spill: {_show(result.stdout)}"
        )
        assert path is not None
        ctx.expect(await exists(ex, path), f"the spill file {path} does not exist")
    async with ctx.executor() as probe:
        ctx.expect(not await exists(probe, path), f"the spill file {path} outlived its executor's aclose")


class _TapRecorder:
    """An ``on_output`` tap that records each chunk with the moment it came."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, str, bytes]] = []

    def __call__(self, stream: str, data: bytes) -> None:
        self.chunks.append((time.monotonic(), stream, data))

    def joined(self, stream: str) -> bytes:
        return b"".join(data for _, name, data in self.chunks if name == stream)

    def first(self, stream: str) -> float | None:
        return next((at for at, name, _ in self.chunks if name == stream), None)

    def odd_chunks(self) -> list[str]:
        return [
            f"{name!r}: {type(data).__name__}"
            for _, name, data in self.chunks
            if name not in ("stdout", "stderr") or type(data) is not bytes
        ]


def _expect_tapped(ctx: CheckContext, tap: _TapRecorder, want: dict[str, bytes], what: str) -> None:
    odd = tap.odd_chunks()
    ctx.expect(not odd, f"{what}: the tap got chunks that are not (stdout|stderr, bytes): {odd[:3]}")
    for name, full in want.items():
        got = tap.joined(name)
        ctx.expect(
            got == full,
            f"{what}: the tap's {name} chunks joined are {len(got)} bytes, not the whole stream's "
            f"{len(full)}" + ("" if len(got) != len(full) else " (same length, other bytes)"),
        )


# Output that outgrows the kept tail and the spill cap: the tap must still get every byte of it.
_TAP_BULK = 150_000


@check(
    "output-tap-live-exact",
    kind="contract",
    clause="R-output-tap",
    rule="A run's `on_output` gets each stream's chunks as they arrive, every byte exactly (beyond the "
    "kept tail and the spill cap), and nothing after `run` returned.",
)
async def output_tap_run(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000, max_spill_bytes=10_000) as ex:
        tap = _TapRecorder()
        command = (
            "printf 'first\\n'; sleep 1; printf 'e1' >&2; "
            f"head -c {_TAP_BULK} /dev/zero | tr '\\0' x; printf 'é' >&2; printf last"
        )
        started = time.monotonic()
        result = await ex.exec(command, on_output=tap)
        returned = time.monotonic()
        calls_at_return = len(tap.chunks)
        stdout_full = b"first\n" + b"x" * _TAP_BULK + b"last"
        _expect_tapped(ctx, tap, {"stdout": stdout_full, "stderr": "e1é".encode()}, "a run")
        ctx.expect(
            result.stdout.total_bytes == len(stdout_full) and result.stdout.truncated,
            f"the run's stdout should count {len(stdout_full)} bytes, truncated: {_show(result.stdout)}",
        )
        first = tap.first("stdout")
        # 'first' was written a second before the command went on: a live tap has it well before the end.
        ctx.expect(
            first is not None and returned - first >= 0.5,
            "the tap got the run's first stdout chunk "
            + ("never" if first is None else f"{first - started:.2f} s after the start and only ")
            + f"{returned - (first or returned):.2f} s before run returned (the command slept 1 s after "
            "writing it): output must reach the tap as it arrives, not at the end",
        )
        await anyio.sleep(0.2)
        ctx.expect(
            len(tap.chunks) == calls_at_return,
            f"the tap was called {len(tap.chunks) - calls_at_return} more times after run returned",
        )


@check(
    "output-tap-task",
    kind="contract",
    clause="R-output-tap",
    rule="A background task's `on_output` gets each stream's chunks as they arrive, every byte exactly, "
    "all before `wait()` returns and before the task's listeners are called.",
)
async def output_tap_task(ctx: CheckContext) -> None:
    async with ctx.executor(max_output_bytes=1000, max_spill_bytes=10_000) as ex:
        tap = _TapRecorder()
        calls_at_listener: list[int] = []
        ex.on_task_done(lambda task: calls_at_listener.append(len(tap.chunks)))
        command = f"printf 'a'; sleep 1; printf 'b' >&2; head -c {_TAP_BULK} /dev/zero | tr '\\0' y"
        task = await ex.start(ex.resolve(BashExecRequest(command=command, on_output=tap)))
        await wait_task(task, 10 + ctx.allowance_s)
        ended = time.monotonic()
        calls_at_wait = len(tap.chunks)
        _expect_tapped(ctx, tap, {"stdout": b"a" + b"y" * _TAP_BULK, "stderr": b"b"}, "a background task")
        first = tap.first("stdout")
        ctx.expect(
            first is not None and ended - first >= 0.5,
            "the tap got the task's first stdout chunk "
            + ("never" if first is None else f"only {ended - first:.2f} s before wait() returned")
            + " (the command slept 1 s after writing it): output must reach the tap as it arrives",
        )
        await anyio.sleep(0.2)
        ctx.expect(
            calls_at_listener == [len(tap.chunks)] and len(tap.chunks) == calls_at_wait,
            f"the tap had {calls_at_listener} calls when the listener ran, {calls_at_wait} when wait() "
            f"returned and {len(tap.chunks)} later: every chunk must come before both",
        )
