"""Checks of input to a running background task: open stdin, its order, its end and its refusals."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import anyio

from dsh_bash import (
    MAX_INPUT_BYTES,
    MAX_PENDING_INPUT,
    BashExecRequest,
    BashExecutor,
    BashInfrastructureError,
    BashTask,
    BashTaskId,
    OwnerToken,
    TaskInputError,
    UnknownTaskError,
)

from ._kit import CheckContext, check
from ._support import expect_raises, read_to_end, wait_task


async def _start_open(ctx: CheckContext, ex: BashExecutor, command: str, **fields: Any) -> BashTask:
    """Start ``command`` with open input; a backend that refuses open input makes the check N/A."""
    try:
        return await ex.start(ex.resolve(BashExecRequest(command=command, open_stdin=True, **fields)))
    except BashInfrastructureError as exc:
        if exc.reason == "interactive_unsupported":
            ctx.not_applicable(f"the target keeps no command's stdin open: {exc}")
        raise


async def _read_until(ctx: CheckContext, ex: BashExecutor, task: BashTask, want: str, what: str) -> str:
    """Read the task's output until it holds ``want`` (within the allowance); return all of it."""
    seen = ""
    deadline = time.monotonic() + 2 + ctx.allowance_s
    while want not in seen:
        if time.monotonic() > deadline:
            ctx.fail(
                f"{what}: the task's output was {seen!r} after {2 + ctx.allowance_s:g} s, expected {want!r}"
            )
        seen += (await ex.read_output(task.id)).delta
        await anyio.sleep(0.02)
    return seen


async def _refused(ctx: CheckContext, call: partial[Any], reason: str, what: str) -> None:
    error = await expect_raises(TaskInputError, call, what)
    assert isinstance(error, TaskInputError)
    ctx.expect(
        error.reason == reason, f"{what} was refused with reason {error.reason!r}, expected {reason!r}"
    )


@check(
    "input-reaches-task",
    kind="contract",
    clause="R-input-open",
    rule="A task started with `open_stdin` reads the spec's `stdin` and then, in order and once each, "
    "the bytes of every `write_input`, while it runs.",
)
async def input_reaches_task(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start_open(ctx, ex, "cat", stdin="first\n")
        await ex.write_input(task.id, "second\n", owner=None)
        # Read back before anything else is written: input reaches a running task, not only at its end.
        seen = await _read_until(ctx, ex, task, "first\nsecond\n", "after writing 'second\\n'")
        await ex.write_input(task.id, b"thi", owner=None)
        await ex.write_input(task.id, "rd \u00e9\n", owner=None)
        seen += await _read_until(ctx, ex, task, "third é\n", "after writing 'thi' and 'rd é\\n'")
        ctx.expect(
            await ex.close_input(task.id, owner=None) is True, "close_input of open input was not True"
        )
        await wait_task(task, 2 + ctx.allowance_s, "cat after close_input")
        seen += await read_to_end(ctx, ex, task.id)
        ctx.expect(
            seen == "first\nsecond\nthird é\n",
            f"cat echoed {seen!r}, expected 'first\\nsecond\\nthird é\\n' (each write once, in order)",
        )
        ctx.expect(task.exit_code == 0, f"cat ended {task!r}, expected exit code 0")


@check(
    "input-off-by-default",
    kind="contract",
    clause="R-input-open",
    rule="A task started without `open_stdin` reads the spec's `stdin` and then end of file, as before.",
)
async def input_off_by_default(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        for stdin, expected in ((None, "end\n"), ("given ", "given end\n")):
            task = await ex.start(ex.resolve(BashExecRequest(command="cat; echo end", stdin=stdin)))
            await wait_task(
                task, 2 + ctx.allowance_s, f"`cat; echo end` with stdin={stdin!r} (no open_stdin)"
            )
            out = await read_to_end(ctx, ex, task.id)
            ctx.expect(
                out == expected,
                f"`cat; echo end` with stdin={stdin!r} printed {out!r}, expected {expected!r}",
            )


@check(
    "input-eof-after-close",
    kind="contract",
    clause="R-input-eof",
    rule="After `close_input` the command reads end of file once it read all the queued input; "
    "`close_input` returns True the first time and False after.",
)
async def input_eof_after_close(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        # More than a pipe holds (64 KiB), written and closed at once: the close must wait for the queue.
        sizes = [5, 300_000, 7, 200_000]
        task = await _start_open(ctx, ex, "wc -c | tr -d ' '", stdin="12345")
        for size in sizes[1:]:
            await ex.write_input(task.id, b"z" * size, owner=None)
        ctx.expect(await ex.close_input(task.id, owner=None) is True, "the first close_input was not True")
        ctx.expect(await ex.close_input(task.id, owner=None) is False, "a second close_input was not False")
        await wait_task(task, 5 + ctx.allowance_s, "`wc -c` after close_input")
        out = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            out == f"{sum(sizes)}\n",
            f"`wc -c` counted {out!r}: expected {sum(sizes)} (every queued byte before the end of file)",
        )


@check(
    "input-refusals",
    kind="contract",
    clause="R-input-refused",
    rule="`write_input` refuses with TaskInputError, sending nothing: `other_owner` for another owner's "
    "task, `input_not_open` without `open_stdin`, `input_closed` after `close_input`, `input_broken` once "
    "the command closed its stdin, `input_full` past MAX_PENDING_INPUT unread bytes, `task_ended` once the "
    "task ended; an unknown id raises UnknownTaskError, an oversized write ValueError, and `run` refuses "
    "`open_stdin`.",
)
async def input_refusals(ctx: CheckContext) -> None:
    owner, other = OwnerToken("kit-owner-a"), OwnerToken("kit-owner-b")
    async with ctx.executor() as ex:
        mine = await _start_open(ctx, ex, "cat", owner=owner)
        for wrong in (other, None):
            await _refused(
                ctx,
                partial(ex.write_input, mine.id, "x", owner=wrong),
                "other_owner",
                f"write as owner {wrong!r}",
            )
            await _refused(
                ctx, partial(ex.close_input, mine.id, owner=wrong), "other_owner", f"close as owner {wrong!r}"
            )
        await ex.write_input(mine.id, "mine\n", owner=owner)
        out = await _read_until(ctx, ex, mine, "mine\n", "the owner's write")
        ctx.expect(out == "mine\n", f"the refused writes reached the task: it printed {out!r}")

        shut = await ex.start(ex.resolve(BashExecRequest(command="sleep 30")))
        await _refused(
            ctx,
            partial(ex.write_input, shut.id, "x", owner=None),
            "input_not_open",
            "write without open_stdin",
        )
        await _refused(
            ctx, partial(ex.close_input, shut.id, owner=None), "input_not_open", "close without open_stdin"
        )

        await ex.close_input(mine.id, owner=owner)
        await _refused(
            ctx, partial(ex.write_input, mine.id, "x", owner=owner), "input_closed", "write after close"
        )
        await wait_task(mine, 2 + ctx.allowance_s, "cat after close_input")
        await _refused(
            ctx, partial(ex.write_input, mine.id, "x", owner=owner), "task_ended", "write after the end"
        )
        await _refused(
            ctx, partial(ex.close_input, mine.id, owner=owner), "task_ended", "close after the end"
        )

        deaf = await _start_open(ctx, ex, "exec 0<&-; sleep 30")
        deadline = time.monotonic() + 2 + ctx.allowance_s
        while True:
            try:
                await ex.write_input(deaf.id, "x", owner=None)
            except TaskInputError as exc:
                ctx.expect(
                    exc.reason == "input_broken", f"a write to a closed stdin was refused as {exc.reason!r}"
                )
                break
            if time.monotonic() > deadline:
                ctx.fail("writes to a command that closed its stdin were still taken after the allowance")
            await anyio.sleep(0.05)

        full = await _start_open(ctx, ex, "sleep 30")
        await ex.write_input(full.id, b"f" * MAX_PENDING_INPUT, owner=None)
        await _refused(
            ctx,
            partial(ex.write_input, full.id, b"f" * (MAX_PENDING_INPUT // 2), owner=None),
            "input_full",
            "a write past MAX_PENDING_INPUT unread bytes",
        )

        await expect_raises(
            UnknownTaskError,
            partial(ex.write_input, BashTaskId("kit-no-such-task"), "x", owner=None),
            "write to an unknown id",
        )
        await expect_raises(
            ValueError,
            partial(ex.write_input, full.id, b"o" * (MAX_INPUT_BYTES + 1), owner=None),
            "an oversized write",
        )
        await expect_raises(
            ValueError,
            partial(ex.run, ex.resolve(BashExecRequest(command="true", open_stdin=True))),
            "run with open_stdin",
        )
        for task in (shut, deaf, full):
            await ex.kill(task.id)
