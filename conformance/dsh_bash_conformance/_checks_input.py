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
    TerminalSize,
    UnknownTaskError,
)

from ._harness import CheckContext, check
from ._support import expect_raises, expect_raises_sync, gone, loop, read_to_end, started, wait_task


async def _start_open(ctx: CheckContext, ex: BashExecutor, command: str, **fields: Any) -> BashTask:
    """Start ``command`` with open input (or with ``terminal=``); a backend that refuses it makes the
    check N/A."""
    try:
        return await ex.start(ex.resolve(BashExecRequest(command=command, open_stdin=True, **fields)))
    except BashInfrastructureError as exc:
        if exc.reason == "interactive_unsupported":
            ctx.not_applicable(f"the target refuses open input or a terminal: {exc}")
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


# -- terminals ------------------------------------------------------------------------------------


async def _start_terminal(
    ctx: CheckContext, ex: BashExecutor, command: str, rows: int = 24, cols: int = 80
) -> BashTask:
    return await _start_open(ctx, ex, command, terminal=TerminalSize(rows=rows, cols=cols))


@check(
    "terminal-size",
    kind="contract",
    clause="R-term-size",
    rule="A task started with `terminal` runs on a pseudo-terminal of that size that is its controlling "
    "terminal: `tty` names a terminal, `stty size` prints the rows and columns, `/dev/tty` opens.",
)
async def terminal_size(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start_terminal(
            ctx,
            ex,
            'tty; stty size; if : </dev/tty; then echo ctty; else echo no-ctty; fi; echo "TERM=$TERM"',
            30,
            100,
        )
        await wait_task(task, 2 + ctx.allowance_s, "a terminal task printing its terminal")
        out = (await read_to_end(ctx, ex, task.id)).replace("\r\n", "\n")
        lines = out.splitlines()
        ctx.expect(
            len(lines) == 4 and lines[0].startswith("/dev/"), f"`tty` printed no terminal device: {out!r}"
        )
        ctx.expect("30 100" in lines, f"`stty size` of a 30x100 terminal printed {out!r}")
        ctx.expect(
            "ctty" in lines, f"/dev/tty did not open: the terminal is not the controlling one ({out!r})"
        )
        ctx.expect(
            any(line.startswith("TERM=") and line != "TERM=dumb" for line in lines),
            f"a terminal task kept TERM=dumb or none: {out!r}",
        )


@check(
    "terminal-resize",
    kind="contract",
    clause="R-term-size",
    rule="`resize_terminal` changes the size the terminal task's programs see, and its foreground job "
    "gets SIGWINCH; on a task without a terminal it raises TaskInputError (`not_terminal`).",
)
async def terminal_resize(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start_terminal(
            ctx,
            ex,
            "trap 'stty size' WINCH; echo ready; i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done",
        )
        await _read_until(ctx, ex, task, "ready", "a terminal task starting")
        await ex.resize_terminal(task.id, TerminalSize(rows=40, cols=120), owner=None)
        await _read_until(
            ctx, ex, task, "40 120", "after resize_terminal to 40x120 (the WINCH trap prints `stty size`)"
        )
        await ex.kill(task.id)
        plain = await _start_open(ctx, ex, "sleep 30")
        await _refused(
            ctx,
            partial(ex.resize_terminal, plain.id, TerminalSize(rows=5, cols=5), owner=None),
            "not_terminal",
            "resize_terminal of a task without a terminal",
        )
        await ex.kill(plain.id)


@check(
    "terminal-ctrl-c",
    kind="contract",
    clause="R-term-interrupt",
    rule="On a terminal task, `\\x03` interrupts the foreground job (SIGINT to the terminal's foreground "
    "process group) and `\\x04` at a line start is end of file; `close_input` raises TaskInputError "
    "(`terminal_no_close`).",
)
async def terminal_ctrl_c(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start_terminal(
            ctx,
            ex,
            "trap 'echo INT' INT; echo ready; sleep 30; echo after; read x; echo \"got [$x]\"; exit 3",
        )
        await _read_until(ctx, ex, task, "ready", "a terminal task starting")
        await _refused(
            ctx,
            partial(ex.close_input, task.id, owner=None),
            "terminal_no_close",
            "close_input of a terminal",
        )
        started = time.monotonic()
        await ex.write_input(task.id, "\x03", owner=None)
        await _read_until(ctx, ex, task, "after", "after writing \\x03 to a terminal running `sleep 30`")
        ctx.expect(time.monotonic() - started < 5, "\\x03 did not interrupt `sleep 30`")
        await ex.write_input(task.id, "\x04", owner=None)
        await wait_task(task, 2 + ctx.allowance_s, "`read` after \\x04")
        rest = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            "got []" in rest and task.exit_code == 3, f"`read` did not end at \\x04: {rest!r}, {task!r}"
        )


@check(
    "terminal-output-incremental",
    kind="contract",
    clause="R-term-output",
    rule="A terminal task's output is one stream, stdout, as the terminal shows it (stderr included, "
    "`\\r\\n` line ends), read incrementally and consumed as any task's output.",
)
async def terminal_output_incremental(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start_terminal(ctx, ex, "echo one; echo two >&2; sleep 0.5; echo three")
        first = await _read_until(ctx, ex, task, "two", "the first lines of a terminal task")
        ctx.expect(task.end_cause is None, "the output of a terminal task arrived only at its end")
        await wait_task(task, 2 + ctx.allowance_s, "a terminal task")
        rest = await read_to_end(ctx, ex, task.id)
        whole = first + rest
        ctx.expect(
            whole == "one\r\ntwo\r\nthree\r\n",
            f"a terminal task's output read as {whole!r}, expected one stream: "
            "'one\\r\\ntwo\\r\\nthree\\r\\n'",
        )


@check(
    "terminal-kill-leaves-nothing",
    kind="contract",
    clause="R-term-contained",
    rule="Kill and aclose of a terminal task leave no process of it, also one that left the terminal's "
    "session and ignores SIGHUP and SIGTERM.",
)
async def terminal_kill_leaves_nothing(ctx: CheckContext) -> None:
    # Each task: a process that left the terminal's session (its own mark) and one in the foreground.
    # The kill waits until the one that left runs as itself: until ``setsid`` exec'd, the child is
    # still in the foreground group, where a kill of that group alone would end it too.
    marks = [(ctx.marker(), ctx.marker()) for _ in range(2)]
    bound = 2 * 0.3 + 2 + ctx.allowance_s
    async with ctx.executor() as ex:
        tasks = []
        for hidden, foreground in marks:
            body = loop(hidden, trap_term=True, prelude="trap '' HUP")
            hiding = f"setsid {body} >/dev/null 2>&1 &"
            tasks.append(await _start_terminal(ctx, ex, f"{hiding} {loop(foreground, trap_term=True)}"))
        for pair in marks:
            for mark in pair:
                await started(ctx, mark, "a terminal task's processes")
        await ex.kill(tasks[0].id)
        await wait_task(tasks[0], bound, "a killed terminal task")
        for mark, what in zip(marks[0], ("that left its session", "in the foreground"), strict=True):
            await gone(ctx, mark, bound, f"after kill of a terminal task, its process {what}")
    for mark, what in zip(marks[1], ("that left its session", "in the foreground"), strict=True):
        await gone(ctx, mark, bound, f"after aclose with a terminal task running, its process {what}")


# -- waiting for input ------------------------------------------------------------------------------


async def _waiting_seen(ctx: CheckContext, ex: BashExecutor, task: BashTask, within_s: float) -> float | None:
    """Read the task for ``within_s``: when ``waiting_for_input`` first came (seconds), or None. A
    backend that cannot tell (None) makes the check N/A."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        read = await ex.read_output(task.id)
        _look_agrees(ctx, ex, task, read.waiting_for_input)
        if read.waiting_for_input is None:
            ctx.not_applicable(
                "the target cannot tell whether a task waits for input (waiting_for_input is None)"
            )
        if read.waiting_for_input:
            return time.monotonic() - started
        await anyio.sleep(0.02)
    return None


def _look_agrees(ctx: CheckContext, ex: BashExecutor, task: BashTask, reported: bool | None) -> None:
    """Called right after a read, with no await between: the look sees the state the read reported."""
    look = ex.waiting_for_input(task.id)
    ctx.expect(
        look is reported,
        f"waiting_for_input({task.id!r}) right after a read was {look!r}, the read reported {reported!r}",
    )


async def _looks_consume_nothing(
    ctx: CheckContext, ex: BashExecutor, task: BashTask, want: str, what: str
) -> None:
    """Look for a second while the task answers, then read: the answer must still be there."""
    started = time.monotonic()
    while time.monotonic() - started < 1:
        ex.waiting_for_input(task.id)
        await anyio.sleep(0.02)
    await _read_until(
        ctx, ex, task, want, f"{what}, after a second of waiting_for_input looks (do they consume output?)"
    )


@check(
    "waiting-reported",
    kind="contract",
    clause="R-input-waiting",
    rule="A read reports `waiting_for_input` within 1 s after a process of the task blocked reading its "
    "open input (pipe or terminal, also through /dev/tty) with nothing to read, and no longer once input "
    "was written; `waiting_for_input(id)` agrees with each read, is False right after a write and consumes "
    "nothing.",
)
async def waiting_reported(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        expect_raises_sync(
            UnknownTaskError,
            partial(ex.waiting_for_input, BashTaskId("kit-no-such-task")),
            "waiting_for_input of an unknown id",
        )
        readers = [("`read` on open stdin", await _start_open(ctx, ex, 'read -r x; echo "got $x"; sleep 30'))]
        on_terminal = {
            "`read` on a terminal": 'read -r x; echo "got $x"; sleep 30',
            # As ssh and sudo ask for a password: from /dev/tty, whatever stdin is.
            "`read` from /dev/tty, stdin elsewhere": (
                'exec 3</dev/tty </dev/null; read -r -u 3 x; echo "got $x"; sleep 30'
            ),
        }
        for name, command in on_terminal.items():
            try:
                task = await ex.start(
                    ex.resolve(BashExecRequest(command=command, terminal=TerminalSize(rows=24, cols=80)))
                )
            except BashInfrastructureError as exc:
                if exc.reason != "interactive_unsupported":
                    raise
                break
            readers.append((name, task))
        for what, task in readers:
            after = await _waiting_seen(ctx, ex, task, 1 + ctx.allowance_s)
            ctx.expect(
                after is not None,
                f"{what}: no read reported waiting_for_input within {1 + ctx.allowance_s:g} s",
            )
            await ex.write_input(task.id, "answer\n", owner=None)
            look = ex.waiting_for_input(task.id)
            ctx.expect(
                look is False,
                f"{what}: waiting_for_input right after write_input was {look!r}: a wait seen before the "
                "write still counted",
            )
            read = await ex.read_output(task.id)
            ctx.expect(
                read.waiting_for_input is False,
                f"{what}: the read right after write_input still reported "
                f"waiting_for_input={read.waiting_for_input}",
            )
            if "got answer" not in read.delta:
                await _looks_consume_nothing(ctx, ex, task, "got answer", what)
            await ex.kill(task.id)


@check(
    "waiting-not-reported",
    kind="contract",
    clause="R-input-waiting",
    rule="`waiting_for_input` is not reported while the task's processes compute, sleep, or read another "
    "pipe, nor for a task without open input; `waiting_for_input(id)` agrees with each read.",
)
async def waiting_not_reported(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        cases = {
            "sleeping": await _start_open(ctx, ex, "sleep 10"),
            "computing": await _start_open(
                ctx, ex, "end=$((SECONDS + 10)); while [ $SECONDS -lt $end ]; do :; done"
            ),
            "reading another pipe": await _start_open(ctx, ex, "sleep 10 | cat"),
            "without open input": await ex.start(
                ex.resolve(BashExecRequest(command="read -r x; cat; sleep 10"))
            ),
        }
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            for what, task in cases.items():
                read = await ex.read_output(task.id)
                _look_agrees(ctx, ex, task, read.waiting_for_input)
                if read.waiting_for_input is None and what != "without open input":
                    ctx.not_applicable("the target cannot tell whether a task waits for input")
                ctx.expect(
                    not read.waiting_for_input and task.end_cause is None,
                    f"a task {what} was reported waiting for input (or ended: {task!r})",
                )
            await anyio.sleep(0.05)
        for task in cases.values():
            await ex.kill(task.id)
