"""Checks of shell sessions: the state carried from one command to the next, what never carries, whose
it is, and how long it lives (``R-session-*``). A target whose commands cannot carry a session (a
backend without its supervisor, say) refuses one with reason ``session_unsupported``: N/A."""

from __future__ import annotations

from typing import Any

from dsh_bash import (
    BashExecRequest,
    BashExecutor,
    BashInfrastructureError,
    BashRunResult,
    OwnerToken,
    SessionId,
)

from ._harness import CheckContext, check
from ._support import expect_raises, read_to_end, wait_task

_OWNER = OwnerToken("kit-session-owner")


async def _run(
    ctx: CheckContext, ex: BashExecutor, session: SessionId, command: str, **fields: Any
) -> BashRunResult:
    fields.setdefault("owner", _OWNER)
    try:
        return await ex.run(ex.resolve(BashExecRequest(command=command, session=session, **fields)))
    except BashInfrastructureError as exc:
        if exc.reason == "session_unsupported":
            ctx.not_applicable(f"the target refuses sessions: {exc}")
        raise


def _out(result: BashRunResult) -> str:
    return result.stdout.text


def _kept(ctx: CheckContext, result: BashRunResult, what: str) -> None:
    """The command's state became the session's."""
    report = result.session
    ctx.expect(report is not None, f"{what}: a run in a session has no session report")
    assert report is not None
    ctx.expect(
        report.kept_previous is None,
        f"{what}: its state was not taken ({report.kept_previous!r}); stderr {result.stderr.text!r}",
    )


@check(
    "session-carries-state",
    kind="contract",
    clause="R-session-carry",
    rule="A command run in a session gets the state the session's last command left at its exit: the "
    "directory, exported variables (added, changed, unset), `set -o` and `shopt` options, functions, "
    "aliases and umask (a command that runs a function of the session changes it too); a request's own "
    "`workdir` wins for that command alone; a background task starts from the state.",
)
async def session_carries_state(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        session = ex.session(_OWNER)
        first = await _run(
            ctx,
            ex,
            session,
            "cd /tmp && export KIT_A=1 KIT_B=two && kit_f() { echo fn-$1; } && alias kit_al='echo aliased' "
            "&& set -o pipefail && shopt -s extglob && umask 027 && builtin pwd -P",
        )
        _kept(ctx, first, "the command that set the state")
        here = _out(first).strip()
        assert first.session is not None
        ctx.expect(
            first.session.cwd == here,
            f"the session report's cwd is {first.session.cwd!r}, the command's directory was {here!r}",
        )
        second = await _run(
            ctx,
            ex,
            session,
            'builtin pwd -P; echo "$KIT_A $KIT_B"; kit_f x\nkit_al\nshopt -q extglob && echo extglob; '
            "[[ -o pipefail ]] && echo pipefail; umask; unset KIT_A; export KIT_B=changed",
        )
        want = f"{here}\n1 two\nfn-x\naliased\nextglob\npipefail\n0027\n"
        ctx.expect(
            _out(second) == want,
            f"the next command saw {_out(second)!r} (stderr {second.stderr.text!r}), expected {want!r}",
        )
        _kept(ctx, second, "the command that unset and changed variables")
        third = await _run(ctx, ex, session, 'echo "${KIT_A-unset} $KIT_B"')
        ctx.expect(
            _out(third) == "unset changed\n",
            f"after `unset KIT_A; export KIT_B=changed` the next command saw {_out(third)!r}",
        )
        # A command of one plain word runs the session's function of that name, not the program:
        # what the function changes is the session's (a harness that skips the capture of commands
        # that look like they change nothing must not skip this one).
        await _run(ctx, ex, session, "ls() { export KIT_FROM_FN=ran; }")
        await _run(ctx, ex, session, "ls")
        after_fn = await _run(ctx, ex, session, 'echo "${KIT_FROM_FN-unset}"; unset -f ls')
        ctx.expect(
            _out(after_fn) == "ran\n",
            f"after a command `ls` that ran the session's function `ls` (which exports KIT_FROM_FN), the "
            f"next command saw {_out(after_fn)!r}: the function's change was lost",
        )
        elsewhere = await _run(ctx, ex, session, "builtin pwd -P", workdir="/")
        ctx.expect(
            _out(elsewhere) == "/\n",
            f"a request with workdir='/' ran in {_out(elsewhere)!r}, not in the directory it named",
        )
        task = await ex.start(
            ex.resolve(
                BashExecRequest(command='builtin pwd -P; echo "$KIT_B"', session=session, owner=_OWNER)
            )
        )
        await wait_task(task, 2 + ctx.allowance_s, "a background task in a session")
        out = await read_to_end(ctx, ex, task.id)
        ctx.expect(
            out == f"{here}\nchanged\n", f"a background task in the session printed {out!r}, not its state"
        )


@check(
    "session-killed-keeps-previous",
    kind="contract",
    clause="R-session-killed",
    rule="A session command killed by its timeout or by a signal leaves the session as it was before it, "
    "and its report says why (`kept_previous`); one that exited by itself, with any status, leaves its "
    "state.",
)
async def session_killed_keeps_previous(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        session = ex.session(_OWNER)
        _kept(ctx, await _run(ctx, ex, session, "export KIT_K=kept; cd /tmp"), "the first command")
        timed = await _run(ctx, ex, session, "export KIT_K=timeout; cd /; sleep 30", timeout_ms=300)
        ctx.expect(timed.timed_out, f"a 30 s sleep under a 300 ms timeout did not time out: {timed!r}")
        ctx.expect(
            timed.session is not None and timed.session.kept_previous,
            f"a timed-out command's report does not say that the session kept its state: {timed.session!r}",
        )
        killed = await _run(ctx, ex, session, "export KIT_K=killed; cd /; kill -KILL $$")
        ctx.expect(
            killed.signal == "SIGKILL" and killed.session is not None and killed.session.kept_previous,
            f"a command that SIGKILLed its shell: signal {killed.signal!r}, report {killed.session!r}",
        )
        failed = await _run(ctx, ex, session, "export KIT_F=failed; exit 3")
        ctx.expect(failed.exit_code == 3, f"`exit 3` ended with {failed.exit_code!r}")
        _kept(ctx, failed, "a command that exited 3 by itself")
        after = await _run(ctx, ex, session, 'echo "$KIT_K $KIT_F"; builtin pwd -P')
        real_tmp = (await _run(ctx, ex, session, "builtin pwd -P", workdir="/tmp")).stdout.text
        want = f"kept failed\n{real_tmp}"
        ctx.expect(
            _out(after) == want,
            f"after a timed-out, a killed and a failing command the session holds {_out(after)!r}, "
            f"expected {want!r}",
        )


@check(
    "session-owners-isolated",
    kind="contract",
    clause="R-session-isolation",
    rule="Each owner has a session of its own, which no other owner can run in or reset (reason "
    "`session_unknown`); no state of it reaches another owner's commands, and a name the env policy "
    "scrubs never enters a session's state.",
)
async def session_owners_isolated(ctx: CheckContext) -> None:
    other = OwnerToken("kit-session-other")
    async with ctx.executor() as ex:
        mine = ex.session(_OWNER)
        theirs = ex.session(other)
        ctx.expect(
            mine != theirs and ex.session(_OWNER) == mine,
            f"two owners' sessions: {mine!r} and {theirs!r}; the same owner's again: {ex.session(_OWNER)!r}",
        )
        plain = _out(await ex.run(ex.resolve(BashExecRequest(command="builtin pwd -P", owner=other))))
        _kept(
            ctx,
            await _run(ctx, ex, mine, "export KIT_O=mine KIT_SECRET_TOKEN=leak; cd /tmp"),
            "the owner's command",
        )
        seen = await _run(ctx, ex, theirs, 'echo "${KIT_O-none}"; builtin pwd -P', owner=other)
        fresh = f"none\n{plain}"
        ctx.expect(
            _out(seen) == fresh,
            f"another owner's session saw {_out(seen)!r}, expected a fresh shell's {fresh!r}",
        )
        for what, call in (
            ("a run in another owner's session", lambda: _run(ctx, ex, mine, "true", owner=other)),
            ("a reset of another owner's session", _reset(ex, mine, other)),
        ):
            error = await expect_raises(BashInfrastructureError, call, what)
            assert isinstance(error, BashInfrastructureError)
            ctx.expect(
                error.reason == "session_unknown",
                f"{what} was refused with reason {error.reason!r}, expected 'session_unknown'",
            )
        scrubbed = await _run(ctx, ex, mine, 'echo "${KIT_SECRET_TOKEN-none} $KIT_O"')
        ctx.expect(
            _out(scrubbed) == "none mine\n",
            f"a variable the env policy scrubs (KIT_SECRET_TOKEN) carried into the next command: "
            f"{_out(scrubbed)!r}",
        )


def _reset(ex: BashExecutor, session: SessionId, owner: OwnerToken) -> Any:
    async def call() -> None:
        ex.reset_session(session, owner=owner)

    return call


@check(
    "session-reset-and-reconfigure",
    kind="contract",
    clause="R-session-lifetime",
    rule="A session survives `reconfigure`; `reset_session` makes its next command a fresh shell; "
    "`end_session` forgets it (its id is refused, the owner's next session is new); it ends with the "
    "executor.",
)
async def session_reset_and_reconfigure(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        session = ex.session(_OWNER)
        _kept(ctx, await _run(ctx, ex, session, "export KIT_R=1; kit_g() { :; }"), "the first command")
        ex.reconfigure(timeout_ms=5000)
        kept = await _run(ctx, ex, session, 'echo "${KIT_R-none}"; type -t kit_g')
        ctx.expect(
            _out(kept) == "1\nfunction\n", f"after reconfigure the session's command saw {_out(kept)!r}"
        )
        ex.reset_session(session, owner=_OWNER)
        fresh = await _run(ctx, ex, session, 'echo "${KIT_R-none}"; type -t kit_g || echo no-function')
        ctx.expect(
            _out(fresh) == "none\nno-function\n", f"after reset_session the next command saw {_out(fresh)!r}"
        )
        ex.end_session(session, owner=_OWNER)
        ended = await expect_raises(
            BashInfrastructureError, lambda: _run(ctx, ex, session, "true"), "a run in an ended session"
        )
        assert isinstance(ended, BashInfrastructureError)
        ctx.expect(
            ended.reason == "session_unknown",
            f"a run in an ended session was refused with reason {ended.reason!r}, expected 'session_unknown'",
        )
        again = ex.session(_OWNER)
        ctx.expect(again != session, f"the owner's session after end_session is the ended one: {again!r}")
    error = await expect_raises(
        BashInfrastructureError, _reset(ex, session, _OWNER), "a reset after the executor closed"
    )
    ctx.expect(
        isinstance(error, BashInfrastructureError),
        f"a reset after close raised {type(error).__name__}",
    )
