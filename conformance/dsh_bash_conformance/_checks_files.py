"""Checks of files moved without a shell: ``read_file`` and ``write_file`` (``R-file-*``). A target
that cannot move files refuses them with reason ``files_unsupported``: N/A."""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio

from dsh_bash import BashExecRequest, BashExecutor, BashInfrastructureError, FileOperationError

from ._harness import CheckContext, check
from ._support import expect_raises, read_to_end, wait_task

_MIB = 1 << 20


@asynccontextmanager
async def _scratch(ctx: CheckContext, ex: BashExecutor) -> AsyncIterator[str]:
    """A fresh directory where commands run, removed afterwards; N/A on a target without files."""
    made = await ex.exec('d=$(mktemp -d) && chmod 755 "$d" && printf %s "$d"')
    ctx.expect(made.exit_code == 0 and made.stdout.text.startswith("/"), f"mktemp -d: {made.stderr.text!r}")
    where = made.stdout.text
    try:
        try:
            await ex.read_file(f"{where}/probe")
        except BashInfrastructureError as exc:
            if exc.reason == "files_unsupported":
                ctx.not_applicable(f"the target moves no files: {exc}")
            raise
        except FileOperationError:
            pass  # the probe is missing, as it should be
        yield where
    finally:
        with anyio.CancelScope(shield=True):
            await ex.exec(f"rm -rf -- '{where}'")


@check(
    "file-round-trip",
    kind="contract",
    clause="R-file-bytes",
    rule="`write_file` then `read_file` give back exactly the bytes written (empty, every byte value, "
    "several MiB); a command sees them at once, and `read_file` reads exactly what a command wrote; a "
    "relative path is relative to the default working directory.",
)
async def file_round_trip(ctx: CheckContext) -> None:
    async with ctx.executor() as ex, _scratch(ctx, ex) as where:
        every = bytes(range(256)) * 3
        large = secrets.token_bytes(5 * _MIB)
        for name, data in (("empty", b""), ("every", every), ("large", large)):
            await ex.write_file(f"{where}/{name}", data)
            back = await ex.read_file(f"{where}/{name}")
            ctx.expect(
                back == data,
                f"{name}: read_file gave {len(back)} bytes back for {len(data)} written"
                + ("" if len(back) != len(data) else " (different bytes)"),
            )
        seen = await ex.exec(f"cat '{where}/every'")
        ctx.expect(
            seen.stdout.data == every, f"a command read {seen.stdout.total_bytes} bytes of 768 written"
        )
        written = await ex.exec(f"printf 'a\\000b\\377\\n' > '{where}/by-command'")
        ctx.expect(written.exit_code == 0, f"the command could not write: {written.stderr.text!r}")
        got = await ex.read_file(f"{where}/by-command")
        ctx.expect(got == b"a\x00b\xff\n", f"read_file of a command's file gave {got!r}")
        home = (await ex.exec("builtin pwd -P")).stdout.text.strip()
        relative = posixpath.relpath(f"{where}/relative", home)  # climbs from the default directory
        await ex.write_file(relative, b"relative")
        back = await ex.read_file(relative)
        seen = await ex.exec(f"cat '{where}/relative'")
        ctx.expect(
            seen.stdout.text == "relative" and back == b"relative",
            f"the relative path {relative!r} (default working directory {home!r}): a command read "
            f"{seen.stdout.text!r}, read_file gave {back!r}",
        )


@check(
    "file-refusals",
    kind="contract",
    clause="R-file-refusals",
    rule="`read_file` of a missing path, a directory, a FIFO or a file over `max_file_bytes`, and "
    "`write_file` into a missing directory (without `make_parents`) or onto a directory, raise "
    "FileOperationError with the matching reason and change nothing; `make_parents` makes the "
    "directories.",
)
async def file_refusals(ctx: CheckContext) -> None:
    async with ctx.executor(max_file_bytes=1000) as ex, _scratch(ctx, ex) as where:
        fifo = await ex.exec(f"mkfifo '{where}/fifo'")
        ctx.expect(fifo.exit_code == 0, f"mkfifo failed: {fifo.stderr.text!r}")
        await ex.write_file(f"{where}/big", b"x" * 1001)
        await ex.write_file(f"{where}/fits", b"x" * 1000)
        cases: tuple[tuple[str, Callable[[], Awaitable[Any]], str], ...] = (
            ("a missing file", partial(ex.read_file, f"{where}/missing"), "file_not_found"),
            ("a directory", partial(ex.read_file, where), "is_a_directory"),
            ("a FIFO", partial(ex.read_file, f"{where}/fifo"), "not_a_regular_file"),
            ("a file over max_file_bytes", partial(ex.read_file, f"{where}/big"), "file_too_large"),
            (
                "a write into a missing directory",
                partial(ex.write_file, f"{where}/no/such", b"x"),
                "file_not_found",
            ),
            ("a write onto a directory", partial(ex.write_file, where, b"x"), "is_a_directory"),
        )
        for what, call, reason in cases:
            error = await expect_raises(FileOperationError, call, what)
            assert isinstance(error, FileOperationError)
            ctx.expect(error.reason == reason, f"{what}: reason {error.reason!r}, expected {reason!r}")
        ctx.expect(len(await ex.read_file(f"{where}/fits")) == 1000, "a file of max_file_bytes was refused")
        left = await ex.exec(f"ls -A '{where}'")
        ctx.expect(
            sorted(left.stdout.text.split()) == ["big", "fifo", "fits"],
            f"the refused writes left {left.stdout.text.split()} in the directory",
        )
        await ex.write_file(f"{where}/made/on/the/way", b"deep", make_parents=True)
        deep = await ex.exec(f"cat '{where}/made/on/the/way'")
        ctx.expect(deep.stdout.text == "deep", f"make_parents: a command read {deep.stdout.text!r}")


@check(
    "file-link-replaced",
    kind="contract",
    clause="R-file-write",
    rule="`write_file` onto a symlink a command planted replaces the link with the file: the link's "
    "target is never written.",
)
async def file_link_replaced(ctx: CheckContext) -> None:
    async with ctx.executor() as ex, _scratch(ctx, ex) as where:
        planted = await ex.exec(f"cd '{where}' && printf precious > victim && ln -s victim link")
        ctx.expect(planted.exit_code == 0, f"planting the link failed: {planted.stderr.text!r}")
        await ex.write_file(f"{where}/link", b"written")
        after = await ex.exec(f"cd '{where}' && cat victim; echo; [ -L link ] && echo link || cat link")
        ctx.expect(
            after.stdout.text == "precious\nwritten",
            f"after a write onto a planted link: {after.stdout.text!r} (the victim first)",
        )


@check(
    "file-write-atomic",
    kind="contract",
    clause="R-file-atomic",
    rule="A command reading a file while `write_file` rewrites it never sees it partly written, and two "
    "writes at once leave one of the two, whole.",
)
async def file_write_atomic(ctx: CheckContext) -> None:
    async with ctx.executor() as ex, _scratch(ctx, ex) as where:
        first, second = b"a" * _MIB, b"b" * _MIB
        await ex.write_file(f"{where}/f", first)
        reader = await ex.start(
            ex.resolve(
                BashExecRequest(
                    command=f"i=0; while [ $i -lt 400 ]; do wc -c < '{where}/f'; i=$((i+1)); done",
                    task_timeout_ms=30_000,
                )
            )
        )
        while reader.status == "running":
            await ex.write_file(f"{where}/f", second)
            await ex.write_file(f"{where}/f", first)
        await wait_task(reader, 5, "the reading loop")
        sizes = (await read_to_end(ctx, ex, reader.id)).split()
        partial = sorted({size for size in sizes if size != str(_MIB)})
        ctx.expect(bool(sizes), "the reading loop read nothing")
        ctx.expect(not partial, f"a command saw the file partly written: sizes {partial[:5]}")
        async with anyio.create_task_group() as both:
            both.start_soon(ex.write_file, f"{where}/g", first)
            both.start_soon(ex.write_file, f"{where}/g", second)
        result = await ex.read_file(f"{where}/g")
        ctx.expect(result in (first, second), f"two writes at once left {len(result)} bytes, neither whole")
