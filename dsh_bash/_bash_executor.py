"""The abstract executor: every rule of the contract that is not process mechanics lives here."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import posixpath
import secrets
import signal as _signal
import stat
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from types import TracebackType
from typing import Any, ClassVar, Generic, Literal, Self, cast

import anyio
import anyio.abc
import anyio.lowlevel
from pydantic import ValidationError
from typing_extensions import TypeVar

from ._config import (
    BUDGET_FIELDS,
    BudgetConfig,
    config_error_from,
    default_task_cap,
)
from ._env import build_command_env, is_scrubbed
from ._errors import (
    BashInfrastructureError,
    ConfigError,
    DshBashError,
    ExecutorClosedError,
    FileOperationError,
    InfraReason,
    InputRefusal,
    TaskInputError,
    UnknownTaskError,
)
from ._output import (
    OutputStream,
    SpillBudget,
    SpillFile,
    StreamName,
    merge_streams,
)
from ._policy import (
    PROXY_KEY_VAR,
    ConfinementProbe,
    EgressRoute,
    SandboxPolicy,
    confine_options,
    narrowed,
    step_variables,
)
from ._protocol import (
    MARKER_VAR,
    UNKNOWN_PREFIX,
    CommandProcess,
    ExitStatus,
    Killable,
    Launch,
    kill_sequence,
    signal_name,
)
from ._session import (
    MAX_SESSION_BYTES,
    CaptureError,
    SessionCapture,
    SessionState,
    defined_names,
    leaves_state_as_is,
    parse_capture,
    session_replay,
    state_after,
    wrap_in_session,
)
from ._task_input import TaskInput, input_bytes
from ._types import (
    BashExecRequest,
    BashExecSpec,
    BashRunResult,
    BashTask,
    BashTaskId,
    BashTaskRead,
    BashTaskStatus,
    EndCause,
    OwnerToken,
    SessionId,
    SessionReport,
    TerminalSize,
)

__all__ = ["BashExecutor", "ConfigT_co", "TaskListener"]

log = logging.getLogger("dsh_bash")

TaskListener = Callable[[BashTask], None]
#: The config class of a backend: ``class MyExecutor(BashExecutor[MyConfig])`` types ``self.config``.
ConfigT_co = TypeVar("ConfigT_co", bound=BudgetConfig, covariant=True, default=BudgetConfig)
_KillCause = Literal["timeout", "aborted", "killed", "closed", "cancelled", "lost"]
_State = Literal["new", "open", "closing", "closed"]
#: How long releasing what a failed ``_open`` acquired may take (removing a container, a spill
#: directory over SSH) before ``__aenter__`` raises the open's error anyway.
_OPEN_RELEASE_BOUND_S = 10.0


#: The least time a backend has to report a command's end once the kill sequence is over (at least
#: ``grace_ms``): past it, the command is lost (``command_lost``) rather than waited for for ever.
_REPORT_AFTER_KILL_S = 1.0
#: How long a backend may take, once a foreground command's shell exited, to report that nothing of
#: it is left (a supervisor's ``empty`` trails the exit by a moment), before what is left is killed.
_LEFT_BEHIND_SETTLE_S = 0.2


class _Command:
    """Bookkeeping of one spawned command, foreground or background."""

    __slots__ = (
        "after_kill_scope",
        "capture_file",
        "exit",
        "failure",
        "finalized",
        "finished",
        "finishing",
        "input",
        "kill_cause",
        "kill_done",
        "launch",
        "leader_exited",
        "output_done",
        "process",
        "sent_signals",
        "session_start",
        "started_at",
        "task",
        "tg",
        "wait_scope",
        "watch_scope",
    )

    def __init__(
        self,
        launch: Launch,
        process: CommandProcess,
        task: BashTask | None,
        started_at: float,
    ):
        self.launch = launch
        self.process = process
        self.task = task
        self.started_at = started_at
        self.exit: ExitStatus | None = None
        self.failure: BashInfrastructureError | None = None
        self.kill_cause: _KillCause | None = None
        self.kill_done: anyio.Event | None = None
        self.sent_signals: set[int] = set()
        self.leader_exited = False
        self.finishing = False
        self.finalized = False
        self.finished = anyio.Event()
        self.output_done = anyio.Event()
        self.watch_scope = anyio.CancelScope()
        #: Around the wait for the shell's exit: cancelled when the backend did not report it within
        #: the bound after the kill sequence (:data:`_REPORT_AFTER_KILL_S`).
        self.wait_scope = anyio.CancelScope()
        #: Around that bound's timer: cancelled once the exit came.
        self.after_kill_scope = anyio.CancelScope()
        self.tg: anyio.abc.TaskGroup | None = None
        self.input: TaskInput | None = None
        #: A session command: the file of this host its state comes back in (else its backend feeds
        #: ``launch.session``), and the session's state it started from.
        self.capture_file: str | None = None
        self.session_start: SessionState | None = None

    @property
    def spec(self) -> BashExecSpec:
        return self.launch.spec

    def classify_exit(self) -> tuple[int | None, str | None]:
        status = self.exit
        if status is None:
            return None, None
        if status.signal is not None:
            return None, signal_name(status.signal)
        code = status.code
        if code is not None and code > 128 and status.exit_code_only and (code - 128) in self.sent_signals:
            return None, signal_name(code - 128)
        return code, None


def _file_failure(exc: Exception, doing: str, path: str) -> BashInfrastructureError:
    """A backend's own exception under ``read_file``/``write_file``, as the contract's error."""
    return BashInfrastructureError(
        f"could not {doing} {path}: {type(exc).__name__}: {exc}", reason="unclassified"
    )


def _read_capture_file(path: str) -> bytes:
    """A capture file's bytes (one more than the most a state may have, to tell one too large);
    nothing when the command never wrote it. Never follows a link a command put in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        chunks: list[bytes] = []
        left = MAX_SESSION_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


#: The largest capture file a session keeps for its next command.
_SPARE_CAPTURE_BYTES = 64 * 1024


class _Session:
    """One shell session: its owner and the state its next command gets."""

    __slots__ = ("_defined", "_replay", "last_capture", "last_env", "owner", "spare_file", "state")

    def __init__(self, owner: OwnerToken | None) -> None:
        self.owner = owner
        self.state = SessionState()
        #: A capture file of this host no command of the session uses now: the next one takes it
        #: (its bash truncates it), instead of a file made and removed for every command.
        self.spare_file: str | None = None
        #: The capture ``state`` was taken from (its id left out) and the environment its command
        #: started with (the marker left out): a command that leaves the same needs no parse.
        self.last_capture = b""
        self.last_env: dict[str, str] | None = None
        self._replay: tuple[SessionState, str] | None = None
        self._defined: tuple[SessionState, frozenset[str]] | None = None

    def replay(self) -> str:
        """The replay of ``state`` for a request that sets neither env nor workdir, kept while the
        state stands (the quoting of every value is paid once)."""
        cached = self._replay
        if cached is None or cached[0] is not self.state:
            cached = self._replay = (self.state, session_replay(self.state))
        return cached[1]

    def leaves_state_as_is(self, command: str) -> bool:
        """Whether ``command`` cannot change this session's state as it stands (its function and
        alias names are read once per state)."""
        cached = self._defined
        if cached is None or cached[0] is not self.state:
            cached = self._defined = (self.state, defined_names(self.state))
        return leaves_state_as_is(command, cached[1])

    def reset(self) -> None:
        self.state = SessionState()
        self.last_capture, self.last_env = b"", None

    def rescrub(self, scrub: tuple[str, ...], allow: tuple[str, ...]) -> None:
        state = self.state
        env = {name: value for name, value in state.env.items() if not is_scrubbed(name, scrub, allow)}
        unset = tuple(name for name in state.unset if not is_scrubbed(name, scrub, allow))
        if env != state.env or unset != state.unset:
            self.state = state.model_copy(update={"env": env, "unset": unset})
        self.last_capture, self.last_env = b"", None

    def forget_files(self) -> None:
        if self.spare_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.spare_file)
            self.spare_file = None


class _Delivered:
    """A :class:`Killable` that remembers which signals one of its passes delivered to the end."""

    def __init__(self, target: Killable) -> None:
        self._target = target
        self.delivered: set[int] = set()

    async def signal_all(self, sig: int) -> None:
        await self._target.signal_all(sig)
        self.delivered.add(sig)

    async def remaining(self) -> list[str]:
        return await self._target.remaining()


def _waiting(command: _Command) -> bool | None:
    """The waiting-for-input verdict a read reports: only while the task runs with its input open."""
    feed = command.input
    if feed is None or command.finalized or feed.state != "open":
        return False
    return feed.waiting


class _SentToAll(set[int]):
    """The signals aclose's one kill sequence sends, recorded for every command it kills."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list[_Command] = []

    def add(self, sig: int) -> None:
        super().add(sig)
        for command in self.commands:
            command.sent_signals.add(sig)


class BashExecutor(ABC, Generic[ConfigT_co]):
    """An async shell executor. Use as ``async with Executor(config) as ex: ...``.

    Subclasses (backends) implement the hooks below; the public methods are the contract's.
    """

    #: The backend's config model: :meth:`from_fields` validates plain fields with it.
    config_class: ClassVar[type[BudgetConfig]] = BudgetConfig
    #: False for backends whose :meth:`_leftovers` reaches every process of every command (their
    #: groups included) and whose every look at processes is costly (Docker: an exec each): aclose
    #: then runs that one kill sequence for all commands instead of one per command, whose polls
    #: would pile up in the engine by the thousand with many tasks running.
    close_kills_each_command: ClassVar[bool] = True
    #: What to do about this backend's infrastructure errors, by :attr:`BashInfrastructureError.reason`:
    #: one imperative sentence each, naming this backend's config fields (``dsh-bash doctor`` prints it
    #: as the fix). A reason not here gets the doctor's generic hint. Subclasses extend their base's
    #: with ``{**Base.infra_hints, ...}``.
    infra_hints: ClassVar[Mapping[InfraReason, str]] = {}
    #: True for backends that need ``setsid`` where commands run (to start commands or background
    #: tasks in a session of their own): ``dsh-bash doctor`` then fails when it is missing there.
    needs_setsid: ClassVar[bool] = True

    @classmethod
    def from_fields(cls, **fields: Any) -> Self:
        """Build from plain config fields (what an entry point in ``dsh_bash.backends`` resolves to).

        A bad field raises :class:`ConfigError` naming it.
        """
        try:
            config = cls.config_class.model_validate(fields)
        except ValidationError as exc:
            raise config_error_from(exc, f"{cls.__name__} config") from None
        return cls(cast(ConfigT_co, config))

    def __init__(self, config: ConfigT_co) -> None:
        self._config = config
        self._state: _State = "new"
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed_event: anyio.Event | None = None
        self._token = secrets.token_hex(8)
        self._command_numbers = itertools.count(1)
        self._task_numbers = itertools.count(1)
        self._tasks: dict[BashTaskId, _Command] = {}
        self._live: set[_Command] = set()
        #: Background tasks started or starting and not finalized yet, against max_running_tasks.
        self._running_tasks = 0
        self._default_task_cap = default_task_cap()
        #: What the sandbox policy's step can apply where commands run (probed once, when needed).
        self._confinement_probe: ConfinementProbe | None = None
        self._policy_gap_said = False
        #: Whether the warning that workspace-write with / writable confines no writes was logged.
        self._root_writable_said = False
        self._listeners: list[TaskListener] = []
        self._spill_budget = SpillBudget(config.max_spill_total_bytes)
        self._helper_scopes: set[anyio.CancelScope] = set()
        #: Each owner's shell session (``session``): held here, so it survives ``reconfigure`` and is
        #: no backend's to keep.
        self._sessions: dict[SessionId, _Session] = {}
        self._session_of_owner: dict[OwnerToken | None, SessionId] = {}

    # -- hooks a backend implements --------------------------------------------------------------

    @abstractmethod
    async def _open(self) -> None:
        """Acquire what the backend needs (connection, container, spill directory).

        When it raises, :meth:`_release` runs (shielded, bounded) before ``__aenter__`` re-raises: keep
        in the executor's fields what is acquired as soon as it is, so that nothing is left behind.
        """

    @abstractmethod
    async def _release(self) -> None:
        """Release everything ``_open`` acquired. Called once: after every command was killed, or
        after ``_open`` raised, when it must release whatever part was acquired (and only that)."""

    @abstractmethod
    def _default_cwd(self) -> str:
        """The working directory of a request without one (may use what ``_open`` learned)."""

    @abstractmethod
    def _ambient_env(self) -> Mapping[str, str]:
        """The environment commands would inherit, before the policy scrubs it."""

    @abstractmethod
    async def _spawn(self, launch: Launch) -> CommandProcess:
        """Start the command; return once it runs. Raise BashInfrastructureError when it cannot start."""

    @abstractmethod
    def _open_spill(self, command_marker: str, stream: StreamName) -> SpillFile:
        """Create a new private spill file where commands run. Raise OSError on failure."""

    @abstractmethod
    def _leftovers(self) -> Killable:
        """Every process any command of this executor left behind, for the sweep at ``aclose``."""

    def _supports_terminal(self) -> bool:
        """True when this executor's commands can run on a pseudo-terminal (their processes implement
        :meth:`~dsh_bash.backend.CommandProcess.resize` besides the input hooks). False refuses
        ``terminal`` at start (reason ``interactive_unsupported``)."""
        return False

    def _supports_open_stdin(self) -> bool:
        """True when this executor's commands can keep stdin open (their processes implement the input
        hooks of :class:`~dsh_bash.backend.CommandProcess`). False refuses ``open_stdin`` at start
        (reason ``interactive_unsupported``), before anything runs."""
        return False

    def _supports_sessions(self) -> bool:
        """True when this executor's commands can carry a shell session: each foreground command of
        one gets :data:`~dsh_bash.backend.SESSION_FD` (``launch.session`` set), and what the command
        writes there reaches ``launch.session.feed`` before its process reports its end (a
        supervisor's ``--capture-fd``); or :meth:`_session_capture_file` names a file of this host.
        False refuses a spec with a session (reason ``session_unsupported``)."""
        return False

    def _supports_files(self) -> bool:
        """True when this executor implements :meth:`_read_file` and :meth:`_write_file`. False (the
        default) refuses ``read_file``/``write_file`` (reason ``files_unsupported``)."""
        return False

    def _confine_prefix(self) -> list[str] | None:
        """The argv that starts the sandbox policy's step where commands run (``[PATH, "--confine"]``,
        PATH the ``dsh-supervise`` there), which the backend then puts before each confined command's
        bash (``launch.confine``); None (the default): this backend cannot, and an active policy is
        refused (reason ``policy_unenforceable``) unless its enforcement is ``best_effort``."""
        return None

    async def _probe_confinement(self) -> ConfinementProbe:
        """What the policy's step can apply where commands run (``dsh-supervise --confine --probe``
        there, :func:`dsh_bash.supervisor.confinement_from_probe`); the default: nothing. Asked once,
        when the first active policy needs it."""
        return ConfinementProbe()

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        """The way to the egress proxy of ``network = "allow-list"`` for ``allow_hosts``
        (:class:`dsh_bash.backend.EgressProxy`, run in the executor's task group; started at the
        first call for a list, the same after): an abstract unix socket (``@NAME``) in the network
        namespace where commands start (``key`` None); or the absolute path of a unix socket file
        where commands run that leads to such a proxy one connection at a time (the step relays
        each), with the proxy's key (a name is no secret among one user's processes: the key, which
        the step takes out of the command's environment, is what lets a relay through).
        None (the default): this backend serves none, and the allow-list is refused
        (``policy_unenforceable``)."""
        return None

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        """The bytes of the file at ``path`` (absolute) where commands run, read as
        ``user`` would read it; raise :class:`~dsh_bash.FileOperationError` for what is about the file
        (``file_too_large`` past ``max_bytes``, never a short read), ``BashInfrastructureError`` when
        the backend fails under it."""
        raise NotImplementedError

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        """Write ``data`` as the file at ``path`` (absolute) where commands run, as
        ``user`` could: into a fresh file beside it, renamed over it once whole (in place where only
        the file is writable); a link at ``path`` is replaced, never written through."""
        raise NotImplementedError

    def _session_capture_file(self, command_marker: str) -> str | None:
        """A fresh path on the harness's own host that a session command's bash opens as its capture
        descriptor, which the executor reads back (and removes) once the command ended: for a backend
        whose commands run on this host and cannot be handed the descriptor. None (the default): the
        backend hands it over itself and feeds ``launch.session``."""
        return None

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def supports_sessions(self) -> bool:
        """Whether a request may name a session (``R-session-carry``): False where this executor's
        commands cannot carry one (a backend without its supervisor), which refuses such a request
        with reason ``session_unsupported``. Known once the executor is open."""
        return self._supports_sessions()

    @property
    def containment(self) -> str | None:
        """What kills and closes rest on, once open: ``subreaper`` (each command under
        ``dsh-supervise``: every process it starts stays findable and is killed, its outcome cannot be
        forged) or ``marker`` (processes found by an environment marker; see ``docs/contract.md``).
        None: the backend does not say. ``dsh-bash doctor`` reports it."""
        return None

    @property
    def where(self) -> str | None:
        """Where this executor's commands run, in words for people (a node of a cluster), once
        open; None: the backend does not say. ``dsh-bash doctor`` reports it."""
        return None

    @property
    def config(self) -> ConfigT_co:
        return self._config

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise ExecutorClosedError("an executor can be entered only once; create a new one")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._closed_event = anyio.Event()
        try:
            await self._open()
            policy = self._config.policy
            if policy.active and policy.enforcement == "required":
                problem = await self._confinement_problem(policy)
                if problem is not None:
                    raise BashInfrastructureError(
                        f"{type(self).__name__} cannot apply its sandbox policy where its commands run: "
                        f'{problem} (enforcement = "best_effort" runs without it)',
                        reason="policy_unenforceable",
                    )
        except BaseException as exc:
            self._state = "closed"
            # What _open acquired before it failed (a container, a connection, a spill directory, a
            # fork server) is released here, once for every backend: _release must accept a partial
            # open. Shielded (a cancelled open still cleans up) and bounded (a stalled engine or host
            # must not hold the caller).
            with anyio.CancelScope(shield=True), anyio.move_on_after(_OPEN_RELEASE_BOUND_S) as bound:
                try:
                    await self._release()
                except Exception:
                    log.exception("%s: releasing after a failed open failed", type(self).__name__)
            if bound.cancelled_caught:
                log.warning(
                    "%s: releasing after a failed open did not finish within %.0f s",
                    type(self).__name__,
                    _OPEN_RELEASE_BOUND_S,
                )
            self._closed_event.set()
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            if isinstance(exc, Exception) and not isinstance(exc, BashInfrastructureError | ConfigError):
                raise BashInfrastructureError(f"{type(self).__name__} could not open: {exc}") from exc
            raise
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                tg.cancel_scope.cancel()
                # The children are gone; passing the body's exception on would let the task group
                # wrap it in an ExceptionGroup, so it is left to propagate by itself.
                await tg.__aexit__(None, None, None)
        return None

    async def aclose(self) -> None:
        """Kill everything, wait (bounded), release the backend. Idempotent; callable from any task."""
        if self._state == "new":
            self._state = "closed"
            return
        if self._state in ("closing", "closed"):
            assert self._closed_event is not None
            await self._closed_event.wait()
            return
        self._state = "closing"
        for session in self._sessions.values():
            session.forget_files()
        self._sessions.clear()  # sessions end with the executor
        self._session_of_owner.clear()
        grace_s = self._config.grace_ms / 1000
        #: Why aclose cannot say that nothing it started is alive: raised once everything is released.
        problem: BashInfrastructureError | None = None
        with anyio.CancelScope(shield=True):
            try:
                sent = _SentToAll()
                for command in list(self._live):
                    if self.close_kills_each_command:
                        self._request_kill(command, "closed")
                    elif not (command.finishing or command.finalized) and command.kill_cause is None:
                        command.kill_cause = "closed"  # the leftovers' sequence below kills it
                        sent.commands.append(command)
                leftovers = _Delivered(self._leftovers())
                with anyio.move_on_after(2 * grace_s + 0.5) as bound:
                    try:
                        survivors = await kill_sequence(
                            leftovers, grace_s, f"{type(self).__name__} leftovers", sent
                        )
                    except Exception as exc:
                        # Only the library's own errors leave aclose (a worker thread or descriptor the
                        # OS refused must not surface as a bare RuntimeError or OSError).
                        log.exception("%s: killing the leftovers failed", type(self).__name__)
                        problem = BashInfrastructureError(
                            f"{type(self).__name__}.aclose could not kill every process it started: {exc}"
                        )
                        problem.__cause__ = exc
                    else:
                        # A look at the processes that failed for the whole sequence (a /proc scan
                        # refused descriptors or memory) leaves them unknown: that is not "all gone".
                        # (Survivors a supervisor has not confirmed gone yet are only logged: its
                        # ``empty`` may still be on its way.)
                        unknown = [each for each in survivors if each.startswith(UNKNOWN_PREFIX)]
                        if unknown:
                            problem = BashInfrastructureError(
                                f"{type(self).__name__}.aclose cannot tell whether every process it "
                                f"started is gone: {'; '.join(unknown)}"
                            )
                    for command in list(self._live):
                        await command.finished.wait()
                if bound.cancelled_caught and _signal.SIGKILL not in leftovers.delivered:
                    await self._last_sigkill(grace_s, sent)
                for command in list(self._live):
                    log.warning("command %s did not finish within the close bound", command.launch.marker)
                    await self._finalize(command)
                for scope in list(self._helper_scopes):
                    scope.cancel()
                try:
                    await self._release()
                except Exception:
                    log.exception("%s: releasing the backend failed", type(self).__name__)
            finally:
                self._state = "closed"
                assert self._closed_event is not None
                self._closed_event.set()
        if problem is not None:
            raise problem

    async def _last_sigkill(self, grace_s: float, sent: set[int]) -> None:
        """One more SIGKILL to everything still marked, when the close bound cut the kills short.

        On a slow backend (a saturated engine, a loaded host) the bound can end the sequences before
        their SIGKILL went out, and a process that traps SIGTERM would then outlive the executor.
        (Once one SIGKILL pass reached everything, another would only cost time: on remote Docker an
        exec, which the conformance kit's aclose bound saw.)
        Sending is bounded too, but apart from the wait: it is never skipped for lack of time.
        """
        sent.add(_signal.SIGKILL)  # so that a 137 it causes reads as SIGKILL, not as an exit code
        with anyio.move_on_after(max(5.0, 2 * grace_s)) as scope:
            try:
                await self._leftovers().signal_all(_signal.SIGKILL)
            except Exception:
                log.exception("%s: the last SIGKILL to leftovers failed", type(self).__name__)
        if scope.cancelled_caught:
            log.warning("%s: the last SIGKILL to leftovers did not finish in time", type(self).__name__)

    def _ensure_open(self) -> None:
        if self._state != "open":
            what = "not entered yet" if self._state == "new" else "closed"
            raise ExecutorClosedError(f"{type(self).__name__} is {what}")

    def reconfigure(self, **fields: Any) -> None:
        """Validate new budget values and apply them from the next command on."""
        not_budget = sorted(set(fields) - BUDGET_FIELDS)
        if not_budget:
            raise ConfigError(
                f"reconfigure: {', '.join(not_budget)} cannot change on a live executor "
                f"(changeable: {', '.join(sorted(BUDGET_FIELDS))})"
            )
        self._config = self._config.with_changes(**fields)
        self._spill_budget.limit = self._config.max_spill_total_bytes
        if {"env_scrub", "env_allow"} & set(fields):
            # A name the policy scrubs from now on leaves every session's state too.
            config = self._config
            for session in self._sessions.values():
                session.rescrub(config.env_scrub, config.env_allow)

    # -- the contract's methods -------------------------------------------------------------------

    def resolve(self, request: BashExecRequest) -> BashExecSpec:
        self._ensure_open()
        config = self._config
        cwd = self._default_cwd()
        workdir = request.workdir
        if workdir is None:
            workdir = cwd
        elif not posixpath.isabs(workdir):
            workdir = posixpath.join(cwd, workdir)
        timeout_ms = config.timeout_ms if request.timeout_ms is None else request.timeout_ms
        return BashExecSpec.model_construct(
            command=request.command,
            workdir=workdir,
            timeout_ms=float(min(timeout_ms, config.max_timeout_ms)),
            owner=request.owner,
            user=request.user,
            signal=request.signal,
            stdin=request.stdin,
            env=request.env,
            open_stdin=request.open_stdin or request.terminal is not None,
            terminal=request.terminal,
            on_output=request.on_output,
            task_timeout_ms=(
                None
                if request.task_timeout_ms is None
                else float(min(request.task_timeout_ms, config.max_timeout_ms))
            ),
            session=request.session,
            enter_session_cwd=request.workdir is None,
            policy=narrowed(config.policy, request.policy),
        )

    async def exec(self, command: str, **request_fields: Any) -> BashRunResult:
        return await self.run(self.resolve(BashExecRequest(command=command, **request_fields)))

    async def run(self, spec: BashExecSpec) -> BashRunResult:
        if isinstance(spec, BashExecSpec) and spec.terminal is not None:
            raise ValueError(
                "terminal is for start(): nobody can type into a foreground run (nothing was started)"
            )
        if isinstance(spec, BashExecSpec) and spec.open_stdin:
            raise ValueError(
                "open_stdin is for start(): nobody can write to a foreground run's stdin (nothing was "
                "started)"
            )
        command = await self._launch(spec, background=False)
        try:
            try:
                await self._supervise(command, spec.timeout_ms / 1000)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._kill_now(command, "cancelled")
                    await self._finalize(command)
                raise
            await self._finalize(command)
            return self._result(command)
        finally:
            if command.capture_file is not None:
                self._recycle_capture_file(command)

    async def start(self, spec: BashExecSpec) -> BashTask:
        command = await self._launch(spec, background=True)
        assert command.task is not None and self._tg is not None
        self._tasks[command.task.id] = command
        self._tg.start_soon(self._run_background, command)
        if spec.open_stdin:
            stdin = spec.stdin
            command.input = TaskInput(stdin.encode() if isinstance(stdin, str) else stdin or b"")
            self._start_helper(command.input.pump, command.process, command.launch.marker)
        return command.task

    async def write_input(self, task_id: BashTaskId, data: str | bytes, *, owner: OwnerToken | None) -> None:
        """Queue ``data`` for the stdin of a task started with ``open_stdin``; return without waiting
        for the command to read it. Writes to one task reach it in the order they were made.

        Raises :class:`TaskInputError` (nothing sent) when the task cannot take it, ``ValueError``
        for more than :data:`~dsh_bash.MAX_INPUT_BYTES` or text without a UTF-8 form.
        """
        payload = input_bytes(data)
        command, feed = self._input_of(task_id, owner, "write to")
        feed.write(payload, command.process, task_id)

    async def close_input(self, task_id: BashTaskId, *, owner: OwnerToken | None) -> bool:
        """Close the stdin of a task started with ``open_stdin``: it reads end of file once it read
        what was queued. True if this call closed it, False if it was closed already (or broken)."""
        command, feed = self._input_of(task_id, owner, "close the input of")
        if command.spec.terminal is not None:
            raise TaskInputError(
                f"task {task_id} runs on a terminal, whose input is never closed: write \\x04 (Ctrl-D) "
                "for end of file at a line start, or kill it",
                reason="terminal_no_close",
            )
        return feed.close()

    async def resize_terminal(
        self, task_id: BashTaskId, size: TerminalSize, *, owner: OwnerToken | None
    ) -> None:
        """Set the size of a terminal task's terminal; its foreground job gets SIGWINCH."""
        if not isinstance(size, TerminalSize):
            raise TypeError(f"size must be a TerminalSize, got {type(size).__name__}")
        command, _ = self._input_of(task_id, owner, "resize the terminal of", terminal=True)
        await command.process.resize(size)

    def _input_of(
        self, task_id: BashTaskId, owner: OwnerToken | None, what: str, *, terminal: bool = False
    ) -> tuple[_Command, TaskInput]:
        """The task's open input, or the refusal (checked in this order: owner, end, input or terminal)."""
        self._ensure_open()
        command = self._command_for(task_id)
        task = command.task
        assert task is not None
        refusal: InputRefusal | None = None
        if task.owner is not None and owner != task.owner:
            refusal, message = "other_owner", f"task {task_id} belongs to another owner"
        elif command.finalized or command.finishing or command.kill_cause is not None:
            refusal, message = "task_ended", f"task {task_id} has ended (or its kill began): cannot {what} it"
        elif terminal and command.spec.terminal is None:
            refusal, message = "not_terminal", f"task {task_id} runs on no terminal"
        elif command.input is None:
            refusal, message = (
                "input_not_open",
                f"task {task_id} was not started with open_stdin: its stdin is closed",
            )
        if refusal is not None:
            raise TaskInputError(message, reason=refusal)
        assert command.input is not None
        return command, command.input

    def owner_of(self, task_id: BashTaskId) -> OwnerToken | None:
        self._ensure_open()
        command = self._tasks.get(task_id)
        return None if command is None or command.task is None else command.task.owner

    async def read_output(self, task_id: BashTaskId) -> BashTaskRead:
        self._ensure_open()
        command = self._command_for(task_id)
        await anyio.lowlevel.checkpoint()
        assert command.task is not None
        launch = command.launch
        out_text, out_dropped = launch.stdout.read()
        err_text, err_dropped = launch.stderr.read()
        dropped = out_dropped + err_dropped
        return BashTaskRead.model_construct(
            task=command.task,
            delta=merge_streams(out_text, err_text),
            lossy=dropped > 0,
            dropped_bytes=dropped,
            stdout_spill_path=launch.stdout.spill_path,
            stderr_spill_path=launch.stderr.spill_path,
            waiting_for_input=_waiting(command),
        )

    def waiting_for_input(self, task_id: BashTaskId) -> bool | None:
        """What the next ``read_output`` would report as ``waiting_for_input``, without reading: the
        task's output stays for that read.

        Synchronous: the verdict is kept in memory by the task's watch (a look does no I/O), and a look
        made right after a read (no await between) sees the state that read reported. A write clears the
        verdict at once, so a ``True`` seen after ``write_input`` returned is a wait that came after it.
        """
        self._ensure_open()
        return _waiting(self._command_for(task_id))

    async def kill(self, task_id: BashTaskId) -> bool:
        self._ensure_open()
        command = self._command_for(task_id)
        await anyio.lowlevel.checkpoint()
        if self._request_kill(command, "killed"):
            return True
        # Already ended: what its shell left behind still gets the kill sequence.
        self._start_helper(
            kill_sequence, command.process, self._config.grace_ms / 1000, f"leftovers of {task_id}"
        )
        return False

    def on_task_done(self, listener: TaskListener) -> Callable[[], None]:
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # -- helpers for backends ----------------------------------------------------------------------

    async def read_file(
        self, path: str, *, owner: OwnerToken | None = None, user: str | None = None
    ) -> bytes:
        """The bytes of the file at ``path`` where commands run (``R-file-read``): absolute, or
        relative to the default working directory; read as a command of ``user`` would. At most
        ``max_file_bytes``; refusals are :class:`~dsh_bash.FileOperationError` with a reason."""
        where = self._file_path(path)
        try:
            return await self._read_file(where, user=user, max_bytes=self._config.max_file_bytes)
        except (DshBashError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise _file_failure(exc, "read", where) from exc

    async def write_file(
        self,
        path: str,
        data: bytes,
        *,
        owner: OwnerToken | None = None,
        user: str | None = None,
        make_parents: bool = False,
    ) -> None:
        """Write ``data`` as the file at ``path`` where commands run (``R-file-write``): whole or not
        at all (atomic where the file system allows), as a command of ``user`` could, the directories
        on the way made with ``make_parents``; a link at ``path`` is replaced, never written through."""
        if isinstance(data, bytearray | memoryview):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise TypeError(f"write_file takes bytes, not {type(data).__name__} (encode text first)")
        where = self._file_path(path)
        if posixpath.basename(where) in ("", ".", ".."):
            raise FileOperationError(f"{where} names a directory", reason="is_a_directory")
        try:
            await self._write_file(where, data, user=user, make_parents=make_parents)
        except (DshBashError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise _file_failure(exc, "write", where) from exc

    def _file_path(self, path: str) -> str:
        self._ensure_open()
        if not isinstance(path, str):
            raise TypeError(f"a file path is a str, not {type(path).__name__}")
        if not path or "\0" in path:
            raise ValueError("a file path must be a non-empty string without NUL")
        if not self._supports_files():
            raise BashInfrastructureError(
                f"{type(self).__name__} cannot read or write files here (read_file, write_file); nothing "
                "was read or written",
                reason="files_unsupported",
            )
        return posixpath.join(self._default_cwd(), path)  # as given: ".." is the kernel's to resolve

    def session(self, owner: OwnerToken | None = None) -> SessionId:
        """The shell session of ``owner`` (``R-session``), made at its first use: a request with it
        runs in it. Sessions live as long as the executor, through ``reconfigure``."""
        self._ensure_open()
        found = self._session_of_owner.get(owner)
        if found is None:
            found = SessionId(f"session-{secrets.token_hex(6)}")
            self._sessions[found] = _Session(owner)
            self._session_of_owner[owner] = found
        return found

    def reset_session(self, session: SessionId, *, owner: OwnerToken | None = None) -> None:
        """Forget the state of ``session``: its next command starts as a fresh shell. A session of
        another owner is refused as an unknown one (``session_unknown``)."""
        self._session_for(session, owner).reset()

    def end_session(self, session: SessionId, *, owner: OwnerToken | None = None) -> None:
        """Forget ``session`` altogether (an owner that is gone): its id is unknown from now on, and
        the owner's next ``session`` makes a new one. A command of it still running keeps its result
        but sets no state. Refused as ``reset_session`` is."""
        self._session_for(session, owner).forget_files()
        del self._sessions[session]
        self._session_of_owner.pop(owner, None)

    def _session_for(self, session: SessionId, owner: OwnerToken | None) -> _Session:
        found = self._sessions.get(session)
        if found is None or found.owner != owner:
            raise BashInfrastructureError(
                f'no session "{session}" of this owner on {type(self).__name__} (made by session(owner), '
                "ended with the executor); nothing was started",
                reason="session_unknown",
            )
        return found

    def _start_helper(self, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``func(*args)`` in the executor's task group until it ends or the executor closes."""
        if self._tg is None:
            return
        self._tg.start_soon(self._helper, func, args)

    async def _helper(self, func: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        scope = anyio.CancelScope()
        if self._state in ("closing", "closed"):
            # Started while closing: run it cancelled, so it only cleans up (its finally blocks).
            # (One started while opening runs: an egress proxy the open's policy look started.)
            scope.cancel()
        self._helper_scopes.add(scope)
        try:
            with scope:
                await func(*args)
        except Exception:
            log.exception("%s: background helper %s failed", type(self).__name__, func)
        finally:
            self._helper_scopes.discard(scope)

    # -- internals ---------------------------------------------------------------------------------

    def _command_for(self, task_id: BashTaskId) -> _Command:
        command = self._tasks.get(task_id)
        if command is None:
            raise UnknownTaskError(f'unknown bash task "{task_id}"')
        return command

    async def _launch(self, spec: BashExecSpec, *, background: bool) -> _Command:
        self._ensure_open()
        if not isinstance(spec, BashExecSpec):
            raise TypeError(f"expected a BashExecSpec (resolve a request first), got {type(spec).__name__}")
        if spec.signal is not None and spec.signal.aborted:
            raise BashInfrastructureError(
                "the abort signal was already aborted; nothing was started", reason="already_aborted"
            )
        if spec.terminal is not None and not self._supports_terminal():
            raise BashInfrastructureError(
                f"{type(self).__name__} cannot run a command on a terminal here (terminal); nothing was "
                "started",
                reason="interactive_unsupported",
            )
        if spec.open_stdin and not self._supports_open_stdin():
            raise BashInfrastructureError(
                f"{type(self).__name__} cannot keep a command's stdin open here (open_stdin); nothing was "
                "started",
                reason="interactive_unsupported",
            )
        if spec.session is not None:
            self._session_for(spec.session, spec.owner)
            if not self._supports_sessions():
                raise BashInfrastructureError(
                    f"{type(self).__name__} cannot carry a shell session here (its commands cannot be given "
                    "a capture descriptor); nothing was started",
                    reason="session_unsupported",
                )
        config = self._config
        if background:
            cap = config.max_running_tasks or self._default_task_cap
            if self._running_tasks >= cap:
                raise BashInfrastructureError(
                    f"{self._running_tasks} background tasks are running, the most this executor allows "
                    f"(max_running_tasks = {cap}); nothing was started: kill or wait for one first",
                    reason="task_limit",
                )
            self._running_tasks += 1
            try:
                return await self._launch_counted(spec, background=True)
            except BaseException:
                self._running_tasks -= 1
                raise
        return await self._launch_counted(spec, background=False)

    async def _launch_counted(self, spec: BashExecSpec, *, background: bool) -> _Command:
        config = self._config
        marker = f"{self._token}-{next(self._command_numbers)}"
        env = build_command_env(
            self._ambient_env(), scrub=config.env_scrub, allow=config.env_allow, explicit=spec.env
        )
        if spec.terminal is not None and "TERM" not in (spec.env or {}):
            # The policy's TERM=dumb is for output read as plain text; a terminal task's programs draw.
            env["TERM"] = "xterm-256color"
        env[MARKER_VAR] = marker
        streams = [
            OutputStream(
                name,
                max_bytes=config.max_output_bytes,
                max_spill_bytes=config.max_spill_bytes,
                budget=self._spill_budget,
                open_spill=partial(self._open_spill, marker, name),
                tap=spec.on_output,
            )
            for name in ("stdout", "stderr")
        ]
        capture = capture_file = None
        launch_spec = spec
        session_start: SessionState | None = None
        if spec.session is not None:
            session = self._session_for(spec.session, spec.owner)
            capture_id = ""
            if not background:
                session_start = session.state
            # A command that cannot change the state needs no capture (R-session-carry): it leaves
            # the state it started from. Not one that may run a function bash imports from its
            # environment (`BASH_FUNC_name%%`): it is not the session's, and may be named like a program.
            captured = not background and not (
                session.leaves_state_as_is(spec.command)
                and not any(name.startswith("BASH_FUNC_") for name in env)
            )
            if captured:
                capture_file, session.spare_file = session.spare_file, None
                if capture_file is None:
                    capture_file = self._session_capture_file(marker)
                capture_id = secrets.token_hex(6)
                capture = SessionCapture(file=capture_file, capture_id=capture_id)
            if spec.env or not spec.enter_session_cwd:
                replay = session_replay(
                    session.state, explicit_env=spec.env or (), explicit_cwd=not spec.enter_session_cwd
                )
            else:
                replay = session.replay()
            wrapped = wrap_in_session(
                spec.command,
                replay,
                capture=capture is not None,
                capture_id=capture_id,
                capture_file=capture_file,
            )
            launch_spec = spec.model_copy(update={"command": wrapped})
        confine, step_env = await self._confine_argv(spec, () if capture_file is None else (capture_file,))
        env.update(step_env)
        launch = Launch(
            spec=launch_spec,
            env=env,
            marker=marker,
            stdout=streams[0],
            stderr=streams[1],
            background=background,
            session=capture,
            confine=confine,
        )
        started_at = time.monotonic()
        try:
            process = await self._spawn(launch)
        except BashInfrastructureError:
            raise
        except Exception as exc:
            raise BashInfrastructureError(
                f"could not start the command: {exc}", reason="start_failed"
            ) from exc
        if (spec.open_stdin and type(process).send_input is CommandProcess.send_input) or (
            spec.terminal is not None and type(process).resize is CommandProcess.resize
        ):
            # The executor said yes, but its process (a wrapper around another, say) implements no
            # input hooks: every write would fail. Nothing may stay running of it.
            with anyio.CancelScope(shield=True):
                orphan = _Command(launch, process, None, started_at)
                await self._kill_now(orphan, "closed")
                await self._finalize(orphan)
            raise BashInfrastructureError(
                f"{type(self).__name__} takes open_stdin, but its process {type(process).__name__} does "
                "not implement the input hooks (send_input, end_input, and resize for a terminal); nothing "
                "was started",
                reason="interactive_unsupported",
            )
        task = None
        if background:
            task = BashTask(BashTaskId(f"bash-{next(self._task_numbers)}"), spec.command, spec.owner)
        command = _Command(launch, process, task, started_at)
        command.capture_file = capture_file
        command.session_start = session_start
        if self._state != "open":
            # aclose began while the backend was starting it.
            with anyio.CancelScope(shield=True):
                await self._kill_now(command, "closed")
                await self._finalize(command)
            raise ExecutorClosedError(f"{type(self).__name__} closed while the command was starting")
        self._live.add(command)
        return command

    async def _confine_argv(
        self, spec: BashExecSpec, also_writable: tuple[str, ...]
    ) -> tuple[tuple[str, ...] | None, dict[str, str]]:
        """The policy's step for ``spec`` (``launch.confine``): the executor's policy narrowed by the
        spec's (a spec made by hand cannot widen it either), None when it confines nothing; and what
        the step takes from the command's environment before the command runs (a proxy's key)."""
        policy = narrowed(self._config.policy, spec.policy)
        if not policy.active:
            return None, {}
        problem = await self._confinement_problem(policy)
        prefix = self._confine_prefix()
        if problem is None and prefix is not None:
            # Asked again: the same list's proxy is already serving (the problem's look started it).
            proxy = await self._egress_socket(policy.allow_hosts) if policy.network == "allow-list" else None
            options = confine_options(policy, spec.workdir, also_writable=also_writable, proxy=proxy)
            if options is not None:
                self._say_if_nothing_is_kept_from_writes(policy, spec.workdir)
                step_env = {} if proxy is None or proxy.key is None else {PROXY_KEY_VAR: proxy.key}
                return (*prefix, *options, "--"), step_env
        if policy.enforcement == "best_effort":
            if not self._policy_gap_said:
                self._policy_gap_said = True
                name = type(self).__name__
                log.warning("%s runs commands without their sandbox policy (best_effort): %s", name, problem)
            return None, {}
        raise BashInfrastructureError(
            f"{type(self).__name__} cannot apply the sandbox policy where its commands run: {problem}; "
            'nothing was started (enforcement = "best_effort" runs without it)',
            reason="policy_unenforceable",
        )

    def _say_if_nothing_is_kept_from_writes(self, policy: SandboxPolicy, workdir: str) -> None:
        """A warning, once: workspace-write with ``/`` writable (a container's working directory is
        ``/`` where its image names none) writes everywhere, as asked, and should not do so silently."""
        if self._root_writable_said or policy.filesystem != "workspace-write":
            return
        if "/" in (workdir, *policy.writable):
            self._root_writable_said = True
            log.warning(
                '%s: filesystem = "workspace-write" with / writable (%s) confines no writes; give the '
                "commands a working directory (cwd) other than /",
                type(self).__name__,
                "the working directory" if workdir == "/" else "in writable",
            )

    async def _confinement_problem(self, policy: SandboxPolicy) -> str | None:
        """Why ``policy`` cannot be applied where commands run (None: it can); the backend is probed once."""
        if self._confine_prefix() is None:
            return "this backend has no confinement step (dsh-supervise --confine)"
        if self._confinement_probe is None:
            self._confinement_probe = await self._probe_confinement()
        problem = self._confinement_probe.problem(policy)
        allow_list = problem is None and policy.network == "allow-list"
        if allow_list and await self._egress_socket(policy.allow_hosts) is None:
            problem = 'network = "allow-list": this backend serves no egress proxy where its commands run'
        return problem

    async def _supervise(self, command: _Command, timeout_s: float | None) -> None:
        """Run one command to its end: exit, timeout, abort or kill, then the bounded drain."""
        grace_s = self._config.grace_ms / 1000
        async with anyio.create_task_group() as tg:
            command.tg = tg
            tg.start_soon(self._pump, command)
            if command.spec.signal is not None:
                tg.start_soon(self._watch_abort, command)
            try:
                command.exit = await self._wait_for_exit(command, timeout_s)
            except BashInfrastructureError as exc:
                command.failure = exc
            except Exception as exc:
                command.failure = BashInfrastructureError(
                    f"the backend lost the command: {exc!r}", reason="command_lost"
                )
            if command.spec.signal is not None:
                # Only then is there a watcher; cancelling a scope formats the current task's repr
                # into its reason, which a short command would feel.
                command.watch_scope.cancel()
            command.leader_exited = True
            command.after_kill_scope.cancel()
            if command.failure is not None:
                self._request_kill(command, "lost")
            elif (
                command.task is None
                and command.kill_cause is None
                and self._config.foreground_leftovers == "kill"
            ):
                await self._kill_left_behind(command)
            if command.kill_done is not None:
                await command.kill_done.wait()
            # Checked first: an event's wait is a checkpoint even when the event is set, and each
            # costs a turn of the event loop, which a short command would feel.
            if not command.output_done.is_set():
                with anyio.move_on_after(grace_s):
                    await command.output_done.wait()
            command.finishing = True
            if command.kill_done is not None:
                await command.kill_done.wait()
            if not command.output_done.is_set():
                tg.cancel_scope.cancel()  # the drain bound passed: the pump stops

    async def _kill_left_behind(self, command: _Command) -> None:
        """A foreground run's shell exited: kill what it left running (a ``server &``, a fork bomb's
        last generations) before the result, so that nothing of one command reaches the next one
        (its pids, its ports, its load). Never signals the shell's own exit status into question:
        the signals go unrecorded in ``command.sent_signals``."""
        marker = command.launch.marker
        try:
            left = await command.process.left_behind(_LEFT_BEHIND_SETTLE_S)
            if not left:
                return
            log.info("command %s left %d process(es) running; killing them", marker, len(left))
            await kill_sequence(command.process, self._config.grace_ms / 1000, f"what {marker} left behind")
        except Exception:
            log.exception("killing what command %s left behind failed", marker)

    async def _pump(self, command: _Command) -> None:
        try:
            await command.process.pump_output()
        except Exception:
            log.exception("reading the output of command %s failed", command.launch.marker)
        finally:
            command.output_done.set()

    async def _wait_for_exit(self, command: _Command, timeout_s: float | None) -> ExitStatus:
        """The shell's exit; at the timeout the kill sequence starts, and its exit is still awaited.

        The timeout is a deadline on the wait itself rather than a watcher task: one task less
        per command (a backend's ``wait`` is cancellation-safe and may be called again).
        """
        process = command.process
        with command.wait_scope:
            if timeout_s is not None:
                with anyio.move_on_after(timeout_s):
                    return await process.wait()
                self._request_kill(command, "timeout")
            return await process.wait()
        bound = self._report_after_kill_s()
        raise BashInfrastructureError(
            f"the backend did not report the command's end {bound:g} s after the kill sequence (its "
            "helper where the command runs may be stopped or gone); the command is lost",
            reason="command_lost",
        )

    def _report_after_kill_s(self) -> float:
        return max(_REPORT_AFTER_KILL_S, self._config.grace_ms / 1000)

    async def _watch_abort(self, command: _Command) -> None:
        signal = command.spec.signal
        assert signal is not None
        with command.watch_scope:
            await signal.wait()
            self._request_kill(command, "aborted")

    def _request_kill(self, command: _Command, cause: _KillCause) -> bool:
        """Start the kill sequence unless the command is ending anyway. True if it was still running."""
        if command.finishing or command.finalized:
            return False
        if command.kill_cause is not None:
            return True
        command.kill_cause = cause
        command.kill_done = anyio.Event()
        tg = command.tg if command.tg is not None else self._tg
        assert tg is not None
        tg.start_soon(self._kill_task, command)
        return True

    async def _kill_task(self, command: _Command) -> None:
        assert command.kill_done is not None
        try:
            await kill_sequence(
                command.process, self._config.grace_ms / 1000, command.launch.marker, command.sent_signals
            )
        except Exception:
            log.exception("killing command %s failed", command.launch.marker)
        finally:
            command.kill_done.set()
        # Every wait for a helper's answer has a deadline: one that never reports the end (stopped by
        # the command, say) must not hold the run or the task for ever.
        with command.after_kill_scope:
            await anyio.sleep(self._report_after_kill_s())
            if not command.leader_exited:
                log.warning(
                    "command %s: no end reported %.1f s after the kill sequence: lost",
                    command.launch.marker,
                    self._report_after_kill_s(),
                )
                command.wait_scope.cancel()

    async def _kill_now(self, command: _Command, cause: _KillCause) -> None:
        """Kill inline (the caller is being cancelled, or the executor closed under a start)."""
        if command.finalized:
            return
        if command.kill_cause is None:
            command.kill_cause = cause
        try:
            with anyio.move_on_after(2 * self._config.grace_ms / 1000 + 0.5):
                await kill_sequence(
                    command.process, self._config.grace_ms / 1000, command.launch.marker, command.sent_signals
                )
        except Exception:
            log.exception("killing command %s failed", command.launch.marker)

    async def _run_background(self, command: _Command) -> None:
        try:
            task_timeout_ms = command.spec.task_timeout_ms
            await self._supervise(command, None if task_timeout_ms is None else task_timeout_ms / 1000)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._kill_now(command, "closed")
                await self._finalize(command)
            raise
        await self._finalize(command)

    async def _finalize(self, command: _Command) -> None:
        if command.finalized:
            return
        command.finalized = True
        command.finishing = True
        if command.input is not None:
            command.input.end()  # no input hook runs once the backend releases the command
        # Streams first: closing them ends their spill files, which a backend's release may wait on.
        command.launch.stdout.close()
        command.launch.stderr.close()
        with anyio.CancelScope(shield=True):
            try:
                await command.process.release()
            except Exception:
                log.exception("releasing command %s failed", command.launch.marker)
        if command in self._live:
            self._live.discard(command)
            if command.task is not None:
                self._running_tasks -= 1
        task = command.task
        if task is not None:
            exit_code, signal = command.classify_exit()
            cause = command.kill_cause
            end_cause: EndCause
            if command.failure is not None and cause != "closed":
                # Once aclose took the command, its end is the close's, even when the backend
                # then lost it (a stream cut while the executor tears everything down).
                end_cause = "lost"
            elif cause in ("killed", "aborted", "closed"):
                end_cause = cause
            elif cause == "timeout":
                end_cause = "timed_out"
            elif cause == "cancelled":
                end_cause = "closed"
            elif signal is not None:
                end_cause = "signaled"
            else:
                end_cause = "exited"
            status: BashTaskStatus = "completed" if end_cause in ("exited", "signaled") else "killed"
            task._finish(status, exit_code, signal, end_cause)
        command.finished.set()
        if task is not None and self._state == "open":
            self._notify(task)

    def _notify(self, task: BashTask) -> None:
        for listener in list(self._listeners):
            try:
                listener(task)
            except Exception:
                log.exception("a task-done listener raised for %s; ignored", task.id)

    def _result(self, command: _Command) -> BashRunResult:
        cause = command.kill_cause
        if cause == "closed":
            raise ExecutorClosedError(f"{type(self).__name__} closed while the command ran")
        if command.failure is not None:
            raise command.failure
        exit_code, signal = command.classify_exit()
        launch = command.launch
        return BashRunResult.model_construct(
            exit_code=exit_code,
            signal=signal,
            timed_out=cause == "timeout",
            aborted=cause == "aborted",
            timeout_ms=command.spec.timeout_ms,
            duration_ms=(time.monotonic() - command.started_at) * 1000,
            stdout=launch.stdout.collected(),
            stderr=launch.stderr.collected(),
            session=None
            if command.session_start is None
            else self._settle_session(command, exit_code, signal),
        )

    def _recycle_capture_file(self, command: _Command) -> None:
        """A finished command's capture file becomes its session's spare, or goes."""
        path = command.capture_file
        assert path is not None and command.spec.session is not None
        session = self._sessions.get(command.spec.session)
        if session is not None and session.spare_file is None and self._state == "open":
            with contextlib.suppress(OSError):
                # Overwritten in place by the next command: one that grew large goes (what it holds
                # past a later capture would count against that capture's size bound).
                # A command may have put a link or a FIFO in its place: only a plain file is kept.
                found = os.stat(path, follow_symlinks=False)
                if stat.S_ISREG(found.st_mode) and found.st_size <= _SPARE_CAPTURE_BYTES:
                    session.spare_file = path
                    return
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _settle_session(self, command: _Command, exit_code: int | None, signal: str | None) -> SessionReport:
        """The session after one of its commands ended: the state it wrote at its exit when its shell
        exited by itself, else the state it started from (``R-session-killed-keeps``)."""
        spec = command.spec
        capture = command.launch.session
        assert spec.session is not None and command.session_start is not None
        session = self._sessions.get(spec.session)
        if session is None:  # ended (end_session, aclose) while the command ran
            return SessionReport.model_construct(id=spec.session, cwd=None, kept_previous="the session ended")
        if capture is not None and command.capture_file is not None:
            capture.feed(_read_capture_file(command.capture_file))
        kept: str | None = None
        cause = command.kill_cause
        if cause == "timeout":
            kept = "the command timed out"
        elif cause == "aborted":
            kept = "the command was aborted"
        elif exit_code is None:
            kept = f"the command ended by {signal}" if signal else "the command did not exit by itself"
        elif capture is None:
            # A command that could not change the state: it leaves the state it started from, as
            # its capture would have said (the last to end sets it).
            session.state = command.session_start
        elif capture.overflowed:
            kept = f"its state came back larger than {MAX_SESSION_BYTES} bytes"
        else:
            data = capture.data
            started_with = {name: value for name, value in command.launch.env.items() if name != MARKER_VAR}
            # Without what differs from one command to the next whatever it did: its id and its marker.
            body = data.replace(capture.id.encode(), b"", 1).replace(command.launch.marker.encode(), b"", 1)
            if (
                body == session.last_capture
                and started_with == session.last_env
                and command.session_start is session.state
                and not spec.env
                and spec.enter_session_cwd
            ):
                # What the last taken command left, from the same start: the state stands as it is.
                return SessionReport.model_construct(
                    id=spec.session, cwd=session.state.cwd, kept_previous=None
                )
            try:
                captured = parse_capture(data, capture.id)
            except CaptureError as exc:
                kept = str(exc)
            else:
                session.last_capture, session.last_env = body, started_with
                config = self._config
                if not spec.enter_session_cwd and captured.cwd == posixpath.normpath(spec.workdir):
                    # The request's workdir held for this command alone, as its env does: a command
                    # that did not leave it leaves the session's directory as it was.
                    captured = dataclasses.replace(captured, cwd=command.session_start.cwd)
                # What the allow-list's step set held for this command alone, as the request's env
                # does (a later command of the session may run under another rule), unless the
                # command changed it itself; and the step took the proxy's key out itself.
                # What the step was given decides (a reconfigure since cannot change it).
                confine = command.launch.confine or ()
                allow_list = any(
                    option == "--network" and value == "allow-list"
                    for option, value in itertools.pairwise(confine)
                )
                by_step = step_variables(captured.env) if allow_list else {}
                session.state = state_after(
                    captured,
                    {**command.launch.env, **by_step},
                    previous=command.session_start,
                    explicit=(*(spec.env or ()), *by_step),
                    scrub=(*config.env_scrub, MARKER_VAR, PROXY_KEY_VAR),
                    allow=config.env_allow,
                )
        return SessionReport.model_construct(id=spec.session, cwd=session.state.cwd, kept_previous=kept)
