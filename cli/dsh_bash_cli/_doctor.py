"""``dsh-bash doctor``: can this configuration's backend run commands? One finding per step.

Steps, in order: ``config`` (the file loads), ``open`` (the backend is reached within the bound),
``bash`` (``$BASH_VERSION``), ``workdir`` (``pwd`` in the default working directory), ``spill``
(output beyond ``max_output_bytes`` lands in a spill file that ``test -f`` finds), ``setsid``
(``command -v setsid``, a failure only for a backend whose ``needs_setsid`` is true), ``policy``
(the configured sandbox policy, and which of its rules can hold where commands run: each is tried
on ``true``, narrowing the configured policy; a failure only when the configured policy's own rules
do not all hold, which ``enforcement = "best_effort"`` lets the executor open with), ``close``. A
failed ``config`` or ``open`` ends the run.

Each failure carries a fix, chosen by the reason of the error behind it
(:attr:`dsh_bash.BashInfrastructureError.reason`): the backend's own hint for that reason
(:attr:`dsh_bash.BashExecutor.infra_hints`) before the generic one (:data:`GENERIC_HINTS`). A
failure without a reason (no error, or an ``unclassified`` one) gets the hint of the reason its
step stands for (``bash``: ``shell_missing``, ``workdir``: ``workdir_missing``, ``spill``:
``spill_unavailable``). The doctor knows no backend by name and never reads an error's message.

The steps run on an event loop in a daemon thread; the calling thread waits for each finding at
most the bound (plus a little), so a backend that blocks the event loop or swallows cancellation
still gets a ``FAIL`` line instead of a hang.
"""

from __future__ import annotations

import math
import os
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from dsh_bash import (
    BashExecRequest,
    BashExecutor,
    BashInfrastructureError,
    BashRunResult,
    ConfigError,
    DshBashError,
    InfraReason,
    PolicyWidened,
    SandboxPolicy,
    load_executor,
)

from ._text import one_line

__all__ = ["GENERIC_HINTS", "STEPS", "Finding", "hint", "run_doctor"]

#: Every step, in the order it runs.
STEPS = ("config", "open", "bash", "workdir", "spill", "setsid", "policy", "close")

#: The rules the ``policy`` step tries, each as fields that narrow the configured policy.
_POLICY_RULES: tuple[tuple[str, dict[str, object]], ...] = (
    ("workspace-write", {"filesystem": "workspace-write"}),
    ("network none", {"network": "none"}),
    ("network loopback", {"network": "loopback"}),
    # A configured allow-list keeps its own hosts (another list would be wider than it).
    ("network allow-list", {"network": "allow-list", "allow_hosts": ["example.com"]}),
    ("processes", {"limits": {"processes": 64}}),
)

#: ``max_output_bytes`` for the spill step, and how much the step prints (beyond it, so it spills).
_SPILL_LIMIT = 1024
_SPILL_PRINT = 4096
#: Slack the calling thread grants beyond a step's own bound before it declares the step hung.
_WATCHDOG_SLACK_S = 5.0

_SET_CWD = "set cwd in the config to an existing directory, where the commands run, that this user may enter"
_POLICY_GAP = (
    "run where the rule can hold (the reason above names what is missing there), or drop the rule from "
    "the policy; best_effort lets commands run without it"
)
_BACKEND_FAILED = "the backend failed under the command: check that where commands run is healthy, then retry"


@dataclass(frozen=True)
class Finding:
    """The outcome of one step: ``ok``, what was seen, and how to fix it when not ok."""

    step: str
    ok: bool
    detail: str
    fix: str = ""


class _StepFailed(Exception):
    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


#: The fix for an infrastructure error's reason when the backend has none of its own in
#: :attr:`BashExecutor.infra_hints`.
GENERIC_HINTS: Mapping[InfraReason, str] = {
    "closed": "a bug: the executor was used outside its block; please report it",
    "already_aborted": "a bug: the doctor aborts nothing; please report it",
    "workdir_missing": _SET_CWD,
    "workdir_not_directory": _SET_CWD,
    "workdir_not_accessible": _SET_CWD,
    "shell_missing": "install bash where the commands run",
    "start_failed": (
        "see the message: no process could be created where the commands run (process or memory "
        "limits, a missing program such as setsid)"
    ),
    "spill_unavailable": (
        "make the spill location writable where the commands run, and check free space and "
        "max_spill_bytes/max_spill_total_bytes"
    ),
    "task_limit": (
        "wait for or kill a running background task, or raise max_running_tasks (each task holds a few "
        "descriptors: raise the descriptor limit with it)"
    ),
    "interactive_unsupported": (
        'start the task without open_stdin or terminal, or use a backend (or containment = "subreaper") '
        "that keeps a command's input open"
    ),
    "session_unknown": (
        "make the session with executor.session(owner) on this executor, for the owner the request names"
    ),
    "session_unsupported": (
        'run without a session, or use a backend (or containment = "subreaper") whose commands carry one'
    ),
    "files_unsupported": (
        "move the file with a command (cat, base64), or use a backend that moves files (local, SSH with "
        "SFTP or exec_sftp_server)"
    ),
    "policy_unenforceable": (
        "run on a backend and kernel that apply the policy (local with Landlock), set the policy's "
        'enforcement = "best_effort" to run without what cannot hold, or drop the policy'
    ),
    "engine_unreachable": "start the container engine, or point the config at one that answers",
    "image_missing": "pull the image, or let the backend pull it",
    "container_missing": "name an existing, running container in the config",
    "user_unknown": "set the user in the config (or the request's user) to one that exists where the "
    "commands run",
    "user_unsupported": "drop the request's user: this backend runs every command as its one user (the "
    "Docker backend switches users per command)",
    "host_unreachable": "check the host, the port and that the network reaches it; raise the connect timeout",
    "auth_failed": "check the user name and credentials in the config: the server must accept one",
    "host_key_rejected": "add the host's key to the known hosts file the config names",
    "cluster_unreachable": "start the Ray cluster, or set the config's address to one that answers "
    "(ray status tells)",
    "no_node_fits": "add a node with the config's resources or labels, or loosen the placement",
    "container_gone": _BACKEND_FAILED,
    "connection_lost": _BACKEND_FAILED,
    "command_lost": _BACKEND_FAILED,
    "node_lost": "open a new executor: the node and everything of the old one on it are gone",
}

#: The reason a failed step stands for when no error says better (no error, or an unclassified one).
_STEP_REASONS: Mapping[str, InfraReason] = {
    "bash": "shell_missing",
    "workdir": "workdir_missing",
    "spill": "spill_unavailable",
}
_OPEN_HINT = "make the backend reachable (see the message), or raise the bound with --timeout"


def hint(executor: type[BashExecutor] | None, step: str, error: BaseException | None = None) -> str:
    """The fix for a failed ``step``: by the error's reason, the backend's hint before the generic one.

    Without a reason (no error, not an infrastructure error, or ``unclassified``), the step says which
    reason it stands for.
    """
    reason = error.reason if isinstance(error, BashInfrastructureError) else None
    if reason is None or reason == "unclassified":
        if step == "open":
            return _OPEN_HINT
        reason = _STEP_REASONS.get(step)
        if reason is None:
            return "see the message above"
    own = executor.infra_hints if executor is not None else {}
    return own.get(reason) or GENERIC_HINTS[reason]


def _show(result: BashRunResult) -> str:
    parts = [f"exit {result.exit_code}" if result.signal is None else f"killed by {result.signal}"]
    if result.timed_out:
        parts.append("timed out")
    stderr = result.stderr.text.strip()
    if stderr:
        parts.append(f"stderr: {' '.join(stderr.split())[:300]}")
    return ", ".join(parts)


class _Doctor:
    def __init__(
        self,
        source: Mapping[str, Any] | str | os.PathLike[str],
        timeout_s: float,
        send: Callable[[Finding], None],
    ) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.send = send
        self.backend: type[BashExecutor] | None = None

    def put(self, step: str, ok: bool, detail: str, fix: str = "") -> None:
        self.send(Finding(step, ok, detail, fix))

    async def exec(self, ex: BashExecutor, step: str, command: str) -> BashRunResult:
        bound_ms = min(self.timeout_s * 1000, ex.config.max_timeout_ms)
        try:
            with anyio.fail_after(self.timeout_s + 1.0):
                return await ex.exec(command, timeout_ms=bound_ms)
        except TimeoutError:
            raise _StepFailed(
                f"`{command}` did not return within {self.timeout_s:g} s", hint(self.backend, step)
            ) from None
        except DshBashError as exc:
            raise _StepFailed(one_line(exc), hint(self.backend, step, exc)) from None

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as exc:  # a bug: still a finding, never a traceback from a thread
            detail = f"unexpected {type(exc).__name__}: {one_line(exc)}"
            self.put("error", False, detail, "a bug in the backend or in dsh-bash: please report it")

    async def _run(self) -> None:
        try:
            ex = load_executor(self.source)
        except ConfigError as exc:
            fix = (
                "correct what the message names (in the file, or the DSH_BASH_<FIELD> variable), or "
                "install the package it names"
            )
            self.put("config", False, one_line(exc), fix)
            return
        cls = self.backend = type(ex)
        self.put("config", True, f"backend {cls.__name__} ({cls.__module__.partition('.')[0]})")

        started = time.monotonic()
        opened = False
        closing_at = 0.0
        #: The step under way: an error no step expected is that step's (else the close's).
        current = "close"
        try:
            # The bound covers opening only: the executor's task group lives from its __aenter__
            # to its __aexit__, so the scope must enclose both and is lifted once it is open.
            with anyio.CancelScope(deadline=anyio.current_time() + self.timeout_s) as bound:
                async with ex:
                    opened = True
                    bound.deadline = math.inf
                    where = f"; commands run on {ex.where}" if ex.where else ""
                    self.put("open", True, f"opened in {time.monotonic() - started:.2f} s{where}")
                    self._containment(ex)
                    for step, probe in (
                        ("bash", self._bash),
                        ("workdir", self._workdir),
                        ("spill", self._spill),
                        ("setsid", self._setsid),
                        ("policy", self._policy),
                    ):
                        current = step
                        try:
                            self.put(step, True, await probe(ex))
                        except _StepFailed as exc:
                            self.put(step, False, exc.detail, exc.fix)
                    current = "close"
                    closing_at = time.monotonic()
        except Exception as exc:
            if opened:
                self.put(current, False, one_line(exc), "see the message above")
            else:
                self.put("open", False, one_line(exc), hint(cls, "open", exc))
            return
        if not opened:  # the bound ran out while opening
            detail = f"the backend did not open within {self.timeout_s:g} s"
            self.put("open", False, detail, hint(cls, "open"))
            return
        self.put("close", True, f"closed in {time.monotonic() - closing_at:.2f} s")

    def _containment(self, ex: BashExecutor) -> None:
        """Which containment is active; a marker the config did not ask for is a finding to fix."""
        level = ex.containment
        if level is None:
            return
        if level != "marker":
            self.put("containment", True, f"{level}: every command under dsh-supervise")
            return
        chosen = getattr(ex.config, "containment", None) == "marker"
        detail = "marker: processes are found by an environment marker (a process that drops it escapes)"
        if chosen:
            self.put("containment", True, f"{detail}; as configured")
        else:
            fix = (
                "the supervisor cannot run where the commands run (the warning logged at open says why); "
                "set containment = 'marker' to accept it, or 'subreaper' to refuse to open without it"
            )
            self.put("containment", False, detail, fix)

    async def _bash(self, ex: BashExecutor) -> str:
        result = await self.exec(ex, "bash", 'printf "%s" "$BASH_VERSION"')
        version = result.stdout.text.strip()
        if result.exit_code != 0 or not version:
            raise _StepFailed(
                f"`echo $BASH_VERSION` printed {version!r} ({_show(result)})", hint(self.backend, "bash")
            )
        return f"bash {version}"

    async def _workdir(self, ex: BashExecutor) -> str:
        expected = ex.resolve(BashExecRequest(command="pwd")).workdir
        result = await self.exec(ex, "workdir", "pwd")
        if result.exit_code != 0:
            detail = f"`pwd` in {expected} failed ({_show(result)})"
            raise _StepFailed(detail, hint(self.backend, "workdir"))
        shown = result.stdout.text.strip()
        return expected if shown in ("", expected) else f"{expected} (pwd: {shown})"

    async def _spill(self, ex: BashExecutor) -> str:
        limit = ex.config.max_output_bytes
        try:
            ex.reconfigure(max_output_bytes=_SPILL_LIMIT)
        except ConfigError as exc:
            raise _StepFailed(one_line(exc), "see the message above") from None
        try:
            result = await self.exec(ex, "spill", f"printf '%{_SPILL_PRINT}s' x")
        finally:
            ex.reconfigure(max_output_bytes=limit)
        out = result.stdout
        if result.exit_code != 0 or out.total_bytes != _SPILL_PRINT or not out.truncated:
            detail = (
                f"printing {_SPILL_PRINT} bytes with max_output_bytes={_SPILL_LIMIT} gave "
                f"total_bytes={out.total_bytes}, truncated={out.truncated} ({_show(result)})"
            )
            raise _StepFailed(detail, "the backend's output accounting is broken: report it to its authors")
        if out.spill_path is None:
            detail = f"output beyond max_output_bytes={_SPILL_LIMIT} was truncated but no spill file was made"
            raise _StepFailed(detail, hint(self.backend, "spill"))
        found = await self.exec(ex, "spill", f"test -f {shlex.quote(out.spill_path)}")
        if found.exit_code != 0:
            detail = f"the spill file {out.spill_path} is not there for the next command ({_show(found)})"
            raise _StepFailed(detail, hint(self.backend, "spill"))
        return f"spill file {out.spill_path}"

    async def _setsid(self, ex: BashExecutor) -> str:
        result = await self.exec(ex, "setsid", "command -v setsid")
        path = result.stdout.text.strip()
        if result.exit_code == 0 and path:
            return path
        if not type(ex).needs_setsid:
            return f"not found ({type(ex).__name__} does not need it)"
        raise _StepFailed(
            "setsid not found where the commands run (`command -v setsid` failed)",
            f"install setsid there (util-linux, or busybox): {type(ex).__name__} needs it",
        )

    async def _policy(self, ex: BashExecutor) -> str:
        configured = ex.config.policy
        detail = f"configured: {_describe_policy(configured)}"
        if configured.active and configured.enforcement == "best_effort":
            problem = await self._policy_problem(
                ex, configured.model_copy(update={"enforcement": "required"})
            )
            if problem is not None:
                raise _StepFailed(
                    f"{detail}; it does not hold here and commands run without it: {problem}",
                    _POLICY_GAP,
                )
        holds: list[str] = []
        for name, fields in _POLICY_RULES:
            merged = {**configured.model_dump(), **fields}
            if merged["network"] != "allow-list":
                merged["allow_hosts"] = []  # a list goes with network = "allow-list" only
            elif configured.network == "allow-list":
                merged["allow_hosts"] = list(configured.allow_hosts)
            try:
                asked = SandboxPolicy.model_validate(merged)
                problem = await self._policy_problem(ex, asked)
            except PolicyWidened:
                holds.append(f"{name}: wider than configured")
                continue
            holds.append(f"{name}: yes" if problem is None else f"{name}: no: {problem}")
        return f"{detail}; can hold here: {', '.join(holds)}"

    async def _policy_problem(self, ex: BashExecutor, policy: SandboxPolicy) -> str | None:
        """None when ``true`` runs under ``policy`` (in ``/``, which every backend has), else why not."""
        try:
            result = await ex.exec("true", workdir="/", policy=policy, timeout_ms=self.timeout_s * 1000)
        except BashInfrastructureError as exc:
            if exc.reason != "policy_unenforceable":
                raise _StepFailed(one_line(exc), hint(self.backend, "policy", exc)) from None
            return one_line(exc)
        if result.exit_code != 0:
            return f"`true` under it failed ({_show(result)})"
        return None


def _describe_policy(policy: SandboxPolicy) -> str:
    if not policy.active:
        return "unrestricted"
    words: list[str] = [policy.filesystem]
    if policy.deny_read:
        words.append(f"{len(policy.deny_read)} path(s) unreadable")
    if policy.network != "all":
        words.append(f"network {policy.network}")
    limits = [f"{name}={value}" for name, value in policy.limits.model_dump().items() if value is not None]
    if limits:
        words.append(f"limits {' '.join(limits)}")
    words.append(f"enforcement {policy.enforcement}")
    return ", ".join(words)


def run_doctor(
    source: Mapping[str, Any] | str | os.PathLike[str],
    *,
    timeout_s: float = 30.0,
    report: Callable[[Finding], None],
) -> bool:
    """Run the steps against the configured backend, ``report`` each finding as it comes; True if all ok.

    ``timeout_s`` bounds opening the backend, each check's command and closing it.
    """
    from dsh_bash_conformance import Abandoned, watched

    seen: list[str] = []

    def pending() -> str:
        return next((step for step in STEPS if step not in seen), "close")

    def bound() -> float:
        return timeout_s + (2 * timeout_s if pending() == "spill" else 0) + _WATCHDOG_SLACK_S

    def run(send: Callable[[Finding], None]) -> None:
        anyio.run(_Doctor(source, timeout_s, send).run)

    all_ok = True
    try:
        for finding in watched(run, name="dsh-bash-doctor", bound=bound):
            seen.append(finding.step)
            all_ok = all_ok and finding.ok
            report(finding)
    except Abandoned as abandoned:
        detail = (
            f"no answer within {abandoned.waited_s:g} s: the backend blocks its event loop or ignores "
            "cancelling"
        )
        fix = "report it to the backend's authors; meanwhile this process abandons it"
        report(Finding(pending(), False, detail, fix))
        return False
    return all_ok
