"""Containment against commands that hide: kill and close reach processes whatever they do to their
environment, session or group.

Each check starts a background task whose escapee hides one way, waits until the hiding is done
(the escapee writes a file once it is), kills the task and requires every process carrying the
check's marker to be gone. The hiding is done with bash and what coreutils and busybox provide, so
the checks run wherever the commands run:

- dropping the environment (``env -i``): a marker the executor put in the environment is gone;
- rewriting the environment area in place, as ``setproctitle`` (nginx, postgres, gunicorn) does: the
  escapee opens its own ``/proc/$$/mem`` (a process may always write its own memory) and has ``dd``
  write zeros over the area ``/proc/$$/stat`` names, so ``/proc/PID/environ`` reads nothing;
- a fork chain that calls ``setsid`` in every generation: each generation leaves the session of the
  one before and the parent exits, so none shares a group or session with the command.

They are contract checks: every backend of this project keeps them with its default containment
(a per-command subreaper, ``dsh-supervise``). A backend that finds processes by an environment marker
alone misses the first two escapees and loses the race against the fork chain now and then, as the
``marker`` fallback of Docker shows (``MARKER_CONTAINMENT_FAILS`` and ``MARKER_CONTAINMENT_RACES`` in
``tests/kit_targets.py``). ``self-kill-reported-as-signal`` too: every backend reports the wait status
its supervisor observed (the bubblewrap example through a second supervisor inside its sandbox).
"""

from __future__ import annotations

import shlex
import time

import anyio

from dsh_bash import BashExecRequest

from ._harness import CheckContext, check
from ._support import show, show_task, wait_files, wait_task

GRACE_S = 0.3  # the kit's default grace_ms, in seconds
_LOOP = "while :; do sleep 0.05; done"
# A loop that forks nothing: a read with a timeout on a FIFO the process holds open both ways.
_QUIET_LOOP = 'mkfifo "$READY.fifo" && exec 3<>"$READY.fifo"; while :; do read -r -t 0.05 -u 3 _; done'

# Overwrites the environment area of this very process with zeros, through a descriptor the process
# opened on its own memory (fields 50 and 51 of /proc/PID/stat, counted from 1, are the area's
# bounds; after the command name they are words 48 and 49), then proves /proc/$$/environ reads empty.
_REWRITE_OWN_ENVIRON = (
    "rewrite() { exec 3<>/proc/$$/mem || return 1; "
    "read -r st < /proc/$$/stat; set -- ${st##*) }; "
    'head -c $((${49} - ${48})) /dev/zero | dd bs=1 seek="${48}" conv=notrunc 1>&3 2>/dev/null; '
    "exec 3>&-; "
    "[ -z \"$(tr -d '\\0' < /proc/$$/environ)\" ]; }"
)


#: How long no process may carry the marker before the kit believes they are all gone: one scan of
#: ``/proc`` can miss a fork chain (the next generation is born after the scan listed the pids, the
#: one it listed dies before it is read), many in a row over this span cannot.
_QUIET_S = 0.25


async def _gone_for_good(ctx: CheckContext, mark: str, within_s: float, what: str) -> None:
    """No process may carry ``mark`` for ``_QUIET_S`` in a row, reached within ``within_s``."""
    deadline = time.monotonic() + within_s + _QUIET_S
    quiet_since: float | None = None
    survivors: list[int] = []
    while True:
        survivors = await ctx.processes(mark)
        now = time.monotonic()
        if survivors:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        if quiet_since is not None and now - quiet_since >= _QUIET_S:
            return
        if now >= deadline:
            break
        await anyio.sleep(0.01)
    ctx.fail(f"{what}: processes {survivors} carrying {mark} still alive after {within_s:g} s")


def _rule(how: str) -> str:
    return f"Kill and close end every process a command started, including one that {how}."


async def _start_kill_require_gone(ctx: CheckContext, body: str, mark: str, what: str) -> None:
    """Start ``body`` (a bash script that creates ``$READY`` once it hid) as a background task beside
    a loop; once it hid, kill the task: every process carrying ``mark`` must be gone."""
    async with ctx.executor() as ex:
        tmp = await ctx.tempdir(ex)
        ready, failed = f"{tmp}/ready", f"{tmp}/failed"
        setup = f"READY={shlex.quote(ready)} FAILED={shlex.quote(failed)}; export READY FAILED; "
        task = await ex.start(ex.resolve(BashExecRequest(command=f"{setup}{body} {_LOOP}")))
        await wait_files(ex, [ready], within_s=5 + ctx.allowance_s)
        probe = await ex.exec(f"cat {shlex.quote(failed)} 2>/dev/null; true")
        ctx.expect(probe.stdout.text == "", f"the kit's escapee could not hide here: {probe.stdout.text!r}")
        ctx.expect(await ex.kill(task.id) is True, "kill of a running task did not return True")
        await wait_task(task, 2 * GRACE_S + ctx.allowance_s, "killed task")
        await _gone_for_good(ctx, mark, 2 * GRACE_S + ctx.allowance_s, f"after kill, {what}")


@check(
    "escapee-without-environment-killed",
    kind="contract",
    clause="R-contain-hiding",
    rule=_rule("drops its whole environment (`env -i`) and leaves the session"),
)
async def escapee_without_environment(ctx: CheckContext) -> None:
    mark = ctx.marker()
    body = f': > "$READY"; {_LOOP}'
    command = (
        f'env -i PATH="$PATH" READY="$READY" setsid bash -c {shlex.quote(body)} {mark} >/dev/null 2>&1 &'
    )
    await _start_kill_require_gone(ctx, command, mark, "an escapee that dropped its environment")


@check(
    "escapee-rewriting-environment-killed",
    kind="contract",
    clause="R-contain-hiding",
    rule=_rule("overwrites its environment area in place (as setproctitle does) and leaves the session"),
)
async def escapee_rewriting_environment(ctx: CheckContext) -> None:
    mark = ctx.marker()
    # The rewrite runs in the escapee's own process (a function, not a subshell): its marker on the
    # command line stays for the kit to find it, its environment is gone for anyone else.
    # Its loop forks nothing (a read with a timeout on a FIFO it holds open both ways): a child would
    # get the variables back from bash's own copy, and a marker-based kill would find the child and
    # signal its group, the escapee with it.
    failed = 'echo "environ not rewritten" > "$FAILED"'
    body = f'{_REWRITE_OWN_ENVIRON}; rewrite || {failed}; : > "$READY"; {_QUIET_LOOP}'

    command = f"setsid bash -c {shlex.quote(body)} {mark} >/dev/null 2>&1 &"
    await _start_kill_require_gone(ctx, command, mark, "an escapee that overwrote its environment")


@check(
    "setsid-chain-killed",
    kind="contract",
    clause="R-contain-hiding",
    rule=_rule(
        "forks a chain of processes that each ignore SIGTERM, call `setsid` and let their parent exit"
    ),
)
async def setsid_chain(ctx: CheckContext) -> None:
    mark = ctx.marker()
    # Each generation starts the next in a session of its own at once, then exits after 0.1 s: about
    # 0.1 s / (fork + exec) generations live at any moment, none in the command's session or group.
    # Every generation ignores SIGTERM (the ignored disposition is inherited through fork and exec),
    # so the chain goes on through the kill's grace period: a kill that signals only the processes
    # one scan saw, however early, leaves a generation born after that scan going. (Without the trap
    # such a kill could end the chain by luck: its TERM reaching the newest generation before that
    # one forked.) The chain stops by itself 10 s after it began (bash's $EPOCHSECONDS), so a backend
    # that fails to kill it cannot leave it running for good.
    hop = (
        "trap '' TERM; "
        '[ "$EPOCHSECONDS" -lt "$2" ] && setsid bash -c "$1" "$0" "$1" "$2" >/dev/null 2>&1 & '
        ': > "$READY"; sleep 0.1'
    )
    deadline = '"$((EPOCHSECONDS + 10))"'
    command = f"setsid bash -c {shlex.quote(hop)} {mark} {shlex.quote(hop)} {deadline} >/dev/null 2>&1 &"
    await _start_kill_require_gone(ctx, command, mark, "a generation of a setsid chain")


@check(
    "non-dumpable-escapee-killed",
    kind="contract",
    clause="R-contain-hiding",
    rule=_rule(
        "is non-dumpable (runs an execute-only copy of bash), so that its environment cannot be "
        "read without ptrace rights, and leaves the session"
    ),
)
async def non_dumpable_escapee(ctx: CheckContext) -> None:
    mark = ctx.marker()
    # The kernel makes a process non-dumpable when it execs a file it cannot read: its /proc/PID
    # entries then belong to root and /proc/PID/environ needs ptrace rights (which root on a host
    # has; root in a container without CAP_SYS_PTRACE, or any other user, has not). Its loop forks
    # nothing, as in escapee-rewriting-environment-killed, so no child of it carries the marker where
    # it can be read.
    quiet_loop = f': > "$READY"; {_QUIET_LOOP}'
    copy = '"$READY.bash"'
    command = (
        f'cat "$BASH" > {copy} && chmod 111 {copy} && '
        f"(setsid {copy} --noprofile --norc -c {shlex.quote(quiet_loop)} {mark} >/dev/null 2>&1 &) "
        '|| echo "cannot make an execute-only bash" > "$FAILED";'
    )
    await _start_kill_require_gone(ctx, command, mark, "a non-dumpable escapee")


# Every way this project's backends ever carried an outcome in band, forged: the exit trailer with
# the nonce of any ancestor's environment (a boot script's), on stdout and stderr; and the exit and
# end files beside the command's output files (a detached task's), found through the output
# descriptors of its ancestors and of their children (output relays). The command then goes on.
_FORGE = r"""
ancestors=" "
p=$$
while [ "${p:-0}" -gt 1 ]; do
  ancestors="$ancestors$p "
  n=$(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | sed -n 's/^DSH_BASH_NONCE=//p')
  if [ -n "$n" ]; then printf '\0dsh-bash-exit:%s:000\0' "$n"; printf '\0dsh-bash-exit:%s:000\0' "$n" >&2; fi
  read -r st < /proc/$p/stat 2>/dev/null || break
  set -- ${st##*) }; p=$2
done
for d in /proc/[0-9]*; do
  read -r st < "$d/stat" 2>/dev/null || continue
  set -- ${st##*) }
  case $ancestors in *" ${d#/proc/} "*|*" $2 "*) ;; *) continue ;; esac
  for fd in 1 2; do
    f=$(readlink "$d/fd/$fd" 2>/dev/null)
    case $f in /*.stdout|/*.stderr) b=${f%.*}; : > "$b.exit-0" 2>/dev/null; : > "$b.eof" 2>/dev/null ;; esac
  done
done
"""


@check(
    "forged-outcome-ignored",
    kind="contract",
    clause="R-outcome-unforgeable",
    rule="Nothing a command writes (its output, files it can write, what it reads from its parents) "
    "makes the executor report that it ended, or report another status.",
)
async def forged_outcome(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        started = time.monotonic()
        result = await ex.exec(_FORGE + "sleep 1; exit 3", timeout_ms=int((5 + ctx.allowance_s) * 1000))
        took = time.monotonic() - started
        ctx.expect(
            result.exit_code == 3 and result.signal is None and not result.timed_out and took >= 0.9,
            f"a command that forged its outcome, then slept 1 s and exited 3, was reported after "
            f"{took:.2f} s as {show(result)}",
        )
        started = time.monotonic()
        task = await ex.start(ex.resolve(BashExecRequest(command=_FORGE + "sleep 1; exit 7")))
        await wait_task(task, 5 + ctx.allowance_s, "forging task")
        took = time.monotonic() - started
        ctx.expect(
            (task.status, task.end_cause, task.exit_code) == ("completed", "exited", 7) and took >= 0.9,
            f"a background task that forged its outcome, then slept 1 s and exited 7, ended after "
            f"{took:.2f} s as {show_task(task)}",
        )


@check(
    "self-kill-reported-as-signal",
    kind="contract",
    clause="R-outcome-self-signal",
    rule="A command that kills itself reports the signal (`signal` set, `exit_code` None, a task's "
    "end_cause `signaled`) on every backend, never a 128+n exit code.",
)
async def self_kill_as_signal(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        result = await ex.exec("kill -TERM $$")
        ctx.expect(
            (result.signal, result.exit_code) == ("SIGTERM", None) and not result.timed_out,
            f"`kill -TERM $$` should report signal SIGTERM and no exit code: {show(result)}",
        )
        task = await ex.start(ex.resolve(BashExecRequest(command="kill -KILL $$")))
        await wait_task(task, 2 + ctx.allowance_s, "self-killing task")
        ctx.expect(
            (task.status, task.end_cause, task.exit_code, task.signal)
            == ("completed", "signaled", None, "SIGKILL"),
            f"a task that ran `kill -KILL $$` should end completed/signaled with signal SIGKILL: "
            f"{show_task(task)}",
        )


# Pushes one byte into the input of a terminal the command opens itself (a fresh pseudo-terminal from
# /dev/ptmx, so nothing real receives it) with TIOCSTI: what, on another terminal, types into
# someone's shell. perl or python3 make the ioctl; bash and busybox cannot.
_TIOCSTI_PROBE = r"""
if command -v perl >/dev/null 2>&1; then
  perl -e 'open(T, "+<", "/dev/ptmx") or do { print "no-ptmx\n"; exit 0 };
           my $c = "x"; if (ioctl(T, 0x5412, $c)) { print "accepted\n" } else { print "refused $!\n" }'
elif command -v python3 >/dev/null 2>&1; then
  python3 -c '
import fcntl, os
try:
    fd = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
except OSError:
    print("no-ptmx"); raise SystemExit
try:
    fcntl.ioctl(fd, 0x5412, b"x")
    print("accepted")
except OSError as exc:
    print("refused", os.strerror(exc.errno))'
else
  echo no-tool
fi
"""


@check(
    "terminal-injection-refused",
    kind="contract",
    clause="R-contain-no-keystrokes",
    rule="A command cannot push input into a terminal (ioctl TIOCSTI): refused, whoever it runs as.",
)
async def terminal_injection_refused(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        result = await ex.exec(_TIOCSTI_PROBE)
        verdict = result.stdout.text.strip()
        if verdict == "no-tool":
            ctx.not_applicable("needs perl or python3 where commands run, to make the ioctl")
        if verdict == "no-ptmx":
            ctx.not_applicable("no /dev/ptmx where commands run: no terminal to push input into")
        ctx.expect(
            verdict.startswith("refused"),
            f"ioctl(TIOCSTI) on a terminal the command opened was {verdict or 'not tried'!r}: a command "
            f"that may do that can type into any terminal it can open, the harness's own: {show(result)}",
        )
