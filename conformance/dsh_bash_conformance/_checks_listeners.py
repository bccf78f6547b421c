"""Checks of task-done listeners."""

from __future__ import annotations

from collections import Counter

import anyio

from dsh_bash import BashExecRequest, BashExecutor, BashTask, BashTaskId

from ._harness import CheckContext, check
from ._support import SETUP_S, loop, read_to_end, repeat, sh, show_task, wait_task

GRACE_S = 0.3


async def _start(ex: BashExecutor, command: str) -> BashTask:
    return await ex.start(ex.resolve(BashExecRequest(command=command)))


@check(
    "listener-called-once-per-task",
    kind="contract",
    clause="R-listen-once",
    rule="A listener is called exactly once for every background task that ends before `aclose` begins, "
    "after its final fields are set and all its output is readable.",
)
async def called_once(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        calls: list[tuple[BashTaskId, tuple[object, ...]]] = []
        big_done = anyio.Event()
        big_id: list[BashTaskId] = []

        def listener(task: BashTask) -> None:
            calls.append((task.id, (task.status, task.end_cause, task.exit_code, task.signal)))
            if big_id and task.id == big_id[0]:
                big_done.set()

        ex.on_task_done(listener)
        ok = await _start(ex, "exit 0")
        failing = await _start(ex, "exit 5")
        killed = await _start(ex, "while :; do sleep 0.05; done")
        big = await _start(ex, f"sleep 0.2; {repeat('L', 30_000)}")
        big_id.append(big.id)
        await ex.kill(killed.id)
        for task in (ok, failing, killed, big):
            await wait_task(task, GRACE_S + ctx.allowance_s)
        with anyio.move_on_after(ctx.allowance_s):
            await big_done.wait()
        read = await ex.read_output(big.id)
        ctx.expect(
            read.delta == "L" * 30_000,
            f"right after the listener ran, the task's output read as {len(read.delta)} of 30000 characters",
        )
        await anyio.sleep(0.2)
        counts = Counter(task_id for task_id, _ in calls)
        for task in (ok, failing, killed, big):
            ctx.expect(counts[task.id] == 1, f"the listener was called {counts[task.id]} times for {task.id}")
        expected = {
            ok.id: ("completed", "exited", 0, None),
            failing.id: ("completed", "exited", 5, None),
            killed.id: ("killed", "killed", None, "SIGTERM"),
            big.id: ("completed", "exited", 0, None),
        }
        for task_id, fields in calls:
            ctx.expect(
                fields == expected.get(task_id),
                f"the listener saw {task_id} with fields {fields}, not the final {expected.get(task_id)}",
            )


@check(
    "listener-unsubscribe",
    kind="contract",
    clause="R-listen-unsubscribe",
    rule="The callable `on_task_done` returns unsubscribes the listener.",
)
async def unsubscribe(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        a_calls: list[BashTaskId] = []
        b_calls: list[BashTaskId] = []
        unsubscribe_a = ex.on_task_done(lambda task: a_calls.append(task.id))
        unsubscribe_b = ex.on_task_done(lambda task: b_calls.append(task.id))
        unsubscribe_a()
        unsubscribe_a()
        first = await _start(ex, "printf one")
        await wait_task(first, SETUP_S)
        await anyio.sleep(0.1)
        ctx.expect(a_calls == [], f"an unsubscribed listener was called for {a_calls}")
        ctx.expect(b_calls == [first.id], f"the subscribed listener saw {b_calls}, expected [{first.id!r}]")
        unsubscribe_b()
        second = await _start(ex, "printf two")
        await wait_task(second, SETUP_S)
        await anyio.sleep(0.1)
        ctx.expect(b_calls == [first.id], f"a listener unsubscribed later was still called: {b_calls}")


@check(
    "listener-raising-isolated",
    kind="contract",
    clause="R-listen-raising",
    rule="A listener that raises is logged and disturbs nothing else.",
)
async def raising_listener(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        good: list[BashTaskId] = []

        def bad(task: BashTask) -> None:
            raise RuntimeError("a kit listener that always fails")

        ex.on_task_done(bad)
        ex.on_task_done(lambda task: good.append(task.id))
        first = await _start(ex, "printf one")
        await wait_task(first, SETUP_S)
        await anyio.sleep(0.1)
        ctx.expect(good == [first.id], f"after a raising listener, the next listener saw {good}")
        ctx.expect(
            first.status == "completed" and first.exit_code == 0,
            f"a raising listener changed the task: {show_task(first)}",
        )
        delta = await read_to_end(ctx, ex, first.id)
        ctx.expect(delta == "one", f"after a raising listener the task's output read as {delta!r}")
        ok = await sh(ex, "printf ok")
        ctx.expect(ok == "ok", f"after a raising listener, exec printed {ok!r}")
        second = await _start(ex, "exit 2")
        await wait_task(second, SETUP_S)
        await anyio.sleep(0.1)
        ctx.expect(good == [first.id, second.id], f"listeners stopped after one raised: {good}")


@check(
    "listener-silent-after-aclose",
    kind="contract",
    clause="R-listen-silent-after-close",
    rule="No listener is called once `aclose` has begun (for tasks killed by it).",
)
async def silent_after_aclose(ctx: CheckContext) -> None:
    ex = ctx.executor()
    calls: list[BashTaskId] = []
    async with ex:
        ex.on_task_done(lambda task: calls.append(task.id))
        plain = await _start(ex, loop(ctx.marker()))
        stubborn = await _start(ex, loop(ctx.marker(), trap_term=True))
        await anyio.sleep(0.1)
        await ex.aclose()
        for task in (plain, stubborn):
            await wait_task(task, ctx.allowance_s, "a task killed by aclose")
    await anyio.sleep(0.2)
    ctx.expect(calls == [], f"listeners were called after aclose began, for {calls}")
