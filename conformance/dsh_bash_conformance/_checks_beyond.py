"""Beyond the surveyed tools: processes that left the command's session are killed too."""

from __future__ import annotations

import anyio

from dsh_bash import AbortController, BashExecRequest

from ._harness import CheckContext, check
from ._support import SETUP_S, alive, escapee, gone, show, touch, wait_files, wait_task

GRACE_S = 0.3
_LOOP = "while :; do sleep 0.05; done"
_RULE = "Processes that left the group (`setsid`, double fork) are found and killed too, on {}."


@check("escapee-killed-on-kill", kind="beyond", clause="R-contain-escapees", rule=_RULE.format("kill"))
async def escapee_on_kill(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        mark = ctx.marker()
        ready = f"{tmp}/ready"
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"{escapee(mark, prelude=touch(ready))} {_LOOP}"))
        )
        await wait_files(ex, [ready])
        ctx.expect(await ex.kill(task.id) is True, "kill of a running task did not return True")
        await wait_task(task, GRACE_S + ctx.allowance_s, "killed task")
        await gone(
            ctx, mark, GRACE_S + ctx.allowance_s, "after kill, a process that left the session with setsid"
        )


@check("escapee-killed-on-timeout", kind="beyond", clause="R-contain-escapees", rule=_RULE.format("timeout"))
async def escapee_on_timeout(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        mark = ctx.marker()
        ready = f"{tmp}/ready"
        result = await ex.exec(f"{escapee(mark, prelude=touch(ready))} {_LOOP}", timeout_ms=400)
        ctx.expect(result.timed_out, f"the command was not timed out: {show(result)}")
        await wait_files(ex, [ready], within_s=ctx.allowance_s)
        await gone(
            ctx,
            mark,
            GRACE_S + ctx.allowance_s,
            "after the timeout, a process that left the session with setsid",
        )


@check("escapee-killed-on-abort", kind="beyond", clause="R-contain-escapees", rule=_RULE.format("abort"))
async def escapee_on_abort(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        mark = ctx.marker()
        ready = f"{tmp}/ready"
        controller = AbortController()

        async def abort_when_ready() -> None:
            await wait_files(ex, [ready])
            await anyio.sleep(0.05)
            controller.abort("kit")

        async with anyio.create_task_group() as tg:
            tg.start_soon(abort_when_ready)
            result = await ex.exec(f"{escapee(mark, prelude=touch(ready))} {_LOOP}", signal=controller.signal)
        ctx.expect(result.aborted, f"the command was not aborted: {show(result)}")
        await gone(
            ctx,
            mark,
            GRACE_S + ctx.allowance_s,
            "after the abort, a process that left the session with setsid",
        )


@check("escapee-killed-on-aclose", kind="beyond", clause="R-contain-escapees", rule=_RULE.format("aclose"))
async def escapee_on_aclose(ctx: CheckContext) -> None:
    ex = ctx.executor()
    async with ex:
        tmp = await ctx.tempdir(ex)
        fg, bg = ctx.marker(), ctx.marker()
        a, b = f"{tmp}/a", f"{tmp}/b"
        # A finished background task's: a foreground run's escapee is killed when the run ends.
        finished = await ex.start(
            ex.resolve(BashExecRequest(command=f"{escapee(fg, prelude=touch(a))} echo started"))
        )
        await wait_task(finished, SETUP_S, "a task that leaves an escapee")
        task = await ex.start(ex.resolve(BashExecRequest(command=f"{escapee(bg, prelude=touch(b))} {_LOOP}")))
        await wait_files(ex, [a, b])
        await alive(ctx, fg, "the escapee of a finished task")
        await ex.aclose()
        await wait_task(task, ctx.allowance_s, "a task running at aclose")
    await gone(ctx, fg, 0.5, "after aclose, an escapee of a finished task")
    await gone(ctx, bg, 0.5, "after aclose, an escapee of a running task")
