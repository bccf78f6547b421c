"""Deliberately broken local backends: each breaks exactly one rule of the executor contract.

They exist to prove that the conformance kit catches every rule it checks
(``tests/test_kit_catches_broken.py``). Each public class here is a small subclass of
:class:`dsh_bash_local.LocalBashExecutor` whose docstring names the rule it breaks; the breakage
sits in the smallest internal piece that would realistically carry such a bug (a spawn hook, the
process's kill or wait, an output stream, the result builder), not in a rewrite of the results.

Two hooks keep the classes short:

- :class:`_ProcessBreaker` re-classes the :class:`HostProcess` that ``spawn_host_process`` built into a
  broken subclass (``process_class``), for bugs in waiting, reading, writing stdin and killing;
- :class:`_StreamBreaker` re-classes the command's two :class:`OutputStream` objects into a broken
  subclass (``stream_class``), for bugs in output accounting and decoding.

Nothing here patches a module or a shared class: every breakage is local to its own class.

They run with the marker containment (``containment="marker"``): their commands are spawned as
plain :class:`HostProcess` objects, the layout the process breakers re-class. The supervised
(subreaper) path is the sound backend's, held to the same checks in ``test_conformance_local.py``.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread
from dsh_bash_local import LocalBashExecutor as _SoundLocal
from dsh_bash_local import LocalConfig

from dsh_bash import (
    DEFAULT_ENV_SCRUB,
    BashExecRequest,
    BashExecSpec,
    BashInfrastructureError,
    BashRunResult,
    BashTask,
    BashTaskId,
    BashTaskRead,
    CollectedOutput,
    FileOperationError,
    OwnerToken,
    SessionId,
    SessionReport,
    TaskListener,
    TerminalSize,
)
from dsh_bash._bash_executor import (
    _Command,
    _KillCause,
)
from dsh_bash._output import (
    SpillBudget,
    _skip_continuation,
    merge_streams,
)
from dsh_bash._policy import confine_options
from dsh_bash._task_input import TaskInput
from dsh_bash.backend import (
    MODEL_FRIENDLY_ENV,
    CommandProcess,
    EgressProxy,
    EgressRoute,
    ExitStatus,
    Killable,
    Launch,
    OutputStream,
    SpillFile,
    is_scrubbed,
    kill_sequence,
)
from dsh_bash.host._host_process import HostProcess, SupervisedProcess
from dsh_bash.host._proc_scan import (
    ProcScanner,
    read_proc_stat,
    signal_marked,
)
from dsh_bash.host._spill_dir import HostSpillFile
from dsh_bash.remote import (
    KILL,
    ExitTrailerFilter,
    kill_args,
)

log = logging.getLogger("dsh_bash.broken")


class LocalBashExecutor(_SoundLocal):
    """The local backend with the marker containment: the base of every broken backend here."""

    def __init__(self, config: LocalConfig | None = None) -> None:
        config = config if config is not None else LocalConfig()
        super().__init__(config.model_copy(update={"containment": "marker"}))


# =================================================================================================
# Hooks shared by the broken backends
# =================================================================================================


class _ProcessBreaker(LocalBashExecutor):
    """Spawns like the local backend, then turns the process into an instance of ``process_class``."""

    process_class: ClassVar[type[HostProcess]] = HostProcess

    async def _spawn(self, launch: Launch) -> CommandProcess:
        process = await super()._spawn(launch)
        assert isinstance(process, HostProcess)
        # spawn_host_process builds a HostProcess; the breakage lives in a subclass with the same layout.
        process.__class__ = self.process_class
        return process


class _StreamBreaker(LocalBashExecutor):
    """Turns both output streams of every command into instances of ``stream_class`` before it runs."""

    stream_class: ClassVar[type[OutputStream]] = OutputStream

    async def _spawn(self, launch: Launch) -> CommandProcess:
        for stream in (launch.stdout, launch.stderr):
            self._break_stream(stream)
        return await super()._spawn(launch)

    def _break_stream(self, stream: OutputStream) -> None:
        # OutputStream has __slots__; a subclass that adds none has the same layout.
        stream.__class__ = self.stream_class


def _with_spec(launch: Launch, **changes: Any) -> Launch:
    """The launch with some fields of its spec changed (both are immutable)."""
    return replace(launch, spec=launch.spec.model_copy(update=changes))


def _plain_spawn(
    ex: LocalBashExecutor,
    launch: Launch,
    *,
    new_session: bool = True,
    idle_stdin: int | None = None,
    end_of_options: bool = True,
) -> HostProcess:
    """A hand-rolled spawn: ``bash --noprofile --norc -c -- COMMAND``, the command always in argv.

    ``new_session`` is ``start_new_session``; ``idle_stdin`` is the fd a command without
    ``spec.stdin`` reads (``/dev/null`` when None). A given ``spec.stdin`` is written and closed.
    ``end_of_options`` False leaves out the ``--``.
    """
    bash = ex._bash
    if bash is None:
        raise BashInfrastructureError("bash not found")
    spec = launch.spec
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    stdin: int = subprocess.DEVNULL if idle_stdin is None else idle_stdin
    in_w: int | None = None
    if spec.stdin is not None:
        stdin, in_w = os.pipe2(os.O_CLOEXEC)
    child_ends = [out_w, err_w] + ([stdin] if in_w is not None else [])
    try:
        popen = subprocess.Popen(
            [bash, "--noprofile", "--norc", "-c", *(["--"] if end_of_options else []), spec.command],
            stdin=stdin,
            stdout=out_w,
            stderr=err_w,
            cwd=spec.workdir,
            env=launch.env,
            start_new_session=new_session,
        )
    except OSError as exc:
        for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
            os.close(fd)
        raise BashInfrastructureError(f"cannot start {bash!r}: {exc.strerror or exc}") from exc
    finally:
        for fd in child_ends:
            os.close(fd)
    for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
        os.set_blocking(fd, False)
    return HostProcess(
        popen,
        launch,
        stdout_fd=out_r,
        stderr_fd=err_r,
        stdin_fd=in_w,
        scanner=ex._scanner,
        start_helper=ex._start_helper,
        script=None,
    )


class _AnyOf:
    """The union of several killable sets."""

    def __init__(self, parts: list[Killable]) -> None:
        self._parts = parts

    async def signal_all(self, sig: int) -> None:
        for part in self._parts:
            await part.signal_all(sig)

    async def remaining(self) -> list[str]:
        return [pid for part in self._parts for pid in await part.remaining()]


class _Nothing:
    """A killable set that is always empty."""

    async def signal_all(self, sig: int) -> None:
        return None

    async def remaining(self) -> list[str]:
        return []


# =================================================================================================
# Outcome classification
# =================================================================================================


class _HighExitIsSignalProcess(HostProcess):
    async def wait(self) -> ExitStatus:
        status = await super().wait()
        if status.code is not None and status.code > 128:
            return ExitStatus(code=None, signal=status.code - 128)
        return status


class HighExitCodeAsSignal(_ProcessBreaker):
    """Breaks: a plain exit code above 128 is reported as it is (`exit 143` is not a SIGTERM death).

    It decodes every exit status above 128 as a signal death, whoever sent the signal.
    """

    process_class = _HighExitIsSignalProcess


class _SignalAsExitCodeProcess(HostProcess):
    async def wait(self) -> ExitStatus:
        status = await super().wait()
        if status.signal is not None:
            return ExitStatus(code=128 + status.signal)
        return status


class SignalAsExitCode(_ProcessBreaker):
    """Breaks: `signal` names the terminating signal and then `exit_code` is None.

    It sees signal deaths only as the shell-style status 128+n (as `docker exec` does), so
    `kill -TERM $$` comes out as exit code 143.
    """

    process_class = _SignalAsExitCodeProcess


class TimeoutReportedAsPlainKill(LocalBashExecutor):
    """Breaks: `timed_out` is true when the executor's own timeout killed the command.

    The timeout kill is recorded as an ordinary kill, so the result looks like a command that just
    died of SIGTERM: neither flag is set.
    """

    def _request_kill(self, command: _Command, cause: _KillCause) -> bool:
        return super()._request_kill(command, "killed" if cause == "timeout" else cause)


class WrapperNoticeOnStderr(LocalBashExecutor):
    """Breaks: a stream carries only what the command wrote.

    Like a supervising shell outside the command's session that reports "Terminated" on the
    stderr it shares with the command when the executor kills it.
    """

    async def _kill_task(self, command: Any) -> None:
        command.launch.stderr.feed(b"bash: line 1: 4242 Terminated\n")
        await super()._kill_task(command)


class AbortReportedAsTimeout(LocalBashExecutor):
    """Breaks: `aborted` is true (and a task ends `aborted`) only when the spec's signal killed it.

    The abort kill is recorded as a timeout: a run reports timed_out, a task ends as if its shell
    died of a signal nobody sent.
    """

    def _request_kill(self, command: _Command, cause: _KillCause) -> bool:
        return super()._request_kill(command, "timeout" if cause == "aborted" else cause)


class IgnoresTaskCap(LocalBashExecutor):
    """Breaks: a start beyond `max_running_tasks` running background tasks is refused.

    It starts every task, however many run already (as the executor did before the cap).
    """

    async def _launch(self, spec: BashExecSpec, *, background: bool) -> _Command:
        self._ensure_open()
        return await self._launch_counted(spec, background=background)


class LastCauseWins(LocalBashExecutor):
    """Breaks: never both `timed_out` and `aborted`; the first cause wins.

    A cause arriving during the kill's grace (the timeout, or the abort) overwrites the first one.
    """

    async def _wait_for_exit(self, command: _Command, timeout_s: float | None) -> ExitStatus:
        process = command.process
        if timeout_s is not None:
            with anyio.move_on_after(timeout_s):
                return await process.wait()
            self._record(command, "timeout")
        return await process.wait()

    async def _watch_abort(self, command: _Command) -> None:
        abort_signal = command.spec.signal
        assert abort_signal is not None
        with command.watch_scope:
            await abort_signal.wait()
            self._record(command, "aborted")

    def _record(self, command: _Command, cause: _KillCause) -> None:
        if command.kill_cause in ("timeout", "aborted") and not command.finishing:
            command.kill_cause = cause  # the kill is under way: only its cause is (wrongly) replaced
        else:
            self._request_kill(command, cause)


class TimedOutOnlyIfSignaled(LocalBashExecutor):
    """Breaks: `timed_out` is true even if the command trapped SIGTERM and exited 0.

    It decides "timed out" from how the shell ended: a shell that exits on its TERM trap looks like a
    command that finished by itself.
    """

    def _result(self, command: _Command) -> BashRunResult:
        result = super()._result(command)
        if result.timed_out and result.signal is None:
            return result.model_copy(update={"timed_out": False})
        return result


class DurationInSeconds(LocalBashExecutor):
    """Breaks: `duration_ms` is the run's duration (in milliseconds).

    It reports the duration in seconds.
    """

    def _result(self, command: _Command) -> BashRunResult:
        result = super()._result(command)
        return result.model_copy(update={"duration_ms": time.monotonic() - command.started_at})


# =================================================================================================
# resolve, exec and refusing to start
# =================================================================================================


class NoTimeoutClamp(LocalBashExecutor):
    """Breaks: resolve clamps `timeout_ms` to `max_timeout_ms`.

    A timeout given in the request is taken as it is.
    """

    def resolve(self, request: BashExecRequest) -> BashExecSpec:
        spec = super().resolve(request)
        if request.timeout_ms is not None:
            return spec.model_copy(update={"timeout_ms": float(request.timeout_ms)})
        return spec


class ClampsOnlyAtRunTime(LocalBashExecutor):
    """Breaks: resolve clamps `timeout_ms` to `max_timeout_ms`, and the result carries the effective one.

    resolve leaves the request's timeout as it is; the run clamps it when it arms the timer, so the
    command is killed in time but the result reports the unclamped timeout.
    """

    def resolve(self, request: BashExecRequest) -> BashExecSpec:
        spec = super().resolve(request)
        if request.timeout_ms is not None:
            return spec.model_copy(update={"timeout_ms": float(request.timeout_ms)})
        return spec

    async def _supervise(self, command: _Command, timeout_s: float | None) -> None:
        if timeout_s is not None:
            timeout_s = min(timeout_s, self._config.max_timeout_ms / 1000)
        await super()._supervise(command, timeout_s)


class ResolveForgetsOwner(LocalBashExecutor):
    """Breaks: resolve carries the request's `owner` (and every task keeps it).

    The owner is not copied into the spec, so every task is ownerless.
    """

    def resolve(self, request: BashExecRequest) -> BashExecSpec:
        return super().resolve(request).model_copy(update={"owner": None})


class WorkdirIgnored(LocalBashExecutor):
    """Breaks: the command runs in the resolved workdir.

    Every command runs in the configured cwd, whatever workdir the spec names.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(_with_spec(launch, workdir=self._default_cwd()))


class MissingWorkdirFallsBack(LocalBashExecutor):
    """Breaks: run and start raise BashInfrastructureError when the workdir is unusable.

    A workdir that is not a directory silently falls back to the configured cwd.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        if not os.path.isdir(launch.spec.workdir):
            launch = _with_spec(launch, workdir=self._default_cwd())
        return await super()._spawn(launch)


class WorkdirReasonUnclassified(LocalBashExecutor):
    """Breaks: every BashInfrastructureError carries the reason that says why.

    An unusable workdir is refused, but as ``unclassified``: code cannot tell it from a lost backend.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        try:
            return await super()._spawn(launch)
        except BashInfrastructureError as exc:
            if exc.reason.startswith("workdir_"):
                raise BashInfrastructureError(str(exc)) from None
            raise


class IgnoresUser(LocalBashExecutor):
    """Breaks: a spec's user that does not exist is refused, and nothing runs.

    The spec's user is dropped: every command runs as the executor's own user.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(_with_spec(launch, user=None))


class RefusesEveryUser(LocalBashExecutor):
    """Breaks: a spec's user that names the user commands run as runs the command.

    Any user at all is refused, the executor's own included.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        if launch.spec.user is not None:
            raise BashInfrastructureError("no user switching here", reason="user_unsupported")
        return await super()._spawn(launch)


class PreAbortedSignalIgnored(LocalBashExecutor):
    """Breaks: run and start refuse a spec whose signal is already aborted, and nothing runs.

    An already-aborted signal is treated like no signal: the command runs to its end.
    """

    @staticmethod
    def _without_dead_signal(spec: BashExecSpec) -> BashExecSpec:
        if spec.signal is not None and spec.signal.aborted:
            return spec.model_copy(update={"signal": None})
        return spec

    async def run(self, spec: BashExecSpec) -> BashRunResult:
        return await super().run(self._without_dead_signal(spec))

    async def start(self, spec: BashExecSpec) -> BashTask:
        return await super().start(self._without_dead_signal(spec))


class LeaksExceptionGroup(LocalBashExecutor):
    """Breaks: no public method lets an ExceptionGroup escape.

    run executes the command in a child task of its own task group, so a refusal to start comes
    out wrapped in an ExceptionGroup.
    """

    async def run(self, spec: BashExecSpec) -> BashRunResult:
        results: list[BashRunResult] = []

        async def child() -> None:
            results.append(await super(LeaksExceptionGroup, self).run(spec))

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
        return results[0]


class ExecDropsStdinAndEnv(LocalBashExecutor):
    """Breaks: exec(command, **fields) is run(resolve(BashExecRequest(command=command, **fields))).

    exec forwards workdir and timeout_ms but silently drops stdin and env.
    """

    async def exec(self, command: str, **request_fields: Any) -> BashRunResult:
        request_fields.pop("stdin", None)
        request_fields.pop("env", None)
        return await super().exec(command, **request_fields)


class InlinesLongCommands(LocalBashExecutor):
    """Breaks: any command string runs, even one longer than one execve argument (128 KiB).

    Every command goes into bash's argv; the kernel refuses a long one (E2BIG), and run raises.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return _plain_spawn(self, launch)


# =================================================================================================
# Cancellation, and a run in flight when aclose begins
# =================================================================================================


class CancelSendsTermOnly(LocalBashExecutor):
    """Breaks: if the awaiting task is cancelled, the command's processes are killed first.

    On cancellation it sends SIGTERM and lets the cancellation go on without the kill sequence:
    whatever ignores SIGTERM lives on.
    """

    async def _kill_now(self, command: _Command, cause: _KillCause) -> None:
        if command.kill_cause is None:
            command.kill_cause = cause
        with contextlib.suppress(Exception):
            await command.process.signal_all(signal.SIGTERM)


class SpawnNotCancelSafe(LocalBashExecutor):
    """Breaks: a cancellation that comes while the command is being started kills it too.

    After starting the shell it waits a moment for it to settle; a cancellation there leaves the
    started command running, unknown to the executor until aclose.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        process = await super()._spawn(launch)
        await anyio.sleep(0.005)
        return process


class SwallowsCancellation(LocalBashExecutor):
    """Breaks: a cancelled run kills the command and lets the cancellation propagate.

    It kills the command properly, then returns the killed command's result as if nobody had
    cancelled the call.
    """

    async def run(self, spec: BashExecSpec) -> BashRunResult:
        command = await self._launch(spec, background=False)
        try:
            await self._supervise(command, spec.timeout_ms / 1000)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._kill_now(command, "killed")
                await self._finalize(command)
            return self._result(command)  # the bug: the caller's cancellation is swallowed
        await self._finalize(command)
        return self._result(command)


class CloseKillReportedAsResult(LocalBashExecutor):
    """Breaks: a run in flight when aclose begins is killed and raises ExecutorClosedError.

    The close kill is reported like any other kill: the run returns a result.
    """

    def _result(self, command: _Command) -> BashRunResult:
        if command.kill_cause == "closed":
            command.kill_cause = "killed"
        return super()._result(command)


# =================================================================================================
# Processes: stdin, rc files, sessions
# =================================================================================================


class StdinPipeNeverClosed(LocalBashExecutor):
    """Breaks: stdin is empty (/dev/null) unless spec.stdin is given.

    A command without stdin inherits the read end of a pipe the executor keeps open: whatever reads
    stdin waits forever.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._idle_stdin: tuple[int, int] | None = None

    async def _open(self) -> None:
        await super()._open()
        self._idle_stdin = os.pipe2(os.O_CLOEXEC)

    async def _release(self) -> None:
        if self._idle_stdin is not None:
            for fd in self._idle_stdin:
                os.close(fd)
            self._idle_stdin = None
        await super()._release()

    async def _spawn(self, launch: Launch) -> CommandProcess:
        assert self._idle_stdin is not None
        return _plain_spawn(self, launch, idle_stdin=self._idle_stdin[0])


class _SingleWriteStdinProcess(HostProcess):
    async def _write_stdin(self, fd: int) -> None:
        data = self._launch.spec.stdin
        assert data is not None
        try:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(fd, data.encode() if isinstance(data, str) else data)  # no loop: a partial write
        finally:
            self._stdin_fd = None
            os.close(fd)


class StdinSingleWrite(_ProcessBreaker):
    """Breaks: spec.stdin is written to the command's stdin (all of it) and closed.

    It writes stdin with one write call and ignores a partial write: past a pipe's capacity
    (64 KiB) the rest is lost.
    """

    process_class = _SingleWriteStdinProcess


class PassesBashEnv(LocalBashExecutor):
    """Breaks: every call runs a bash that reads no rc files.

    It hands the ambient BASH_ENV to the command, and non-interactive bash sources it.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        bash_env = self._ambient_env().get("BASH_ENV")
        if bash_env is not None:
            launch.env["BASH_ENV"] = bash_env
        return await super()._spawn(launch)


class EmptyPipeStdin(LocalBashExecutor):
    """Breaks: stdin is empty (``/dev/null``) unless given.

    Without ``spec.stdin``, fd 0 is a pipe closed at once: empty, but not /dev/null.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        read_end, write_end = os.pipe()
        os.close(write_end)
        try:
            return _plain_spawn(self, launch, idle_stdin=read_end)
        finally:
            os.close(read_end)


class CommandTakenForOptions(LocalBashExecutor):
    """Breaks: a command that begins with ``-`` runs as a command.

    ``bash -c COMMAND`` without ``--``: ``-x`` is read as bash's option, and ``-c`` lacks its argument.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return _plain_spawn(self, launch, end_of_options=False)


class TerminalInjectable(LocalBashExecutor):
    """Breaks: a command cannot push input into a terminal (ioctl TIOCSTI).

    Commands run as plain subprocesses, without dsh-supervise and its seccomp filter: one running as
    root may type into any terminal it opens.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return _plain_spawn(self, launch)


class NoNewSession(LocalBashExecutor):
    """Breaks: every call runs in a process group (session) of its own.

    The shell stays in the caller's session and process group.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return _plain_spawn(self, launch, new_session=False)


# =================================================================================================
# Processes: the kill sequence, the drain bound, leftovers
# =================================================================================================


class _LeaderOnlyProcess(HostProcess):
    async def signal_all(self, sig: int) -> None:
        if not self._reaped:  # an unreaped child's pid cannot be reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, sig)

    async def remaining(self) -> list[str]:
        return [] if self._reaped or self._peek_exit() is not None else [str(self._pid)]


class KillsOnlyLeader(_ProcessBreaker):
    """Breaks: killing means every process of the command (the group, children included).

    Kill, timeout and abort signal the shell alone; its children live on.
    """

    process_class = _LeaderOnlyProcess


class _NoContinueProcess(SupervisedProcess):
    #: Duplicates of the pidfds of supervisors that were asked to kill: the executor continues them at
    #: its close, so that no stopped supervisor outlives the test.
    asked: ClassVar[list[int]] = []

    def _signal_supervisor(self, sig: int) -> bool:
        if self._pidfd is None or self._supervisor_gone():
            return False
        _NoContinueProcess.asked.append(os.dup(self._pidfd))
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)
        return True

    async def _until_answered(self, done: Callable[[], bool]) -> None:
        # Reads the records without the sound one's nudges (a SIGCONT every half second while a start
        # waits), which a rehearsal saw continue the stopped supervisor and pass the check.
        await self._status_until(done)


class _ServerNudgesSilenced(_SoundLocal):
    """While open, the fork server's ``nudge`` (the SIGCONT to the server and its spare) does nothing;
    at close the server is continued, so that nothing of the test stays stopped."""

    _real_nudge: Callable[[], None] | None = None

    async def _open(self) -> None:
        await super()._open()
        server = self._server
        if server is not None:
            self._real_nudge = server.nudge
            # An instance attribute shadows the method: the server's own calls and every command's
            # (each takes ``server.nudge`` when it is launched) get the one that does nothing.
            object.__setattr__(server, "nudge", lambda: None)

    async def _release(self) -> None:
        server = self._server
        if server is not None and self._real_nudge is not None:
            object.__setattr__(server, "nudge", self._real_nudge)
            self._real_nudge()
        await super()._release()


class StoppedSupervisorNotContinued(_ServerNudgesSilenced, _ProcessBreaker):
    """Breaks: a command that stops its supervisor is still timed out and killed on time.

    Kill requests go to the supervisor without a SIGCONT first: a stopped one hears none of them, and
    the run ends only when the executor gives the command up as lost.
    """

    process_class = _NoContinueProcess

    def __init__(self, config: LocalConfig | None = None) -> None:
        # Under the supervisor (the sound backend's containment), unlike the other broken backends:
        # the supervisor is what it fails to continue.
        # No SIGCONT from the fork server's nudges either (it continues its spare, which may be the
        # supervisor the command stopped): _ServerNudgesSilenced.
        _SoundLocal.__init__(self, config if config is not None else LocalConfig())

    def _report_after_kill_s(self) -> float:
        # Waits for the stopped supervisor's word as a backend without the base class's net would:
        # with the net's 1 s, its `command_lost` came just inside the check's bound on a loaded
        # machine (a rehearsal saw the check pass), which made the row flaky rather than broken.
        return 10.0

    async def _release(self) -> None:
        while _NoContinueProcess.asked:
            pidfd = _NoContinueProcess.asked.pop()
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGCONT)
            os.close(pidfd)
        await super()._release()


class StoppedSparesNotContinued(_ServerNudgesSilenced):
    """Breaks: a command that stops the helpers kept ready for the next commands makes the next
    command wait at most a second.

    The fork server and its spare are never continued (its ``nudge`` does nothing): a command's
    request to a server that the command before stopped waits until someone else continues it.
    Under the supervisor, unlike most broken backends: its fork server is what is left stopped.
    """


class _SigkillOnlyProcess(HostProcess):
    async def signal_all(self, sig: int) -> None:
        await super().signal_all(signal.SIGKILL)


class SigkillWithoutSigterm(_ProcessBreaker):
    """Breaks: SIGTERM to the group first, SIGKILL only after `grace_ms`.

    Every signal of the kill sequence is a SIGKILL: nothing gets the chance to clean up.
    """

    process_class = _SigkillOnlyProcess


class _NeverSigkillProcess(HostProcess):
    async def signal_all(self, sig: int) -> None:
        if sig != signal.SIGKILL:
            await super().signal_all(sig)


class NeverSigkill(_ProcessBreaker):
    """Breaks: SIGKILL after `grace_ms` to whatever is left, including members that trap SIGTERM.

    The kill sequence stops at SIGTERM.
    """

    process_class = _NeverSigkillProcess


class _NoKillAfterLeaderExitProcess(HostProcess):
    async def signal_all(self, sig: int) -> None:
        if self._reaped or self._peek_exit() is not None:
            return  # "the command has exited": but its group has not
        await super().signal_all(sig)


class StopsKillingAfterLeaderExit(_ProcessBreaker):
    """Breaks: the kill sequence reaches members that trap SIGTERM even after the leader exited.

    It treats the command as gone once its shell has exited, and signals nothing.
    """

    process_class = _NoKillAfterLeaderExitProcess


class _KillGroupAtExitProcess(HostProcess):
    async def wait(self) -> ExitStatus:
        status = await super().wait()
        await self.signal_all(signal.SIGKILL)
        return status


class KillsDescendantsAtExit(_ProcessBreaker):
    """Breaks: descendants of a background task that hold the output pipes after its shell exits
    keep running.

    It kills everything left of the command the moment its shell exits, a task's too, instead of
    bounding the drain and leaving them to a kill or aclose.
    """

    process_class = _KillGroupAtExitProcess


class _NothingLeftBehindProcess(HostProcess):
    async def left_behind(self, settle_s: float) -> list[str]:
        return []  # "the shell exited: the command is over"


class KeepsForegroundLeftovers(_ProcessBreaker):
    """Breaks: what a foreground run leaves running when its shell exits is killed before the result.

    It never looks for what the shell left, so a `server &` (or a fork bomb's last generations)
    outlives the run, until aclose.
    """

    process_class = _NothingLeftBehindProcess


class _WaitForEofProcess(HostProcess):
    async def wait(self) -> ExitStatus:
        status = await super().wait()
        while not all(self._fds.values()):  # noqa: ASYNC110 - _read flips the flags, nothing notifies
            await anyio.sleep(0.01)
        return status


class NoDrainBound(_ProcessBreaker):
    """Breaks: once the shell has exited, the output gets at most `grace_ms` more.

    It reports the shell's exit only once the output pipes close (as ``communicate()`` does): a
    child holding stdout keeps the run going until the timeout.
    """

    process_class = _WaitForEofProcess


class _BlockingWaitProcess(HostProcess):
    async def wait(self) -> ExitStatus:
        # Blocks the event loop until the shell exits: no timer, no abort, no cancel can act.
        os.waitid(os.P_PID, self._pid, os.WEXITED | os.WNOWAIT)  # noqa: ASYNC222 - the bug
        return await super().wait()


class BlocksEventLoop(_ProcessBreaker):
    """Breaks: run never blocks the event loop (the executor's own timeout needs the loop to fire).

    It waits for the shell with a blocking call, so a command that never ends blocks the event loop
    and the timeout never fires: the run hangs.
    """

    process_class = _BlockingWaitProcess


class NoLeftoverSweep(LocalBashExecutor):
    """Breaks: aclose kills every process the executor's commands left behind.

    aclose only kills the commands still running; a `server &` of a finished command lives on.
    """

    def _leftovers(self) -> Killable:
        return _Nothing()


class SerialClose(LocalBashExecutor):
    """Breaks: aclose waits for what it kills, bounded by about twice `grace_ms`.

    It runs the kill sequence of each running command one after the other, so TERM-ignoring tasks
    cost a full grace each.
    """

    async def aclose(self) -> None:
        if self._state == "open":
            grace_s = self._config.grace_ms / 1000
            for command in list(self._live):
                await kill_sequence(command.process, grace_s, command.launch.marker)
        await super().aclose()


class SweepsAllExecutors(LocalBashExecutor):
    """Breaks: aclose kills what this executor's commands started, not another executor's.

    Its leftover sweep covers the processes of every executor of its class in this process.
    """

    _every_executor: ClassVar[list[LocalBashExecutor]] = []

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._every_executor.append(self)

    def _leftovers(self) -> Killable:
        return _AnyOf([LocalBashExecutor._leftovers(executor) for executor in self._every_executor])


class SharedResultSlot(LocalBashExecutor):
    """Breaks: concurrent runs on one executor each get their own result.

    It keeps "the" foreground command in one executor-wide slot: every run reports the command
    started last.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._latest: _Command | None = None

    async def _launch(self, spec: BashExecSpec, *, background: bool) -> _Command:
        command = await super()._launch(spec, background=background)
        if not background:
            self._latest = command
        return command

    def _result(self, command: _Command) -> BashRunResult:
        return super()._result(self._latest or command)


# =================================================================================================
# Background tasks
# =================================================================================================


class StartReturnsSnapshot(LocalBashExecutor):
    """Breaks: start returns a live handle (its fields change as the task ends).

    It returns a snapshot of the task, which stays `running` forever.
    """

    async def start(self, spec: BashExecSpec) -> BashTask:
        task = await super().start(spec)
        return BashTask(task.id, task.command, task.owner)


class BackgroundTasksTimedOut(LocalBashExecutor):
    """Breaks: no timeout applies to a background task (start ignores `timeout_ms`).

    Background tasks are supervised with the spec's timeout, like foreground runs.
    """

    async def _supervise(self, command: _Command, timeout_s: float | None) -> None:
        if timeout_s is None:
            timeout_s = command.spec.timeout_ms / 1000
        await super()._supervise(command, timeout_s)


class TaskTimeoutIgnored(LocalBashExecutor):
    """Breaks: a background task's `task_timeout_ms` kills it.

    Background tasks are supervised without a timeout, as before `task_timeout_ms` existed.
    """

    async def _supervise(self, command: _Command, timeout_s: float | None) -> None:
        await super()._supervise(command, None if command.task is not None else timeout_s)


class TaskTimeoutReportedAsKill(LocalBashExecutor):
    """Breaks: a task ended by its `task_timeout_ms` has end_cause `timed_out`.

    The timeout's kill is recorded as a plain `kill`.
    """

    def _request_kill(self, command: _Command, cause: Any) -> bool:
        if command.task is not None and cause == "timeout":
            cause = "killed"
        return super()._request_kill(command, cause)


class KillWaitsForEnd(LocalBashExecutor):
    """Breaks: kill starts the kill sequence and returns without waiting.

    kill waits until the task has ended, a whole grace for a TERM-ignoring task.
    """

    async def kill(self, task_id: BashTaskId) -> bool:
        was_running = await super().kill(task_id)
        task = self._tasks[task_id].task
        assert task is not None
        await task.wait()
        return was_running


class KillOfEndedTaskNoop(LocalBashExecutor):
    """Breaks: kill of an ended task still sends its leftover processes the kill sequence.

    kill of an ended task just returns False.
    """

    async def kill(self, task_id: BashTaskId) -> bool:
        self._ensure_open()
        if self._command_for(task_id).finalized:
            return False
        return await super().kill(task_id)


class UnknownIdRaisesKeyError(LocalBashExecutor):
    """Breaks: read_output and kill raise UnknownTaskError for an unknown id.

    An unknown id raises the dict's KeyError.
    """

    def _command_for(self, task_id: BashTaskId) -> _Command:
        return self._tasks[task_id]


class BackgroundExitStatusLost(LocalBashExecutor):
    """Breaks: a task that ends by itself is `completed`, `exited`, with its exit code.

    The background path never keeps the shell's exit status: every task ends with exit_code None.
    """

    async def _finalize(self, command: _Command) -> None:
        if command.task is not None:
            command.exit = None
        await super()._finalize(command)


class SelfSignalCountedAsKill(LocalBashExecutor):
    """Breaks: a task that died of a signal nobody here sent is `completed`, `signaled`.

    Any signal death of a task is taken for the executor's own kill.
    """

    async def _finalize(self, command: _Command) -> None:
        status = command.exit
        signaled = status is not None and status.signal is not None
        if command.task is not None and command.kill_cause is None and signaled:
            command.kill_cause = "killed"
        await super()._finalize(command)


class CloseReportedAsKill(LocalBashExecutor):
    """Breaks: a task still running at aclose ends with end_cause `closed`.

    aclose ends the running tasks through kill(), so they end `killed`.
    """

    async def aclose(self) -> None:
        if self._state == "open":
            for task_id, command in list(self._tasks.items()):
                if not command.finalized:
                    await self.kill(task_id)
        await super().aclose()


class WakesWaitersEarly(LocalBashExecutor):
    """Breaks: status, exit code, signal and end cause are final before wait() returns.

    It wakes the task's waiters as soon as it starts finalizing, before the end fields are set.
    """

    async def _finalize(self, command: _Command) -> None:
        if command.task is not None and not command.finalized:
            command.task._done.set()
            await anyio.lowlevel.checkpoint()
        await super()._finalize(command)


class _WholeSeconds(itertools.count):  # type: ignore[type-arg]
    """A counter that yields the current time in whole seconds."""

    def __next__(self) -> int:
        return int(time.time())


class TaskIdsFromClock(LocalBashExecutor):
    """Breaks: each background task has its own id.

    Task ids are made from the wall clock in whole seconds: tasks started in the same second share one.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._task_numbers = _WholeSeconds()


class OwnerOfForgetsEndedTasks(LocalBashExecutor):
    """Breaks: owner_of returns the token stored at start, for as long as the task is known.

    owner_of looks among the running commands only: once a task ended, its owner is None.
    """

    def owner_of(self, task_id: BashTaskId) -> OwnerToken | None:
        self._ensure_open()
        for command in self._live:
            if command.task is not None and command.task.id == task_id:
                return command.task.owner
        return None


# =================================================================================================
# Background reads
# =================================================================================================


class MergesStderrWithoutMarker(LocalBashExecutor):
    """Breaks: a read gives stdout, then a `[stderr]` line and stderr.

    It concatenates the two deltas with no marker between them.
    """

    async def read_output(self, task_id: BashTaskId) -> BashTaskRead:
        self._ensure_open()
        command = self._command_for(task_id)
        await anyio.lowlevel.checkpoint()
        assert command.task is not None
        stdout, stderr = command.launch.stdout, command.launch.stderr
        out_text, out_dropped = stdout.read()
        err_text, err_dropped = stderr.read()
        dropped = out_dropped + err_dropped
        return BashTaskRead(
            task=command.task,
            delta=out_text + err_text,
            lossy=dropped > 0,
            dropped_bytes=dropped,
            stdout_spill_path=stdout.spill_path,
            stderr_spill_path=stderr.spill_path,
        )


class NonConsumingReads(LocalBashExecutor):
    """Breaks: reads are consuming: two reads never deliver the same bytes.

    Every read is served from the collected (foreground) view: it re-delivers all that is kept.
    """

    async def read_output(self, task_id: BashTaskId) -> BashTaskRead:
        self._ensure_open()
        command = self._command_for(task_id)
        await anyio.lowlevel.checkpoint()
        assert command.task is not None
        stdout, stderr = command.launch.stdout.collected(), command.launch.stderr.collected()
        return BashTaskRead(
            task=command.task,
            delta=merge_streams(stdout.text, stderr.text),
            lossy=False,
            dropped_bytes=0,
            stdout_spill_path=stdout.spill_path,
            stderr_spill_path=stderr.spill_path,
        )


class LongPollingReads(LocalBashExecutor):
    """Breaks: read_output returns at once, possibly with "".

    A read waits (up to half a second) for new output or the task's end.
    """

    async def read_output(self, task_id: BashTaskId) -> BashTaskRead:
        self._ensure_open()
        command = self._command_for(task_id)
        assert command.task is not None
        stdout, stderr = command.launch.stdout, command.launch.stderr
        task = command.task
        before = (stdout.total_bytes, stderr.total_bytes)

        def nothing_new() -> bool:
            return (stdout.total_bytes, stderr.total_bytes) == before and task.end_cause is None

        with anyio.move_on_after(0.5):
            while nothing_new():  # noqa: ASYNC110 - output arrives without a notification to wait on
                await anyio.sleep(0.01)
        return await super().read_output(task_id)


class NeverLossy(LocalBashExecutor):
    """Breaks: `dropped_bytes` counts unread output lost from memory; `lossy` is true when it is > 0.

    Reads never admit a loss.
    """

    async def read_output(self, task_id: BashTaskId) -> BashTaskRead:
        read = await super().read_output(task_id)
        return read.model_copy(update={"dropped_bytes": 0, "lossy": False})


class EvictsFinishedOutput(LocalBashExecutor):
    """Breaks: finished tasks stay readable until aclose.

    Starting a task discards the unread output of the tasks that already ended.
    """

    async def start(self, spec: BashExecSpec) -> BashTask:
        for command in list(self._tasks.values()):
            if command.finalized:
                command.launch.stdout.read()
                command.launch.stderr.read()
        return await super().start(spec)


# =================================================================================================
# Output: separation, truncation, spill files, decoding
# =================================================================================================


class _StderrIntoStdoutProcess(HostProcess):
    async def pump_output(self) -> None:
        async with anyio.create_task_group() as tg:
            if self._stdin_fd is not None:
                tg.start_soon(self._write_stdin, self._stdin_fd)
            tg.start_soon(self._read, self._stdout_fd, self._launch.stdout)
            await self._read(self._stderr_fd, self._launch.stdout)


class StderrIntoStdout(_ProcessBreaker):
    """Breaks: stdout and stderr are collected apart.

    Both pipes feed the stdout stream.
    """

    process_class = _StderrIntoStdoutProcess


class _HeadKeepingStream(OutputStream):
    __slots__ = ()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        head = bytes(self._tail)
        super().feed(data)
        if len(head) + len(data) > self.max_bytes:
            self._tail[:] = (head + bytes(data))[: self.max_bytes]


class KeepsHead(_StreamBreaker):
    """Breaks: each stream keeps at most `max_output_bytes` in memory: the tail.

    It keeps the head.
    """

    stream_class = _HeadKeepingStream


class _KeptBytesCountStream(OutputStream):
    __slots__ = ()

    def collected(self) -> CollectedOutput:
        collected = super().collected()
        return collected.model_copy(update={"total_bytes": len(self._tail)})


class CountsOnlyKeptBytes(_StreamBreaker):
    """Breaks: `total_bytes` counts every byte the stream produced, kept or not.

    It counts the bytes it kept.
    """

    stream_class = _KeptBytesCountStream


class _NoSpillPathStream(OutputStream):
    __slots__ = ()

    @property
    def spill_path(self) -> str | None:
        return None


class DropsSpillPaths(_StreamBreaker):
    """Breaks: beyond `max_output_bytes` the whole stream is in a spill file, `spill_path`.

    The spill file is written but its path is never reported.
    """

    stream_class = _NoSpillPathStream


class _HeldTap:
    """A tap in front of the caller's that holds every chunk until it is released."""

    def __init__(self, tap: Callable[[Any, bytes], None]) -> None:
        self.tap = tap
        self.held: list[tuple[Any, bytes]] = []

    def __call__(self, stream: Any, data: bytes) -> None:
        self.held.append((stream, data))

    def release(self) -> None:
        for stream, data in self.held:
            self.tap(stream, data)
        self.held.clear()


class _TapAtEndStream(OutputStream):
    __slots__ = ()

    def close(self) -> None:
        if isinstance(self._tap, _HeldTap):
            self._tap.release()
        super().close()


class TapDeliveredAtEnd(_StreamBreaker):
    """Breaks: a run's `on_output` gets each chunk as it arrives.

    Every chunk reaches the tap, exactly, but only when the stream ends.
    """

    stream_class = _TapAtEndStream

    def _break_stream(self, stream: OutputStream) -> None:
        if stream._tap is not None:
            stream._tap = _HeldTap(stream._tap)
        super()._break_stream(stream)


class _TapPlaceholderStream(OutputStream):
    __slots__ = ()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        # What the kept tail would drop goes in as zeros (counted, never fetched), as a follower that
        # skips to the tail would: the tail and the counts stay right, the tap's bytes do not.
        excess = len(data) - self.max_bytes
        if excess > 0:
            super().feed(bytes(excess))
            data = bytes(data)[excess:]
        super().feed(data)


class TapGetsPlaceholders(_StreamBreaker):
    """Breaks: a background task's `on_output` gets every byte exactly.

    What the kept tail would drop reaches the tap as zeros.
    """

    stream_class = _TapPlaceholderStream


class _TruncatesAtLimitStream(OutputStream):
    __slots__ = ()

    @property
    def truncated(self) -> bool:
        return self.total_bytes >= self.max_bytes


class TruncatesAtLimit(_StreamBreaker):
    """Breaks: output of exactly `max_output_bytes` is not truncated.

    Off by one: it calls a stream truncated once it reaches the limit.
    """

    stream_class = _TruncatesAtLimitStream


class _ExclusiveSpillCapStream(OutputStream):
    __slots__ = ()

    def _spill_begin(self, data: bytes | bytearray | memoryview) -> None:
        if self.total_bytes >= self.max_spill_bytes:
            self._spill_state = "lost"
            return
        super()._spill_begin(data)

    def _spill_append(self, data: bytes | bytearray | memoryview, size: int) -> None:
        if self.total_bytes >= self.max_spill_bytes:
            self._lose_spill()
            return
        super()._spill_append(data, size)


class ExclusiveSpillCap(_StreamBreaker):
    """Breaks: a stream keeps its spill file while within `max_spill_bytes` (inclusive).

    Off by one: a stream of exactly `max_spill_bytes` loses its spill file.
    """

    stream_class = _ExclusiveSpillCapStream


class _UnlimitedBudget(SpillBudget):
    __slots__ = ()

    def reserve(self, size: int) -> bool:
        self.used += size
        return True


class IgnoresSpillTotal(LocalBashExecutor):
    """Breaks: the executor's spill files together stay within `max_spill_total_bytes`.

    It counts the bytes in spill files but never refuses one.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._spill_budget = _UnlimitedBudget(self._config.max_spill_total_bytes)


class WorldReadableSpills(LocalBashExecutor):
    """Breaks: a spill file is created 0600.

    Spill files are made readable by everyone (0644).
    """

    def _open_spill(self, command_marker: str, stream: str) -> SpillFile:
        spill = super()._open_spill(command_marker, stream)
        os.chmod(spill.path, 0o644)
        return spill


class SequentialSpillNames(LocalBashExecutor):
    """Breaks: a spill file has a name nobody can predict.

    Spill files are numbered 000001.stdout, 000002.stderr, ...
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._spill_numbers = itertools.count(1)

    def _open_spill(self, command_marker: str, stream: str) -> SpillFile:
        if self._spill_dir is None:
            raise OSError("the spill directory is gone")
        return HostSpillFile(self._spill_dir, f"{next(self._spill_numbers):06d}.{stream}")


class LeaksOnFailedOpen(LocalBashExecutor):
    """Breaks: when entering the executor raises, nothing it acquired is left behind.

    Its open refuses a bash it cannot find, after the host part made the spill directory; its
    release does nothing unless the open completed ("nothing was opened"), so the directory stays.
    (``left_behind`` lists them so the tests can remove them.)
    """

    left_behind: ClassVar[list[str]] = []
    _opened = False

    async def _open(self) -> None:
        await super()._open()
        if self._bash is None:
            if self._spill_dir is not None:
                self.left_behind.append(self._spill_dir.path)
            raise BashInfrastructureError(f"bash not found: {self.config.bash!r}", reason="shell_missing")
        self._opened = True

    async def _release(self) -> None:
        if self._opened:
            await super()._release()

    def kit_failing_open(self) -> Mapping[str, Any] | None:
        return {"bash": "dsh-bash-kit-no-such-bash"}


class KeepsSpillDir(LocalBashExecutor):
    """Breaks: aclose releases the spill directories the executor owns.

    aclose closes its handle on the spill directory and leaves the directory behind.
    (``left_behind`` lists them so the tests can remove them.)
    """

    left_behind: ClassVar[list[str]] = []

    async def _release(self) -> None:
        if self._spill_dir is not None:
            os.close(self._spill_dir.fd)
            self.left_behind.append(self._spill_dir.path)
            self._spill_dir = None


class _IgnoringDecodeStream(OutputStream):
    __slots__ = ()

    def collected(self) -> CollectedOutput:
        tail = self._tail
        start = _skip_continuation(tail, 0) if self.truncated else 0
        text = bytes(tail[start:]).decode("utf-8", errors="ignore")
        return super().collected().model_copy(update={"text": text})


class _ReencodedStream(OutputStream):
    __slots__ = ()

    def collected(self) -> CollectedOutput:
        collected = super().collected()
        return collected.model_copy(update={"data": collected.text.encode()})


class BytesFromText(_StreamBreaker):
    """Breaks: `data` is the kept tail exactly as the command wrote it.

    It encodes the text again: invalid bytes come back as U+FFFD's three bytes.
    """

    stream_class = _ReencodedStream


class DropsInvalidUtf8(_StreamBreaker):
    """Breaks: text is UTF-8 with invalid bytes replaced (U+FFFD).

    It decodes with errors="ignore": invalid bytes vanish.
    """

    stream_class = _IgnoringDecodeStream

    def _break_stream(self, stream: OutputStream) -> None:
        super()._break_stream(stream)
        stream._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")


class _ChunkDecodingStream(OutputStream):
    __slots__ = ()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        # Each chunk is decoded on its own (and stored re-encoded): a split character is mangled.
        super().feed(bytes(data).decode("utf-8", errors="replace").encode())


class DecodesChunkByChunk(_StreamBreaker):
    """Breaks: a multi-byte character split across two chunks or two reads is never mangled.

    It decodes each chunk as it arrives, so both halves of a split character become U+FFFD.
    """

    stream_class = _ChunkDecodingStream


# =================================================================================================
# Environment
# =================================================================================================


class LeaksAmbientSecrets(LocalBashExecutor):
    """Breaks: the ambient variables matching a scrub pattern are kept out of the command's env.

    It gives the child its own environment with the computed one on top
    (``env=dict(os.environ, **env)``), so every scrubbed secret comes back.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        computed = dict(launch.env)
        launch.env.update(self._ambient_env())
        launch.env.update(computed)
        return await super()._spawn(launch)


class NoAmbientEnv(LocalBashExecutor):
    """Breaks: the command's environment is the backend's ambient environment (minus scrubbed names).

    Commands get a clean environment with only PATH.
    """

    def _ambient_env(self) -> Mapping[str, str]:
        return {"PATH": os.environ.get("PATH", os.defpath)}


class FriendlyDefaultsDontOverride(LocalBashExecutor):
    """Breaks: the model-friendly set (TERM=dumb, PAGER=cat, ...) wins over ambient values.

    It applies the model-friendly set with setdefault: ambient values win.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        ambient = self._ambient_env()
        explicit = launch.spec.env or {}
        for name in MODEL_FRIENDLY_ENV:
            if name in ambient and name not in explicit:
                launch.env[name] = ambient[name]
        return await super()._spawn(launch)


class ScrubsSpecEnv(LocalBashExecutor):
    """Breaks: spec.env wins over everything and is not scrubbed.

    It applies the scrub patterns to the explicit variables too.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        config = self._config
        for name in launch.spec.env or {}:
            if is_scrubbed(name, config.env_scrub, config.env_allow):
                launch.env.pop(name, None)
        return await super()._spawn(launch)


class ForgetsEnvAllow(LocalBashExecutor):
    """Breaks: a variable matching a scrub pattern is kept when it matches `env_allow`.

    It copies its config without `env_allow`.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        config = config if config is not None else LocalConfig()
        super().__init__(config.model_copy(update={"env_allow": ()}))


class ScrubExtendsDefaults(LocalBashExecutor):
    """Breaks: setting `env_scrub` replaces the default patterns.

    It adds the configured patterns to the defaults.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        config = config if config is not None else LocalConfig()
        patterns = tuple(dict.fromkeys((*DEFAULT_ENV_SCRUB, *config.env_scrub)))
        super().__init__(config.model_copy(update={"env_scrub": patterns}))


class EnvOnCommandLine(LocalBashExecutor):
    """Breaks: no value the executor passes in the environment appears on a command line.

    It passes spec.env as `export NAME=VALUE;` in front of the command (as an SSH backend might):
    the values are in bash's argv for everyone's `ps` to see.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        explicit = launch.spec.env or {}
        if explicit:
            exports = "".join(f"export {name}={shlex.quote(value)}; " for name, value in explicit.items())
            launch = _with_spec(launch, command=exports + launch.spec.command)
        return await super()._spawn(launch)


# =================================================================================================
# Task-done listeners
# =================================================================================================


class NotifiesTwice(LocalBashExecutor):
    """Breaks: a listener is called exactly once for every background task that ends.

    It notifies once when the task ends and once more when it is cleaned up.
    """

    def _notify(self, task: BashTask) -> None:
        super()._notify(task)
        super()._notify(task)


class UnsubscribeRemovesWrongCallable(LocalBashExecutor):
    """Breaks: the callable on_task_done returns unsubscribes the listener.

    It registers a wrapper around the listener but the unsubscriber removes the listener itself,
    which is not registered: a no-op.
    """

    def on_task_done(self, listener: TaskListener) -> Callable[[], None]:
        def wrapper(task: BashTask) -> None:
            listener(task)

        self._listeners.append(wrapper)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe


class RaisingListenerStopsOthers(LocalBashExecutor):
    """Breaks: a listener that raises is logged and disturbs nothing else.

    The first listener that raises ends the notification: the listeners after it are skipped.
    """

    def _notify(self, task: BashTask) -> None:
        try:
            for listener in list(self._listeners):
                listener(task)
        except Exception:
            log.exception("a task-done listener raised for %s", task.id)


class NotifiesDuringClose(LocalBashExecutor):
    """Breaks: no listener is called once aclose has begun.

    Tasks that aclose kills are reported to the listeners too.
    """

    async def _finalize(self, command: _Command) -> None:
        first = not command.finalized
        await super()._finalize(command)
        if first and command.task is not None and self._state != "open":
            self._notify(command.task)


# =================================================================================================
# Lifecycle: closed executors, aclose
# =================================================================================================


class UsableAfterClose(LocalBashExecutor):
    """Breaks: calls after the executor closed raise ExecutorClosedError.

    Only calls before the block is entered are refused.
    """

    def _ensure_open(self) -> None:
        if self._state == "new":
            super()._ensure_open()


class ResizeIgnoredAfterClose(LocalBashExecutor):
    """Breaks: calls after the executor closed raise ExecutorClosedError.

    Every call is refused but a terminal's resize, which does nothing once the executor is not open.
    """

    async def resize_terminal(
        self, task_id: BashTaskId, size: TerminalSize, *, owner: OwnerToken | None
    ) -> None:
        if self._state != "open":
            return
        await super().resize_terminal(task_id, size, owner=owner)


class ExecutorClosed(RuntimeError):
    """The backend's own "closed" error (it should be dsh_bash.ExecutorClosedError)."""


class OwnClosedError(LocalBashExecutor):
    """Breaks: calls on a closed executor raise ExecutorClosedError (a BashInfrastructureError).

    It raises an error class of its own, a RuntimeError.
    """

    def _ensure_open(self) -> None:
        if self._state != "open":
            raise ExecutorClosed(f"{type(self).__name__} is not open")


class ConcurrentAcloseRaises(LocalBashExecutor):
    """Breaks: aclose may be called from any task, any number of times.

    An aclose that comes while another is in progress raises instead of waiting for it.
    """

    async def aclose(self) -> None:
        if self._state == "closing":
            raise RuntimeError("aclose is already in progress")
        await super().aclose()


# =================================================================================================
# Beyond the contract: processes that left the session
# =================================================================================================


class _GroupOnlyProcess(HostProcess):
    async def signal_all(self, sig: int) -> None:
        group_ours, _escaped = await self._members()
        if group_ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pid, sig)
        self._scanner.invalidate()

    async def remaining(self) -> list[str]:
        group_ours, _escaped = await self._members()
        if not group_ours:
            return []
        return [str(e.pid) for e in await self._scanner.entries() if e.alive and e.pgrp == self._pid]


class _GroupMembers:
    """The live processes of some process groups (each checked to carry one of our markers)."""

    def __init__(self, scanner: ProcScanner, groups: set[int]) -> None:
        self._scanner = scanner
        self._groups = groups

    async def _pids(self) -> list[int]:
        entries = await self._scanner.entries()
        return [e.pid for e in entries if e.alive and e.marker is not None and e.pgrp in self._groups]

    async def signal_all(self, sig: int) -> None:
        for pid in await self._pids():
            await anyio.to_thread.run_sync(signal_marked, pid, self._scanner.prefix, sig, False)
        self._scanner.invalidate()

    async def remaining(self) -> list[str]:
        return [str(pid) for pid in await self._pids()]


class GroupOnlyTracking(_ProcessBreaker):
    """Breaks (beyond): processes that left the group (setsid, double fork) are killed too.

    It knows its commands by process group only: kill, timeout, abort and aclose reach the groups
    its shells led and never what left them.
    """

    process_class = _GroupOnlyProcess

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._groups: set[int] = set()

    async def _spawn(self, launch: Launch) -> CommandProcess:
        process = await super()._spawn(launch)
        assert isinstance(process, HostProcess)
        self._groups.add(process._pid)
        return process

    def _leftovers(self) -> Killable:
        return _GroupMembers(self._scanner, self._groups)


class MarkerContainment(LocalBashExecutor):
    """Breaks: kill and close end every process a command started, whatever it did to its environment.

    Processes are found by the environment marker alone: one that dropped or overwrote its
    environment, and left the command's group, escapes. (This is the local backend's own fallback
    where ``dsh-supervise`` is missing; the broken part is relying on it as the mechanism.)
    """


class _FirstScanOnlyProcess(HostProcess):
    """Signals the command's group and the marked processes its first scan saw, never a newer one."""

    seen: list[int] | None = None

    async def signal_all(self, sig: int) -> None:
        if self.seen is None:
            _, self.seen = await self._members()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pid, sig)
        for pid in self.seen:
            await anyio.to_thread.run_sync(signal_marked, pid, self._launch.marker, sig, True)

    async def remaining(self) -> list[str]:
        alive = []
        for pid in self.seen or []:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 0)
                alive.append(str(pid))
        return alive


class KillsWhatItSawFirst(_ProcessBreaker):
    """Breaks: kill ends every generation of a fork chain that calls setsid in each.

    The kill sequence signals the processes one scan found when it began, and keeps signalling
    only those: a generation forked after that scan lives on.
    """

    process_class = _FirstScanOnlyProcess


class _KillScriptAsNobodyProcess(HostProcess):
    """Signals its group, then whatever the shared kill script, run as the commands' user, finds by marker."""

    async def signal_all(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pid, sig)
        await _kill_script_as_nobody("signal", sig, self._launch.marker, exact=True)

    async def remaining(self) -> list[str]:
        left = await _kill_script_as_nobody("list", 0, self._launch.marker, exact=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pid, 0)
            left.append(f"group {self._pid}")
        return left


_AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


async def _kill_script_as_nobody(
    mode: Literal["signal", "list"], sig: int, marker: str, *, exact: bool
) -> list[str]:
    done = await anyio.run_process(
        [
            *_AS_NOBODY,
            "bash",
            "--noprofile",
            "--norc",
            "-c",
            KILL,
            "dsh-bash",
            *kill_args(mode, sig, marker, exact=exact),
        ],
        check=False,
    )
    return done.stdout.decode().split()


class _NobodyLeftovers:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix

    async def signal_all(self, sig: int) -> None:
        await _kill_script_as_nobody("signal", sig, self._prefix, exact=False)

    async def remaining(self) -> list[str]:
        return await _kill_script_as_nobody("list", 0, self._prefix, exact=False)


class KillScriptWithoutPtraceRights(_ProcessBreaker):
    """Breaks: kill ends a non-dumpable escapee (one whose environment needs ptrace rights to read).

    Commands run as an unprivileged user (``nobody``), and the marker kill script runs as that
    user too, as the SSH backend's does as the login user: it cannot read the environment of a
    process that exec'd a file it cannot read, so that process, once out of the group, escapes.
    """

    process_class = _KillScriptAsNobodyProcess

    def _wrap_command(self, argv: list[str], launch: Launch) -> tuple[list[str], str]:
        return [*_AS_NOBODY, *argv], launch.spec.workdir

    def _leftovers(self) -> Killable:
        return _NobodyLeftovers(self._token + "-")


class _TrailerTrustingProcess(HostProcess):
    """Reads the exit status from a trailer in the command's stdout, as a boot wrapper's would be."""

    nonce = ""

    async def pump_output(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_trailer, self._stdout_fd, self._launch.stdout)
            await self._read(self._stderr_fd, self._launch.stderr)

    async def _read_trailer(self, fd: int, stream: OutputStream) -> None:
        self.trailer = ExitTrailerFilter(self.nonce, stream.feed)
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                await anyio.wait_readable(fd)
                continue
            if not data:
                self._fds[fd] = True
                self.trailer.flush()
                return
            self.trailer.feed(data)
            await anyio.lowlevel.checkpoint()

    async def wait(self) -> ExitStatus:
        trailer: ExitTrailerFilter | None = getattr(self, "trailer", None)
        while trailer is None or trailer.exit_code is None:
            if self._peek_exit() is not None:
                return await super().wait()
            await anyio.sleep(0.01)
            trailer = getattr(self, "trailer", None)
        return ExitStatus(code=trailer.exit_code)


class TrustsForgedTrailer(_ProcessBreaker):
    """Breaks: nothing a command writes can make the executor report that it ended, or another status.

    As the Docker backend's boot wrapper did: the exit status travels in band, as a trailer on
    stdout that carries a per-command nonce, and the nonce sits in the command's environment.
    """

    process_class = _TrailerTrustingProcess

    async def _spawn(self, launch: Launch) -> CommandProcess:
        nonce = os.urandom(8).hex()
        launch.env["DSH_BASH_NONCE"] = nonce
        process = await super()._spawn(launch)
        assert isinstance(process, _TrailerTrustingProcess)
        process.nonce = nonce
        return process


# -- input to a running task ------------------------------------------------------------------------


class ResolveDropsOpenStdin(LocalBashExecutor):
    """Breaks: resolve carries the request's `open_stdin`.

    The spec never asks for open input, so every task's stdin ends after the spec's ``stdin``.
    """

    def resolve(self, request: BashExecRequest) -> BashExecSpec:
        return super().resolve(request).model_copy(update={"open_stdin": False})


class _InputTwiceProcess(HostProcess):
    """Hands every piece of input to the command twice."""

    async def send_input(self, data: bytes) -> None:
        await super().send_input(data)
        await super().send_input(data)


class InputWrittenTwice(_ProcessBreaker):
    """Breaks: a task with open input reads each write once, in order.

    Every piece of input (the spec's ``stdin`` and each ``write_input``) is written twice.
    """

    process_class = _InputTwiceProcess


class InputAlwaysOpen(LocalBashExecutor):
    """Breaks: a task started without `open_stdin` reads end of file after the spec's `stdin`.

    Every command is spawned as if it asked for open input, and nobody ever writes or closes it.
    """

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(_with_spec(launch, open_stdin=True))


class CloseDropsQueue(LocalBashExecutor):
    """Breaks: after `close_input` the command reads every queued byte before end of file.

    The close ends the command's stdin at once, and what was still queued is lost.
    """

    async def close_input(self, task_id: BashTaskId, *, owner: OwnerToken | None) -> bool:
        closed = await super().close_input(task_id, owner=owner)
        await self._tasks[task_id].process.end_input()
        return closed


class InputIgnoresOwner(LocalBashExecutor):
    """Breaks: `write_input` and `close_input` refuse another owner's task.

    The caller's owner is never compared: any caller may write to any task.
    """

    def _input_of(
        self, task_id: BashTaskId, owner: OwnerToken | None, what: str, *, terminal: bool = False
    ) -> tuple[_Command, TaskInput]:
        task = self._command_for(task_id).task
        return super()._input_of(task_id, None if task is None else task.owner, what, terminal=terminal)


# -- terminals -------------------------------------------------------------------------------------------


class _OnTerminal(LocalBashExecutor):
    """Rewrites the command of every terminal task with ``rewrite`` (the breakage)."""

    def _rewrite(self, command: str) -> str:
        return command

    async def _spawn(self, launch: Launch) -> CommandProcess:
        if launch.spec.terminal is not None:
            launch = _with_spec(launch, command=self._rewrite(launch.spec.command))
        return await super()._spawn(launch)


class TerminalNotControlling(_OnTerminal):
    """Breaks: a terminal task's terminal is its controlling terminal.

    The command runs in a session of its own that has none (as a terminal only passed as fds 0, 1
    and 2 would be): `tty` and `stty size` work, `/dev/tty` does not open.
    """

    def _rewrite(self, command: str) -> str:
        return f"exec setsid -w bash --noprofile --norc -c {shlex.quote(command)}"


class TerminalWithoutSignals(_OnTerminal):
    """Breaks: `\\x03` written to a terminal task interrupts its foreground job.

    The terminal's line discipline makes no signals of keys (``stty -isig``): Ctrl-C is a plain byte.
    """

    def _rewrite(self, command: str) -> str:
        return f"stty -isig; {command}"


class TerminalDropsStderr(_OnTerminal):
    """Breaks: a terminal task's stderr is part of its one stream of output.

    What the command writes to stderr is dropped.
    """

    def _rewrite(self, command: str) -> str:
        return f"exec 2>/dev/null; {command}"


class _ResizeIgnoredProcess(HostProcess):
    async def resize(self, size: TerminalSize) -> None:
        return None


class ResizeIgnored(_ProcessBreaker):
    """Breaks: `resize_terminal` changes the size a terminal task's programs see.

    The new size never reaches the terminal.
    """

    process_class = _ResizeIgnoredProcess


class _TerminalGroupOnlyProcess(HostProcess):
    """Signals the terminal's foreground process group alone: no scan for processes that left it."""

    async def signal_all(self, sig: int) -> None:
        if self._launch.spec.terminal is None:
            await super().signal_all(sig)
            return
        group = self._foreground()
        if group is not None:
            with contextlib.suppress(OSError):
                os.killpg(group, sig)

    def _foreground(self) -> int | None:
        # A terminal without a session answers 0 (killpg(0) would signal our own group) or fails.
        try:
            group = os.tcgetpgrp(self._stdout_fd)
        except OSError:
            return None
        return group if group > 1 and group != os.getpgrp() else None

    async def remaining(self) -> list[str]:
        if self._launch.spec.terminal is None:
            return await super().remaining()
        group = self._foreground()
        if group is None:
            return []
        try:
            os.killpg(group, 0)
        except OSError:
            return []
        return [f"group {group}"]


class TerminalKillsForegroundOnly(_ProcessBreaker):
    """Breaks: kill and aclose of a terminal task leave no process of it.

    They signal the terminal's foreground process group only (as a terminal's hang-up does): a process
    that left the terminal's session lives on.
    """

    process_class = _TerminalGroupOnlyProcess


# -- waiting for input -------------------------------------------------------------------------------


class _NeverWaitingProcess(HostProcess):
    async def sample_input_waiting(self) -> bool | None:
        return False


class NeverWaiting(_ProcessBreaker):
    """Breaks: a read reports `waiting_for_input` while a process of the task is blocked reading it.

    Every look says no process waits.
    """

    process_class = _NeverWaitingProcess


class _SleepingIsWaitingProcess(HostProcess):
    async def sample_input_waiting(self) -> bool | None:
        # The state alone (S, sleeping): a process blocked on anything at all counts as waiting.
        entries = await self._scanner.entries()
        marker = self._launch.marker
        for entry in entries:
            if entry.alive and entry.marker == marker:
                stat = read_proc_stat(entry.pid)
                if stat is not None and stat.state == "S":
                    return True
        return False


class WaitingWhenSleeping(_ProcessBreaker):
    """Breaks: `waiting_for_input` is not reported while the task sleeps or reads another pipe.

    Any process in state S (sleeping, for whatever reason) counts as waiting for input.
    """

    process_class = _SleepingIsWaitingProcess


class WaitLookConsumes(LocalBashExecutor):
    """Breaks: `waiting_for_input(id)` consumes nothing: the next read delivers every byte.

    The look is built on a read that throws its delta away, as a look written with the read's code might.
    """

    def waiting_for_input(self, task_id: BashTaskId) -> bool | None:
        waiting = super().waiting_for_input(task_id)
        launch = self._command_for(task_id).launch
        launch.stdout.read()
        launch.stderr.read()
        return waiting


class WaitLookFromLastRead(LocalBashExecutor):
    """Breaks: `waiting_for_input(id)` is False right after a write: a wait seen before it does not count.

    The look answers from a cache of what the last read reported, which a write does not clear.
    """

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config)
        self._last_waiting: dict[BashTaskId, bool | None] = {}

    async def read_output(self, task_id: BashTaskId) -> BashTaskRead:
        read = await super().read_output(task_id)
        self._last_waiting[task_id] = read.waiting_for_input
        return read

    def waiting_for_input(self, task_id: BashTaskId) -> bool | None:
        super().waiting_for_input(task_id)  # refusals as the sound look's
        return self._last_waiting.get(task_id, False)


# -- sessions ---------------------------------------------------------------------------------------


class SessionCaptureNeverHanded(LocalBashExecutor):
    """Breaks: a session command's state at its exit becomes the session's.

    The backend says its launch hands the command the capture descriptor (as a supervisor's
    `--capture-fd` would), but nothing does: the trap writes into a closed fd and no state comes back.
    """

    def _session_capture_file(self, command_marker: str) -> str | None:
        return None


class SessionKeepsKilledState(LocalBashExecutor):
    """Breaks: a killed or timed-out session command leaves the session as it was before it.

    Whatever state came back is taken, as if every command had exited by itself (a SIGTERM runs the
    command's EXIT trap, so a timed-out command's state does come back).
    """

    def _settle_session(self, command: _Command, exit_code: int | None, signal: str | None) -> SessionReport:
        command.kill_cause = None
        return super()._settle_session(command, 0, None)


class SessionSharedByOwners(LocalBashExecutor):
    """Breaks: each owner has a session of its own that no other owner can run in.

    Sessions are looked up without their owner: every owner gets the one session.
    """

    def session(self, owner: OwnerToken | None = None) -> SessionId:
        return super().session(None)

    def _session_for(self, session: SessionId, owner: OwnerToken | None) -> Any:
        return super()._session_for(session, None)


class SessionKeepsScrubbedNames(LocalBashExecutor):
    """Breaks: a name the env policy scrubs never enters a session's state.

    The state is taken from the capture without the policy's scrub globs.
    """

    def _settle_session(self, command: _Command, exit_code: int | None, signal: str | None) -> SessionReport:
        config = self._config
        self._config = config.model_copy(update={"env_scrub": ()})
        try:
            return super()._settle_session(command, exit_code, signal)
        finally:
            self._config = config


class SessionLostOnReconfigure(LocalBashExecutor):
    """Breaks: a session survives `reconfigure`.

    The sessions are kept with the budgets they were made under and made anew when those change.
    """

    def reconfigure(self, **fields: Any) -> None:
        super().reconfigure(**fields)
        for session in self._sessions.values():
            session.reset()


# -- files ------------------------------------------------------------------------------------------


class FileReadAsText(LocalBashExecutor):
    """Breaks: `read_file` gives back exactly the bytes of the file.

    The bytes pass through text on the way (decoded as UTF-8 with replacement, encoded again)."""

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        data = await super()._read_file(path, user=user, max_bytes=max_bytes)
        return data.decode("utf-8", "replace").encode()


class MissingFileReadAsEmpty(LocalBashExecutor):
    """Breaks: `read_file` of a missing path raises FileOperationError `file_not_found`.

    A missing file reads as an empty one."""

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        try:
            return await super()._read_file(path, user=user, max_bytes=max_bytes)
        except FileOperationError as exc:
            if exc.reason == "file_not_found":
                return b""
            raise


def _write_through(path: str, data: bytes, chunk: int) -> None:
    with open(path, "wb") as handle:  # follows a link; truncates, then writes in chunks
        for at in range(0, len(data), chunk):
            handle.write(data[at : at + chunk])
            handle.flush()
            time.sleep(0.0005)


class WritesThroughLinks(LocalBashExecutor):
    """Breaks: `write_file` onto a planted link replaces the link, never writing its target.

    The file is opened for writing as a path, which follows the link."""

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        if os.path.islink(path):
            await anyio.to_thread.run_sync(_write_through, path, data, 1 << 20)
            return
        await super()._write_file(path, data, user=user, make_parents=make_parents)


class WritesInPlace(LocalBashExecutor):
    """Breaks: a command never sees a file `write_file` rewrites partly written.

    The file is truncated and written in place, 64 KiB at a time."""

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        if os.path.isfile(path):
            await anyio.to_thread.run_sync(_write_through, path, data, 64 * 1024)
            return
        await super()._write_file(path, data, user=user, make_parents=make_parents)


# -- sandbox policy ---------------------------------------------------------------------------------


_DENY = frozenset({"--deny-read"})
_LIMITS = frozenset({"--cpu-seconds", "--file-bytes", "--memory-bytes", "--open-files"})
_NETWORK = frozenset({"--network", "--proxy"})
_PROCESSES = frozenset({"--processes"})


def _without_options(confine: tuple[str, ...] | None, dropped: frozenset[str]) -> tuple[str, ...] | None:
    """``confine`` (``PATH --confine OPTIONS... --``) without the options named in ``dropped`` (and
    their values)."""
    if confine is None:
        return None
    kept: list[str] = list(confine[:2])
    rest = list(confine[2:-1])
    while rest:
        option, value = rest.pop(0), rest.pop(0)
        if option not in dropped:
            kept += [option, value]
    return (*kept, "--")


class PolicyIgnored(LocalBashExecutor):
    """Breaks: under workspace-write a command writes beneath its working directory only.

    The policy is resolved and checked, and then nothing applies it: the step is left out."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=None))


class DeniedReadsAllowed(LocalBashExecutor):
    """Breaks: a path of deny_read can be neither read nor written.

    The step confines writes and limits, without the denied paths."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=_without_options(launch.confine, _DENY)))


class LimitsDropped(LocalBashExecutor):
    """Breaks: a policy's limits hold in the command's process.

    The step confines the files only."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=_without_options(launch.confine, _LIMITS)))


class LimitsByTheShell(LocalBashExecutor):
    """Breaks: a command cannot lift its policy (raise a hard limit).

    The limit on open files is set by the command's own shell, as a soft limit (``ulimit -S``): a
    cooperative rule, which the command raises again."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        confine = launch.confine
        if confine is None or "--open-files" not in confine:
            return await super()._spawn(launch)
        limit = confine[confine.index("--open-files") + 1]
        command = f"ulimit -S -n {limit}\n{launch.spec.command}"
        spec = launch.spec.model_copy(update={"command": command})
        return await super()._spawn(replace(launch, spec=spec, confine=_without_options(confine, _LIMITS)))


class ProcessesDropped(LocalBashExecutor):
    """Breaks: limits.processes bounds how many processes a command has at once.

    The step applies every other limit: the processes limit is dropped (as a backend would that
    set it with RLIMIT_NPROC where the command runs as root, which the kernel never holds to it)."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=_without_options(launch.confine, _PROCESSES)))


class NetworkIgnored(LocalBashExecutor):
    """Breaks: under network = "none" a command can make no socket but a unix one.

    The step confines files and limits, and leaves the network rule out."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=_without_options(launch.confine, _NETWORK)))


def _network_as(confine: tuple[str, ...] | None, asked: str, applied: str) -> tuple[str, ...] | None:
    """``confine`` with the network rule ``asked`` swapped for ``applied``."""
    if confine is None or "--network" not in confine:
        return confine
    at = confine.index("--network") + 1
    return (*confine[:at], applied, *confine[at + 1 :]) if confine[at] == asked else confine


class _AnyHost(EgressProxy):
    def allows(self, host: str, port: int) -> bool:
        return True


class ProxyAllowsAnyHost(LocalBashExecutor):
    """Breaks: under network = "allow-list" a host the list lacks gets 403 from the proxy.

    The command's network is its own and the proxy its one way out, but the proxy lets every host
    through."""

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        if not hasattr(self, "_any_host_socket"):
            listener, self._any_host_socket = await EgressProxy.listen()
            self._start_helper(_AnyHost(()).serve, listener)
        return EgressRoute(socket=self._any_host_socket, key=None)


class ProxyFilesWithoutKeys(LocalBashExecutor):
    """Breaks: a command under a narrower policy cannot use a wider list's proxy.

    Each list's proxy is behind a socket file (as for an SSH host's commands), without a key: a
    command that finds another list's file by its name in a forwarder's command line goes through
    it."""

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        if not hasattr(self, "_keyless"):
            self._keyless: dict[tuple[str, ...], str] = {}
            self._keyless_dir = tempfile.mkdtemp(prefix="dsh-bash-broken-egress-")
        if allow_hosts not in self._keyless:
            listener, path = await EgressProxy.listen_at(self._keyless_dir)
            self._start_helper(EgressProxy(allow_hosts).serve_clients, listener)
            self._keyless[allow_hosts] = path
        return EgressRoute(socket=self._keyless[allow_hosts], key=None)

    async def _release(self) -> None:
        await super()._release()
        if hasattr(self, "_keyless_dir"):
            shutil.rmtree(self._keyless_dir, ignore_errors=True)


class LoopbackMeansNone(LocalBashExecutor):
    """Breaks: under network = "loopback" a command reaches its own loopback.

    Loopback is taken for no network at all: safe, and a command's own server on 127.0.0.1 is
    unreachable."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=_network_as(launch.confine, "loopback", "none")))


class NoneMeansLoopback(LocalBashExecutor):
    """Breaks: under network = "none" nothing is reachable, not even loopback.

    None is taken for loopback only: a command still reaches whatever listens in its namespace."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        return await super()._spawn(replace(launch, confine=_network_as(launch.confine, "none", "loopback")))


class WideningAccepted(LocalBashExecutor):
    """Breaks: resolve refuses a request's policy that widens the executor's.

    The request's policy is taken as it is."""

    def resolve(self, request: BashExecRequest) -> BashExecSpec:
        spec = super().resolve(request.model_copy(update={"policy": None}))
        return spec.model_copy(update={"policy": request.policy or spec.policy})

    async def _confine_argv(
        self, spec: BashExecSpec, also_writable: tuple[str, ...]
    ) -> tuple[tuple[str, ...] | None, dict[str, str]]:
        if spec.policy is None:
            return await super()._confine_argv(spec, also_writable)
        options = confine_options(spec.policy, spec.workdir, also_writable=also_writable)
        prefix = self._confine_prefix()
        return (None if options is None or prefix is None else (*prefix, *options, "--")), {}
