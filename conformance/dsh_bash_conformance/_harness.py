"""The kit's harness: targets, the check registry, the per-check context and the runner."""

from __future__ import annotations

import re
import secrets
import shlex
import statistics
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

import anyio
import anyio.to_thread

from dsh_bash import BashExecRequest, BashExecutor

from ._host import find_host_processes, patch_os_environ
from ._watchdog import Abandoned, call_watched

__all__ = [
    "CHECKS",
    "Check",
    "CheckContext",
    "CheckFailed",
    "CheckKind",
    "CheckOutcome",
    "CheckResult",
    "KitReport",
    "KitTarget",
    "LatencyCache",
    "NotApplicable",
    "check",
    "run_kit",
]

CheckKind = Literal["contract", "beyond"]
CheckOutcome = Literal["passed", "failed", "error", "hung", "not_applicable"]
CheckFn = Callable[["CheckContext"], Awaitable[None]]

#: The budgets every executor a check creates starts from; a check's overrides win.
EXECUTOR_DEFAULTS: Mapping[str, Any] = {"grace_ms": 300, "timeout_ms": 10_000}

#: How long the kit's own cleanup after a check may take (killing leftovers, removing temp dirs).
_CLEANUP_TIMEOUT_S = 15.0

#: The fixed part of every allowance: the kit's default grace (``EXECUTOR_DEFAULTS["grace_ms"]``), the
#: time the kit already grants a process to react to a signal.
ALLOWANCE_BASE_S: float = EXECUTOR_DEFAULTS["grace_ms"] / 1000

#: Round trips the kit times before each check: ``exec("true")`` runs, then ``start`` + ``read_output``
#: until the task's output arrived. The latency is the median of all of them (one stall moves it not).
_PROBE_EXECS = 3
_PROBE_READS = 2
#: How long the probe may take in all; what it measured by then counts.
_PROBE_LIMIT_S = 10.0
#: How long a measurement stands for the checks after it (a check that fails measures afresh).
_LATENCY_MAX_AGE_S = 15.0

_KIT_DIR = str(Path(__file__).resolve().parent)


class LatencyCache:
    """The latency last measured for a target, reused by the checks that follow within its lifetime.

    A measurement costs about five round trips through a fresh executor (a container, in Docker's
    image mode): measuring before every check would double the kit's run time there. A check that
    fails forgets it (:meth:`forget`), so that the next one measures afresh. Thread-safe: runs on one
    target may overlap.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: float | None = None
        self._taken_at = 0.0

    def fresh(self) -> float | None:
        with self._lock:
            if self._value is None or time.monotonic() - self._taken_at > _LATENCY_MAX_AGE_S:
                return None
            return self._value

    def update(self, value: float) -> None:
        with self._lock:
            self._value, self._taken_at = value, time.monotonic()

    def forget(self) -> None:
        with self._lock:
            self._value = None


@dataclass(frozen=True)
class KitTarget:
    """A backend under test.

    ``make_executor(**config_overrides)`` returns a new, unopened executor; the overrides are
    :class:`dsh_bash.BudgetConfig` field names. ``plant_ambient(variables)`` is a context manager
    under which executors created inside the block see ``variables`` in their ambient
    environment. ``find_processes(marker)`` lists the live (non-zombie) processes, where the
    backend's commands run, whose command line contains ``marker`` (pids as seen there).
    """

    name: str
    make_executor: Callable[..., BashExecutor]
    plant_ambient: Callable[[Mapping[str, str]], AbstractContextManager[None]] = patch_os_environ
    find_processes: Callable[[str], list[int]] = find_host_processes
    anyio_backend: str = "asyncio"
    check_timeout_s: float = 30.0
    #: Each allowance is ``ALLOWANCE_BASE_S + allowance_factor * latency``, the latency being what the
    #: kit measured for this target right before the check (see :meth:`CheckContext.allowance_s`).
    allowance_factor: float = 10.0
    #: The latency last measured for this target: every run on the same target object reuses it for
    #: up to ``_LATENCY_MAX_AGE_S`` (a measurement costs five round trips through a fresh executor),
    #: so a test suite that runs one check per :func:`run_kit` call keeps one target per backend.
    latency: LatencyCache = field(default_factory=LatencyCache, compare=False, repr=False)


class CheckFailed(Exception):
    """A check observed behaviour the contract forbids."""


class NotApplicable(Exception):
    """A check cannot be run against this target (the backend lacks an optional hook it needs).

    Reported as ``not_applicable``: neither a pass nor a failure (see :attr:`KitReport.contract_ok`).
    """


#: The form of a rule id in ``docs/contract.md``: ``R-<section>-<short-name>``.
CLAUSE_PATTERN = re.compile(r"R-[a-z]+(?:-[a-z0-9]+)+")


@dataclass(frozen=True)
class Check:
    """A registered check: ``clause`` is the id of the rule of ``docs/contract.md`` it enforces,
    ``rule`` that rule's sentence as the check proves it."""

    name: str
    kind: CheckKind
    clause: str
    rule: str
    fn: CheckFn


#: How a report line shows each outcome.
_LABELS: Mapping[CheckOutcome, str] = {
    "passed": "PASS",
    "failed": "FAIL",
    "error": "ERROR",
    "hung": "HUNG",
    "not_applicable": "N/A",
}


@dataclass(frozen=True)
class CheckResult:
    name: str
    kind: CheckKind
    clause: str
    rule: str
    outcome: CheckOutcome
    message: str
    duration_s: float

    def line(self, name_width: int = 0) -> str:
        """The result as a report line: ``FAIL  contract NAME  0.12s  message`` (name padded to the width)."""
        line = f"{_LABELS[self.outcome]:<5} {self.kind:<8} {self.name:<{name_width}} {self.duration_s:6.2f}s"
        if self.message:
            line += "  " + " ".join(self.message.split("\n"))
        return line


#: Every registered check, by name, in definition order.
CHECKS: dict[str, Check] = {}


def check(name: str, *, kind: CheckKind, clause: str, rule: str) -> Callable[[CheckFn], CheckFn]:
    """Register ``async def fn(ctx: CheckContext) -> None`` as a check.

    ``clause`` is the id of the rule in ``docs/contract.md`` the check enforces (``R-output-tail``);
    ``rule`` is that rule's sentence.
    """
    if kind not in ("contract", "beyond"):
        raise ValueError(f"check {name!r}: kind must be 'contract' or 'beyond', not {kind!r}")
    if not CLAUSE_PATTERN.fullmatch(clause):
        raise ValueError(f"check {name!r}: clause must be a rule id like 'R-output-tail', not {clause!r}")

    def register(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"a check named {name!r} is already registered")
        CHECKS[name] = Check(name=name, kind=kind, clause=clause, rule=rule, fn=fn)
        return fn

    return register


class CheckContext:
    """What a check works with: executors of the target, markers, expectations, process probes."""

    def __init__(self, target: KitTarget, current: Check) -> None:
        self.target = target
        self.check = current
        self._markers: list[str] = []
        self._tempdirs: list[str] = []
        #: The target's round-trip latency in seconds, measured right before the check ran.
        self.latency_s: float = 0.0

    # -- allowances -----------------------------------------------------------------------------

    @property
    def allowance_s(self) -> float:
        """Extra seconds a "returns within" bound grants for scheduling and process start-up.

        ``ALLOWANCE_BASE_S`` (the kit's default grace) plus ``target.allowance_factor`` times the
        latency the kit measured for this target right before the check: a busy machine or a slow
        transport widens it, an idle one keeps it tight.
        """
        return ALLOWANCE_BASE_S + self.target.allowance_factor * self.latency_s

    @property
    def prompt_s(self) -> float:
        """How long a call that must return at once (no process to wait for: a read) may take.

        0.1 s plus ``target.allowance_factor`` times the measured latency: with the default factor
        it stays below half a second while the latency is under 40 ms.
        """
        return 0.1 + self.target.allowance_factor * self.latency_s

    def describe_allowance(self) -> str:
        return (
            f"allowance {self.allowance_s:.2f} s = {ALLOWANCE_BASE_S:g} s + {self.target.allowance_factor:g} "
            f"x {self.latency_s * 1000:.0f} ms measured latency"
        )

    async def _measure_latency(self) -> None:
        """Time a few round trips of a fresh executor of the target; keep their median."""
        samples: list[float] = []
        with anyio.move_on_after(_PROBE_LIMIT_S):
            async with self.executor() as ex:
                for _ in range(_PROBE_EXECS):
                    started = time.monotonic()
                    await ex.exec("true")
                    samples.append(time.monotonic() - started)
                for _ in range(_PROBE_READS):
                    started = time.monotonic()
                    task = await ex.start(ex.resolve(BashExecRequest(command="printf x")))
                    seen = ""
                    while "x" not in seen and time.monotonic() - started < _PROBE_LIMIT_S / 4:
                        seen += (await ex.read_output(task.id)).delta
                        if "x" not in seen:
                            await anyio.sleep(0.002)
                    samples.append(time.monotonic() - started)
        if not samples:
            raise CheckFailed(
                f"the kit could not time a single exec('true') of the target within {_PROBE_LIMIT_S:g} s"
            )
        self.latency_s = statistics.median(samples)

    # -- executors and markers ----------------------------------------------------------------

    def executor(self, **overrides: Any) -> BashExecutor:
        """A new, unopened executor of the target with fast defaults (grace 300 ms, timeout 10 s)."""
        fields = dict(EXECUTOR_DEFAULTS)
        if "max_timeout_ms" in overrides and "timeout_ms" not in overrides:
            fields["timeout_ms"] = min(fields["timeout_ms"], overrides["max_timeout_ms"])
        fields.update(overrides)
        return self.target.make_executor(**fields)

    def marker(self) -> str:
        """A unique string to put in a command line and find the process by (``kitmark-<hex>``)."""
        mark = f"kitmark-{secrets.token_hex(6)}"
        self._markers.append(mark)
        return mark

    def plant_ambient(self, variables: Mapping[str, str]) -> AbstractContextManager[None]:
        """Executors created inside the block see ``variables`` in their ambient environment."""
        return self.target.plant_ambient(variables)

    async def tempdir(self, ex: BashExecutor) -> str:
        """A new directory where ``ex`` runs its commands, removed by the kit after the check."""
        result = await ex.exec("mktemp -d")
        path = result.stdout.text.strip()
        if result.exit_code != 0 or not path.startswith("/"):
            raise CheckFailed(
                f"could not create a temporary directory with mktemp -d: exit {result.exit_code}, "
                f"stdout {result.stdout.text!r}, stderr {result.stderr.text!r}"
            )
        self._tempdirs.append(path)
        return path

    # -- expectations ---------------------------------------------------------------------------

    def expect(self, condition: object, message: str) -> None:
        """Fail the check with ``message`` unless ``condition`` holds."""
        if not condition:
            raise CheckFailed(message)

    def fail(self, message: str) -> NoReturn:
        raise CheckFailed(message)

    def not_applicable(self, message: str) -> NoReturn:
        """End the check as ``not_applicable`` (it cannot run against this target), saying why."""
        raise NotApplicable(message)

    # -- processes ----------------------------------------------------------------------------

    async def processes(self, marker: str) -> list[int]:
        """Pids of live processes whose command line contains ``marker`` (run in a worker thread)."""
        return await anyio.to_thread.run_sync(self.target.find_processes, marker)

    async def wait_gone(self, marker: str, within_s: float) -> list[int]:
        """Poll until no process carries ``marker`` or ``within_s`` passed; return the survivors."""
        deadline = time.monotonic() + within_s
        while True:
            survivors = await self.processes(marker)
            if not survivors or time.monotonic() >= deadline:
                return survivors
            await anyio.sleep(0.02)

    # -- the kit's own cleanup ----------------------------------------------------------------

    async def _cleanup(self) -> str:
        """Kill processes still carrying this check's markers and remove its temp dirs."""
        pids: set[int] = set()
        for mark in self._markers:
            pids.update(await self.processes(mark))
        if not pids and not self._tempdirs:
            return ""
        parts = []
        if pids:
            # The pids are checked again where the commands run: only a process that still carries
            # one of the markers is killed (pids are reused).
            marks = "|".join(f"*{mark}*" for mark in self._markers)
            parts.append(
                f"for p in {' '.join(str(pid) for pid in sorted(pids))}; do "
                f'case "$(tr "\\0" " " < /proc/$p/cmdline 2>/dev/null)" in {marks}) kill -KILL $p;; esac; '
                "done 2>/dev/null"
            )
        if self._tempdirs:
            parts.append("rm -rf " + " ".join(shlex.quote(path) for path in self._tempdirs))
        async with self.executor() as ex:
            await ex.exec("; ".join([*parts, "true"]))
        if pids:
            return f"kit cleanup killed {len(pids)} leftover process(es) carrying this check's markers"
        return ""


@dataclass
class KitReport:
    """The results of one kit run against one target."""

    target: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def contract_ok(self) -> bool:
        """True when every contract check that ran passed or was not applicable."""
        return all(r.outcome in ("passed", "not_applicable") for r in self.results if r.kind == "contract")

    @property
    def failed(self) -> list[CheckResult]:
        """Every result that did not pass (failed, error or hung; not_applicable is none of them)."""
        return [r for r in self.results if r.outcome not in ("passed", "not_applicable")]

    def _counts(self, kind: CheckKind) -> dict[str, int]:
        counts = {"total": 0, "passed": 0, "failed": 0, "error": 0, "hung": 0, "not_applicable": 0}
        for result in self.results:
            if result.kind == kind:
                counts["total"] += 1
                counts[result.outcome] += 1
        return counts

    def summary(self) -> str:
        """One line per check, then the :meth:`verdict`."""
        width = max((len(r.name) for r in self.results), default=0)
        return "\n".join([*(r.line(width) for r in self.results), self.verdict()])

    def verdict(self) -> str:
        """One line that reports contract and beyond checks apart, then the verdict."""
        parts = []
        for kind in ("contract", "beyond"):
            c = self._counts(kind)
            # Shown only when some check could not run, so that the usual line stays as it was.
            not_applicable = f", {c['not_applicable']} n/a" if c["not_applicable"] else ""
            parts.append(
                f"{kind} {c['passed']}/{c['total']} passed"
                f" ({c['failed']} failed, {c['error']} error, {c['hung']} hung{not_applicable})"
            )
        verdict = "contract OK" if self.contract_ok else "contract FAILED"
        return f"{self.target}: {'; '.join(parts)}: {verdict}"

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "contract_ok": self.contract_ok,
            "counts": {kind: self._counts(kind) for kind in ("contract", "beyond")},
            "results": [asdict(r) for r in self.results],
        }


def _where(tb: traceback.StackSummary) -> str:
    """The innermost frame of a check module in a stack (else of the kit's helpers), as ``file:line``."""
    kit_frames = [
        frame
        for frame in tb
        if frame.filename.startswith(_KIT_DIR) and not frame.filename.endswith("_harness.py")
    ]
    checks = [frame for frame in kit_frames if Path(frame.filename).name.startswith("_checks_")]
    frames = checks or kit_frames
    if not frames:
        return ""
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"


def _describe(exc: BaseException) -> str:
    where = _where(traceback.extract_tb(exc.__traceback__))
    suffix = f" at {where}" if where else ""
    if isinstance(exc, BaseExceptionGroup):
        inner = "; ".join(f"{type(e).__name__}: {e}" for e in exc.exceptions)
        return (
            f"an ExceptionGroup escaped (the contract lets none escape a public method): "
            f"{type(exc).__name__}: {exc} [{inner}]{suffix}"
        )
    return f"{type(exc).__name__}: {exc}{suffix}"


def _check_failure(exc: BaseException) -> CheckFailed | None:
    """The CheckFailed inside (possibly nested) exception groups, if any."""
    if isinstance(exc, CheckFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _check_failure(inner)
            if found is not None:
                return found
    return None


def _failed(exc: CheckFailed) -> tuple[CheckOutcome, str]:
    where = _where(traceback.extract_tb(exc.__traceback__))
    return "failed", f"{exc}" + (f" [{where}]" if where else "")


def _run_one(target: KitTarget, current: Check) -> CheckResult:
    ctx = CheckContext(target, current)
    cache = target.latency

    async def body() -> None:
        known = cache.fresh()
        if known is None:
            await ctx._measure_latency()
            cache.update(ctx.latency_s)
        else:
            ctx.latency_s = known
        await current.fn(ctx)

    def worker() -> tuple[CheckOutcome, str]:
        try:
            anyio.run(body, backend=target.anyio_backend)
        except CheckFailed as exc:
            return _failed(exc)
        except NotApplicable as exc:
            return "not_applicable", str(exc)
        except BaseException as exc:
            # A check's own task group wraps its CheckFailed in a group: that is a failed check,
            # not an ExceptionGroup escaping the backend.
            failure = _check_failure(exc)
            return _failed(failure) if failure is not None else ("error", _describe(exc))
        return "passed", ""

    started = time.monotonic()
    outcome: CheckOutcome
    try:
        outcome, message = call_watched(worker, name=f"kit-{current.name}", timeout_s=target.check_timeout_s)
    except Abandoned as abandoned:
        where = _where(abandoned.stack())
        outcome = "hung"
        message = f"did not finish within {target.check_timeout_s:g} s; its thread was abandoned"
        if where:
            message += f" while at {where}"
    duration = time.monotonic() - started

    def cleaner() -> str:
        try:
            return anyio.run(ctx._cleanup, backend=target.anyio_backend)
        except BaseException as exc:
            return f"kit cleanup failed: {_describe(exc)}"

    try:
        note = call_watched(cleaner, name=f"kit-cleanup-{current.name}", timeout_s=_CLEANUP_TIMEOUT_S)
    except Abandoned:
        note = "kit cleanup did not finish"
    if outcome not in ("passed", "not_applicable") and ctx.latency_s:
        note = f"{ctx.describe_allowance()}; {note}" if note else ctx.describe_allowance()
    if note:
        message = f"{message} ({note})" if message else f"({note})"
    return CheckResult(
        name=current.name,
        kind=current.kind,
        clause=current.clause,
        rule=current.rule,
        outcome=outcome,
        message=message,
        duration_s=round(duration, 3),
    )


def run_kit(
    target: KitTarget,
    *,
    only: Iterable[str] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> KitReport:
    """Run the checks (all, or those named in ``only``) against ``target``, one at a time.

    Each check runs in a fresh daemon thread with its own event loop; a check still running
    after ``target.check_timeout_s`` is reported ``hung`` and abandoned.
    """
    if target.anyio_backend not in ("asyncio", "trio"):
        raise ValueError(f"anyio_backend must be 'asyncio' or 'trio', not {target.anyio_backend!r}")
    if isinstance(only, str):
        only = [only]
    if only is None:
        names = list(CHECKS)
    else:
        names = list(dict.fromkeys(only))
        unknown = [name for name in names if name not in CHECKS]
        if unknown:
            raise ValueError(f"unknown check name(s): {', '.join(unknown)}")
    report = KitReport(target=target.name)
    for name in names:
        result = _run_one(target, CHECKS[name])
        if result.outcome not in ("passed", "not_applicable"):
            target.latency.forget()  # the next check measures afresh
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    return report
