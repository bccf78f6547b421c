"""What a backend brings: its own process, kill and spill mechanics, and nothing else.

The executor base class (:class:`dsh_bash.BashExecutor`) owns timeouts, aborts, cancellation,
outcome classification, output accounting, the environment policy, task bookkeeping and
listeners. A backend implements the few hooks of the base class and one :class:`CommandProcess`
per spawned command.
"""

from __future__ import annotations

import logging
import math
import secrets
import signal as _signal
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import anyio

from ._errors import BashInfrastructureError
from ._output import OutputStream
from ._session import SessionCapture
from ._types import (
    BashExecSpec,
    TerminalSize,
)

__all__ = [
    "MARKER_VAR",
    "MAX_INLINE_COMMAND",
    "AtMostEvery",
    "CommandProcess",
    "Containment",
    "ContainmentSetting",
    "ExitStatus",
    "Killable",
    "Launch",
    "SupervisedCommand",
    "SupervisedLeftovers",
    "SupervisorInstall",
    "choose_containment",
    "kill_abandoned_start",
    "kill_sequence",
    "refuse_other_user",
    "signal_name",
    "temporary_file_name",
    "while_watching",
]

log = logging.getLogger("dsh_bash")

#: Every command's environment carries ``MARKER_VAR=<executor token>-<command number>``; its
#: descendants inherit it, so a backend can find them again after they left the process group.
MARKER_VAR = "DSH_BASH_MARK"

#: execve refuses a single argument over 128 KiB (MAX_ARG_STRLEN): a command longer than this (in
#: bytes, UTF-8) must reach bash another way than ``bash -c COMMAND`` (a file), on every backend.
MAX_INLINE_COMMAND = 100_000

#: How a :meth:`Killable.remaining` entry starts when the processes could not be looked at (a /proc
#: scan refused descriptors or memory): they are unknown, never "gone". ``aclose`` raises on them.
UNKNOWN_PREFIX = "(unknown: "


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How the command's shell ended: an exit code, or the number of the signal that killed it.

    ``exit_code_only``: the backend could observe only an exit status, in which a signal death reads
    as ``128+n`` (the ``marker`` fallback of Docker and SSH, without a supervisor to see the wait
    status). The executor then reports a ``128+n`` as signal ``n`` when its kill sequence sent ``n``
    to the command, and as the plain exit code otherwise. Every supervised backend reports exact
    statuses and leaves it False.
    """

    code: int | None
    signal: int | None = None
    exit_code_only: bool = False


@dataclass(frozen=True, slots=True)
class Launch:
    """Everything a backend needs to start one command, already decided by the executor."""

    spec: BashExecSpec
    env: dict[str, str]
    marker: str
    stdout: OutputStream
    stderr: OutputStream
    background: bool
    #: A foreground command in a session: where what it writes to its capture descriptor
    #: (:data:`SESSION_FD`) goes. None: no session, or a task (which captures nothing).
    session: SessionCapture | None = None
    #: The sandbox policy's step, to put before the command's bash in its own process: the argv of
    #: ``dsh-supervise --confine ... --`` where commands run (the backend's
    #: :meth:`~dsh_bash.BashExecutor._confine_prefix` and the policy's options). None: no policy.
    confine: tuple[str, ...] | None = None


class Killable(Protocol):
    """A set of processes the kill sequence can signal and watch."""

    async def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process of the set that still exists, verifying each belongs to it."""

    async def remaining(self) -> list[str]:
        """Descriptions (pids) of the processes of the set still alive; empty once all are gone."""


class SupervisedCommand(Killable, Protocol):
    """A command whose processes a supervisor holds: killable, and ``ended`` once all of them are gone."""

    @property
    def ended(self) -> bool:
        """True once the supervisor reported that no process of the command is left, and is gone."""


#: What kills and closes rest on: ``subreaper`` (every process of a command stays below its
#: dsh-supervise, which kills the whole subtree and reports the observed wait status) or ``marker``
#: (processes found by the environment marker: one that drops or overwrites it, or that cannot be
#: read, escapes).
Containment = Literal["subreaper", "marker"]
#: A config's choice: ``auto`` (the supervisor when it can run there, else the marker, said at
#: open), ``subreaper`` (refuse to open without it), ``marker`` (never use it).
ContainmentSetting = Literal["auto", "subreaper", "marker"]


@dataclass(frozen=True, slots=True)
class SupervisorInstall:
    """Where a backend put the supervisor (its path where the commands run; None: it cannot run
    there), and why not."""

    path: str | None
    problem: str = ""


def choose_containment(
    setting: ContainmentSetting, supervisor: str | None, problem: str, where: str
) -> str | None:
    """The supervisor to run commands under, once a backend looked for it: ``supervisor`` (None when
    it cannot run, ``problem`` saying why). ``subreaper`` refuses to go on without it
    (:class:`BashInfrastructureError`, reason ``start_failed``); ``auto`` goes on with the marker and
    says so in a warning naming ``where``; ``marker`` never uses it."""
    if setting == "marker":
        return None
    if supervisor is not None:
        return supervisor
    if setting == "subreaper":
        raise BashInfrastructureError(f"containment = 'subreaper' but {problem}", reason="start_failed")
    log.warning(
        "%s: %s; commands run with the weaker containment of an environment marker (a process that "
        "drops or overwrites it escapes kill and close)",
        where,
        problem,
    )
    return None


SupervisedT = TypeVar("SupervisedT", bound=SupervisedCommand)


class SupervisedLeftovers(Generic[SupervisedT]):
    """An executor's leftovers: every process under its live supervisors, and what a fallback finds.

    ``supervised`` is the executor's own set of live supervised commands (it adds each at spawn);
    a command leaves it here once ended. ``fallback`` reaches what no supervisor holds any more
    (the processes of commands run without one, or of a supervisor a command killed), typically by
    marker.
    """

    def __init__(self, supervised: set[SupervisedT], fallback: Killable) -> None:
        self._supervised = supervised
        self._fallback = fallback
        #: Signals the fallback was sent, and whether its last look found anything: a kill sequence
        #: repeats SIGKILL while anything remains, and a repeat through the fallback (an exec or a
        #: channel on Docker and SSH) is only worth its cost once the fallback itself saw processes.
        self._fallback_sent: set[int] = set()
        self._fallback_found = False

    async def signal_all(self, sig: int) -> None:
        # All at once: a command's request may wait for a process where the commands run (the
        # continue of a supervisor it may have stopped), and a hundred of those one after another
        # held the last commands' SIGKILL past aclose's bound on a loaded engine.
        # One command's failure (its host unreachable) must not cancel the others' requests: the
        # first error is raised once every command was asked.
        errors: list[Exception] = []

        async def ask(command: SupervisedT) -> None:
            try:
                await command.signal_all(sig)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for command in list(self._supervised):
                tg.start_soon(ask, command)
        if errors:
            raise errors[0]
        if sig not in self._fallback_sent or self._fallback_found:
            self._fallback_sent.add(sig)
            await self._fallback.signal_all(sig)

    async def remaining(self) -> list[str]:
        """What the supervisors still hold; the fallback is asked only once they hold nothing.

        A caller polls until the answer is empty, so a look through the fallback (on Docker and SSH an
        exec or a channel each) while a supervisor still reports processes would buy nothing: one
        at the end tells whether anything escaped them.
        """
        found: list[str] = []
        for command in list(self._supervised):
            left = await command.remaining()
            if left:
                found += left
            elif command.ended:
                self._supervised.discard(command)
        if found:
            return found
        found = await self._fallback.remaining()
        self._fallback_found = bool(found)
        return found


class CommandProcess(ABC):
    """One spawned command, as its backend runs it."""

    @abstractmethod
    async def wait(self) -> ExitStatus:
        """Return once the shell has exited; raise BashInfrastructureError if the backend lost it.

        Cancellation-safe: at the command's timeout the executor cancels the wait, starts the kill
        sequence and calls ``wait`` again.
        """

    @abstractmethod
    async def pump_output(self) -> None:
        """Feed the launch's stdout and stderr streams until both reach end of file.

        Cancelled by the executor once the drain bound after the shell's exit has passed.
        """

    @abstractmethod
    async def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process of the command: its group, and those that left it."""

    @abstractmethod
    async def remaining(self) -> list[str]:
        """Descriptions of the command's processes still alive (zombies excluded)."""

    async def left_behind(self, settle_s: float) -> list[str]:
        """Once the shell has exited: the command's processes still alive, as :meth:`remaining`.

        A backend that learns of their end from a report (a supervisor's ``empty``, which may come a
        moment after the exit) overrides this to wait up to ``settle_s`` for it first, so that a
        command that left nothing is never taken for one that did (its kill sequence would cost a
        poll). The executor kills what this returns before a foreground run's result.
        """
        return await self.remaining()

    async def release(self) -> None:  # noqa: B027 - optional hook: most backends hold something
        """Free what the command holds (file descriptors, channels). Called once, after it ended."""

    # Input hooks: called only for a spec with ``open_stdin``, which the executor lets through only
    # when the backend's ``_supports_open_stdin`` says so. The executor queues, orders, bounds and
    # refuses; these do the I/O, one call at a time, never after ``release``.

    async def send_input(self, data: bytes) -> None:
        """Hand ``data`` to the command's stdin: return once it is written to the command's pipe (or
        sent to a supervisor that writes it), waiting while the pipe is full. Raise
        :class:`BrokenPipeError` once the command closed its stdin; nothing more will be sent."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep a command's stdin open")

    async def end_input(self) -> None:
        """Close the command's stdin, after everything sent: it reads end of file."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep a command's stdin open")

    def input_pending(self) -> int:
        """Bytes handed over by :meth:`send_input` and not yet written to the command's stdin (held by
        a supervisor, say). The executor bounds its own queue plus this."""
        return 0

    async def sample_input_waiting(self) -> bool | None:
        """One look, now: is a process of the command blocked reading its open input (the stdin pipe
        or terminal the backend gave it), with nothing there to read? None: this backend cannot tell.
        The executor samples it every 200 ms while the input is open and reports a wait seen twice in
        a row with nothing written between (``BashTaskRead.waiting_for_input``)."""
        return None

    async def resize(self, size: TerminalSize) -> None:
        """Set the size of the command's terminal (a spec with ``terminal``): its foreground job gets
        SIGWINCH. Called only for such a spec, while the command runs."""
        raise NotImplementedError(f"{type(self).__name__} gives no command a terminal")


def refuse_other_user(user: str | None, runs_as: Collection[str], where: str) -> None:
    """For a backend that cannot switch users: a spec whose ``user`` is set and is none of the
    names or uids its commands run as (``runs_as``) raises :class:`BashInfrastructureError`
    (reason ``user_unsupported``) before anything starts."""
    if user is None or user in runs_as:
        return
    known = " or ".join(repr(name) for name in sorted(runs_as)) or "one user"
    raise BashInfrastructureError(
        f"cannot run the command as user {user!r}: commands {where} run as {known}, and this backend "
        "cannot switch users (nothing was started)",
        reason="user_unsupported",
    )


def signal_name(number: int) -> str:
    """Python's name for a signal number (``15`` -> ``"SIGTERM"``)."""
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


async def kill_sequence(
    target: Killable, grace_s: float, what: str, sent: set[int] | None = None
) -> list[str]:
    """SIGTERM, then SIGKILL after ``grace_s`` to whatever is left; bounded by about twice ``grace_s``.

    Returns the survivors (logged by pid), which are never waited for any longer.
    """
    poll = min(0.05, max(0.005, grace_s / 20))
    if sent is not None:
        sent.add(_signal.SIGTERM)
    await target.signal_all(_signal.SIGTERM)
    with anyio.move_on_after(grace_s):
        while await target.remaining():  # noqa: ASYNC110 - processes are polled: nothing notifies their end
            await anyio.sleep(poll)
        return []
    if sent is not None:
        sent.add(_signal.SIGKILL)
    # The first SIGKILL goes out whatever it costs: on a loaded host finding the processes can take
    # longer than the grace, and a bound here would leave SIGTERM-proof processes running for good.
    await target.signal_all(_signal.SIGKILL)
    survivors: list[str] = ["(not known: the bound ended the scan)"]
    with anyio.move_on_after(grace_s):
        while True:
            survivors = await target.remaining()
            if not survivors:
                return []
            await anyio.sleep(poll)
            await target.signal_all(_signal.SIGKILL)
    log.warning("%s: processes survived SIGKILL and are left behind: %s", what, ", ".join(survivors))
    return survivors


async def kill_abandoned_start(target: Killable, grace_s: float) -> None:
    """Kill whatever a start that failed or was cancelled half-way may have left running.

    A remote start cannot be taken back once its request is sent: the command may appear a moment
    after the caller gave up. So this kills by marker until two scans in a row find nothing,
    bounded by about twice ``grace_s``. Nothing was reported as started, so there is no grace.
    """
    with anyio.move_on_after(2 * grace_s + 0.5):
        quiet = 0
        while quiet < 2:
            await anyio.sleep(0.05)
            await target.signal_all(_signal.SIGKILL)
            quiet = 0 if await target.remaining() else quiet + 1


_T = TypeVar("_T")


def temporary_file_name() -> str:
    """A fresh name for a file that ``_write_file`` writes beside its target and renames over it once
    whole (``R-file-write``): hidden, and never one a command would guess."""
    return f".dsh-bash-{secrets.token_hex(8)}.tmp"


class AtMostEvery:
    """Runs ``action`` when called, one run at a time, and not again within ``every_s`` of the last
    run's start: a call meanwhile returns at once, having done nothing. For a remedy that every
    stalled call asks for and one run serves (continuing processes a command stopped, from outside:
    each run costs a process, and a command that keeps stopping them must not make the harness spend
    its time on it)."""

    def __init__(self, action: Callable[[], Awaitable[None]], *, every_s: float) -> None:
        self._action = action
        self._every_s = every_s
        self._lock = anyio.Lock()
        self._last = -math.inf

    async def __call__(self) -> None:
        async with self._lock:
            if anyio.current_time() - self._last < self._every_s:
                return
            self._last = anyio.current_time()
            await self._action()


class CoalescedRuns:
    """Runs ``action`` for its callers one run at a time; callers who ask meanwhile share one run.

    :meth:`run` returns once a run that began after the call has completed, so no caller is served
    by a run that began before its reason to ask (the continue of a supervisor stopped a moment
    ago). For an action that costs a process where the commands run, a hundred callers at once
    (the kills at ``aclose``) then cost two runs, not a hundred. A run cut short by its caller's
    cancellation serves no one: the next waiter runs it again. An error of the action reaches the
    caller whose run raised it; the others' run counts as done. A run still going after
    ``stale_after_s`` is left to its caller and no longer holds the others back: the next run begins
    beside it (a continue whose own process a command stopped must not keep every later one
    waiting for its bound).
    """

    def __init__(self, action: Callable[[], Awaitable[None]], *, stale_after_s: float = math.inf) -> None:
        self._action = action
        self._stale_after_s = stale_after_s
        self._begun = 0  # runs begun: each run's number
        self._completed = 0  # the highest number of a run that completed
        #: The run the others wait for (its number and when it began), or None.
        self._current: tuple[int, float] | None = None
        self._changed = anyio.Event()

    async def run(self) -> None:
        needed = self._begun + 1  # the first run to begin from now on
        while self._completed < needed:
            current = self._current
            if current is not None:
                stale_in = current[1] + self._stale_after_s - anyio.current_time()
                if stale_in > 0:
                    with anyio.move_on_after(stale_in):
                        await self._changed.wait()
                    continue
                self._current = None  # stale: left to its caller, the next run begins
            await self._run_once()

    async def _run_once(self) -> None:
        self._begun += 1
        number = self._begun
        self._current = (number, anyio.current_time())
        completed = False
        try:
            await self._action()
            completed = True
        except Exception:
            completed = True
            raise
        finally:
            if completed:  # cancelled: the run never happened, for anyone
                self._completed = max(self._completed, number)
            if self._current is not None and self._current[0] == number:
                self._current = None
            changed, self._changed = self._changed, anyio.Event()
            changed.set()


async def while_watching(
    body: Callable[[], Awaitable[_T]], watcher: Callable[[], Coroutine[Any, Any, object]]
) -> _T:
    """``await body()`` while ``watcher()`` runs beside it (a nudge every so often, a remedy once a
    wait has stalled). The watcher is cancelled when the body ends; the body's exception is raised
    as it is, never wrapped in an exception group of the task group they share."""
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher)
        try:
            result = await body()
        except Exception as exc:
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result
