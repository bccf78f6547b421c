"""Checks of process mechanics: stdin, rc files, sessions, kills, the drain bound, concurrency."""

from __future__ import annotations

import secrets
import shlex
import time

import anyio

from dsh_bash import BashExecRequest, BashExecutor, BashInfrastructureError, BashRunResult

from ._harness import CheckContext, check
from ._support import (
    SETUP_S,
    Box,
    alive,
    elapsed,
    gone,
    loop,
    marked_flags,
    read_to_end,
    sh,
    show,
    show_task,
    spawn,
    started,
    touch,
    wait_files,
    wait_task,
    within,
)

GRACE_S = 0.3


@check(
    "stdin-empty-by-default",
    kind="contract",
    clause="R-proc-stdin-empty",
    rule="Stdin is empty (`/dev/null`) unless `spec.stdin` is given.",
)
async def stdin_empty(ctx: CheckContext) -> None:
    allow = ctx.allowance_s
    async with ctx.executor() as ex:
        started = time.monotonic()
        # A stdin nobody closes holds `cat` until the timeout: well past the bound, never before.
        result = await ex.exec(
            "cat; printf 'cat=%s ' $?; read -r line; printf 'read=%s' $?",
            timeout_ms=max(3.0, 2 * allow) * 1000,
        )
        took = elapsed(started)
        ctx.expect(
            result.stdout.text == "cat=0 read=1" and not result.timed_out,
            f"with no stdin, `cat` should end at once and `read` hit end of file: {show(result)}",
        )
        ctx.expect(took < allow, f"reading an empty stdin took {took:.2f} s (bound {allow:.2f} s)")
        # Empty is not enough: /dev/null itself, as the contract says (a program asking `[ -p /dev/stdin ]`
        # must see the same on every backend, not an empty pipe on some).
        result = await ex.exec(_STDIN_IS)
        ctx.expect(result.stdout.text == "/dev/null", f"with no stdin, fd 0 is not /dev/null: {show(result)}")
        task = await ex.start(ex.resolve(BashExecRequest(command=f"cat; printf 'cat=%s ' $?; {_STDIN_IS}")))
        await wait_task(task, allow, "a background `cat` with no stdin")
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            delta == "cat=0 /dev/null",
            f"background `cat` with no stdin printed {delta!r}, expected 'cat=0 /dev/null' (fd 0 /dev/null)",
        )


#: What the command's shell has as fd 0 (a pipe reads "pipe:[N]").
_STDIN_IS = 'printf %s "$(readlink /proc/$$/fd/0)"'


@check(
    "stdin-delivered",
    kind="contract",
    clause="R-proc-stdin-given",
    rule="When `spec.stdin` is given (str or bytes) it is written to the command's stdin and closed.",
)
async def stdin_delivered(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        text = "héllo\nwörld"
        result = await ex.exec("cat", stdin=text)
        ctx.expect(result.stdout.text == text, f"stdin text came back as {result.stdout.text!r}")
        result = await ex.exec("wc -c", stdin=b"a\x00b\xffc")
        ctx.expect(result.stdout.text.strip() == "5", f"5 stdin bytes counted as {result.stdout.text!r}")
        result = await ex.exec("cat", stdin=b"a\x00b")
        ctx.expect(result.stdout.text == "a\x00b", f"stdin bytes came back as {result.stdout.text!r}")
        big = "x" * 300_000
        result = await ex.exec("wc -c", stdin=big)
        ctx.expect(
            result.stdout.text.strip() == "300000",
            f"300000 stdin bytes arrived as {result.stdout.text.strip()!r} bytes ({show(result)})",
        )
        # 2 s lets 2 MB through a transport of 1 MB/s, should the backend send it all anyway.
        bound = 2.0 + ctx.allowance_s
        started = time.monotonic()
        result = await ex.exec("exit 0", stdin="z" * 2_000_000)
        took = elapsed(started)
        ctx.expect(
            result.exit_code == 0 and took < bound,
            f"a command that never reads its 2 MB stdin: {show(result)} after {took:.2f} s "
            f"(bound {bound:.2f} s)",
        )
        task = await ex.start(ex.resolve(BashExecRequest(command="cat", stdin="bg-in\n")))
        await wait_task(task, SETUP_S, "background `cat` with stdin")
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(delta == "bg-in\n", f"background stdin came back as {delta!r}")


@check(
    "command-beginning-with-dash-runs",
    kind="contract",
    clause="R-proc-command-verbatim",
    rule="A command that begins with `-` runs as a command, never as bash's own options.",
)
async def command_beginning_with_dash(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        for command in ("-x", "--version"):
            result = await ex.exec(command)
            ctx.expect(
                result.exit_code == 127 and f"{command}: command not found" in result.stderr.text,
                f"{command!r} did not run as a command (bash took it for its options?): {show(result)}",
            )
        task = await ex.start(ex.resolve(BashExecRequest(command="-x")))
        await wait_task(task, SETUP_S)
        ctx.expect(task.exit_code == 127, f"a background '-x' did not run as a command: {show_task(task)}")


@check(
    "no-rc-files",
    kind="contract",
    clause="R-proc-fresh-bash",
    rule="Every call runs a fresh, non-interactive `bash` that reads no rc files.",
)
async def no_rc_files(ctx: CheckContext) -> None:
    token = secrets.token_hex(6)
    home = f"/tmp/kit-home-{token}"
    bash_env = f"/tmp/kit-bashenv-{token}"
    probe = "shopt -q login_shell && echo login; case $- in *i*) echo interactive;; esac; echo done"
    rc_names = (".bashrc", ".bash_profile", ".bash_login", ".profile")
    setup = f"mkdir -p {home} && printf 'echo KIT-RC-RAN:bash_env\\n' > {bash_env} && " + " && ".join(
        f"printf 'echo KIT-RC-RAN:{name}\\n' > {home}/{name}" for name in rc_names
    )
    with ctx.plant_ambient({"BASH_ENV": bash_env, "ENV": bash_env, "HOME": home}):
        async with ctx.executor() as ex:
            # The rc files are written by the first command, where the executor's commands run.
            await ex.exec(setup)
            try:
                result = await ex.exec(probe)
                ctx.expect(
                    result.stdout.text == "done\n" and result.stderr.text == "",
                    f"the command's shell read an rc file or is login/interactive: {show(result)}",
                )
                task = await ex.start(ex.resolve(BashExecRequest(command=probe)))
                await wait_task(task, SETUP_S)
                delta = await read_to_end(ctx, ex, task.id)
                ctx.expect(
                    delta == "done\n", f"a background shell read an rc file or is interactive: {delta!r}"
                )
            finally:
                await ex.exec(f"rm -rf {home} {bash_env}")


_SESSION_PROBE = (
    'read -r stat < /proc/$$/stat; rest=${stat##*) }; set -- $rest; printf "%s %s %s" "$$" "$3" "$4"'
)


@check(
    "own-session-and-group",
    kind="contract",
    clause="R-proc-own-session",
    rule="Every call runs in a process group (session) of its own.",
)
async def own_session(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        result = await ex.exec(_SESSION_PROBE)
        parts = result.stdout.text.split()
        ctx.expect(
            len(parts) == 3 and parts[0] == parts[1] == parts[2],
            f"the command's shell should lead its own group and session (pid == pgrp == sid), "
            f"got 'pid pgrp sid' = {result.stdout.text!r} ({show(result)})",
        )
        task = await ex.start(ex.resolve(BashExecRequest(command=_SESSION_PROBE)))
        await wait_task(task, ctx.allowance_s)
        parts = (await read_to_end(ctx, ex, task.id)).split()
        ctx.expect(
            len(parts) == 3 and parts[0] == parts[1] == parts[2],
            f"a background shell should lead its own group and session, got {parts!r}",
        )


@check(
    "kill-kills-whole-group",
    kind="contract",
    clause="R-proc-kill-all",
    rule="Killing means every process of the command: SIGTERM to the group, including children.",
)
async def kill_whole_group(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        mark, (a, b) = await marked_flags(ctx, ex, 2)
        task = await ex.start(
            ex.resolve(
                BashExecRequest(
                    command=f"{loop(mark, prelude=touch(a))} & {loop(mark, prelude=touch(b))} & wait"
                )
            )
        )
        await wait_files(ex, [a, b])
        ctx.expect(await ex.kill(task.id) is True, "kill of a running task did not return True")
        await wait_task(task, GRACE_S + ctx.allowance_s, "killed task")
        await gone(ctx, mark, 0.5, "after kill")
        ctx.expect(
            task.status == "killed" and task.end_cause == "killed",
            f"a killed task should end status='killed', end_cause='killed': {show_task(task)}",
        )


@check(
    "kill-escalates-after-grace",
    kind="contract",
    clause="R-proc-kill-escalates",
    rule="SIGTERM to the group first, then SIGKILL after `grace_ms` to whatever is left, including "
    "members that trap SIGTERM.",
)
async def kill_escalates(ctx: CheckContext) -> None:
    # Half the grace (two allowances or more) lets the polite member die of SIGTERM; until 0.6 of it
    # the stubborn one must still live.
    grace_s = max(0.8, 4 * ctx.allowance_s)
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        tmp = await ctx.tempdir(ex)
        polite, stubborn = ctx.marker(), ctx.marker()
        seen = f"{tmp}/term-seen"
        a, b = f"{tmp}/a", f"{tmp}/b"
        polite_cmd = loop(polite, prelude=f"trap 'printf got-term > {seen}; exit 0' TERM; {touch(a)}")
        command = f"{polite_cmd} & {loop(stubborn, trap_term=True, prelude=touch(b))} & wait"
        task = await ex.start(ex.resolve(BashExecRequest(command=command)))
        await wait_files(ex, [a, b])
        killed_at = time.monotonic()
        ctx.expect(await ex.kill(task.id) is True, "kill of a running task did not return True")
        await gone(ctx, polite, 0.5 * grace_s, "a member that exits on SIGTERM, within half the grace")
        since = elapsed(killed_at)
        if since < 0.6 * grace_s:
            await alive(
                ctx,
                stubborn,
                f"{since:.2f} s after kill (grace {grace_s:.2f} s), a SIGTERM-ignoring member "
                "was already gone: SIGKILL came before the grace ran out",
            )
        await gone(ctx, stubborn, grace_s + ctx.allowance_s, "a SIGTERM-ignoring member after the grace")
        await wait_task(task, ctx.allowance_s, "killed task")
        got = await sh(ex, f"cat {seen}")
        ctx.expect(got == "got-term", f"the member trapping TERM did not record a SIGTERM: {got!r}")


# Stops (SIGSTOP) the supervisor the command runs under, when it runs under one (its parent is a
# dsh-supervise), and then outlives any timeout: every kill request then goes to a process that
# cannot act on it unless someone continues it first. Never the parent of an unsupervised command
# (the harness itself, on a local backend without the supervisor).
_STOP_OWN_SUPERVISOR = (
    "p=$PPID; read -r c < /proc/$p/comm 2>/dev/null; "
    "case $c in dsh-supervise*) echo supervised; kill -STOP $p ;; *) echo unsupervised ;; esac; "
    "sleep 30"
)


async def _run_stopping(ctx: CheckContext, ex: BashExecutor, command: str) -> BashRunResult | None:
    """Run ``command`` (one that stops helpers it runs under, and says "unsupervised" where it runs
    under none) with a 1 s timeout: its result, or None when the backend gave it up as
    ``command_lost``. Either within the timeout, the grace twice and two allowances (one more process
    where the commands run, to continue what it stopped); not applicable without a supervisor."""
    bound = 1.0 + 2 * GRACE_S + 2 * ctx.allowance_s
    try:
        result = await within(ex.exec(command, timeout_ms=1000), bound, "the run")
    except BashInfrastructureError as exc:
        ctx.expect(exc.reason == "command_lost", f"the run raised {exc.reason}, not command_lost: {exc}")
        return None
    if "unsupervised" in result.stdout.text:
        ctx.not_applicable("commands do not run under dsh-supervise here (marker containment)")
    return result


@check(
    "stopped-supervisor-killed-on-time",
    kind="contract",
    clause="R-proc-kill-stopped-helper",
    rule="A command that stops (SIGSTOP) its supervisor still times out, and is killed by `kill`, on "
    "time; the next command runs at once.",
)
async def stopped_supervisor(ctx: CheckContext) -> None:
    async with ctx.executor(grace_ms=GRACE_S * 1000) as ex:
        started_at = time.monotonic()
        result = await _run_stopping(ctx, ex, _STOP_OWN_SUPERVISOR)
        if result is not None:
            ctx.expect(result.timed_out, f"the run should be timed out: {show(result)}")
        took = elapsed(started_at)
        nxt = await within(
            ex.exec("echo next"), 1.0 + ctx.allowance_s, f"the next command (after {took:.2f} s)"
        )
        ctx.expect(nxt.stdout.text == "next\n", f"the next command did not run as usual: {show(nxt)}")

        task = await ex.start(ex.resolve(BashExecRequest(command=_STOP_OWN_SUPERVISOR)))
        await anyio.sleep(0.3 + ctx.allowance_s)  # it stopped its supervisor by now
        ctx.expect(await ex.kill(task.id) is True, "kill of a running task did not return True")
        await wait_task(task, 2 * GRACE_S + 2 * ctx.allowance_s, "a task that stopped its supervisor, killed")
        ctx.expect(
            task.end_cause in ("killed", "lost"),
            f"a task killed after it stopped its supervisor ended {task.end_cause}: {show_task(task)}",
        )


# Under a supervisor (its parent is a dsh-supervise), stops (SIGSTOP) what a command can reach of what
# the next commands need: every other process with its supervisor's parent (the spares of a fork
# server, the other execs of a container, the other channels of an SSH connection: the warm ones
# among them), that parent too when it is a dsh-supervise (a fork server), and last its own
# supervisor. Nothing outside its executor's reach: processes of other executors of the same user
# have other parents. Says how many others it stopped, or "unsupervised" (then it stops nothing).
_STOP_SPARES = r"""
sup=$PPID
read -r s < /proc/$sup/stat || { echo unsupervised; exit 0; }
c=${s#*(}
case ${c%%)*} in dsh-supervise*) ;; *) echo unsupervised; exit 0 ;; esac
f=(${s##*) })
pp=${f[1]}
n=0
if [ "$pp" != 0 ] && read -r s < /proc/$pp/stat 2>/dev/null; then
    c=${s#*(}
    case ${c%%)*} in dsh-supervise*) kill -STOP $pp 2>/dev/null && n=$((n+1)) ;; esac
fi
for d in /proc/[0-9]*; do
    p=${d#/proc/}
    if [ "$p" = "$sup" ] || [ "$p" = "$$" ] || [ "$p" = 1 ]; then continue; fi
    read -r s < $d/stat 2>/dev/null || continue
    f=(${s##*) })
    [ "${f[1]}" = "$pp" ] && kill -STOP $p 2>/dev/null && n=$((n+1))
done
echo stopped=$n
kill -STOP $sup
"""


@check(
    "stopped-spares-next-command-on-time",
    kind="contract",
    clause="R-proc-kill-stopped-helper",
    rule="A command that stops (SIGSTOP) the helpers kept ready for the next commands (warm spares, a "
    "fork server) makes the next command wait at most a second.",
)
async def stopped_spares(ctx: CheckContext) -> None:
    async with ctx.executor(grace_ms=GRACE_S * 1000) as ex:
        for _ in range(2):
            await ex.exec("true")
        await anyio.sleep(0.5 + ctx.allowance_s)  # whatever the backend keeps ready is there now
        await _run_stopping(ctx, ex, _STOP_SPARES)
        for attempt in ("first", "second"):
            nxt = await within(
                ex.exec("echo next"), 1.0 + ctx.allowance_s, f"the {attempt} command after the stopping one"
            )
            ctx.expect(nxt.stdout.text == "next\n", f"the {attempt} next command did not run: {show(nxt)}")


@check(
    "kill-reaches-group-after-leader-exit",
    kind="contract",
    clause="R-proc-kill-after-leader",
    rule="The kill sequence reaches members that trap SIGTERM even after the group leader has exited.",
)
async def kill_after_leader_exit(ctx: CheckContext) -> None:
    grace_s = 1.0
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        tmp = await ctx.tempdir(ex)
        mark = ctx.marker()
        a = f"{tmp}/a"
        # The leader exits at once; its TERM-ignoring child keeps the output pipes open, so the task
        # is still draining when it is killed.
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"{loop(mark, trap_term=True, prelude=touch(a))} & exit 0"))
        )
        await wait_files(ex, [a])
        await ex.kill(task.id)
        await gone(
            ctx, mark, grace_s + ctx.allowance_s, "a TERM-ignoring member whose leader had exited, after kill"
        )
        await wait_task(task, ctx.allowance_s)


@check(
    "bounded-drain",
    kind="contract",
    clause="R-proc-bounded-drain",
    rule="Once a background task's shell has exited, descendants that still hold the output pipes get "
    "at most `grace_ms` more and keep running until a kill of that task or `aclose`; a foreground run's "
    "are killed (R-proc-foreground-leftovers), and its result comes within `grace_ms` all the same.",
)
async def bounded_drain(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        mark = ctx.marker()
        started_at = time.monotonic()
        result = await ex.exec(f"{loop(mark)} & echo hi")
        took = elapsed(started_at)
        bound = GRACE_S + ctx.allowance_s
        ctx.expect(
            took <= bound, f"a command whose child holds stdout returned after {took:.2f} s (bound {bound:g})"
        )
        ctx.expect(
            result.stdout.text == "hi\n" and result.exit_code == 0 and not result.timed_out,
            f"expected stdout 'hi\\n', exit 0: {show(result)}",
        )
        other = ctx.marker()
        task = await ex.start(ex.resolve(BashExecRequest(command=f"{loop(other)} & echo hi")))
        await wait_task(task, bound, "a background task whose child holds stdout")
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            delta == "hi\n" and task.status == "completed" and task.exit_code == 0,
            f"expected the task to complete with exit 0 and output 'hi\\n': {show_task(task)}, {delta!r}",
        )
        await alive(ctx, other, "the background task's child should keep running after the task ended")
    await gone(ctx, other, 0.5, "after aclose, the background task's child")


@check(
    "foreground-leftovers-killed",
    kind="contract",
    clause="R-proc-foreground-leftovers",
    rule="What a foreground run leaves running when its shell exits (a `server &`, one that traps SIGTERM, "
    "one that left the session) is killed before the result, which is the shell's own exit.",
)
async def foreground_leftovers_killed(ctx: CheckContext) -> None:
    # A grace of at least a second, as in aclose-during-run-raises-closed: the leftover that traps
    # SIGTERM costs the grace and the backend's own signals and looks, which grow with the load.
    grace_s = max(1.0, ctx.allowance_s)
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        mark, (a, b) = await marked_flags(ctx, ex, 2)
        trapping = loop(mark, trap_term=True, prelude=touch(a))
        hiding = loop(mark, prelude=touch(b))
        # The shell waits until both run (their files exist), then exits with a status of its own.
        both_run = f"[ -e {shlex.quote(a)} ] && [ -e {shlex.quote(b)} ]"
        command = (
            f"{trapping} >/dev/null 2>&1 & setsid {hiding} >/dev/null 2>&1 & "
            f"until {both_run}; do sleep 0.02; done; echo started; exit 3"
        )
        started_at = time.monotonic()
        result = await ex.exec(command, timeout_ms=30_000)
        took = elapsed(started_at)
        ctx.expect(
            (result.exit_code, result.signal, result.timed_out) == (3, None, False)
            and result.stdout.text == "started\n",
            f"expected the shell's own exit 3 and 'started': {show(result)}",
        )
        bound = 2 * grace_s + ctx.allowance_s
        ctx.expect(took <= bound, f"the run returned after {took:.2f} s (bound {bound:.2f})")
        await gone(ctx, mark, 0.25, "right after the run's result, what it left running")
        ok = await sh(ex, "printf ok")
        ctx.expect(ok == "ok", f"after the leftovers' kill, the next command printed {ok!r}")


@check(
    "aclose-kills-leftovers",
    kind="contract",
    clause="R-life-aclose-kills",
    rule="aclose kills every process the executor's commands left behind (a `server &` of a finished "
    "background task, even one that traps SIGTERM).",
)
async def aclose_kills_leftovers(ctx: CheckContext) -> None:
    ex = ctx.executor()
    async with ex:
        bg = ctx.marker()
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"{loop(bg, trap_term=True)} >/dev/null 2>&1 & echo started"))
        )
        await wait_task(task, SETUP_S)
        await started(ctx, bg, "the background task's server")
        await ex.aclose()
    await gone(ctx, bg, 0.25, "right after aclose, the server a finished background task left")


@check(
    "timeout-kills-children",
    kind="contract",
    clause="R-proc-kill-all",
    rule="A timeout kills every process of the command: its children too, including one that traps SIGTERM.",
)
async def timeout_kills_children(ctx: CheckContext) -> None:
    # A grace of at least a second, as in aclose-during-run-raises-closed: the child that traps
    # SIGTERM costs the grace and the backend's own signals and looks, which grow with the load.
    grace_s = max(1.0, ctx.allowance_s)
    async with ctx.executor(grace_ms=grace_s * 1000) as ex:
        mark, (a, b) = await marked_flags(ctx, ex, 2)
        command = f"{loop(mark, prelude=touch(a))} & {loop(mark, trap_term=True, prelude=touch(b))} & wait"
        started = time.monotonic()
        result = await ex.exec(command, timeout_ms=400)
        took = elapsed(started)
        ctx.expect(result.timed_out, f"the command was not timed out: {show(result)}")
        bound = 0.4 + 2 * grace_s + ctx.allowance_s
        ctx.expect(took <= bound, f"the timed-out run returned after {took:.2f} s (bound {bound:g})")
        await wait_files(ex, [a, b], within_s=ctx.allowance_s)  # both children had really started
        await gone(ctx, mark, 0.5, "after the timeout, the command's children")


@check(
    "long-command-runs",
    kind="contract",
    clause="R-proc-any-command",
    rule="Any command string runs, including one longer than the 128 KiB limit of one execve argument.",
)
async def long_command(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        command = f"v='{'a' * 150_000}'; printf '%s' \"${{#v}}\""
        started = time.monotonic()
        result = await ex.exec(command)
        took = elapsed(started)
        ctx.expect(result.stdout.text == "150000", f"a 150 KB command failed: {show(result)}")
        task = await ex.start(ex.resolve(BashExecRequest(command=command)))
        # As long as the same command took in the foreground, and the allowance.
        await wait_task(task, took + ctx.allowance_s)
        delta = await read_to_end(ctx, ex, task.id)
        ctx.expect(delta == "150000", f"a 150 KB background command printed {delta[:200]!r}")


@check(
    "concurrent-runs",
    kind="contract",
    clause="R-proc-concurrent",
    rule="Concurrent runs on one executor each get their own, correct result.",
)
async def concurrent_runs(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        boxes: list[Box[BashRunResult]] = []
        async with anyio.create_task_group() as tg:
            for i in range(20):
                command = f"printf 'out-{i}'; sleep 0.2; printf 'err-{i}' >&2; exit {i % 7}"
                boxes.append(spawn(tg, ex.exec, command))
        for i, box in enumerate(boxes):
            result = box.value
            ctx.expect(result is not None, f"concurrent run {i} {box.describe()}")
            assert result is not None
            ctx.expect(
                result.stdout.text == f"out-{i}"
                and result.stderr.text == f"err-{i}"
                and result.exit_code == i % 7,
                f"concurrent run {i} got someone else's result or lost output: {show(result)}",
            )
