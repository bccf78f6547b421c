"""The vocabulary of the seam: requests, specs, results and the live task handle."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, NewType

import anyio
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBytes,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._abort import AbortSignal
from ._policy import SandboxPolicy

__all__ = [
    "BashExecRequest",
    "BashExecSpec",
    "BashRunResult",
    "BashTask",
    "BashTaskId",
    "BashTaskRead",
    "BashTaskStatus",
    "CollectedOutput",
    "EndCause",
    "OutputTap",
    "OwnerToken",
    "TerminalSize",
]

BashTaskId = NewType("BashTaskId", str)
OwnerToken = NewType("OwnerToken", str)
#: A shell session of an executor (``BashExecutor.session``): a handle, not a secret; it belongs to
#: the owner it was made for.
SessionId = NewType("SessionId", str)

BashTaskStatus = Literal["running", "completed", "killed"]
EndCause = Literal["exited", "signaled", "killed", "timed_out", "aborted", "closed", "lost"]

#: ``on_output(stream, data)``: every chunk of a command's output as the executor receives it
#: (``R-output-tap``). Called in the event loop's thread from the backend's reader: it must return at
#: once (queue the bytes; never block, never await).
OutputTap = Callable[[Literal["stdout", "stderr"], bytes], None]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Linux's MAX_ARG_STRLEN (32 pages): execve refuses any single environment string (NAME=VALUE and
#: its NUL) longer than this, on every backend, since each one ends in an execve of bash.
MAX_ENV_ENTRY_BYTES = 131_072


def _no_nul(value: str | None, field: str) -> str | None:
    if value is not None and "\x00" in value:
        raise ValueError(f"{field} must not contain a NUL character")
    return _encodable(value, field)


def _encodable(value: str | None, field: str) -> str | None:
    """Refuse text that has no UTF-8 form (a lone surrogate, including the ``os.fsdecode`` escapes
    of raw bytes): backends encode every text field as UTF-8 on their way to bash, and a failure
    there surfaced as an unnamed "could not start the command" (or, for stdin, mid-run), so it is
    refused here with the field's name. Raw bytes go in ``stdin`` as ``bytes``."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field} is not valid text: lone surrogate {value[exc.start]!r} at index {exc.start} "
            "has no UTF-8 encoding"
        ) from None
    return value


def _check_stdin(value: object) -> object:
    # A bytearray or memoryview is binary input: keep it binary (lax validation would turn a
    # bytearray into text, decoding it).
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return value


#: A user where commands run: a name (``adduser``'s rules, loosely) or a numeric uid.
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,255}")


def _check_user(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"user must be a string (a name or a numeric uid), got {type(value).__name__}")
    if not _USER.fullmatch(value):
        raise ValueError(
            f"user {value!r} is not a user name or uid (letters, digits, '_', '.', '-'; "
            "not starting with '.' or '-'; at most 256)"
        )
    return value


def _check_timeout(value: object, name: str = "timeout_ms") -> float | None:
    if value is None:
        return None
    # bool is an int subclass: refuse it explicitly, as strings are refused.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a positive finite number of milliseconds, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive finite number of milliseconds, got {value!r}")
    return number


def _check_env(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"env must be a mapping of names to strings, got {type(value).__name__}")
    checked: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ValueError(f"env name {name!r} is not a shell identifier ([A-Za-z_][A-Za-z0-9_]*)")
        if not isinstance(item, str):
            raise ValueError(f"env value of {name} must be a string, got {type(item).__name__}")
        if "\x00" in item:
            raise ValueError(f"env value of {name} must not contain a NUL character")
        _encodable(item, f"env value of {name}")
        entry_size = len(name) + len(item.encode("utf-8")) + 2
        if entry_size > MAX_ENV_ENTRY_BYTES:
            raise ValueError(
                f"env value of {name} is too long: NAME=VALUE takes {entry_size} bytes, and Linux "
                f"starts no process with an environment string over {MAX_ENV_ENTRY_BYTES} bytes "
                "(pass large data as stdin or in a file)"
            )
        checked[name] = item
    return checked


class _Frozen(BaseModel):
    # defer_build: each model builds its validator when first used, not at import (``dsh-bash run``
    # never uses ``BashRunResult``, ``CollectedOutput`` or ``TerminalSize`` of its own).
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid", defer_build=True)


class TerminalSize(_Frozen):
    """The size of a task's pseudo-terminal, in character cells."""

    rows: Annotated[int, Strict(), Field(ge=1, le=1000)]
    cols: Annotated[int, Strict(), Field(ge=1, le=1000)]


class SessionReport(_Frozen):
    """What a command run in a session did to it (``BashRunResult.session``, ``R-session``).

    ``cwd``: the session's directory after the command (None: the executor's default).
    ``kept_previous``: None when the shell state at the command's exit became the session's; else why
    it did not (killed, timed out, aborted, no state came back, too large): the session stays as it
    was before the command."""

    id: StrictStr
    cwd: StrictStr | None
    kept_previous: StrictStr | None = None


class _CommandChecks(_Frozen):
    """The checks a request and a spec share, on the fields both have."""

    @field_validator("command", "workdir", mode="after", check_fields=False)
    @classmethod
    def _text(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _no_nul(value, str(info.field_name))

    @field_validator("env", mode="before", check_fields=False)
    @classmethod
    def _env(cls, value: object) -> dict[str, str] | None:
        return _check_env(value)

    @field_validator("stdin", mode="before", check_fields=False)
    @classmethod
    def _stdin_before(cls, value: object) -> object:
        return _check_stdin(value)

    @field_validator("stdin", mode="after", check_fields=False)
    @classmethod
    def _stdin(cls, value: str | bytes | None) -> str | bytes | None:
        return value if not isinstance(value, str) else _encodable(value, "stdin")

    @field_validator("user", mode="before", check_fields=False)
    @classmethod
    def _user(cls, value: object) -> str | None:
        return _check_user(value)


class BashExecRequest(_CommandChecks):
    """What a caller asks for; optional fields are filled by :meth:`BashExecutor.resolve`."""

    command: StrictStr
    workdir: StrictStr | None = None
    timeout_ms: float | None = None
    signal: AbortSignal | None = None
    stdin: StrictStr | StrictBytes | None = None
    env: dict[str, str] | None = None
    owner: Annotated[OwnerToken, Strict()] | None = None
    #: Run the command as this user (a name or uid where commands run); None: the user every command
    #: of the executor runs as. A backend that cannot switch users refuses another one.
    user: str | None = None
    #: Keep the command's stdin open after ``stdin`` was written, for ``write_input`` and
    #: ``close_input`` (background tasks only: ``run`` refuses it). False: ``stdin``, then end of file.
    open_stdin: Annotated[bool, Strict()] = False
    #: Run the background task on a pseudo-terminal of this size (its controlling terminal, its stdin,
    #: stdout and stderr; input open as with ``open_stdin``). None: pipes, as always.
    terminal: TerminalSize | None = None
    #: Called with every chunk of stdout and stderr as it arrives, beyond what the result keeps
    #: (``R-output-tap``): for a caller that shows output live. None: only the result.
    on_output: OutputTap | None = None
    #: The timeout of a background task (``start``; ``run`` has ``timeout_ms``): at it the task is
    #: killed and ends ``killed``, end cause ``timed_out`` (``R-task-timeout``). None: no timeout.
    task_timeout_ms: float | None = None
    #: Run in this shell session (``BashExecutor.session``): its state is replayed into the command's
    #: bash, and the state at its exit becomes the session's (``run``; a task starts from it and
    #: changes nothing). None: a fresh shell, as always.
    session: Annotated[SessionId, Strict()] | None = None
    #: Narrow the executor's sandbox policy for this command (``resolve`` refuses a widening one:
    #: :class:`PolicyWidened`). None: the executor's policy.
    policy: SandboxPolicy | None = None

    @field_validator("timeout_ms", mode="before")
    @classmethod
    def _timeout(cls, value: object) -> float | None:
        return _check_timeout(value)

    @field_validator("task_timeout_ms", mode="before")
    @classmethod
    def _task_timeout(cls, value: object) -> float | None:
        return _check_timeout(value, "task_timeout_ms")


class BashExecSpec(_CommandChecks):
    """What the executor acts on: every choice made explicit. ``start`` ignores ``timeout_ms`` (its
    timeout is ``task_timeout_ms``), ``run`` ignores ``task_timeout_ms``."""

    command: StrictStr
    workdir: StrictStr
    timeout_ms: float
    owner: Annotated[OwnerToken, Strict()] | None
    user: str | None
    signal: AbortSignal | None = None
    stdin: StrictStr | StrictBytes | None = None
    env: dict[str, str] | None = None
    #: As on the request. A backend that gets it writes nothing to the command's stdin itself: the
    #: executor sends ``stdin`` and then every ``write_input`` through the process's input hooks.
    open_stdin: Annotated[bool, Strict()] = False
    #: As on the request. A spec with a terminal has ``open_stdin`` too (``resolve`` sets it): a
    #: terminal's input is always open.
    terminal: TerminalSize | None = None
    #: As on the request.
    on_output: OutputTap | None = None
    #: As on the request (``resolve`` caps it at ``max_timeout_ms``).
    task_timeout_ms: float | None = None
    #: As on the request.
    session: Annotated[SessionId, Strict()] | None = None
    #: The session's directory is entered (the request named no ``workdir``); False: ``workdir``
    #: wins over it. Without a session it means nothing.
    enter_session_cwd: Annotated[bool, Strict()] = True
    #: The policy the command runs under (``resolve``: the executor's, narrowed by the request's). The
    #: executor narrows its own policy by this one again when it starts the command: a spec made by
    #: hand cannot widen it. None: the executor's.
    policy: SandboxPolicy | None = None

    @model_validator(mode="after")
    def _terminal_input_open(self) -> BashExecSpec:
        if self.terminal is not None and not self.open_stdin:
            raise ValueError(
                "a spec with a terminal needs open_stdin=True: a terminal's input is always open"
            )
        return self

    @field_validator("timeout_ms", mode="before")
    @classmethod
    def _timeout(cls, value: object) -> float:
        checked = _check_timeout(value)
        if checked is None:
            raise ValueError("timeout_ms is required on a spec")
        return checked

    @field_validator("task_timeout_ms", mode="before")
    @classmethod
    def _task_timeout(cls, value: object) -> float | None:
        return _check_timeout(value, "task_timeout_ms")


class CollectedOutput(_Frozen):
    """One stream of a foreground run: the kept tail as text and as bytes, and where the whole stream is.

    In JSON (``model_dump_json``), ``data`` is base64: the bytes need not be UTF-8.
    """

    model_config = ConfigDict(
        frozen=True,
        arbitrary_types_allowed=True,
        extra="forbid",
        ser_json_bytes="base64",
        val_json_bytes="base64",
    )

    text: str
    truncated: bool
    spill_path: str | None
    total_bytes: int = Field(ge=0)
    #: The kept tail exactly as the command wrote it: the stream's last ``len(data)`` bytes (all of
    #: them unless ``truncated``). ``text`` is these bytes decoded, minus a character cut at the start.
    data: StrictBytes


class BashRunResult(_Frozen):
    """The outcome of one foreground run. Each cause is its own field; the first cause wins."""

    exit_code: int | None
    signal: str | None
    timed_out: bool
    aborted: bool
    timeout_ms: float
    duration_ms: float
    stdout: CollectedOutput
    stderr: CollectedOutput
    #: A command run in a session: what it did to it. None: no session.
    session: SessionReport | None = None


class BashTask:
    """Live handle of a background task; its fields change once, when the task ends."""

    __slots__ = ("_command", "_done", "_end_cause", "_exit_code", "_id", "_owner", "_signal", "_status")

    def __init__(self, task_id: BashTaskId, command: str, owner: OwnerToken | None) -> None:
        self._id = task_id
        self._command = command
        self._owner = owner
        self._status: BashTaskStatus = "running"
        self._exit_code: int | None = None
        self._signal: str | None = None
        self._end_cause: EndCause | None = None
        self._done = anyio.Event()

    @property
    def id(self) -> BashTaskId:
        return self._id

    @property
    def command(self) -> str:
        return self._command

    @property
    def owner(self) -> OwnerToken | None:
        return self._owner

    @property
    def status(self) -> BashTaskStatus:
        return self._status

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    @property
    def signal(self) -> str | None:
        return self._signal

    @property
    def end_cause(self) -> EndCause | None:
        return self._end_cause

    async def wait(self) -> None:
        """Return once the task has ended; never raises but for the caller's own cancellation."""
        await self._done.wait()

    def _finish(
        self, status: BashTaskStatus, exit_code: int | None, signal: str | None, end_cause: EndCause
    ) -> None:
        self._status = status
        self._exit_code = exit_code
        self._signal = signal
        self._end_cause = end_cause
        self._done.set()

    def __repr__(self) -> str:
        return (
            f"BashTask(id={self._id!r}, status={self._status!r}, exit_code={self._exit_code!r}, "
            f"signal={self._signal!r}, end_cause={self._end_cause!r})"
        )


class BashTaskRead(_Frozen):
    """What one ``read_output`` delivered: output since the previous read, and what was lost."""

    task: BashTask
    delta: str
    lossy: bool
    dropped_bytes: int = Field(ge=0)
    stdout_spill_path: str | None
    stderr_spill_path: str | None
    #: True while a process of the task is blocked reading its open input (stdin pipe or terminal)
    #: with nothing there to read, as the backend saw it twice, 200 ms apart, with nothing written
    #: between; False when it is not, or the task has no open input or ended; None when the backend
    #: cannot tell.
    waiting_for_input: bool | None = False

    def model_post_init(self, context: Any, /) -> None:
        if self.lossy != (self.dropped_bytes > 0):
            raise ValueError("lossy must be true exactly when dropped_bytes > 0")
