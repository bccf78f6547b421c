"""Checks of background tasks: start, kill, end causes, wait, ids and owners."""

from __future__ import annotations

import time
from functools import partial

import anyio

from dsh_bash import (
    AbortController,
    BashExecRequest,
    BashExecutor,
    BashInfrastructureError,
    BashTask,
    BashTaskId,
    OwnerToken,
    UnknownTaskError,
)

from ._harness import CheckContext, check
from ._support import (
    SETUP_S,
    elapsed,
    expect_raises,
    gone,
    loop,
    read_to_end,
    repeat,
    show_task,
    started,
    wait_task,
)

GRACE_S = 0.3


async def _start(ex: BashExecutor, command: str, **fields: object) -> BashTask:
    return await ex.start(ex.resolve(BashExecRequest(command=command, **fields)))  # type: ignore[arg-type]


def _final(task: BashTask) -> tuple[object, ...]:
    return (task.status, task.end_cause, task.exit_code, task.signal)


@check(
    "start-returns-while-running",
    kind="contract",
    clause="R-task-start",
    rule="start returns once the command runs, with a live handle whose status is `running` and whose "
    "wait() does not return while it runs.",
)
async def start_returns(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        command = "printf started; while :; do sleep 0.05; done"
        started = time.monotonic()
        task = await _start(ex, command, owner=OwnerToken("kit-owner"))
        took = elapsed(started)
        ctx.expect(
            took < ctx.allowance_s,
            f"start took {took:.2f} s for a command that never ends (bound {ctx.allowance_s:.2f} s)",
        )
        ctx.expect(
            task.status == "running"
            and task.end_cause is None
            and task.exit_code is None
            and task.signal is None,
            f"a just-started task should be running with no end fields: {show_task(task)}",
        )
        ctx.expect(
            task.command == command and task.owner == "kit-owner" and isinstance(task.id, str) and task.id,
            f"the handle does not carry id, command and owner: {task!r}",
        )
        with anyio.move_on_after(0.3):
            await task.wait()
            ctx.fail(f"wait() returned while the task was still running: {show_task(task)}")
        ctx.expect(task.status == "running", f"the looping task is no longer running: {show_task(task)}")
        read = await ex.read_output(task.id)
        ctx.expect(
            read.task is task, f"read_output's task {read.task!r} is not the live handle start returned"
        )


@check(
    "background-has-no-timeout",
    kind="contract",
    clause="R-task-no-timeout",
    rule="No timeout applies to a background task (start ignores `timeout_ms`).",
)
async def background_no_timeout(ctx: CheckContext) -> None:
    async with ctx.executor(timeout_ms=200) as ex:
        started = time.monotonic()
        task = await _start(ex, "sleep 0.6; printf done", timeout_ms=200)
        await wait_task(task, 0.6 + ctx.allowance_s)
        took = elapsed(started)
        ctx.expect(
            _final(task) == ("completed", "exited", 0, None),
            f"a 0.6 s task under a 200 ms timeout should complete normally: {show_task(task)}",
        )
        ctx.expect(took >= 0.55, f"the task ended after {took:.2f} s, before its 0.6 s sleep")
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(delta == "done", f"the task's output is {delta!r}, expected 'done'")


@check(
    "task-timeout-applies",
    kind="contract",
    clause="R-task-timeout",
    rule="A background task's `task_timeout_ms` kills it, its processes too: it ends `killed`, end_cause "
    "`timed_out`, not before the timeout; what it wrote before stays readable.",
)
async def task_timeout_applies(ctx: CheckContext) -> None:
    async with ctx.executor(grace_ms=GRACE_S * 1000) as ex:
        mark = ctx.marker()
        started = time.monotonic()
        task = await _start(ex, f"printf begun; {loop(mark)} & wait", task_timeout_ms=500)
        bound = 0.5 + 2 * GRACE_S + 2 * ctx.allowance_s
        await wait_task(task, bound, "a task under a 500 ms task_timeout_ms")
        took = elapsed(started)
        ctx.expect(
            (task.status, task.end_cause) == ("killed", "timed_out"),
            f"a task its task_timeout_ms ended should be status='killed', end_cause='timed_out': "
            f"{show_task(task)}",
        )
        ctx.expect(took >= 0.45, f"the task ended after {took:.2f} s, before its 500 ms task_timeout_ms")
        await gone(ctx, mark, ctx.allowance_s, "a task its task_timeout_ms ended")
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(delta == "begun", f"the timed-out task's output is {delta!r}, expected 'begun'")


@check(
    "task-cap-refused",
    kind="contract",
    clause="R-task-cap",
    rule="A start beyond `max_running_tasks` running background tasks raises BashInfrastructureError with "
    "reason `task_limit` and starts nothing; once a task ended, a start works again. Foreground runs do "
    "not count.",
)
async def task_cap_refused(ctx: CheckContext) -> None:
    async with ctx.executor(max_running_tasks=2) as ex:
        first = await _start(ex, "while :; do sleep 0.05; done")
        await _start(ex, "while :; do sleep 0.05; done")
        ran = await ex.exec("echo foreground")
        ctx.expect(ran.stdout.text == "foreground\n", f"a foreground run beside the capped tasks: {ran!r}")
        mark = ctx.marker()
        error = await expect_raises(
            BashInfrastructureError, partial(_start, ex, loop(mark)), "a start beyond max_running_tasks = 2"
        )
        ctx.expect(
            getattr(error, "reason", None) == "task_limit" and "max_running_tasks" in str(error),
            f"a start beyond the cap should raise reason 'task_limit' naming max_running_tasks: {error!r}",
        )
        await anyio.sleep(0.2)
        started = await ctx.processes(mark)
        ctx.expect(not started, f"the refused start ran its command anyway: {started}")
        await ex.kill(first.id)
        await wait_task(first, 2 * GRACE_S + ctx.allowance_s, "a killed task")
        third = await _start(ex, "echo again")
        await wait_task(third, ctx.allowance_s, "a start after a task ended")
        ctx.expect(
            _final(third) == ("completed", "exited", 0, None), f"a start after one ended: {show_task(third)}"
        )


@check(
    "kill-running-task",
    kind="contract",
    clause="R-task-kill-running",
    rule="kill returns True for a running task; the kill sequence starts and the call returns without "
    "waiting; the task ends `killed`.",
)
async def kill_running(ctx: CheckContext) -> None:
    # A kill that waits for the end takes a whole grace for the TERM-ignoring task: four allowances
    # (at least 1 s), while a kill that does not wait returns within one.
    allow = ctx.allowance_s
    grace_s = max(1.0, 4 * allow)
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        stubborn = await _start(ex, "trap '' TERM; while :; do sleep 0.05; done")
        plain = await _start(ex, "while :; do sleep 0.05; done")
        await anyio.sleep(0.2)
        started = time.monotonic()
        result = await ex.kill(stubborn.id)
        took = elapsed(started)
        ctx.expect(result is True, f"kill of a running task returned {result!r}, expected True")
        ctx.expect(
            took < allow,
            f"kill took {took:.2f} s (bound {allow:.2f} s, grace {grace_s:.2f} s) for a TERM-ignoring task: "
            "it waited for the kill sequence",
        )
        ctx.expect(await ex.kill(plain.id) is True, "kill of a running task did not return True")
        await wait_task(stubborn, grace_s + ctx.allowance_s, "a killed TERM-ignoring task")
        await wait_task(plain, ctx.allowance_s, "a killed task")
        ctx.expect(
            _final(stubborn) == ("killed", "killed", None, "SIGKILL"),
            f"a killed TERM-ignoring task should end killed/killed by SIGKILL: {show_task(stubborn)}",
        )
        ctx.expect(
            _final(plain) == ("killed", "killed", None, "SIGTERM"),
            f"a killed task should end killed/killed by SIGTERM: {show_task(plain)}",
        )


@check(
    "kill-ended-task-kills-leftovers",
    kind="contract",
    clause="R-task-kill-ended",
    rule="kill returns False if the task had already ended; its leftover processes (a `server &` its "
    "shell left behind) are still sent the kill sequence.",
)
async def kill_ended(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        mark = ctx.marker()
        task = await _start(ex, f"{loop(mark, trap_term=True)} >/dev/null 2>&1 & printf started")
        await wait_task(task, SETUP_S)
        ctx.expect(
            _final(task) == ("completed", "exited", 0, None),
            f"the task should have completed with exit 0: {show_task(task)}",
        )
        await started(ctx, mark, "the server the task left behind")
        result = await ex.kill(task.id)
        ctx.expect(result is False, f"kill of an ended task returned {result!r}, expected False")
        ctx.expect(
            _final(task) == ("completed", "exited", 0, None),
            f"kill changed an ended task's fields: {show_task(task)}",
        )
        await gone(
            ctx, mark, GRACE_S + ctx.allowance_s, "after kill of the ended task, its TERM-ignoring leftover"
        )


@check(
    "unknown-task-id",
    kind="contract",
    clause="R-task-unknown-id",
    rule="read_output and kill raise UnknownTaskError (a LookupError) for an id this executor never started.",
)
async def unknown_task(ctx: CheckContext) -> None:
    async with ctx.executor() as ex, ctx.executor() as other:
        task = await _start(other, "printf x")
        await wait_task(task, ctx.allowance_s)
        for task_id in (BashTaskId("kit-no-such-task"), task.id):
            for name, method in (("read_output", ex.read_output), ("kill", ex.kill)):
                error = await expect_raises(
                    UnknownTaskError, partial(method, task_id), f"{name}({task_id!r}) of an unknown id"
                )
                ctx.expect(
                    isinstance(error, LookupError), f"UnknownTaskError is not a LookupError: {error!r}"
                )


@check(
    "end-cause-exited",
    kind="contract",
    clause="R-task-end-cause",
    rule="A task that ends by itself is `completed` with end_cause `exited` and its exit code.",
)
async def end_exited(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start(ex, "printf x; exit 4")
        await wait_task(task, ctx.allowance_s)
        ctx.expect(
            _final(task) == ("completed", "exited", 4, None),
            f"`exit 4` should end completed/exited with exit_code 4: {show_task(task)}",
        )


@check(
    "end-cause-signaled",
    kind="contract",
    clause="R-task-end-cause",
    rule="A task that died of a signal nobody here sent is `completed`, end_cause `signaled`, with "
    "`signal` set and exit_code None.",
)
async def end_signaled(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        for name in ("TERM", "KILL"):
            task = await _start(ex, f"kill -{name} $$")
            await wait_task(task, ctx.allowance_s)
            expected = [("completed", "signaled", None, f"SIG{name}")]
            ctx.expect(
                _final(task) in expected,
                f"`kill -{name} $$` should end as (status, end_cause, exit_code, signal) = {expected}: "
                f"{show_task(task)}",
            )


@check(
    "end-cause-aborted",
    kind="contract",
    clause="R-task-end-cause",
    rule="A task ended by its spec's signal is `killed` with end_cause `aborted`.",
)
async def end_aborted(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        mark = ctx.marker()
        controller = AbortController()
        task = await _start(ex, f"{loop(mark)} & wait", signal=controller.signal)
        await anyio.sleep(0.2)
        ctx.expect(task.status == "running", f"the task ended before the abort: {show_task(task)}")
        controller.abort("kit")
        await wait_task(task, GRACE_S + ctx.allowance_s, "an aborted task")
        ctx.expect(
            _final(task) == ("killed", "aborted", None, "SIGTERM"),
            f"an aborted task should end killed/aborted by SIGTERM: {show_task(task)}",
        )
        await gone(ctx, mark, 0.5, "after the abort, the task's child")


@check(
    "end-cause-closed",
    kind="contract",
    clause="R-task-end-cause",
    rule="A task still running at `aclose` is killed with end_cause `closed`, and its wait() returns.",
)
async def end_closed(ctx: CheckContext) -> None:
    ex = ctx.executor()
    async with ex:
        plain = await _start(ex, "while :; do sleep 0.05; done")
        stubborn = await _start(ex, "trap '' TERM; while :; do sleep 0.05; done")
        await anyio.sleep(0.1)
        await ex.aclose()
        for task in (plain, stubborn):
            await wait_task(task, ctx.allowance_s, "a task killed by aclose")
            ctx.expect(
                task.status == "killed" and task.end_cause == "closed",
                f"a task killed by aclose should end killed/closed: {show_task(task)}",
            )


@check(
    "wait-final-and-never-raises",
    kind="contract",
    clause="R-task-final-before-wait",
    rule="Status, exit code, signal and end cause are final, and all output is readable, before wait() "
    "returns; wait() never raises.",
)
async def wait_final(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        task = await _start(ex, f"sleep 0.2; {repeat('a', 20_000)}; exit 6")
        seen: list[tuple[object, ...]] = []

        async def waiter() -> None:
            await task.wait()
            seen.append(_final(task))

        bound = 0.2 + ctx.allowance_s
        with anyio.move_on_after(bound):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(waiter)
        ctx.expect(len(seen) == 3, f"only {len(seen)} of 3 concurrent waiters returned within {bound:.2f} s")
        ctx.expect(
            all(s == ("completed", "exited", 6, None) for s in seen),
            f"waiters saw non-final fields when wait() returned: {seen}",
        )
        read = await ex.read_output(task.id)
        ctx.expect(
            read.delta == "a" * 20_000,
            f"right after wait(), the read delivered {len(read.delta)} characters, not all 20000",
        )
        started = time.monotonic()
        await wait_task(task, ctx.allowance_s, "wait() on an ended task")
        ctx.expect(
            elapsed(started) < ctx.allowance_s,
            f"wait() on an ended task did not return at once (bound {ctx.allowance_s:.2f} s)",
        )
        killed = await _start(ex, "while :; do sleep 0.05; done")
        await ex.kill(killed.id)
        await wait_task(killed, GRACE_S + ctx.allowance_s, "wait() on a killed task")
        ctx.expect(killed.end_cause == "killed", f"a killed task's end fields: {show_task(killed)}")


@check(
    "task-ids-distinct",
    kind="contract",
    clause="R-task-ids",
    rule="Each background task has its own id.",
)
async def ids_distinct(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tasks: list[BashTask] = []

        async def one() -> None:
            tasks.append(await _start(ex, "printf x"))

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
        tasks.append(await _start(ex, "printf y"))
        ids = [t.id for t in tasks]
        ctx.expect(len(set(ids)) == len(ids), f"task ids repeat: {ids}")
        for task in tasks:
            await wait_task(task, ctx.allowance_s)


@check(
    "owner-of",
    kind="contract",
    clause="R-task-owner",
    rule="owner_of returns the token stored at `start`, verbatim; None for an unknown id and for an "
    "ownerless task.",
)
async def owner_of(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        token = OwnerToken("  Session/42 ünï\tcode  ")
        owned = await _start(ex, "printf x", owner=token)
        ownerless = await _start(ex, "printf y")
        got = ex.owner_of(owned.id)
        ctx.expect(got == token, f"owner_of returned {got!r}, not the stored token {token!r}")
        ctx.expect(owned.owner == token, f"the task's owner is {owned.owner!r}, not {token!r}")
        ctx.expect(
            ex.owner_of(ownerless.id) is None, f"an ownerless task's owner is {ex.owner_of(ownerless.id)!r}"
        )
        unknown = ex.owner_of(BashTaskId("kit-no-such-task"))
        ctx.expect(unknown is None, f"owner_of an unknown id returned {unknown!r}")
        await wait_task(owned, ctx.allowance_s)
        ctx.expect(ex.owner_of(owned.id) == token, "owner_of changed once the task ended")
