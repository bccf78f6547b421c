"""Checks of foreground outcomes: exit codes, timeouts, aborts, cancellation, resolve."""

from __future__ import annotations

import inspect
import posixpath
import shlex
import time
from functools import partial

import anyio

from dsh_bash import (
    AbortController,
    BashExecRequest,
    BashExecSpec,
    BashExecutor,
    BashInfrastructureError,
    BashRunResult,
    ExecutorClosedError,
    OwnerToken,
)

from ._harness import CheckContext, CheckFailed, check
from ._support import (
    elapsed,
    expect_raises,
    loop,
    marked_flags,
    sh,
    show,
    spawn,
    touch,
    wait_files,
    within,
)

GRACE_S = 0.3  # the kit's default grace_ms, in seconds


async def _abort_after(controller: AbortController, delay_s: float) -> None:
    await anyio.sleep(delay_s)
    controller.abort("kit")


@check(
    "exit-code-reported",
    kind="contract",
    clause="R-outcome-exit",
    rule="A non-zero exit returns a result; `signal` names the terminating signal and then `exit_code` is "
    "None, and a plain exit code above 128 is reported as it is.",
)
async def exit_code_reported(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        for code in (3, 0, 143):
            result = await ex.exec(f"exit {code}")
            ctx.expect(
                result.exit_code == code
                and result.signal is None
                and not result.timed_out
                and not result.aborted,
                f"`exit {code}` should report exit_code={code}, signal=None, no flags; got {show(result)}",
            )


@check(
    "timeout-classified",
    kind="contract",
    clause="R-outcome-timeout",
    rule="`timed_out` is true only when the executor's own timeout killed the command; the result "
    "carries the effective `timeout_ms` and the output produced before the kill.",
)
async def timeout_classified(ctx: CheckContext) -> None:
    async with ctx.executor(timeout_ms=300) as ex:
        mark = ctx.marker()
        started = time.monotonic()
        result = await ex.exec(f"printf 'before\\n'; {loop(mark)}")
        took = elapsed(started)
        ctx.expect(
            result.timed_out, f"a looping command under a 300 ms timeout was not timed out: {show(result)}"
        )
        ctx.expect(not result.aborted, f"a timeout kill reported aborted=True: {show(result)}")
        ctx.expect(
            result.signal == "SIGTERM" and result.exit_code is None,
            f"the timed-out shell died of SIGTERM; expected signal='SIGTERM', exit_code=None: {show(result)}",
        )
        ctx.expect(
            result.timeout_ms == 300, f"timeout_ms should be the effective 300, got {result.timeout_ms!r}"
        )
        ctx.expect(
            result.stdout.text == "before\n",
            f"output printed before the timeout was lost: stdout={result.stdout.text!r}",
        )
        ctx.expect(
            result.stderr.text == "" and result.stderr.total_bytes == 0,
            "stderr must carry only what the command wrote (nothing here), not a wrapper's notice of "
            f"the kill: stderr={result.stderr.text!r}",
        )
        ctx.expect(took >= 0.28, f"the command was killed after {took:.3f} s, before its 300 ms timeout")
        bound = 0.3 + 2 * GRACE_S + ctx.allowance_s
        ctx.expect(took <= bound, f"the timed-out run returned after {took:.2f} s (bound {bound:.2f} s)")
        survivors = await ctx.wait_gone(mark, 0.5)
        ctx.expect(not survivors, f"processes of the timed-out command survive: {survivors}")


@check(
    "timeout-clamped-to-max",
    kind="contract",
    clause="R-run-timeout-clamp",
    rule="resolve fills `timeout_ms` from config and clamps it to `max_timeout_ms`; the run is killed at "
    "the clamped timeout and reports it.",
)
async def timeout_clamped(ctx: CheckContext) -> None:
    async with ctx.executor(max_timeout_ms=400) as ex:
        mark = ctx.marker()
        started = time.monotonic()
        bound = 0.4 + 2 * GRACE_S + ctx.allowance_s
        # Bounded: an unclamped 60 s timeout must fail here, not hang the check.
        result = await within(
            ex.exec(loop(mark), timeout_ms=60_000), bound + ctx.allowance_s, "a run that should be clamped"
        )
        took = elapsed(started)
        ctx.expect(
            result.timed_out, f"a 60 s request under max_timeout_ms=400 was not timed out: {show(result)}"
        )
        ctx.expect(
            result.timeout_ms == 400, f"timeout_ms should be the clamped 400, got {result.timeout_ms!r}"
        )
        ctx.expect(
            0.38 <= took <= bound, f"the clamped run returned after {took:.2f} s (expected 0.4..{bound:.1f})"
        )


@check(
    "abort-classified",
    kind="contract",
    clause="R-outcome-abort",
    rule="`aborted` is true only when the spec's signal killed the command.",
)
async def abort_classified(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        mark = ctx.marker()
        controller = AbortController()
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_abort_after, controller, 0.3)
            result = await ex.exec(loop(mark), signal=controller.signal)
        took = elapsed(started)
        ctx.expect(
            result.aborted and not result.timed_out,
            f"an aborted run should report aborted=True, timed_out=False: {show(result)}",
        )
        ctx.expect(
            result.signal == "SIGTERM" and result.exit_code is None,
            f"the aborted shell died of SIGTERM; expected signal='SIGTERM', exit_code=None: {show(result)}",
        )
        ctx.expect(result.timeout_ms == 10_000, f"timeout_ms should be 10000, got {result.timeout_ms!r}")
        bound = 0.3 + 2 * GRACE_S + ctx.allowance_s
        ctx.expect(0.28 <= took <= bound, f"the aborted run returned after {took:.2f} s (abort at 0.3 s)")
        survivors = await ctx.wait_gone(mark, 0.5)
        ctx.expect(not survivors, f"processes of the aborted command survive: {survivors}")


@check(
    "abort-then-timeout-first-cause-wins",
    kind="contract",
    clause="R-outcome-first-cause",
    rule="Never both `timed_out` and `aborted`: the first cause wins (an abort, then the timeout expiring "
    "during the kill's grace).",
)
async def abort_then_timeout(ctx: CheckContext) -> None:
    # The abort comes once the shell and its child ignore SIGTERM (a ready file says so: aborted
    # earlier, a slow start would end the shell by SIGTERM), well before the timeout; the abort's kill
    # lasts a whole grace, which outlasts the timeout, so the timeout surely expires during it.
    allow = ctx.allowance_s
    timeout_s = 1.0 + allow
    grace_s = timeout_s + 2 * allow
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        mark = ctx.marker()
        ready = f"{await ctx.tempdir(ex)}/ready"
        controller = AbortController()

        async def abort_when_ready() -> None:
            await wait_files(ex, [ready], within_s=timeout_s)
            controller.abort("kit")

        async with anyio.create_task_group() as tg:
            tg.start_soon(abort_when_ready)
            result = await ex.exec(
                f'trap "" TERM; {loop(mark, trap_term=True, prelude=f": > {shlex.quote(ready)}")}',
                signal=controller.signal,
                timeout_ms=timeout_s * 1000,
            )
        ctx.expect(
            result.aborted and not result.timed_out,
            f"abort came first (once the shell ignored SIGTERM), timeout later ({timeout_s:.2f} s, grace "
            f"{grace_s:.2f} s): expected aborted only; got {show(result)}",
        )
        ctx.expect(
            result.signal == "SIGKILL" and result.exit_code is None,
            f"a TERM-ignoring shell ends by SIGKILL after the grace: {show(result)}",
        )


@check(
    "timeout-then-abort-first-cause-wins",
    kind="contract",
    clause="R-outcome-first-cause",
    rule="Never both `timed_out` and `aborted`: the first cause wins (the timeout, then an abort during "
    "the kill's grace).",
)
async def timeout_then_abort(ctx: CheckContext) -> None:
    # The timeout expires by 0.2 s + allowance; the abort is asked for then and lands by 0.2 s + twice
    # the allowance, during the timeout's kill, whose grace (three allowances) outlasts that.
    allow = ctx.allowance_s
    timeout_s, abort_s, grace_s = 0.2, 0.2 + allow, 3 * allow
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        mark = ctx.marker()
        controller = AbortController()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_abort_after, controller, abort_s)
            result = await ex.exec(
                f'trap "" TERM; {loop(mark, trap_term=True)}',
                signal=controller.signal,
                timeout_ms=timeout_s * 1000,
            )
        ctx.expect(
            result.timed_out and not result.aborted,
            f"timeout came first ({timeout_s:g} s), abort during the grace ({abort_s:.2f} s, grace "
            f"{grace_s:.2f} s): expected timed_out only; got {show(result)}",
        )
        ctx.expect(
            result.signal == "SIGKILL" and result.exit_code is None,
            f"a TERM-ignoring shell ends by SIGKILL after the grace: {show(result)}",
        )


@check(
    "self-signal-reports-neither",
    kind="contract",
    clause="R-outcome-self-signal",
    rule="A command that kills itself reports neither flag; `signal` names the signal and `exit_code` "
    "is None.",
)
async def self_signal(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        for name in ("TERM", "KILL"):
            result = await ex.exec(f"kill -{name} $$")
            expected = [(f"SIG{name}", None)]
            ctx.expect(
                (result.signal, result.exit_code) in expected and not result.timed_out and not result.aborted,
                f"`kill -{name} $$` should report (signal, exit_code) in {expected}: {show(result)}",
            )


@check(
    "trapped-term-exit-zero-still-timed-out",
    kind="contract",
    clause="R-outcome-timeout",
    rule="`timed_out` is true when the executor's timeout killed the command, even if the command "
    "trapped SIGTERM and exited 0.",
)
async def trapped_term_exit_zero(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        result = await ex.exec("trap 'exit 0' TERM; while :; do sleep 0.05; done", timeout_ms=300)
        ctx.expect(
            result.timed_out and not result.aborted and result.exit_code == 0 and result.signal is None,
            f"expected timed_out=True, exit_code=0, signal=None for a TERM trap that exits 0: {show(result)}",
        )


@check(
    "resolve-fills-and-carries",
    kind="contract",
    clause="R-run-resolve",
    rule="resolve is synchronous; it fills `workdir` from config (joining a relative one to the cwd), "
    "fills `timeout_ms` and clamps it to `max_timeout_ms`, and carries owner, signal, stdin, env and "
    "open_stdin.",
)
async def resolve_fills(ctx: CheckContext) -> None:
    base = "/kit-base/cwd"
    async with ctx.executor(cwd=base, timeout_ms=1234, max_timeout_ms=5000) as ex:
        ctx.expect(
            not inspect.iscoroutinefunction(ex.resolve), "resolve must be a plain (synchronous) method"
        )
        spec = ex.resolve(BashExecRequest(command="echo hi"))
        ctx.expect(
            isinstance(spec, BashExecSpec), f"resolve returned {type(spec).__name__}, not a BashExecSpec"
        )
        ctx.expect(
            spec.command == "echo hi" and spec.workdir == base and spec.timeout_ms == 1234,
            f"defaults not filled from config: workdir={spec.workdir!r} (want {base!r}), "
            f"timeout_ms={spec.timeout_ms!r} (want 1234)",
        )
        ctx.expect(
            spec.owner is None and spec.signal is None and spec.stdin is None and spec.env is None,
            f"a bare request should resolve to no owner/signal/stdin/env: {spec!r}",
        )
        rel = ex.resolve(BashExecRequest(command="true", workdir="sub/dir"))
        ctx.expect(
            posixpath.normpath(rel.workdir) == f"{base}/sub/dir",
            f"relative workdir 'sub/dir' should join the cwd {base!r}, got {rel.workdir!r}",
        )
        absolute = ex.resolve(BashExecRequest(command="true", workdir="/elsewhere/x"))
        ctx.expect(absolute.workdir == "/elsewhere/x", f"absolute workdir changed to {absolute.workdir!r}")
        high = ex.resolve(BashExecRequest(command="true", timeout_ms=99_999))
        ctx.expect(high.timeout_ms == 5000, f"timeout 99999 should clamp to 5000, got {high.timeout_ms!r}")
        low = ex.resolve(BashExecRequest(command="true", timeout_ms=150))
        ctx.expect(low.timeout_ms == 150, f"timeout 150 should stay 150, got {low.timeout_ms!r}")
        controller = AbortController()
        owner = OwnerToken("Owner ⚑ token/42 ")
        env = {"KIT_A": "1", "KIT_B": "two words"}
        full = ex.resolve(
            BashExecRequest(command="true", owner=owner, signal=controller.signal, stdin=b"\x00in", env=env)
        )
        ctx.expect(full.owner == owner, f"owner not carried verbatim: {full.owner!r}")
        ctx.expect(
            full.signal is controller.signal, "the request's AbortSignal was not carried as the same object"
        )
        ctx.expect(full.stdin == b"\x00in", f"stdin bytes not carried: {full.stdin!r}")
        ctx.expect(dict(full.env or {}) == env, f"env not carried: {full.env!r}")
        text = ex.resolve(BashExecRequest(command="true", stdin="text in"))
        ctx.expect(text.stdin == "text in", f"stdin text not carried: {text.stdin!r}")
        ctx.expect(spec.open_stdin is False, f"a bare request should resolve to open_stdin=False: {spec!r}")
        held = ex.resolve(BashExecRequest(command="cat", open_stdin=True))
        ctx.expect(held.open_stdin is True, f"open_stdin not carried: {held!r}")


@check(
    "workdir-and-cwd-used",
    kind="contract",
    clause="R-run-workdir",
    rule="The command runs in the resolved workdir: the configured cwd by default, a relative workdir "
    "joined to it, an absolute one as given.",
)
async def workdir_used(ctx: CheckContext) -> None:
    async with ctx.executor() as plain:
        default_dir = plain.resolve(BashExecRequest(command="true")).workdir
        ctx.expect(posixpath.isabs(default_dir), f"the default workdir {default_dir!r} is not absolute")
        want = await sh(plain, 'cd "$KIT_DIR" && pwd -P', env={"KIT_DIR": default_dir})
        got = await sh(plain, "pwd -P")
        ctx.expect(got == want, f"without a workdir the command ran in {got!r}, not the default {want!r}")
    async with ctx.executor(cwd="/") as ex:
        got = await sh(ex, "pwd -P")
        ctx.expect(got == "/\n", f"with cwd='/' the command ran in {got!r}")
        tmp = await ctx.tempdir(ex)
        await sh(ex, f"mkdir '{tmp}/sub'")
        real = (await sh(ex, f"cd '{tmp}/sub' && pwd -P")).strip()
        got = await sh(ex, "pwd -P", workdir=f"{tmp}/sub".lstrip("/"))
        ctx.expect(got == real + "\n", f"relative workdir {tmp.lstrip('/')}/sub ran in {got!r}, not {real!r}")
        got = await sh(ex, "pwd -P", workdir=f"{tmp}/sub")
        ctx.expect(got == real + "\n", f"absolute workdir {tmp}/sub ran in {got!r}, not {real!r}")
        odd = f"{tmp}/sub dir é'$x"
        await sh(ex, 'mkdir "$KIT_DIR"', env={"KIT_DIR": odd})
        real = (await sh(ex, 'cd "$KIT_DIR" && pwd -P', env={"KIT_DIR": odd})).strip()
        got = await sh(ex, "pwd -P", workdir=odd)
        ctx.expect(got == real + "\n", f"workdir {odd!r} ran in {got!r}, not {real!r}")


@check(
    "pre-aborted-signal-refused",
    kind="contract",
    clause="R-run-refuse-aborted",
    rule="run and start raise BashInfrastructureError when the spec's signal is already aborted, and "
    "nothing runs.",
)
async def pre_aborted(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        controller = AbortController()
        controller.abort("before")
        run_spec = ex.resolve(BashExecRequest(command=f"printf x > '{tmp}/ran'", signal=controller.signal))
        await expect_raises(BashInfrastructureError, partial(ex.run, run_spec), "run with an aborted signal")
        start_spec = ex.resolve(
            BashExecRequest(command=f"printf x > '{tmp}/started'", signal=controller.signal)
        )
        await expect_raises(
            BashInfrastructureError, partial(ex.start, start_spec), "start with an aborted signal"
        )
        await anyio.sleep(0.2)
        listing = await sh(ex, f"ls -A '{tmp}'")
        ctx.expect(
            listing == "", f"a command with an already-aborted signal ran anyway: {tmp} holds {listing!r}"
        )


@check(
    "unusable-workdir-refused",
    kind="contract",
    clause="R-run-refuse-unstartable",
    rule="run and start raise BashInfrastructureError when the command could not be started: a missing "
    "workdir, or one that is a file.",
)
async def unusable_workdir(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        await sh(ex, f": > '{tmp}/afile'")
        for workdir, what in (
            (f"{tmp}/missing", "a missing workdir"),
            (f"{tmp}/afile", "a workdir that is a file"),
        ):
            spec = ex.resolve(BashExecRequest(command="echo ran", workdir=workdir))
            await expect_raises(BashInfrastructureError, partial(ex.run, spec), f"run with {what}")
            await expect_raises(BashInfrastructureError, partial(ex.start, spec), f"start with {what}")
        ok = await sh(ex, "printf ok")
        ctx.expect(ok == "ok", f"the executor no longer works after refused workdirs: {ok!r}")


@check(
    "command-user",
    kind="contract",
    clause="R-run-user",
    rule="A spec's `user` that names the user commands run as runs the command as that user; one that "
    "does not exist where commands run is refused by run and start (BashInfrastructureError, reason "
    "`user_unknown` or `user_unsupported`), and nothing runs.",
)
async def command_user(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        # A uid with no passwd entry has no name: then the uid is the user.
        who = 'if n=$(id -un 2>/dev/null); then echo "$n"; else id -u; fi'
        me = (await sh(ex, who)).strip()
        try:
            got = (await sh(ex, who, user=me)).strip()
        except BashInfrastructureError as exc:
            raise CheckFailed(
                f"a command with user={me!r}, the user commands run as, was refused: {exc!r}"
            ) from None
        ctx.expect(got == me, f"a command with user={me!r} (the user commands run as) ran as {got!r}")
        missing = "dsh-bash-kit-no-such-user"
        for verb, call in (("run", ex.run), ("start", ex.start)):
            spec = ex.resolve(BashExecRequest(command=f": > '{tmp}/ran-{verb}'", user=missing))
            error = await expect_raises(
                BashInfrastructureError, partial(call, spec), f"{verb} with user={missing!r}"
            )
            reason = getattr(error, "reason", None)
            ctx.expect(
                reason in ("user_unknown", "user_unsupported"),
                f"{verb} with user={missing!r}: reason {reason!r}, expected 'user_unknown' or "
                f"'user_unsupported' ({error})",
            )
        await anyio.sleep(0.2)  # a start that went ahead anyway has had time to write its file
        left = await sh(ex, f"ls -A '{tmp}'")
        ctx.expect(left.strip() == "", f"a refused user's command ran anyway: {left.split()}")


@check(
    "infra-error-reasons",
    kind="contract",
    clause="R-error-reason",
    rule="Every BashInfrastructureError carries the reason that says why: `workdir_missing`, "
    "`workdir_not_directory`, `already_aborted`, `closed`, where the kit can provoke them.",
)
async def infra_error_reasons(ctx: CheckContext) -> None:
    aborted = AbortController()
    aborted.abort("kit")
    ex = ctx.executor()
    async with ex:
        tmp = await ctx.tempdir(ex)
        await sh(ex, f": > '{tmp}/afile'")
        cases = (
            (
                BashExecRequest(command="echo ran", workdir=f"{tmp}/missing"),
                "workdir_missing",
                "a missing workdir",
            ),
            (
                BashExecRequest(command="echo ran", workdir=f"{tmp}/afile"),
                "workdir_not_directory",
                "a file as workdir",
            ),
            (
                BashExecRequest(command="echo ran", signal=aborted.signal),
                "already_aborted",
                "an aborted signal",
            ),
        )
        for request, reason, what in cases:
            spec = ex.resolve(request)
            for verb, call in (("run", ex.run), ("start", ex.start)):
                error = await expect_raises(
                    BashInfrastructureError, partial(call, spec), f"{verb} with {what}"
                )
                got = getattr(error, "reason", None)
                ctx.expect(
                    got == reason, f"{verb} with {what}: reason {got!r}, expected {reason!r} ({error})"
                )
    closed = await expect_raises(ExecutorClosedError, partial(ex.exec, "true"), "exec after aclose")
    got = getattr(closed, "reason", None)
    ctx.expect(got == "closed", f"exec after aclose: reason {got!r}, expected 'closed' ({closed})")


async def _cancel_run(
    ctx: CheckContext,
    ex: BashExecutor,
    command: str,
    *,
    ready: list[str],
    mark: str,
    grace_s: float,
    what: str,
) -> None:
    """Cancel the task awaiting ``run`` once ``ready`` exist; the processes must be gone right after."""
    scope = anyio.CancelScope()
    outcome: dict[str, object] = {}
    done = anyio.Event()

    async def runner() -> None:
        try:
            with scope:
                outcome["result"] = await ex.exec(command)
            outcome["propagated"] = scope.cancelled_caught
        except Exception as exc:
            outcome["error"] = exc
        finally:
            done.set()

    bound = 2 * grace_s + ctx.allowance_s
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner)
        await wait_files(ex, ready)
        await anyio.sleep(0.05)
        scope.cancel()
        with anyio.move_on_after(bound):
            await done.wait()
    ctx.expect(done.is_set(), f"{what}: run did not return within {bound:g} s of its cancellation")
    ctx.expect("error" not in outcome, f"{what}: the cancelled run raised {outcome.get('error')!r}")
    ctx.expect(
        outcome.get("propagated") is True,
        f"{what}: the cancellation did not propagate out of run (it returned {outcome.get('result')!r})",
    )
    survivors = await ctx.wait_gone(mark, 0.25)
    ctx.expect(
        not survivors, f"{what}: right after the cancellation propagated, processes {survivors} lived on"
    )


@check(
    "cancel-kills-before-propagating",
    kind="contract",
    clause="R-run-cancel",
    rule="If the awaiting task is cancelled, the command's processes are killed before the cancellation "
    "propagates.",
)
async def cancel_kills(ctx: CheckContext) -> None:
    # A grace of at least a second, as in aclose-during-run-raises-closed: killing a child that traps
    # SIGTERM costs the backend's own signals and looks (on Docker an exec each) on top of the grace,
    # and that cost grows with the machine's load.
    grace_s = max(1.0, ctx.allowance_s)
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        mark, (a, b) = await marked_flags(ctx, ex, 2)
        command = f"{loop(mark, prelude=touch(a))} & {loop(mark, trap_term=True, prelude=touch(b))} & wait"
        await _cancel_run(
            ctx, ex, command, ready=[a, b], mark=mark, grace_s=grace_s, what="a running command"
        )
    # Cancelled while the result waits (a long grace) for what the shell left: a child that holds the
    # output pipe and traps SIGTERM, so that killing it (R-proc-foreground-leftovers) or draining it
    # (with foreground_leftovers = "keep") takes the grace.
    grace_s = 2.0
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        tmp = await ctx.tempdir(ex)
        mark = ctx.marker()
        c = f"{tmp}/c"
        # The shell exits only once the child runs (and traps SIGTERM): a kill of what it left must
        # not come before the trap.
        command = (
            f"{loop(mark, trap_term=True, prelude=touch(c))} & until [ -e {c} ]; do sleep 0.02; done; echo hi"
        )
        await _cancel_run(
            ctx, ex, command, ready=[c], mark=mark, grace_s=grace_s, what="a command whose shell has exited"
        )


@check(
    "cancel-at-any-moment-leaves-nothing",
    kind="contract",
    clause="R-run-cancel",
    rule="If the awaiting task is cancelled, the command's processes are killed before the cancellation "
    "propagates, also when it comes while the command is being started.",
)
async def cancel_any_moment(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        for delay_ms in (0, 1, 2, 3, 5, 8, 12, 20, 30, 50, 80):
            mark = ctx.marker()
            with anyio.move_on_after(delay_ms / 1000) as scope:
                result = await ex.exec(f"{loop(mark)} & {loop(mark)} & wait")
                ctx.fail(f"a looping command returned {show(result)}")
            ctx.expect(scope.cancelled_caught, f"the cancellation after {delay_ms} ms did not propagate")
            survivors = await ctx.wait_gone(mark, 0.25)
            ctx.expect(
                not survivors,
                f"cancelled {delay_ms} ms after run was called: processes {survivors} lived on after the "
                "cancellation propagated",
            )


@check(
    "aclose-during-run-raises-closed",
    kind="contract",
    clause="R-life-aclose-during-run",
    rule="A `run` in flight when `aclose` begins is killed and raises ExecutorClosedError.",
)
async def aclose_during_run(ctx: CheckContext) -> None:
    # The grace is at least a second, as in aclose-bounded: a close's own cost (on Docker an exec per
    # signal and per look) grows with the machine's load, and with the default 0.3 s grace a loaded
    # CI machine's close took 1.61 s for a bound of 1.51 s. The bound's margin over a close that
    # works (one grace and the allowance) now outgrows that noise.
    grace_s = max(1.0, ctx.allowance_s)
    ex = ctx.executor(grace_ms=grace_s * 1000)
    async with ex:
        mark, (a, b) = await marked_flags(ctx, ex, 2)
        command = f"{loop(mark, trap_term=True, prelude=touch(a))} & {loop(mark, prelude=touch(b))} & wait"
        async with anyio.create_task_group() as tg:
            box = spawn(tg, ex.exec, command)
            await wait_files(ex, [a, b])
            started = time.monotonic()
            await ex.aclose()
            took = elapsed(started)
            with anyio.move_on_after(ctx.allowance_s):
                await box.done.wait()
        ctx.expect(
            box.done.is_set(),
            f"the run in flight did not end within {ctx.allowance_s:.2f} s after aclose returned",
        )
        ctx.expect(
            isinstance(box.error, ExecutorClosedError),
            f"the run in flight during aclose should raise ExecutorClosedError; it {box.describe()}",
        )
        bound = 2 * grace_s + ctx.allowance_s
        ctx.expect(took <= bound, f"aclose took {took:.2f} s (bound {bound:.2f} s)")
        survivors = await ctx.wait_gone(mark, 0.25)
        ctx.expect(not survivors, f"processes of the run in flight survived aclose: {survivors}")


@check(
    "exec-convenience",
    kind="contract",
    clause="R-run-exec",
    rule="exec(command, **request_fields) is run(resolve(BashExecRequest(command=command, ...))).",
)
async def exec_convenience(ctx: CheckContext) -> None:
    async with ctx.executor(cwd="/") as ex:
        tmp = await ctx.tempdir(ex)
        await sh(ex, f"mkdir '{tmp}/w'")
        real = (await sh(ex, f"cd '{tmp}/w' && pwd -P")).strip()
        result = await ex.exec(
            'printf "%s|%s|%s" "$KIT_EXEC_VAR" "$(cat)" "$(pwd -P)"',
            workdir=f"{tmp}/w".lstrip("/"),
            timeout_ms=4321,
            stdin="from-stdin",
            env={"KIT_EXEC_VAR": "from-env"},
        )
        ctx.expect(
            isinstance(result, BashRunResult) and result.stdout.text == f"from-env|from-stdin|{real}",
            f"exec did not apply env, stdin and workdir: {show(result)}",
        )
        ctx.expect(result.timeout_ms == 4321, f"exec's timeout_ms=4321 not applied: {result.timeout_ms!r}")
        mark = ctx.marker()
        result = await ex.exec(loop(mark), timeout_ms=200)
        ctx.expect(result.timed_out, f"exec(timeout_ms=200) did not time out: {show(result)}")


@check(
    "duration-plausible",
    kind="contract",
    clause="R-outcome-duration",
    rule="`duration_ms` is the run's duration.",
)
async def duration_plausible(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        started = time.monotonic()
        result = await ex.exec("sleep 0.3")
        wall_ms = elapsed(started) * 1000
        ctx.expect(
            290 <= result.duration_ms <= wall_ms + 20,
            f"`sleep 0.3` reported duration_ms={result.duration_ms:.1f} (wall clock {wall_ms:.1f} ms)",
        )
        started = time.monotonic()
        result = await ex.exec("true")
        wall_ms = elapsed(started) * 1000
        ctx.expect(
            0 <= result.duration_ms <= wall_ms + 20,
            f"`true` reported duration_ms={result.duration_ms:.1f} (wall clock {wall_ms:.1f} ms)",
        )
