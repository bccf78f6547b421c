"""A scripted, in-memory executor for testing code that drives a :class:`dsh_bash.BashExecutor`.

:class:`ScriptedExecutor` answers commands without starting any process, as ``httpx.MockTransport``
answers requests without a network: each command is looked up in a table of canned answers
(:class:`Script`), whose output is played into the command's streams, possibly over time, before the
"shell" exits, dies of a signal, runs until it is killed, or the backend fails under it::

    import re
    from dsh_bash.testing import Chunk, Script, ScriptedExecutor

    ex = ScriptedExecutor()
    ex.on("git status", Script(stdout="nothing to commit\\n"))
    ex.on(re.compile(r"^pytest\\b"), Script(stdout="1 failed\\n", exit_code=1))
    ex.on("npm run dev", Script(chunks=[Chunk("ready\\n", delay_s=0.1)], until_killed=True))

    async with ex:
        result = await ex.exec("git status")
    assert result.stdout.text == "nothing to commit\\n"
    assert [call.command for call in ex.calls] == ["git status"]

It is a real backend of the seam: a fake :class:`~dsh_bash.backend.CommandProcess` feeds the launch's
output streams, and spill files live in memory, so everything the base class owns applies unchanged:
timeouts and aborts and their classification, the kill sequence (SIGTERM, then SIGKILL after
``grace_ms`` for a script that ignores SIGTERM), truncation and spill accounting, incremental and lossy
background reads, owners, listeners called exactly once, and ``aclose``. Delays are real time
(``anyio.sleep``); keep them short. It works on asyncio and trio.

What it does not model: bash itself (nothing is parsed or expanded; ``stdin`` is recorded, not read),
working directories (any workdir is accepted unless a script says otherwise) and processes a command
leaves behind.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Self

import anyio
import anyio.lowlevel
from pydantic import Field

from dsh_bash import (
    INFRA_REASONS,
    BashExecSpec,
    BashExecutor,
    BashInfrastructureError,
    BudgetConfig,
    InfraReason,
    OwnerToken,
)
from dsh_bash.backend import CommandProcess, ExitStatus, Killable, Launch, SpillFile, StreamName

__all__ = [
    "Answer",
    "Chunk",
    "InfraFailure",
    "Match",
    "Script",
    "ScriptedCall",
    "ScriptedConfig",
    "ScriptedExecutor",
    "UnscriptedCommandError",
    "command_not_found",
]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes a scripted command writes to one stream, ``delay_s`` seconds after its previous chunk.

    ``data`` given as ``str`` is written as UTF-8. A chunk may end inside a multi-byte character: the
    executor's decoding never splits it, as with a real pipe.
    """

    data: bytes | str
    stream: StreamName = "stdout"
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes | str):
            raise TypeError(f"Chunk data must be bytes or str, got {type(self.data).__name__}")
        if self.stream not in ("stdout", "stderr"):
            raise ValueError(f'Chunk stream must be "stdout" or "stderr", got {self.stream!r}')
        _check_delay(self.delay_s, "Chunk delay_s")

    @property
    def payload(self) -> bytes:
        """``data`` as bytes."""
        return self.data.encode("utf-8") if isinstance(self.data, str) else self.data


@dataclass(frozen=True, slots=True)
class InfraFailure:
    """The backend fails: the executor raises :class:`dsh_bash.BashInfrastructureError` with ``reason``.

    ``at_start=True``: the command never starts (``run``/``start`` raise, no task exists), as when a
    workdir is missing or the host is unreachable. ``at_start=False``: it starts, plays its output,
    then the backend loses it where it would have exited (``run`` raises; a background task ends with
    ``end_cause="lost"``), as when a container dies or a connection drops mid-run.
    """

    reason: InfraReason = "unclassified"
    message: str = "scripted infrastructure failure"
    at_start: bool = True

    def __post_init__(self) -> None:
        if self.reason not in INFRA_REASONS:
            raise ValueError(f"unknown infrastructure error reason {self.reason!r}")

    def error(self) -> BashInfrastructureError:
        """A new exception for this failure (one per command: an exception carries its traceback)."""
        return BashInfrastructureError(self.message, reason=self.reason)


@dataclass(frozen=True, slots=True)
class Script:
    """What one scripted command does, in order.

    1. writes ``stdout`` then ``stderr`` at once (``str`` is written as UTF-8);
    2. plays ``chunks``, each after its own delay;
    3. with ``until_killed``, runs until a signal kills it; otherwise waits ``duration_s`` more and
       then exits with ``exit_code``, or dies of ``signal`` (a number, as ``signal.SIGSEGV``: what
       ``kill -SEGV $$`` does), or is lost by the backend when ``failure`` has ``at_start=False``.

    Any signal kills it at once, except SIGTERM when ``ignores_sigterm`` (a command that traps it):
    the executor's kill sequence then sends SIGKILL after ``grace_ms``. A ``failure`` with
    ``at_start=True`` (the default) starts nothing: the other fields must keep their defaults.
    """

    stdout: bytes | str = b""
    stderr: bytes | str = b""
    chunks: Sequence[Chunk] = ()
    exit_code: int = 0
    signal: int | None = None
    duration_s: float = 0.0
    until_killed: bool = False
    ignores_sigterm: bool = False
    failure: InfraFailure | None = None

    def __post_init__(self) -> None:
        for name in ("stdout", "stderr"):
            if not isinstance(getattr(self, name), bytes | str):
                raise TypeError(f"Script {name} must be bytes or str")
        object.__setattr__(self, "chunks", tuple(self.chunks))
        for chunk in self.chunks:
            if not isinstance(chunk, Chunk):
                raise TypeError(f"Script chunks must be Chunk objects, got {type(chunk).__name__}")
        if isinstance(self.exit_code, bool) or not isinstance(self.exit_code, int):
            raise TypeError(f"Script exit_code must be an int, got {self.exit_code!r}")
        if not 0 <= self.exit_code <= 255:
            raise ValueError(f"Script exit_code must be within 0..255, got {self.exit_code}")
        if self.signal is not None and (
            isinstance(self.signal, bool) or not isinstance(self.signal, int) or not 0 < self.signal < 65
        ):
            raise ValueError(f"Script signal must be a signal number within 1..64, got {self.signal!r}")
        _check_delay(self.duration_s, "Script duration_s")
        ends = [
            name
            for name, chosen in (
                ("exit_code", self.exit_code != 0),
                ("signal", self.signal is not None),
                ("until_killed", self.until_killed),
                ("failure", self.failure is not None),
            )
            if chosen
        ]
        if len(ends) > 1:
            raise ValueError(f"a Script ends one way only; got {' and '.join(ends)}")
        if self.until_killed and self.duration_s:
            raise ValueError("duration_s has no meaning for a Script that runs until killed")
        if self.failure is not None and self.failure.at_start and self._plays_something():
            raise ValueError("a Script that fails at start runs nothing: give it only the failure")

    def _plays_something(self) -> bool:
        return bool(self.stdout or self.stderr or self.chunks or self.duration_s or self.ignores_sigterm)


#: What a rule matches: the exact command (``str``), a pattern searched in the command
#: (``re.Pattern``, :meth:`re.Pattern.search`: anchor it for a full match), or a predicate on the spec.
Match = str | re.Pattern[str] | Callable[[BashExecSpec], bool]
#: How a rule answers: one :class:`Script` for every matching command, or a function of the spec.
Answer = Script | Callable[[BashExecSpec], Script]


def command_not_found(spec: BashExecSpec) -> Script:
    """The default answer: what bash says about an unknown command (exit 127).

    An empty or blank command succeeds silently, as in bash.
    """
    words = spec.command.split()
    if not words:
        return Script()
    return Script(stderr=f"bash: line 1: {words[0]}: command not found\n", exit_code=127)


class UnscriptedCommandError(BashInfrastructureError):
    """A command matched no rule of a :class:`ScriptedExecutor` built with ``default="raise"``.

    An infrastructure error (reason ``start_failed``), so it leaves ``run``/``start`` unchanged; a tool
    layer turns it into an error result like any start failure. :attr:`ScriptedExecutor.unmatched`
    lists those calls either way.
    """

    def __init__(self, message: str, *, reason: InfraReason = "start_failed") -> None:
        super().__init__(message, reason=reason)


@dataclass(eq=False)
class ScriptedCall:
    """One command the executor was asked to run (after the abort check: an aborted spec never gets here).

    ``spec`` is what ``run``/``start`` received (its ``env`` is the caller's); ``env`` is the whole
    environment the command would have had (ambient env after the policy, plus the caller's, plus the
    marker). ``script`` is the answer, ``None`` when an unmatched command raised. ``signals`` lists the
    signals the command received while it ran, in order; ``running`` is true until it ended.
    """

    spec: BashExecSpec
    background: bool
    env: dict[str, str]
    script: Script | None
    matched: bool
    signals: list[int] = field(default_factory=list)
    running: bool = False

    @property
    def command(self) -> str:
        return self.spec.command

    @property
    def workdir(self) -> str:
        return self.spec.workdir

    @property
    def timeout_ms(self) -> float:
        return self.spec.timeout_ms

    @property
    def owner(self) -> OwnerToken | None:
        return self.spec.owner

    @property
    def stdin(self) -> str | bytes | None:
        return self.spec.stdin


class ScriptedConfig(BudgetConfig):
    """The shared budgets, plus the environment and places a scripted command pretends to have.

    ``cwd`` (default ``/home/agent``) is the working directory of requests without one;
    ``ambient_env`` is the environment commands inherit before the policy scrubs it; spill files get
    paths under ``spill_dir`` but live in memory (read them with :meth:`ScriptedExecutor.read_spill`).
    """

    cwd: str | None = "/home/agent"
    ambient_env: dict[str, str] = Field(
        default_factory=lambda: {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/agent"}
    )
    spill_dir: str = "/tmp/dsh-bash-scripted"


class _MemorySpill:
    """A spill file in the executor's memory; it disappears when deleted and when the executor closes."""

    __slots__ = ("_files", "closed", "path")

    lost = False
    pending = False

    def __init__(self, files: dict[str, bytearray], path: str) -> None:
        self._files = files
        self.path = path
        self.closed = False
        files[path] = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        content = self._files.get(self.path)
        if content is None or self.closed:
            raise OSError(f"{self.path}: the spill file is closed or gone")
        content += data

    def close(self) -> None:
        self.closed = True

    def delete(self, gone: Callable[[], None]) -> None:
        self.closed = True
        self._files.pop(self.path, None)
        gone()


class _ScriptedProcess(CommandProcess):
    """One scripted command: ``pump_output`` plays its script, ``signal_all`` ends it."""

    def __init__(self, launch: Launch, script: Script, call: ScriptedCall, live: set[_ScriptedProcess]):
        self._launch = launch
        self._script = script
        self._call = call
        self._live = live
        self._status: ExitStatus | None = None
        self._failure: BashInfrastructureError | None = None
        self._ended = anyio.Event()
        self._playing = anyio.CancelScope()
        call.running = True
        live.add(self)

    def _end(self, status: ExitStatus | None, failure: BashInfrastructureError | None = None) -> None:
        if self._ended.is_set():
            return
        self._status = status
        self._failure = failure
        self._call.running = False
        self._ended.set()
        self._playing.cancel()  # its output ends with it

    async def wait(self) -> ExitStatus:
        await self._ended.wait()
        if self._failure is not None:
            raise self._failure
        assert self._status is not None
        return self._status

    async def pump_output(self) -> None:
        with self._playing:
            if not self._ended.is_set():
                await self._play()

    async def _play(self) -> None:
        script, launch = self._script, self._launch
        launch.stdout.feed(_encode(script.stdout))
        launch.stderr.feed(_encode(script.stderr))
        for chunk in script.chunks:
            if chunk.delay_s:
                await anyio.sleep(chunk.delay_s)
            (launch.stdout if chunk.stream == "stdout" else launch.stderr).feed(chunk.payload)
        if script.until_killed:
            await anyio.sleep_forever()
        if script.duration_s:
            await anyio.sleep(script.duration_s)
        if script.failure is not None:
            self._end(None, script.failure.error())
        elif script.signal is not None:
            self._end(ExitStatus(code=None, signal=script.signal))
        else:
            self._end(ExitStatus(code=script.exit_code))

    async def signal_all(self, sig: int) -> None:
        await anyio.lowlevel.checkpoint()
        if self._ended.is_set():
            return
        self._call.signals.append(int(sig))
        if sig == _signal.SIGTERM and self._script.ignores_sigterm:
            return
        self._end(ExitStatus(code=None, signal=sig))

    async def remaining(self) -> list[str]:
        await anyio.lowlevel.checkpoint()
        return [] if self._ended.is_set() else [f"scripted:{self._launch.marker}"]

    async def release(self) -> None:
        self._live.discard(self)


class _Leftovers:
    """Every scripted command still running, for the sweep at ``aclose``."""

    def __init__(self, live: set[_ScriptedProcess]) -> None:
        self._live = live

    async def signal_all(self, sig: int) -> None:
        for process in list(self._live):
            await process.signal_all(sig)

    async def remaining(self) -> list[str]:
        found: list[str] = []
        for process in list(self._live):
            found += await process.remaining()
        return found


class ScriptedExecutor(BashExecutor[ScriptedConfig]):
    """An executor whose commands are answered by scripts instead of processes.

    ``scripts`` maps matches to answers (see :meth:`on`); ``default`` answers commands that match no
    rule: a :class:`Script`, a function of the spec (the default, :func:`command_not_found`, gives
    bash's exit 127), or ``"raise"`` to refuse them with :class:`UnscriptedCommandError`. Every command
    asked for is recorded in :attr:`calls`.
    """

    config_class = ScriptedConfig

    def __init__(
        self,
        config: ScriptedConfig | None = None,
        *,
        scripts: Mapping[Match, Answer] | None = None,
        default: Answer | Literal["raise"] = command_not_found,
    ) -> None:
        super().__init__(config if config is not None else ScriptedConfig())
        self._rules: list[tuple[Match, Answer]] = []
        self._default = default
        self._calls: list[ScriptedCall] = []
        self._processes: set[_ScriptedProcess] = set()
        self._spills: dict[str, bytearray] = {}
        self._spill_numbers = 0
        for match, answer in (scripts or {}).items():
            self.on(match, answer)

    def on(self, match: Match, answer: Answer) -> Self:
        """Answer commands that ``match`` with ``answer``; returns the executor, for chaining.

        ``match`` is the exact command (``str``), a compiled pattern searched in the command, or a
        predicate on the :class:`~dsh_bash.BashExecSpec`; ``answer`` is a :class:`Script` or a function
        from the spec to one (for output that depends on the workdir, the env, stdin, a counter...).
        Rules are tried in the order they were added; the first match answers. Rules may be added
        while the executor is open.
        """
        if not (isinstance(match, str | re.Pattern) or callable(match)):
            raise TypeError(f"match must be a str, a compiled re.Pattern or a callable, got {match!r}")
        if not (isinstance(answer, Script) or callable(answer)):
            raise TypeError(f"answer must be a Script or a callable returning one, got {answer!r}")
        self._rules.append((match, answer))
        return self

    @property
    def calls(self) -> list[ScriptedCall]:
        """Every command asked for, in order (a copy: later calls are not added to it)."""
        return list(self._calls)

    @property
    def commands(self) -> list[str]:
        """The command of each of :attr:`calls`."""
        return [call.command for call in self._calls]

    @property
    def unmatched(self) -> list[ScriptedCall]:
        """The calls no rule matched (answered by ``default``, or refused with ``"raise"``)."""
        return [call for call in self._calls if not call.matched]

    def read_spill(self, path: str) -> bytes:
        """The content of an in-memory spill file (a ``spill_path`` of a result or a read).

        Raises :class:`FileNotFoundError` once it was deleted (over its cap) or the executor closed,
        as a real spill file would be gone.
        """
        content = self._spills.get(path)
        if content is None:
            raise FileNotFoundError(path)
        return bytes(content)

    # -- the backend hooks --------------------------------------------------------------------------

    async def _open(self) -> None:
        await anyio.lowlevel.checkpoint()

    async def _release(self) -> None:
        self._spills.clear()

    def _default_cwd(self) -> str:
        return self.config.cwd or "/"

    def _ambient_env(self) -> Mapping[str, str]:
        return self.config.ambient_env

    async def _spawn(self, launch: Launch) -> CommandProcess:
        await anyio.lowlevel.checkpoint()
        spec = launch.spec
        answer: Answer | Literal["raise"] | None = None
        for match, rule_answer in self._rules:
            if _matches(match, spec):
                answer = rule_answer
                break
        matched = answer is not None
        if answer is None:
            answer = self._default
        script = None
        if not isinstance(answer, str):
            script = answer if isinstance(answer, Script) else answer(spec)
            if not isinstance(script, Script):
                raise TypeError(f"the answer for {spec.command!r} returned {script!r}, not a Script")
        call = ScriptedCall(
            spec=spec, background=launch.background, env=dict(launch.env), script=script, matched=matched
        )
        self._calls.append(call)
        if script is None:
            raise UnscriptedCommandError(f"no script matches the command {spec.command!r}")
        if script.failure is not None and script.failure.at_start:
            raise script.failure.error()
        return _ScriptedProcess(launch, script, call, self._processes)

    def _open_spill(self, command_marker: str, stream: StreamName) -> SpillFile:
        self._spill_numbers += 1
        path = f"{self.config.spill_dir.rstrip('/')}/{command_marker}-{self._spill_numbers}.{stream}"
        return _MemorySpill(self._spills, path)

    def _leftovers(self) -> Killable:
        return _Leftovers(self._processes)


def _matches(match: Match, spec: BashExecSpec) -> bool:
    if isinstance(match, str):
        return spec.command == match
    if isinstance(match, re.Pattern):
        return match.search(spec.command) is not None
    return bool(match(spec))


def _encode(data: bytes | str) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


def _check_delay(value: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
