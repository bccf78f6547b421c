"""Checks of the executor's lifecycle: calls outside the block, aclose from anywhere, bounded close."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import anyio

from dsh_bash import (
    BashExecRequest,
    BashExecSpec,
    BashExecutor,
    BashInfrastructureError,
    BashTaskId,
    DshBashError,
    ExecutorClosedError,
    TerminalSize,
    UnknownTaskError,
)

from ._harness import CheckContext, check
from ._support import (
    SETUP_S,
    Box,
    alive,
    elapsed,
    expect_raises,
    expect_raises_sync,
    gone,
    loop,
    sh,
    spawn,
    started,
    wait_task,
)

GRACE_S = 0.3


async def _all_refused(
    ctx: CheckContext, ex: BashExecutor, spec: BashExecSpec, task_id: BashTaskId, when: str
) -> None:
    """Every method of a closed (or never opened) executor raises ExecutorClosedError."""
    expect_raises_sync(
        ExecutorClosedError, partial(ex.resolve, BashExecRequest(command="true")), f"resolve {when}"
    )
    expect_raises_sync(ExecutorClosedError, partial(ex.owner_of, task_id), f"owner_of {when}")
    await expect_raises(ExecutorClosedError, partial(ex.run, spec), f"run {when}")
    await expect_raises(ExecutorClosedError, partial(ex.exec, spec.command), f"exec {when}")
    await expect_raises(ExecutorClosedError, partial(ex.start, spec), f"start {when}")
    await expect_raises(ExecutorClosedError, partial(ex.read_output, task_id), f"read_output {when}")
    expect_raises_sync(
        ExecutorClosedError, partial(ex.waiting_for_input, task_id), f"waiting_for_input {when}"
    )
    await expect_raises(ExecutorClosedError, partial(ex.kill, task_id), f"kill {when}")
    await expect_raises(
        ExecutorClosedError, partial(ex.write_input, task_id, "x", owner=None), f"write_input {when}"
    )
    await expect_raises(
        ExecutorClosedError, partial(ex.close_input, task_id, owner=None), f"close_input {when}"
    )
    await expect_raises(
        ExecutorClosedError,
        partial(ex.resize_terminal, task_id, TerminalSize(rows=30, cols=100), owner=None),
        f"resize_terminal {when}",
    )


@check(
    "closed-executor-refuses-calls",
    kind="contract",
    clause="R-life-closed-refuses",
    rule="Calls before the block is entered or after the executor closed raise ExecutorClosedError.",
)
async def closed_refuses(ctx: CheckContext) -> None:
    witness = f"/tmp/kit-closed-{secrets.token_hex(8)}"
    spec = BashExecSpec(
        command=f"printf x >> {witness}", workdir="/", timeout_ms=5000.0, owner=None, user=None
    )
    ex = ctx.executor()
    await _all_refused(ctx, ex, spec, BashTaskId("kit-no-such-task"), "before the block was entered")
    async with ex:
        task = await ex.start(ex.resolve(BashExecRequest(command="printf hi")))
        await wait_task(task, SETUP_S)
        await ex.aclose()
        await _all_refused(ctx, ex, spec, task.id, "after aclose, inside the block")
    await _all_refused(ctx, ex, spec, task.id, "after the block")
    async with ctx.executor() as probe:
        state = await sh(probe, f"if [ -e {witness} ]; then echo ran; rm -f {witness}; else echo none; fi")
    ctx.expect(state == "none\n", "a command given to a closed executor ran anyway")


@check(
    "closed-error-is-infrastructure-error",
    kind="contract",
    clause="R-error-hierarchy",
    rule="ExecutorClosedError is a BashInfrastructureError (a DshBashError); UnknownTaskError is a "
    "DshBashError and a LookupError.",
)
async def closed_error_type(ctx: CheckContext) -> None:
    ex = ctx.executor()
    error = await expect_raises(ExecutorClosedError, partial(ex.exec, "true"), "exec before the block")
    ctx.expect(
        isinstance(error, BashInfrastructureError) and isinstance(error, DshBashError),
        f"the closed-executor error {type(error).__mro__} is not a BashInfrastructureError",
    )
    async with ex:
        unknown = await expect_raises(
            UnknownTaskError, partial(ex.kill, BashTaskId("kit-no-such-task")), "kill of an unknown id"
        )
        ctx.expect(
            isinstance(unknown, LookupError) and isinstance(unknown, DshBashError),
            f"the unknown-task error {type(unknown).__mro__} is not a LookupError and DshBashError",
        )


@check(
    "aclose-idempotent-from-any-task",
    kind="contract",
    clause="R-life-aclose-any-task",
    rule="`aclose()` may be called from any task, any number of times, also while the block still runs; "
    "leaving the block afterwards finishes the close.",
)
async def aclose_idempotent(ctx: CheckContext) -> None:
    ex = ctx.executor()
    mark = ctx.marker()
    async with ex:
        task = await ex.start(ex.resolve(BashExecRequest(command=loop(mark, trap_term=True))))
        await anyio.sleep(0.1)
        boxes: list[Box[None]] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                boxes.append(spawn(tg, ex.aclose))
            with anyio.move_on_after(2 * GRACE_S + ctx.allowance_s):
                for box in boxes:
                    await box.done.wait()
        for i, box in enumerate(boxes):
            ctx.expect(
                box.done.is_set() and box.error is None, f"aclose call {i} from another task {box.describe()}"
            )
        await ex.aclose()
        await expect_raises(ExecutorClosedError, partial(ex.exec, "true"), "exec after aclose")
        await wait_task(task, ctx.allowance_s, "a task running at aclose")
    await ex.aclose()
    await gone(ctx, mark, 0.25, "after aclose, a running task's process")


@check(
    "aclose-bounded",
    kind="contract",
    clause="R-life-aclose-bounded",
    rule="aclose kills every running task and leftover process and waits for them, bounded by about "
    "twice `grace_ms`.",
)
async def aclose_bounded(ctx: CheckContext) -> None:
    # A close that kills one after the other takes six graces, past the bound of two graces and an
    # allowance as long as the grace is at least the allowance.
    grace_s = max(1.0, ctx.allowance_s)
    ex = ctx.executor(grace_ms=grace_s * 1000)
    marks = [ctx.marker() for _ in range(6)]
    async with ex:
        tasks = [
            await ex.start(ex.resolve(BashExecRequest(command=f"{loop(mark, trap_term=True)} & wait")))
            for mark in marks[:5]
        ]
        leftover = await ex.start(
            ex.resolve(BashExecRequest(command=f"{loop(marks[5], trap_term=True)} >/dev/null 2>&1 &"))
        )
        await wait_task(leftover, SETUP_S, "a task that leaves a TERM-ignoring process")
        for mark, task in zip(marks, [*tasks, leftover], strict=True):
            await started(ctx, mark, "before aclose, a TERM-ignoring process", task=task)
        await anyio.sleep(0.2)  # past the trap: a SIGTERM that kills them would hide a serial close
        closing_at = time.monotonic()
        await ex.aclose()
        took = elapsed(closing_at)
    # Five TERM-ignoring tasks and a leftover, killed one after the other, would take 6 graces.
    bound = 2 * grace_s + ctx.allowance_s
    ctx.expect(took <= bound, f"aclose with TERM-ignoring processes took {took:.2f} s (bound {bound:.2f} s)")
    for mark in marks:
        await gone(ctx, mark, 0.25, "right after aclose, a TERM-ignoring process")


async def _leave_behind(ctx: CheckContext, ex: BashExecutor, mark: str) -> None:
    """A background task that exits at once, leaving a process carrying ``mark`` running."""
    task = await ex.start(ex.resolve(BashExecRequest(command=f"{loop(mark)} >/dev/null 2>&1 &")))
    await wait_task(task, SETUP_S, "a task that leaves a process")


@check(
    "aclose-spares-other-executors",
    kind="contract",
    clause="R-life-aclose-own-only",
    rule="aclose kills what this executor's commands started, not the tasks and leftovers of another "
    "executor.",
)
async def aclose_spares_others(ctx: CheckContext) -> None:
    async with ctx.executor() as keeper:
        running, leftover, doomed = ctx.marker(), ctx.marker(), ctx.marker()
        task = await keeper.start(keeper.resolve(BashExecRequest(command=loop(running))))
        # Leftovers of background tasks: a foreground run's are killed when it ends.
        await _leave_behind(ctx, keeper, leftover)
        closer = ctx.executor()
        async with closer:
            await _leave_behind(ctx, closer, doomed)
            await started(ctx, doomed, "the closing executor's leftover")
        await gone(ctx, doomed, 0.5, "after aclose, its own leftover")
        await anyio.sleep(0.1)
        ctx.expect(task.end_cause is None, f"another executor's aclose ended this task: {task!r}")
        await alive(ctx, running, "after another executor's aclose, this executor's running task")
        await alive(ctx, leftover, "after another executor's aclose, this executor's leftover")
        ok = await sh(keeper, "printf ok")
        ctx.expect(ok == "ok", f"after another executor's aclose, this one printed {ok!r}")


@check(
    "nothing-left-by-failed-open",
    kind="contract",
    clause="R-life-open-failure-clean",
    rule="When entering the executor raises, nothing it acquired is left behind (a container, a "
    "connection, a spill directory, a helper process).",
)
async def nothing_left_by_failed_open(ctx: CheckContext) -> None:
    # The backend says how to make its open fail and how to find what a failed open left: both are
    # optional hooks (dsh_bash.backend.ConformanceHooks); without them the check cannot run.
    probe = ctx.executor()
    make_fail: Callable[[], Mapping[str, Any] | None] | None = getattr(probe, "kit_failing_open", None)
    find_left: Callable[[BashExecutor], list[str]] | None = getattr(probe, "kit_open_leftovers", None)
    if make_fail is None or find_left is None:
        ctx.not_applicable(
            f"{type(probe).__name__} defines no kit_failing_open and kit_open_leftovers hooks: the kit "
            "can neither make its open fail nor see what a failed open left behind"
        )
    overrides = make_fail()
    if overrides is None:
        ctx.not_applicable(f"{type(probe).__name__}: no configuration change makes this target's open fail")
    ex = ctx.executor(**overrides)
    try:
        await ex.__aenter__()
    except BashInfrastructureError:
        pass
    except Exception as exc:
        ctx.fail(
            f"entering an executor whose open fails ({dict(overrides)}) raised {type(exc).__name__}: "
            f"{exc}, not a BashInfrastructureError"
        )
    else:
        await ex.__aexit__(None, None, None)
        ctx.fail(f"an executor with {dict(overrides)} opened; kit_failing_open promised that it would not")
    left = await anyio.to_thread.run_sync(find_left, ex)
    ctx.expect(not left, f"a failed open ({dict(overrides)}) left behind: {'; '.join(left)}")
