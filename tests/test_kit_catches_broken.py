"""The conformance kit catches every rule it checks: each check fails against a backend that breaks it.

``CAUGHT_BY`` maps every registered check to at least one deliberately broken backend (from
``broken_backends``) and the outcome the kit must report for it. A second test runs a basic check
against every broken backend, to show that each is broken in one place only, not broken altogether.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import anyio
import broken_backends as bb
import pytest
from dsh_bash_conformance import CHECKS, CheckOutcome, CheckResult, KitTarget, run_kit
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import BashExecSpec, BashRunResult
from dsh_bash.backend import MARKER_VAR

pytestmark = pytest.mark.kit


class Row(NamedTuple):
    """One check, one broken backend that must not pass it, and what the kit must report."""

    check: str
    backend: type[LocalBashExecutor]
    outcome: CheckOutcome = "failed"
    #: The check's wall-clock limit: short only where the breakage is a hang by design.
    check_timeout_s: float = 30.0
    #: What the check's message must say (for "error" rows: the exception that escaped).
    message_contains: tuple[str, ...] = ()
    #: The breakage shows only to a command running as root (elsewhere the kernel keeps the rule).
    needs_root: bool = False


CAUGHT_BY: list[Row] = [
    # -- outcome classification -------------------------------------------------------------------
    Row("exit-code-reported", bb.HighExitCodeAsSignal),
    Row("timeout-classified", bb.TimeoutReportedAsPlainKill),
    # A hang by design: the blocked event loop cannot fire the timeout.
    Row("timeout-classified", bb.BlocksEventLoop, "hung", 5.0, ("did not finish within 5 s",)),
    Row("timeout-classified", bb.WrapperNoticeOnStderr, "failed", 30.0, ("not a wrapper's notice",)),
    Row("timeout-clamped-to-max", bb.ClampsOnlyAtRunTime),
    # Not clamping at all makes the 60 s request run 60 s; the check bounds that run and fails.
    Row("timeout-clamped-to-max", bb.NoTimeoutClamp, "failed", 30.0, ("should be clamped",)),
    Row("abort-classified", bb.AbortReportedAsTimeout),
    Row("abort-then-timeout-first-cause-wins", bb.LastCauseWins),
    Row("timeout-then-abort-first-cause-wins", bb.LastCauseWins),
    Row("self-signal-reports-neither", bb.SignalAsExitCode),
    Row("trapped-term-exit-zero-still-timed-out", bb.TimedOutOnlyIfSignaled),
    Row("duration-plausible", bb.DurationInSeconds),
    # -- resolve, exec, refusing to start -----------------------------------------------------------
    Row("resolve-fills-and-carries", bb.ResolveForgetsOwner),
    Row("resolve-fills-and-carries", bb.ResolveDropsOpenStdin),
    Row("resolve-fills-and-carries", bb.NoTimeoutClamp),
    Row("workdir-and-cwd-used", bb.WorkdirIgnored),
    Row("pre-aborted-signal-refused", bb.PreAbortedSignalIgnored),
    Row("unusable-workdir-refused", bb.MissingWorkdirFallsBack),
    Row("command-user", bb.IgnoresUser),
    Row("command-user", bb.RefusesEveryUser),
    Row("unusable-workdir-refused", bb.LeaksExceptionGroup),
    Row("infra-error-reasons", bb.WorkdirReasonUnclassified),
    Row("escapee-without-environment-killed", bb.MarkerContainment),
    Row("terminal-injection-refused", bb.TerminalInjectable, needs_root=True),
    Row("stopped-supervisor-killed-on-time", bb.StoppedSupervisorNotContinued),
    Row("stopped-spares-next-command-on-time", bb.StoppedSparesNotContinued),
    Row("escapee-rewriting-environment-killed", bb.MarkerContainment),
    Row("setsid-chain-killed", bb.KillsWhatItSawFirst),
    Row("non-dumpable-escapee-killed", bb.KillScriptWithoutPtraceRights),
    Row("forged-outcome-ignored", bb.TrustsForgedTrailer),
    Row("self-kill-reported-as-signal", bb.SignalAsExitCode),
    Row("exec-convenience", bb.ExecDropsStdinAndEnv),
    # The breakage is an exception escaping run (the kernel refuses the argv: E2BIG), and the
    # check lets it through: the kit reports an error naming it rather than a failure.
    Row(
        "long-command-runs",
        bb.InlinesLongCommands,
        "error",
        message_contains=("BashInfrastructureError", "Argument list too long"),
    ),
    # -- cancellation, close during a run -----------------------------------------------------------
    Row("cancel-kills-before-propagating", bb.CancelSendsTermOnly),
    Row("cancel-at-any-moment-leaves-nothing", bb.SpawnNotCancelSafe),
    Row("cancel-at-any-moment-leaves-nothing", bb.SwallowsCancellation),
    Row("aclose-during-run-raises-closed", bb.CloseKillReportedAsResult),
    # -- processes ------------------------------------------------------------------------------------
    Row("stdin-empty-by-default", bb.StdinPipeNeverClosed),
    Row("stdin-empty-by-default", bb.EmptyPipeStdin),
    Row("stdin-delivered", bb.StdinSingleWrite),
    Row("no-rc-files", bb.PassesBashEnv),
    Row("command-beginning-with-dash-runs", bb.CommandTakenForOptions),
    Row("own-session-and-group", bb.NoNewSession),
    Row("kill-kills-whole-group", bb.KillsOnlyLeader),
    Row("kill-escalates-after-grace", bb.SigkillWithoutSigterm),
    Row("kill-escalates-after-grace", bb.NeverSigkill),
    Row("kill-reaches-group-after-leader-exit", bb.StopsKillingAfterLeaderExit),
    Row("bounded-drain", bb.NoDrainBound),
    Row("bounded-drain", bb.KillsDescendantsAtExit),
    Row("foreground-leftovers-killed", bb.KeepsForegroundLeftovers),
    Row("aclose-kills-leftovers", bb.NoLeftoverSweep),
    Row("timeout-kills-children", bb.KillsOnlyLeader),
    Row("concurrent-runs", bb.SharedResultSlot),
    # -- background tasks ----------------------------------------------------------------------------
    Row("start-returns-while-running", bb.StartReturnsSnapshot),
    Row("background-has-no-timeout", bb.BackgroundTasksTimedOut),
    Row("task-timeout-applies", bb.TaskTimeoutIgnored),
    Row("task-timeout-applies", bb.TaskTimeoutReportedAsKill),
    # -- sessions ------------------------------------------------------------------------------------
    Row("session-carries-state", bb.SessionCaptureNeverHanded),
    Row("session-killed-keeps-previous", bb.SessionKeepsKilledState),
    Row("session-owners-isolated", bb.SessionSharedByOwners),
    Row("session-owners-isolated", bb.SessionKeepsScrubbedNames),
    Row("session-reset-and-reconfigure", bb.SessionLostOnReconfigure),
    # -- files ---------------------------------------------------------------------------------------
    Row("file-round-trip", bb.FileReadAsText),
    Row("file-refusals", bb.MissingFileReadAsEmpty),
    Row("file-link-replaced", bb.WritesThroughLinks),
    Row("file-write-atomic", bb.WritesInPlace),
    # -- sandbox policy ------------------------------------------------------------------------------
    Row("policy-write-confined", bb.PolicyIgnored),
    Row("policy-deny-read", bb.DeniedReadsAllowed),
    Row("policy-limits", bb.LimitsDropped),
    Row("policy-processes", bb.ProcessesDropped, message_contains=("forked 40 of 40",)),
    Row("policy-not-liftable", bb.LimitsByTheShell),
    Row("policy-narrowed", bb.WideningAccepted),
    Row("policy-network-none", bb.NetworkIgnored, message_contains=("still reached: ['loopback'",)),
    Row("policy-network-none", bb.NoneMeansLoopback, message_contains=("still reached: ['loopback'",)),
    Row("policy-network-loopback", bb.LoopbackMeansNone, message_contains=("reached []",)),
    Row(
        "policy-network-allow-list",
        bb.ProxyAllowsAnyHost,
        message_contains=("said kit-allowed', 'status HTTP/1.1 502",),
    ),
    Row("policy-network-allow-list", bb.NetworkIgnored, message_contains=("direct-reached",)),
    Row("policy-allow-list-not-borrowed", bb.ProxyFilesWithoutKeys, message_contains=("reached unix '/",)),
    Row("task-cap-refused", bb.IgnoresTaskCap),
    Row("kill-running-task", bb.KillWaitsForEnd),
    Row("kill-ended-task-kills-leftovers", bb.KillOfEndedTaskNoop),
    Row("unknown-task-id", bb.UnknownIdRaisesKeyError),
    Row("end-cause-exited", bb.BackgroundExitStatusLost),
    Row("end-cause-signaled", bb.SelfSignalCountedAsKill),
    Row("end-cause-aborted", bb.AbortReportedAsTimeout),
    Row("end-cause-closed", bb.CloseReportedAsKill),
    Row("wait-final-and-never-raises", bb.WakesWaitersEarly),
    Row("task-ids-distinct", bb.TaskIdsFromClock),
    Row("owner-of", bb.OwnerOfForgetsEndedTasks),
    # -- background reads ----------------------------------------------------------------------------
    Row("read-merge-format", bb.MergesStderrWithoutMarker),
    Row("read-consuming", bb.NonConsumingReads),
    # -- input to a running task --------------------------------------------------------------------
    Row("input-reaches-task", bb.InputWrittenTwice),
    # The task was started without open input: the kit's first write is refused, and that escapes.
    Row("input-reaches-task", bb.ResolveDropsOpenStdin, "error", 30.0, ("not started with open_stdin",)),
    Row("input-off-by-default", bb.InputAlwaysOpen),
    Row("input-eof-after-close", bb.CloseDropsQueue),
    Row("input-refusals", bb.InputIgnoresOwner),
    # -- terminals ----------------------------------------------------------------------------------
    Row("terminal-size", bb.TerminalNotControlling),
    Row("terminal-resize", bb.ResizeIgnored),
    Row("terminal-ctrl-c", bb.TerminalWithoutSignals),
    Row("terminal-output-incremental", bb.TerminalDropsStderr),
    Row("terminal-kill-leaves-nothing", bb.TerminalKillsForegroundOnly),
    Row("waiting-reported", bb.NeverWaiting),
    Row("waiting-not-reported", bb.WaitingWhenSleeping),
    Row("waiting-reported", bb.WaitLookConsumes, "failed", 30.0, ("do they consume output?",)),
    Row("waiting-reported", bb.WaitLookFromLastRead, "failed", 30.0, ("right after write_input was True",)),
    Row("read-returns-at-once", bb.LongPollingReads),
    Row("read-lossy-exact", bb.NeverLossy),
    Row("finished-tasks-stay-readable", bb.EvictsFinishedOutput),
    Row("read-multibyte-split", bb.DecodesChunkByChunk),
    # -- output -----------------------------------------------------------------------------------------
    Row("streams-separate-exact", bb.StderrIntoStdout),
    Row("truncation-keeps-tail", bb.KeepsHead),
    Row("output-tap-live-exact", bb.TapDeliveredAtEnd),
    Row("output-tap-task", bb.TapGetsPlaceholders),
    Row("truncation-keeps-tail", bb.DropsSpillPaths),
    Row("flood-bounded-and-timed-out", bb.CountsOnlyKeptBytes),
    Row("flood-bounded-and-timed-out", bb.NeverLossy),
    Row("exact-limit-not-truncated", bb.TruncatesAtLimit),
    Row("spill-cap-inclusive", bb.ExclusiveSpillCap),
    Row("spill-total-cap", bb.IgnoresSpillTotal),
    Row("spill-file-private", bb.WorldReadableSpills),
    Row("spill-names-unpredictable", bb.SequentialSpillNames),
    Row("invalid-utf8-replaced", bb.DropsInvalidUtf8),
    Row("output-bytes-exact", bb.BytesFromText),
    Row("utf8-split-never-mangled", bb.DecodesChunkByChunk),
    Row("aclose-removes-spill-files", bb.KeepsSpillDir),
    # -- environment ----------------------------------------------------------------------------------
    Row("env-default-scrub", bb.LeaksAmbientSecrets),
    Row("env-ambient-passes-through", bb.NoAmbientEnv),
    Row("env-model-friendly", bb.FriendlyDefaultsDontOverride),
    Row("env-spec-wins", bb.ScrubsSpecEnv),
    Row("env-allow-readmits", bb.ForgetsEnvAllow),
    Row("env-scrub-replaces-defaults", bb.ScrubExtendsDefaults),
    Row("env-values-not-on-command-line", bb.EnvOnCommandLine),
    # -- listeners -------------------------------------------------------------------------------------
    Row("listener-called-once-per-task", bb.NotifiesTwice),
    Row("listener-unsubscribe", bb.UnsubscribeRemovesWrongCallable),
    Row("listener-raising-isolated", bb.RaisingListenerStopsOthers),
    Row("listener-silent-after-aclose", bb.NotifiesDuringClose),
    # -- lifecycle -------------------------------------------------------------------------------------
    Row("closed-executor-refuses-calls", bb.UsableAfterClose),
    Row("closed-executor-refuses-calls", bb.ResizeIgnoredAfterClose),
    Row("closed-error-is-infrastructure-error", bb.OwnClosedError),
    Row("aclose-idempotent-from-any-task", bb.ConcurrentAcloseRaises),
    Row("aclose-bounded", bb.SerialClose),
    Row("aclose-spares-other-executors", bb.SweepsAllExecutors),
    Row(
        "nothing-left-by-failed-open",
        bb.LeaksOnFailedOpen,
        "failed",
        30.0,
        ("left behind: the spill directory",),
    ),
    # -- beyond the contract ----------------------------------------------------------------------------
    Row("escapee-killed-on-kill", bb.GroupOnlyTracking),
    Row("escapee-killed-on-timeout", bb.GroupOnlyTracking),
    Row("escapee-killed-on-abort", bb.GroupOnlyTracking),
    Row("escapee-killed-on-aclose", bb.GroupOnlyTracking),
]

#: Checks no realistic broken backend can fail, with the reason (none so far).
UNFAILABLE: dict[str, str] = {}

#: Every broken backend defined in broken_backends.
BROKEN: list[type[LocalBashExecutor]] = sorted(
    (
        obj
        for name, obj in vars(bb).items()
        if isinstance(obj, type)
        and issubclass(obj, LocalBashExecutor)
        and obj.__module__ == bb.__name__
        and not name.startswith("_")
        and obj is not bb.LocalBashExecutor  # the (sound) base they share
    ),
    key=lambda cls: cls.__name__,
)

#: Every executor this module's targets made; their processes carry DSH_BASH_MARK=<token>-<n>.
_MADE: list[LocalBashExecutor] = []


def _target(backend: type[LocalBashExecutor], check_timeout_s: float = 30.0) -> KitTarget:
    def make_executor(**overrides: Any) -> LocalBashExecutor:
        executor = backend(LocalConfig(**overrides))
        _MADE.append(executor)
        return executor

    return KitTarget(
        name=backend.__name__,
        make_executor=make_executor,
        anyio_backend="asyncio",
        check_timeout_s=check_timeout_s,
    )


def _run(check: str, backend: type[LocalBashExecutor], check_timeout_s: float = 30.0) -> CheckResult:
    [result] = run_kit(_target(backend, check_timeout_s), only=[check]).results
    return result


def _describe(result: CheckResult) -> str:
    return f"{result.name}: {result.outcome}: {result.message or '(no message)'}"


# -- cleanup: broken backends may leave processes behind ----------------------------------------------


def _marked_pids(executors: list[LocalBashExecutor]) -> list[int]:
    """Live processes whose environment carries the marker of one of ``executors``."""
    needles = [f"\0{MARKER_VAR}={executor._token}-".encode() for executor in executors]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = b"\0" + handle.read()
        except OSError:
            continue
        if any(needle in environ for needle in needles):
            found.append(int(entry))
    return found


def _kill_marked(executors: list[LocalBashExecutor], within_s: float = 5.0) -> list[int]:
    """SIGKILL every process of ``executors`` until none is left; return the survivors."""
    deadline = time.monotonic() + within_s
    while pids := _marked_pids(executors):
        if time.monotonic() >= deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return []


@pytest.fixture(autouse=True)
def _kill_after_each_test() -> Iterator[None]:
    """Keep the machine quiet for the next row: kill what this test's executors left running."""
    first = len(_MADE)
    yield
    _kill_marked(_MADE[first:])


@pytest.fixture(scope="module", autouse=True)
def _kill_at_module_end() -> Iterator[None]:
    """No process of an executor made here outlives the module, nor a spill directory it kept.

    Executors of checks abandoned as hung may never close: their processes are killed here and
    their spill directories removed (the directory's fd is left to the executor, which may still
    close it).
    """
    yield
    survivors = _kill_marked(_MADE)
    kept = [*bb.KeepsSpillDir.left_behind, *bb.LeaksOnFailedOpen.left_behind]
    kept += [executor._spill_dir.path for executor in _MADE if executor._spill_dir is not None]
    for path in kept:
        shutil.rmtree(path, ignore_errors=True)
    assert not survivors, f"processes of this module's executors survived SIGKILL: {survivors}"


# -- the tests ---------------------------------------------------------------------------------------


def test_every_check_has_a_broken_backend() -> None:
    """The table covers exactly the registered checks: a new check needs a row, a stale row fails."""
    covered = {row.check for row in CAUGHT_BY}
    registered = set(CHECKS)
    assert not covered & set(UNFAILABLE), f"both caught and unfailable: {sorted(covered & set(UNFAILABLE))}"
    missing = registered - covered - set(UNFAILABLE)
    assert not missing, f"checks with no broken backend that fails them: {sorted(missing)}"
    stale = (covered | set(UNFAILABLE)) - registered
    assert not stale, f"names in the table that are no registered check: {sorted(stale)}"


def test_every_broken_backend_is_in_the_table() -> None:
    """No broken backend is dead code."""
    used = {row.backend for row in CAUGHT_BY}
    unused = [cls.__name__ for cls in BROKEN if cls not in used]
    assert not unused, f"broken backends no row uses: {unused}"


def test_errors_and_hangs_are_explained() -> None:
    """An "error" row names the exception that escaped; a "hung" row has a short check limit."""
    for row in CAUGHT_BY:
        if row.outcome == "error":
            assert row.message_contains, f"{row}: an error row must say what escaped"
        if row.outcome == "hung":
            assert row.check_timeout_s <= 10, f"{row}: a hang by design needs a short check limit"
        assert row.outcome != "passed", f"{row}: a broken backend must not pass"


@pytest.mark.parametrize("row", CAUGHT_BY, ids=[f"{row.check}-{row.backend.__name__}" for row in CAUGHT_BY])
def test_kit_catches(row: Row) -> None:
    """The kit reports the row's outcome for its check against its broken backend."""
    if row.needs_root and os.geteuid() != 0:
        pytest.skip(f"{row.backend.__name__} breaks {row.check} only for commands running as root")
    result = _run(row.check, row.backend, row.check_timeout_s)
    assert result.outcome == row.outcome, (
        f"expected {row.outcome!r} from {row.check} against {row.backend.__name__}, got {_describe(result)}"
    )
    for part in row.message_contains:
        assert part in result.message, f"the message does not say {part!r}: {_describe(result)}"


class _SlowLongPollingReads(bb.LongPollingReads):
    """LongPollingReads on a transport with a 50 ms round trip (each run waits that long first)."""

    async def run(self, spec: BashExecSpec) -> BashRunResult:
        await anyio.sleep(0.05)
        return await super().run(spec)


def test_reads_that_wait_are_caught_on_a_loaded_machine() -> None:
    """The measured latency widens each read's bound (ten round trips: 0.6 s at 50 ms, as a loaded CI
    machine measured), past LongPollingReads' half second; the fastest read's bound (two) does not."""
    result = _run("read-returns-at-once", _SlowLongPollingReads)
    assert result.outcome == "failed", _describe(result)
    assert "fastest of five reads" in result.message, _describe(result)


#: A basic check that every broken backend passes unless it breaks that very rule.
BASIC_CHECK = "exit-code-reported"


@pytest.mark.parametrize("backend", BROKEN, ids=[cls.__name__ for cls in BROKEN])
def test_broken_only_where_intended(backend: type[LocalBashExecutor]) -> None:
    """Each broken backend still passes a basic check, unless the rule it breaks is that check's."""
    breaks_it = any(row.check == BASIC_CHECK and row.backend is backend for row in CAUGHT_BY)
    result = _run(BASIC_CHECK, backend)
    expected = "failed" if breaks_it else "passed"
    assert result.outcome == expected, f"{backend.__name__}: {_describe(result)}"


class _WithoutFailedOpenHooks(LocalBashExecutor):
    """A sound backend that does not say how to make its open fail (as a third-party one may not)."""

    kit_failing_open = None  # type: ignore[assignment]
    kit_open_leftovers = None  # type: ignore[assignment]


def test_failed_open_check_is_not_applicable_without_its_hooks() -> None:
    """Without the hooks, nothing-left-by-failed-open reports not_applicable, never passed; the
    report's verdict counts it apart and it does not make the contract fail."""
    report = run_kit(_target(_WithoutFailedOpenHooks), only=["nothing-left-by-failed-open"])
    [result] = report.results
    assert result.outcome == "not_applicable", _describe(result)
    assert "kit_failing_open" in result.message and result.line().startswith("N/A "), _describe(result)
    assert report.contract_ok and report.failed == []
    assert "1 n/a" in report.verdict()
