"""``dsh-bash doctor``: can this configuration's backend run commands? One finding per step.

Steps, in order: ``config`` (the file loads), ``open`` (the backend is reached within the bound),
``bash`` (``$BASH_VERSION``), ``workdir`` (``pwd`` in the default working directory), ``spill``
(output beyond ``max_output_bytes`` lands in a spill file that ``test -f`` finds), ``setsid``
(``command -v setsid``), ``close``. A failed ``config`` or ``open`` ends the run. Each failure
carries a fix.

The steps run on an event loop in a daemon thread; the calling thread waits for each finding at
most the bound (plus a little), so a backend that blocks the event loop or swallows cancellation
still gets a ``FAIL`` line instead of a hang.
"""

from __future__ import annotations

import math
import os
import queue
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from dsh_bash import BashExecRequest, BashExecutor, BashRunResult, ConfigError, DshBashError, load_executor

__all__ = ["STEPS", "Finding", "run_doctor"]

#: Every step, in the order it runs.
STEPS = ("config", "open", "bash", "workdir", "spill", "setsid", "close")

#: ``max_output_bytes`` for the spill step, and how much the step prints (beyond it, so it spills).
_SPILL_LIMIT = 1024
_SPILL_PRINT = 4096
#: Slack the calling thread grants beyond a step's own bound before it declares the step hung.
_WATCHDOG_SLACK_S = 5.0


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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _kind(executor: BashExecutor) -> str:
    """``local``, ``docker`` or ``ssh`` for this distribution's backends (and subclasses), else ``other``."""
    for cls in type(executor).__mro__:
        package = cls.__module__.partition(".")[0]
        if package in ("dsh_bash_local", "dsh_bash_docker", "dsh_bash_ssh"):
            return package.removeprefix("dsh_bash_")
    return "other"


def _fix(kind: str, step: str, message: str) -> str:
    """A fix for a failure, from the backend kind, the step and the error's text."""
    m = message.lower()
    if kind == "docker":
        if "permission denied" in m:
            return (
                "give this user access to the engine's socket (the docker group) or set docker_host "
                "to an engine it may use"
            )
        if any(word in m for word in ("unreachable", "cannot connect", "connection refused", "no such file")):
            return (
                "start the Docker engine (dockerd, or Docker Desktop), or set docker_host (or DOCKER_HOST) "
                "to the socket it listens on, e.g. unix:///var/run/docker.sock"
            )
        if "timed out" in m:
            return (
                "the engine did not answer in time: check that it is healthy (docker info) and that "
                "docker_host (or DOCKER_HOST) points at it; --timeout raises the bound"
            )
        if "not present locally" in m or "no such image" in m:
            return 'pull the image (docker pull IMAGE) or set pull = "missing" in the config'
        if "is not running" in m:
            return "start the container (docker start NAME) or name a running one in 'container'"
        if "does not exist" in m and "container" in m:
            return "name an existing container in 'container' (docker ps -a lists them), or use 'image'"
    if kind == "ssh":
        if "host key" in m:
            return (
                "add the server's host key to known_hosts (ssh-keyscan -p PORT HOST >> ~/.ssh/known_hosts) "
                "or point known_hosts at a file that has it"
            )
        if "auth" in m or "permission denied" in m:
            return "check username and client_keys: the server must accept one of the keys"
        if any(word in m for word in ("timed out", "timeout", "refused", "unreachable", "no route")):
            return (
                "check host and port, that sshd runs there and that the network reaches it; raise "
                "connect_timeout_ms for a slow link"
            )
    if "bash not found" in m or "no bash" in m:
        return 'install bash where the commands run (local backend: or set bash = "/path/to/bash")'
    if step == "workdir" or "workdir" in m:
        return (
            "set cwd in the config to an existing directory, where the commands run, that this user may enter"
        )
    if step == "open":
        return "make the backend reachable (see the message), or raise the bound with --timeout"
    if step == "bash":
        return "install bash where the commands run"
    if step == "spill":
        return (
            "make the spill location writable where the commands run (local: spill_dir, else $TMPDIR or "
            "/tmp; Docker and SSH: /tmp), and check free space and max_spill_bytes/max_spill_total_bytes"
        )
    return "see the message above"


def _show(result: BashRunResult) -> str:
    parts = [f"exit {result.exit_code}" if result.signal is None else f"killed by {result.signal}"]
    if result.timed_out:
        parts.append("timed out")
    stderr = result.stderr.text.strip()
    if stderr:
        parts.append(f"stderr: {' '.join(stderr.split())[:300]}")
    return ", ".join(parts)


class _Doctor:
    def __init__(self, source: Mapping[str, Any] | str | os.PathLike[str], timeout_s: float) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.findings: queue.Queue[Finding | None] = queue.Queue()
        self.kind = "other"

    def put(self, step: str, ok: bool, detail: str, fix: str = "") -> None:
        self.findings.put(Finding(step, ok, detail, fix))

    async def exec(self, ex: BashExecutor, step: str, command: str) -> BashRunResult:
        bound_ms = min(self.timeout_s * 1000, ex.config.max_timeout_ms)
        try:
            with anyio.fail_after(self.timeout_s + 1.0):
                return await ex.exec(command, timeout_ms=bound_ms)
        except TimeoutError:
            raise _StepFailed(
                f"`{command}` did not return within {self.timeout_s:g} s", _fix(self.kind, step, "")
            ) from None
        except DshBashError as exc:
            raise _StepFailed(_one_line(exc), _fix(self.kind, step, str(exc))) from None

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as exc:  # a bug: still a finding, never a traceback from a thread
            detail = f"unexpected {type(exc).__name__}: {_one_line(exc)}"
            self.put("error", False, detail, "a bug in the backend or in dsh-bash: please report it")
        finally:
            self.findings.put(None)

    async def _run(self) -> None:
        try:
            ex = load_executor(self.source)
        except ConfigError as exc:
            fix = (
                "install what the message names"
                if "pip install" in str(exc)
                else "correct the field named above (in the file, or the DSH_BASH_<FIELD> variable)"
            )
            self.put("config", False, _one_line(exc), fix)
            return
        self.kind = _kind(ex)
        cls = type(ex)
        self.put("config", True, f"backend {cls.__name__} ({cls.__module__.partition('.')[0]})")

        started = time.monotonic()
        opened = False
        closing_at = 0.0
        try:
            # The bound covers opening only: the executor's task group lives from its __aenter__
            # to its __aexit__, so the scope must enclose both and is lifted once it is open.
            with anyio.CancelScope(deadline=anyio.current_time() + self.timeout_s) as bound:
                async with ex:
                    opened = True
                    bound.deadline = math.inf
                    self.put("open", True, f"opened in {time.monotonic() - started:.2f} s")
                    for step, probe in (
                        ("bash", self._bash),
                        ("workdir", self._workdir),
                        ("spill", self._spill),
                        ("setsid", self._setsid),
                    ):
                        try:
                            self.put(step, True, await probe(ex))
                        except _StepFailed as exc:
                            self.put(step, False, exc.detail, exc.fix)
                    closing_at = time.monotonic()
        except Exception as exc:
            if opened:
                self.put("close", False, _one_line(exc), "see the message above")
            else:
                self.put("open", False, _one_line(exc), _fix(self.kind, "open", str(exc)))
            return
        if not opened:  # the bound ran out while opening
            detail = f"the backend did not open within {self.timeout_s:g} s"
            self.put("open", False, detail, _fix(self.kind, "open", "timed out"))
            return
        self.put("close", True, f"closed in {time.monotonic() - closing_at:.2f} s")

    async def _bash(self, ex: BashExecutor) -> str:
        result = await self.exec(ex, "bash", 'printf "%s" "$BASH_VERSION"')
        version = result.stdout.text.strip()
        if result.exit_code != 0 or not version:
            raise _StepFailed(
                f"`echo $BASH_VERSION` printed {version!r} ({_show(result)})", _fix(self.kind, "bash", "")
            )
        return f"bash {version}"

    async def _workdir(self, ex: BashExecutor) -> str:
        expected = ex.resolve(BashExecRequest(command="pwd")).workdir
        result = await self.exec(ex, "workdir", "pwd")
        if result.exit_code != 0:
            detail = f"`pwd` in {expected} failed ({_show(result)})"
            raise _StepFailed(detail, _fix(self.kind, "workdir", ""))
        shown = result.stdout.text.strip()
        return expected if shown in ("", expected) else f"{expected} (pwd: {shown})"

    async def _spill(self, ex: BashExecutor) -> str:
        limit = ex.config.max_output_bytes
        try:
            ex.reconfigure(max_output_bytes=_SPILL_LIMIT)
        except ConfigError as exc:
            raise _StepFailed(_one_line(exc), "see the message above") from None
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
            raise _StepFailed(detail, _fix(self.kind, "spill", ""))
        found = await self.exec(ex, "spill", f"test -f {shlex.quote(out.spill_path)}")
        if found.exit_code != 0:
            detail = f"the spill file {out.spill_path} is not there for the next command ({_show(found)})"
            raise _StepFailed(detail, _fix(self.kind, "spill", ""))
        return f"spill file {out.spill_path}"

    async def _setsid(self, ex: BashExecutor) -> str:
        result = await self.exec(ex, "setsid", "command -v setsid")
        path = result.stdout.text.strip()
        if result.exit_code == 0 and path:
            return path
        if self.kind == "local":
            return "not found (the local backend does not need it)"
        raise _StepFailed(
            "setsid not found where the commands run (`command -v setsid` failed)",
            "install setsid there (util-linux, or busybox): the Docker and SSH backends start every "
            "command with it",
        )


def run_doctor(
    source: Mapping[str, Any] | str | os.PathLike[str],
    *,
    timeout_s: float = 30.0,
    report: Callable[[Finding], None],
) -> bool:
    """Run the steps against the configured backend, ``report`` each finding as it comes; True if all ok.

    ``timeout_s`` bounds opening the backend, each check's command and closing it.
    """
    doctor = _Doctor(source, timeout_s)
    thread = threading.Thread(target=anyio.run, args=(doctor.run,), name="dsh-bash-doctor", daemon=True)
    thread.start()
    all_ok = True
    seen: list[str] = []
    while True:
        pending = next((step for step in STEPS if step not in seen), "close")
        bound = timeout_s + (2 * timeout_s if pending == "spill" else 0) + _WATCHDOG_SLACK_S
        try:
            finding = doctor.findings.get(timeout=bound)
        except queue.Empty:
            report(
                Finding(
                    pending,
                    False,
                    f"no answer within {bound:g} s: the backend blocks its event loop or ignores cancelling",
                    "report it to the backend's authors; meanwhile this process abandons it",
                )
            )
            return False
        if finding is None:
            return all_ok
        seen.append(finding.step)
        all_ok = all_ok and finding.ok
        report(finding)
