"""``BashToolset``: the ``bash``, ``bash_output``, ``bash_input`` and ``bash_kill`` tools on top of any
``BashExecutor``."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsh_bash import (
    MAX_PENDING_INPUT,
    AbortSignal,
    BashExecRequest,
    BashExecutor,
    BashInfrastructureError,
    BashRunResult,
    BashTask,
    BashTaskId,
    DshBashError,
    ExecutorClosedError,
    OwnerToken,
    SandboxPolicy,
    SessionId,
    TaskInputError,
    TerminalSize,
    UnknownTaskError,
)

from ._keys import KeyNotationError, decode_keys
from ._render import (
    Line,
    completion_notice,
    escape_controls,
    join,
    policy_line,
    render_output,
    render_run,
    status_line,
    status_summary,
)
from ._schemas import (
    BashArgs,
    BashForegroundArgs,
    BashInputArgs,
    BashKillArgs,
    BashOutputArgs,
    describe_validation_error,
    input_schema,
)

__all__ = [
    "MAX_ARGUMENT_BYTES",
    "MAX_ARGUMENT_DEPTH",
    "BashToolset",
    "CompletionCallback",
    "ToolDefinition",
    "ToolResult",
]

log = logging.getLogger("dsh_tool_bash")

BASH = "bash"
BASH_OUTPUT = "bash_output"
BASH_KILL = "bash_kill"
BASH_INPUT = "bash_input"
ABORTED_TEXT = "command aborted"

#: A tool call's arguments may be at most this large: the UTF-8 bytes of the JSON text, or an estimate of
#: them for an already-parsed object. Larger ones are refused as ``invalid_arguments`` before any parsing.
MAX_ARGUMENT_BYTES = 1 << 20
#: ... and nested at most this deep (the arguments object itself is level 1; valid ones need 1).
MAX_ARGUMENT_DEPTH = 100

#: ``callback(text, task)``: called synchronously when a task of the toolset's owner ends.
CompletionCallback = Callable[[str, BashTask], object]

ErrorKind = Literal[
    "unknown_tool",
    "invalid_arguments",
    "aborted",
    "infrastructure",
    "executor_closed",
    "unknown_task",
    "other_owner",
    "too_many_running",
    "internal",
    # bash_input: the reasons of TaskInputError (other_owner above is one of them)
    "task_ended",
    "input_closed",
    "input_not_open",
    "input_full",
    "input_broken",
    "not_terminal",
    "terminal_no_close",
]

#: The terminal of a task started with ``terminal: true``: the size terminal programs assume.
_TERMINAL = TerminalSize(rows=24, cols=80)
#: How often bash_input looks whether the task it wrote to has ended or waits for input again, while it
#: waits ``yield_ms``.
_INPUT_POLL_S = 0.05


class ToolDefinition(BaseModel):
    """One tool as a model sees it: name, description, JSON schema of its arguments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    input_schema: dict[str, Any]


class ToolResult(BaseModel):
    """What a tool call returns: ``text`` for the model, ``is_error``, and ``data`` (the same facts)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    is_error: bool = False
    data: dict[str, Any] = Field(default_factory=dict)


# -- per-owner bookkeeping shared by every toolset of one executor ----------------------------------


class _OwnerBook:
    """Background tasks one owner started through toolsets, plus starts in flight."""

    __slots__ = ("confined", "cwd", "ended", "reserved", "tasks", "waited_on")

    def __init__(self) -> None:
        #: The directory of the owner's session the last result showed (None: none shown yet).
        self.cwd: str | None = None
        self.tasks: dict[BashTaskId, BashTask] = {}
        #: The sandbox policy and working directory of each task that runs under an active policy.
        self.confined: dict[BashTaskId, tuple[SandboxPolicy, str]] = {}
        self.reserved = 0
        #: Tasks a ``bash`` call with ``yield_ms`` still waits for: that call reports their end, so
        #: ``on_completion`` and the next result do not.
        self.waited_on: set[BashTaskId] = set()
        #: Tasks started through toolsets that ended and whose end no result of the owner told yet: the
        #: next result of any toolset of the owner carries them, once.
        self.ended: dict[BashTaskId, BashTask] = {}

    def task_done(self, task: BashTask) -> None:
        if task.id in self.tasks and task.id not in self.waited_on:
            self.ended[task.id] = task

    def running(self) -> list[BashTask]:
        for task_id in [tid for tid, task in self.tasks.items() if task.status != "running"]:
            del self.tasks[task_id]
        return list(self.tasks.values())


_books: weakref.WeakKeyDictionary[BashExecutor, dict[OwnerToken | None, _OwnerBook]] = (
    weakref.WeakKeyDictionary()
)


def _book(executor: BashExecutor, owner: OwnerToken | None) -> _OwnerBook:
    books = _books.get(executor)
    if books is None:
        books = _books[executor] = {}
        # One listener per executor, for every owner's book: the ends the next results tell.
        executor.on_task_done(lambda task: _ended(books, task))
    book = books.get(owner)
    if book is None:
        book = books[owner] = _OwnerBook()
    return book


def _ended(books: dict[OwnerToken | None, _OwnerBook], task: BashTask) -> None:
    book = books.get(task.owner)
    if book is not None:
        book.task_done(task)


# -- descriptions ---------------------------------------------------------------------------------------


def _number(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return f"{value:.0f}" if float(value).is_integer() else f"{value:g}"


def _bash_description(*, background: bool, config: object, sessions: bool = False) -> str:
    timeout = _number(getattr(config, "timeout_ms", None))
    max_timeout = _number(getattr(config, "max_timeout_ms", None))
    max_output = _number(getattr(config, "max_output_bytes", None))
    limits = ""
    if timeout and max_timeout:
        limits = f" (default {timeout}, at most {max_timeout})"
    tail = f"its last {max_output} bytes" if max_output else "its tail"
    if sessions:
        carry = [
            "- Every call runs in a new non-interactive bash that starts where the last one left off: "
            "the current directory (`cd`), exported variables (`export`, `unset`, `source .venv/bin/"
            "activate`), functions, aliases, `set -o`/`shopt` options and umask carry over, as in one "
            "terminal. Plain variables that are not exported do not. A command that times out or is "
            "killed changes nothing of that state. `restart: true` starts from a fresh shell. "
            "`workdir` runs one call elsewhere without moving you. A background task (and a call with "
            "`yield_ms`) starts from that state but does not change it.",
        ]
    else:
        carry = [
            "- Every call starts a fresh, non-interactive bash: nothing carries over from earlier calls "
            "(no current directory, variables, aliases or functions). Pass `workdir` instead of using "
            "`cd`, and chain dependent steps in one command with `&&`.",
        ]
    text = [
        "Run a bash command and return its output.",
        "",
        "How it runs:",
        *carry,
        "- Stdin is empty and there is no terminal: give non-interactive flags (`-y`, `--no-edit`, "
        "`git --no-pager`) to anything that would prompt, page or open an editor.",
        f"- The command is killed after `timeout_ms` milliseconds{limits}.",
    ]
    if getattr(config, "foreground_leftovers", "kill") == "kill":
        text.append(
            "- Whatever the command leaves running (`cmd &`, a daemon) is killed when the call returns."
        )
    text += [
        "",
        "What comes back:",
        "- stdout; then, if the command wrote to stderr, a line `[stderr]` followed by stderr; "
        "`(no output)` when it wrote nothing.",
        "- A last line `[exit code: N]` when the exit code is not 0, or `[killed by signal: NAME]`; "
        "without such a line the command succeeded. `[timed out after Nms]` means the timeout killed it.",
        *(
            [
                "- `[cwd: DIR]` when the call changed the current directory; `[shell state not kept: WHY]` "
                "when the command's changes to the shell state were dropped."
            ]
            if sessions
            else []
        ),
        f"- Each stream shows only {tail}. A line `[output truncated; full output: PATH]` names a file "
        "holding the whole stream: search it with grep or read parts with head, tail or sed -n in a "
        "later call, instead of printing it all again.",
    ]
    if background:
        text += [
            "",
            "Background tasks:",
            "- Set `run_in_background: true` for servers, watchers and long jobs: the call returns "
            "`started background task ID` at once. Read what it printed since your last look with "
            "bash_output, and stop it with bash_kill. Do not start them with `&` or `nohup`: their "
            "output would be lost, and the call kills them when it returns.",
            "- Set `yield_ms` for a command that may or may not end soon (tests, a build): the call "
            "waits at most that long, and if the command still runs then, it goes on as a background "
            "task and you get its id and its output so far. `timeout_ms` still applies to it.",
            "- When a background task ends, the next result of any of these tools says so once, in a "
            "last line `background bash task ID finished: ...`.",
            "- For a program that asks for input (a prompt, a REPL, a confirmation), add "
            "`open_stdin: true` to `run_in_background: true` and answer it with bash_input.",
        ]
    return "\n".join(text)


_BASH_OUTPUT_DESCRIPTION = "\n".join(
    [
        "Read the new output of a background task started with bash and `run_in_background: true`.",
        "",
        "Returns only what the task printed since the previous bash_output call for it (stdout, then a "
        "line `[stderr]` and stderr), or `(no new output)`, followed by a status line: "
        "`[status: running]`, `[status: completed, exit code: N]`, `[status: completed, signal: NAME]` "
        "`[status: killed]` or `[status: killed, timed out]`. Once a finished task's output has been "
        "read, later reads say "
        "`(no new output)`. A line `[some output was dropped from memory; full output: PATHS]` means the "
        "task printed faster than it was read: the complete output is in those files (use grep, tail).",
        "",
        "Poll sparingly: when waiting for something (a server to listen, a build to finish), prefer a "
        "foreground bash command that waits for it, such as `sleep 5` or a loop with a timeout.",
    ]
)

_BASH_INPUT_DESCRIPTION = "\n".join(
    [
        "Type input into a background task started with bash, `run_in_background: true` and "
        "`open_stdin: true`: answer a prompt, feed a REPL or a program reading stdin.",
        "",
        "`input` is sent as is (UTF-8), except for these escapes: `\\n` newline (ends a line: most "
        "prompts need it), `\\r` CR, `\\t` tab, `\\\\` a backslash, `\\e` ESC, `\\xHH` any byte "
        "(hex), `\\^C` Ctrl-C and other control keys (`\\^D`, `\\^Z`, `\\^[`, ...), and named keys "
        "`\\<up>`, `\\<down>`, `\\<left>`, `\\<right>`, `\\<enter>` (CR), `\\<tab>`, "
        "`\\<backspace>`, `\\<esc>`. Any other backslash escape is an error. There is no terminal: "
        "Ctrl-C is just the byte 0x03 (stop a task with bash_kill), and `close: true` sends end of "
        "input (what Ctrl-D means on a terminal).",
        "",
        "Then waits `yield_ms` (default 1000), or less: until the task ends or waits for input again "
        "(a prompt after its answer), and returns `wrote N bytes to task ID` and what the task printed "
        "since the last read, in bash_output's format with its status line.",
    ]
)

_BASH_KILL_DESCRIPTION = "\n".join(
    [
        "Stop a background task started with bash and `run_in_background: true`: all of its processes "
        "get SIGTERM, and SIGKILL shortly after if they are still alive.",
        "",
        "Returns `killed background task ID`, or `task ID had already finished`. What the task printed "
        "stays readable with bash_output.",
    ]
)


# -- the toolset ----------------------------------------------------------------------------------------


def _error(kind: ErrorKind, text: str, tool: str, **facts: Any) -> ToolResult:
    # Error texts quote what the model sent and what backends said: no raw control characters either.
    return ToolResult(text=escape_controls(text), is_error=True, data={"tool": tool, "error": kind, **facts})


def _run_data(result: BashRunResult) -> dict[str, Any]:
    out, err = result.stdout, result.stderr
    return {
        "exit_code": result.exit_code,
        "signal": result.signal,
        "timed_out": result.timed_out,
        "aborted": result.aborted,
        "timeout_ms": result.timeout_ms,
        "duration_ms": result.duration_ms,
        "truncated": out.truncated or err.truncated,
        "stdout_truncated": out.truncated,
        "stdout_spill_path": out.spill_path,
        "stdout_total_bytes": out.total_bytes,
        "stderr_truncated": err.truncated,
        "stderr_spill_path": err.spill_path,
        "stderr_total_bytes": err.total_bytes,
    }


def _task_data(task: BashTask) -> dict[str, Any]:
    return {
        "task_id": task.id,
        "status": task.status,
        "exit_code": task.exit_code,
        "signal": task.signal,
        "end_cause": task.end_cause,
    }


class BashToolset:
    """The model-facing bash tools over one executor, on behalf of one owner.

    ``owner`` separates callers that share an executor (one per chat session, say): a toolset can read and
    kill only its owner's background tasks and ownerless ones. ``background=False`` offers ``bash`` alone,
    without ``run_in_background``. ``max_running`` caps the running background tasks of one owner;
    ``max_running_total`` (None: no cap) those of every owner on the executor together.
    ``sessions`` (default True): ``bash`` runs in the owner's shell session where the executor carries
    one (``R-tools-session``), so a ``cd`` or an ``export`` holds for the next call; False: every call
    is a fresh shell.
    """

    def __init__(
        self,
        executor: BashExecutor,
        *,
        owner: OwnerToken | None = None,
        background: bool = True,
        max_running: int = 10,
        max_running_total: int | None = None,
        sessions: bool = True,
    ) -> None:
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be a positive int, got {max_running!r}")
        if max_running_total is not None and (
            isinstance(max_running_total, bool)
            or not isinstance(max_running_total, int)
            or max_running_total < 1
        ):
            raise ValueError(f"max_running_total must be a positive int or None, got {max_running_total!r}")
        self._executor = executor
        self._owner = owner
        self._background = background
        self._max_running = max_running
        self._max_running_total = max_running_total
        self._sessions = sessions
        self._callbacks: list[CompletionCallback] = []
        self._unsubscribe_executor: Callable[[], None] | None = None

    @property
    def executor(self) -> BashExecutor:
        return self._executor

    @property
    def owner(self) -> OwnerToken | None:
        return self._owner

    @property
    def background(self) -> bool:
        return self._background

    @property
    def max_running(self) -> int:
        return self._max_running

    @property
    def max_running_total(self) -> int | None:
        return self._max_running_total

    @property
    def sessions(self) -> bool:
        """Whether ``bash`` runs in the owner's shell session: asked for, and carried by the executor."""
        return self._sessions and self._executor.supports_sessions

    def end_session(self) -> None:
        """Forget the owner's shell session (an MCP connection that ended): its state is dropped, and
        a later call of the owner starts a new one."""
        if self.sessions:
            with contextlib.suppress(DshBashError):  # the executor closed first: its sessions went too
                self._executor.end_session(self._executor.session(self._owner), owner=self._owner)
            _book(self._executor, self._owner).cwd = None

    def _session(self, restart: bool | None) -> SessionId | None:
        """The owner's session for one ``bash`` call (reset first with ``restart``), or None."""
        if not self.sessions:
            return None
        session = self._executor.session(self._owner)
        if restart:
            self._executor.reset_session(session, owner=self._owner)
            _book(self._executor, self._owner).cwd = None
        return session

    def _session_lines(self, result: BashRunResult, workdir: str) -> tuple[list[Line], dict[str, Any]]:
        """What a run's session report adds to its result: ``[cwd: DIR]`` when the directory changed,
        ``[shell state not kept: WHY]`` when the command's state was dropped."""
        report = result.session
        if report is None:
            return [], {}
        book = _book(self._executor, self._owner)
        lines: list[Line] = []
        shown = book.cwd if book.cwd is not None else workdir
        if report.cwd is not None and report.cwd != shown:
            lines.append(Line(f"[cwd: {escape_controls(report.cwd)}]"))
        if report.cwd is not None:
            book.cwd = report.cwd
        if report.kept_previous is not None:
            lines.append(Line(f"[shell state not kept: {report.kept_previous}]"))
        return lines, {"cwd": report.cwd, "session_kept_previous": report.kept_previous}

    # -- definitions ----------------------------------------------------------------------------------

    def _bash_model(self) -> type[BashForegroundArgs]:
        return BashArgs if self._background else BashForegroundArgs

    def definitions(self) -> list[ToolDefinition]:
        """The tools this toolset offers: ``bash``, and ``bash_output``/``bash_input``/``bash_kill`` with
        background."""
        config = getattr(self._executor, "config", None)
        bash_schema = input_schema(self._bash_model())
        if not self.sessions:
            # Nothing to restart: every call is a fresh shell (the argument is still taken, and ignored).
            del bash_schema["properties"]["restart"]
        timeout = _number(getattr(config, "timeout_ms", None))
        max_timeout = _number(getattr(config, "max_timeout_ms", None))
        if timeout and max_timeout:
            prop = bash_schema["properties"]["timeout_ms"]
            prop["description"] = f"{prop['description']} Default {timeout}, at most {max_timeout}."
        tools = [
            ToolDefinition(
                name=BASH,
                description=_bash_description(
                    background=self._background, config=config, sessions=self.sessions
                ),
                input_schema=bash_schema,
            )
        ]
        if self._background:
            tools += [
                ToolDefinition(
                    name=BASH_OUTPUT,
                    description=_BASH_OUTPUT_DESCRIPTION,
                    input_schema=input_schema(BashOutputArgs),
                ),
                ToolDefinition(
                    name=BASH_INPUT,
                    description=_BASH_INPUT_DESCRIPTION,
                    input_schema=input_schema(BashInputArgs),
                ),
                ToolDefinition(
                    name=BASH_KILL,
                    description=_BASH_KILL_DESCRIPTION,
                    input_schema=input_schema(BashKillArgs),
                ),
            ]
        return tools

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI Chat Completions format (``{"type": "function", "function": ...}``)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": copy.deepcopy(tool.input_schema),
                },
            }
            for tool in self.definitions()
        ]

    def anthropic_tools(self) -> list[dict[str, Any]]:
        """The tools in the Anthropic Messages API format (``name``, ``description``, ``input_schema``)."""
        return [
            {
                "name": tool.name,
                "description": tool.description,
                "input_schema": copy.deepcopy(tool.input_schema),
            }
            for tool in self.definitions()
        ]

    # -- calls ----------------------------------------------------------------------------------------

    async def call(
        self, name: str, arguments: Mapping[str, Any] | str | None, *, signal: AbortSignal | None = None
    ) -> ToolResult:
        """Run one tool call. Never raises, except for the caller's own cancellation."""
        try:
            result = await self._call(name, arguments, signal)
        except Exception as exc:  # a bug, or a backend breaking its contract: still a result
            log.exception("tool %r failed unexpectedly", name)
            result = _error("internal", f"{name} failed unexpectedly: {type(exc).__name__}: {exc}", str(name))
        return self._with_ended_tasks(result)

    def _with_ended_tasks(self, result: ToolResult) -> ToolResult:
        """``result`` with a line for every task of the owner that ended since the last result and
        whose end this result does not show itself (``data["ended_tasks"]``)."""
        book = _book(self._executor, self._owner)
        shown = result.data.get("task_id")
        if isinstance(shown, str) and result.data.get("status") not in (None, "running"):
            book.ended.pop(BashTaskId(shown), None)  # this result shows that end
        if not book.ended:
            return result
        ended = list(book.ended.values())
        book.ended.clear()
        lines = [
            Line(
                completion_notice(
                    task.id, status_summary(task.status, task.exit_code, task.signal, task.end_cause)
                )
            )
            for task in ended
        ]
        return ToolResult(
            text=join([result.text, *lines]),
            is_error=result.is_error,
            data={**result.data, "ended_tasks": [_task_data(task) for task in ended]},
        )

    async def _call(
        self, name: str, arguments: Mapping[str, Any] | str | None, signal: AbortSignal | None
    ) -> ToolResult:
        names = [
            tool for tool in (BASH, BASH_OUTPUT, BASH_INPUT, BASH_KILL) if tool == BASH or self._background
        ]
        if name not in names:
            return _error("unknown_tool", f'unknown tool "{name}" (available: {", ".join(names)})', str(name))
        model: type[BaseModel]
        if name == BASH:
            model = self._bash_model()
        elif name == BASH_OUTPUT:
            model = BashOutputArgs
        elif name == BASH_INPUT:
            model = BashInputArgs
        else:
            model = BashKillArgs
        try:
            parsed = _parse_arguments(arguments)
            if isinstance(parsed, str):
                return _error("invalid_arguments", f"invalid arguments for {name}: {parsed}", name)
            args = model.model_validate(parsed)
        except ValidationError as exc:
            problem = describe_validation_error(exc, model)
            return _error("invalid_arguments", f"invalid arguments for {name}: {problem}", name)
        except RecursionError:  # a safety net: the bounds below should have refused it first
            return _error("invalid_arguments", f"invalid arguments for {name}: {_TOO_DEEP}", name)
        if isinstance(args, BashArgs) and args.run_in_background and args.yield_ms is not None:
            return _error(
                "invalid_arguments",
                'invalid arguments for bash: argument "yield_ms" is for a call that waits; with '
                '"run_in_background": true the call returns at once',
                name,
            )
        if isinstance(args, BashArgs) and not args.run_in_background:
            for flag in ("open_stdin", "terminal"):
                if getattr(args, flag):
                    return _error(
                        "invalid_arguments",
                        f'invalid arguments for bash: argument "{flag}" needs "run_in_background": true '
                        "(only a background task can be answered with bash_input)",
                        name,
                    )
        if signal is not None and signal.aborted:
            return _error("aborted", ABORTED_TEXT, name)
        if isinstance(args, BashForegroundArgs):
            if isinstance(args, BashArgs) and args.run_in_background:
                return await self._start(args, signal)
            if isinstance(args, BashArgs) and args.yield_ms is not None:
                return await self._run_yielding(args, args.yield_ms, signal)
            return await self._run(args, signal)
        if isinstance(args, BashOutputArgs):
            return await self._read(args.task_id)
        if isinstance(args, BashInputArgs):
            return await self._input(args)
        assert isinstance(args, BashKillArgs)
        return await self._kill(args.task_id)

    async def _run(self, args: BashForegroundArgs, signal: AbortSignal | None) -> ToolResult:
        facts: dict[str, Any] = {"background": False}
        if args.description is not None:
            facts["description"] = args.description
        try:
            request = BashExecRequest(
                command=args.command,
                workdir=args.workdir,
                timeout_ms=args.timeout_ms,
                signal=signal,
                owner=self._owner,
                session=self._session(args.restart),
            )
            spec = self._executor.resolve(request)
            facts["workdir"] = spec.workdir
            result = await self._executor.run(spec)
        except ValueError as exc:
            return _error("invalid_arguments", f"invalid arguments for bash: {_one_line(exc)}", BASH)
        except DshBashError as exc:
            if signal is not None and signal.aborted:
                return _error("aborted", ABORTED_TEXT, BASH, **facts)
            return _failure(exc, "the command could not run", BASH, **facts)
        lines, session_facts = self._session_lines(result, spec.workdir)
        refused = policy_line(spec.policy, spec.workdir, result.stderr.text, result.signal)
        if refused is not None:
            lines.append(refused)
            facts["policy_refusal"] = True
        data = {"tool": BASH, **facts, **_run_data(result), **session_facts}
        if result.aborted:
            return ToolResult(text=ABORTED_TEXT, is_error=True, data={**data, "error": "aborted"})
        return ToolResult(text=join([render_run(result), *lines]), is_error=False, data=data)

    async def _start(self, args: BashArgs, signal: AbortSignal | None) -> ToolResult:
        try:
            request = BashExecRequest(
                command=args.command,
                workdir=args.workdir,
                owner=self._owner,
                open_stdin=bool(args.open_stdin),
                terminal=_TERMINAL if args.terminal else None,
                session=self._session(args.restart),
            )
        except DshBashError as exc:
            return _failure(exc, "the command could not run", BASH)
        except ValueError as exc:
            return _error("invalid_arguments", f"invalid arguments for bash: {_one_line(exc)}", BASH)
        facts: dict[str, Any] = {
            "background": True,
            "open_stdin": bool(args.open_stdin or args.terminal),
            "terminal": bool(args.terminal),
        }
        if args.description is not None:
            facts["description"] = args.description
        started = await self._start_task(request, facts, signal, "the background task could not start")
        if isinstance(started, ToolResult):
            return started
        task, book = started
        book.tasks[task.id] = task
        if task.status != "running":  # ended before start returned: its listener found no book entry
            book.ended[task.id] = task
        return ToolResult(
            text=f"started background task {task.id}",
            is_error=False,
            data={"tool": BASH, **facts, **_task_data(task)},
        )

    async def _start_task(
        self,
        request: BashExecRequest,
        facts: dict[str, Any],
        signal: AbortSignal | None,
        failed: str,
        *,
        timeout_applies: bool = False,
    ) -> tuple[BashTask, _OwnerBook] | ToolResult:
        """Start ``request`` as a background task of the owner within the caps (``timeout_applies``:
        its resolved ``timeout_ms`` becomes its ``task_timeout_ms``): the task and the owner's book,
        or the error result (``failed`` says what could not happen). Sets ``facts["workdir"]``."""
        book = _book(self._executor, self._owner)
        refused = self._over_cap(book, facts)
        if refused is not None:
            return refused
        book.reserved += 1
        try:
            spec = self._executor.resolve(request)
            facts["workdir"] = spec.workdir
            if timeout_applies:
                spec = spec.model_copy(update={"task_timeout_ms": spec.timeout_ms})
            task = await self._executor.start(spec)
            if spec.policy is not None and spec.policy.active:
                book.confined[task.id] = (spec.policy, spec.workdir)
            return task, book
        except DshBashError as exc:
            if signal is not None and signal.aborted:
                return _error("aborted", ABORTED_TEXT, BASH, **facts)
            if isinstance(exc, BashInfrastructureError) and exc.reason == "interactive_unsupported":
                return _error(
                    "infrastructure",
                    "the background task could not start: this shell cannot keep a task's stdin open "
                    "(open_stdin), so it cannot be answered with bash_input; start it without open_stdin "
                    "and give its input in the command (a pipe, a here-document, a flag such as --yes)",
                    BASH,
                    reason=exc.reason,
                    **facts,
                )
            return _failure(exc, failed, BASH, **facts)
        finally:
            book.reserved -= 1

    def _over_cap(self, book: _OwnerBook, facts: dict[str, Any]) -> ToolResult | None:
        """The error when one more background task would pass ``max_running`` or ``max_running_total``."""
        running = len(book.running()) + book.reserved
        if running >= self._max_running:
            return _error(
                "too_many_running",
                f"too many background tasks running ({running} of at most {self._max_running}): "
                "stop one with bash_kill or wait for one to finish",
                BASH,
                running=running,
                max_running=self._max_running,
                **facts,
            )
        if self._max_running_total is not None:
            total = sum(len(b.running()) + b.reserved for b in _books.get(self._executor, {}).values())
            if total >= self._max_running_total:
                return _error(
                    "too_many_running",
                    f"too many background tasks running across all sessions ({total} of at most "
                    f"{self._max_running_total}): stop one with bash_kill or wait for one to finish",
                    BASH,
                    running_total=total,
                    max_running_total=self._max_running_total,
                    **facts,
                )
        return None

    async def _run_yielding(self, args: BashArgs, yield_ms: float, signal: AbortSignal | None) -> ToolResult:
        """``bash`` with ``yield_ms``: the command starts as a background task of the owner (its timeout
        as ``task_timeout_ms``) and the call waits for it at most ``yield_ms``. Ended by then: its
        output and status, and it is forgotten by the owner's book; else it goes on in the background.
        An abort of the call, or its cancellation, within the window kills it; after the window the
        call's signal no longer reaches it."""
        try:
            request = BashExecRequest(
                command=args.command,
                workdir=args.workdir,
                timeout_ms=args.timeout_ms,
                owner=self._owner,
                session=self._session(args.restart),
            )
        except DshBashError as exc:
            return _failure(exc, "the command could not run", BASH)
        except ValueError as exc:
            return _error("invalid_arguments", f"invalid arguments for bash: {_one_line(exc)}", BASH)
        facts: dict[str, Any] = {"background": False, "yield_ms": yield_ms}
        if args.description is not None:
            facts["description"] = args.description
        started = await self._start_task(
            request, facts, signal, "the command could not run", timeout_applies=True
        )
        if isinstance(started, ToolResult):
            return started
        task, book = started
        book.tasks[task.id] = task
        book.waited_on.add(task.id)
        aborted = False
        try:
            async with anyio.create_task_group() as watch:
                if signal is not None:

                    async def on_abort(aborting: AbortSignal) -> None:
                        nonlocal aborted
                        await aborting.wait()
                        aborted = True
                        watch.cancel_scope.cancel()

                    watch.start_soon(on_abort, signal)
                with anyio.move_on_after(yield_ms / 1000):
                    await task.wait()
                watch.cancel_scope.cancel()
            if aborted:
                await self._kill_waited_on(task)
                return _error("aborted", ABORTED_TEXT, BASH, **facts, **_task_data(task))
        except BaseException:
            await self._kill_waited_on(task)
            raise
        finally:
            book.waited_on.discard(task.id)
        moved = task.status == "running"
        if not moved:
            book.tasks.pop(task.id, None)
        try:
            read = await self._read_output(task.id, BASH)
        except DshBashError as exc:
            return _failure(exc, "could not read the command's output", BASH, **facts, **_task_data(task))
        text = read.text
        if moved:
            text = f"still running after {_number(yield_ms)} ms: moved to background task {task.id}\n{text}"
        return ToolResult(
            text=text, is_error=False, data={**read.data, **facts, "moved_to_background": moved}
        )

    async def _kill_waited_on(self, task: BashTask) -> None:
        """Kill a task its call gave up on (aborted, cancelled) and wait for its end, as a foreground
        run's end waits for its kill; shielded, and bounded by the executor's kill bound."""
        with anyio.CancelScope(shield=True):
            await self._executor.kill(task.id)
            await task.wait()

    def _foreign(self, task_id: str, tool: str) -> ToolResult | None:
        """An error when ``task_id`` belongs to an owner other than this toolset's."""
        owner = self._executor.owner_of(BashTaskId(task_id))
        if owner is not None and owner != self._owner:
            return _error("other_owner", f"task {task_id} belongs to another session", tool, task_id=task_id)
        return None

    async def _read(self, task_id: str) -> ToolResult:
        try:
            refused = self._foreign(task_id, BASH_OUTPUT)
            if refused is not None:
                return refused
            return await self._read_output(task_id, BASH_OUTPUT)
        except UnknownTaskError:
            return _unknown_task(task_id, BASH_OUTPUT)
        except DshBashError as exc:
            return _failure(exc, "could not read the task's output", BASH_OUTPUT, task_id=task_id)

    async def _read_output(self, task_id: str, tool: str) -> ToolResult:
        """The ``bash_output`` text and data of one read (its errors are the caller's to map)."""
        read = await self._executor.read_output(BashTaskId(task_id))
        task = read.task  # read synchronously after the read: the status matches the delta
        spill_paths = (read.stdout_spill_path, read.stderr_spill_path)
        text = render_output(
            read.delta,
            lossy=read.lossy,
            spill_paths=spill_paths,
            status=status_line(
                task.status,
                task.exit_code,
                task.signal,
                waiting=read.waiting_for_input is True,
                end_cause=task.end_cause,
            ),
        )
        confined = _book(self._executor, self._owner).confined.get(task.id)
        refused = None if confined is None else policy_line(*confined, read.delta, task.signal)
        if refused is not None:
            text = join([text, refused])
        data = {
            "tool": tool,
            **_task_data(task),
            **({"policy_refusal": True} if refused is not None else {}),
            "waiting_for_input": read.waiting_for_input,
            "new_output": bool(read.delta),
            "lossy": read.lossy,
            "dropped_bytes": read.dropped_bytes,
            "stdout_spill_path": read.stdout_spill_path,
            "stderr_spill_path": read.stderr_spill_path,
        }
        return ToolResult(text=text, is_error=False, data=data)

    async def _input(self, args: BashInputArgs) -> ToolResult:
        task_id, close = args.task_id, bool(args.close)
        yield_ms = 1000.0 if args.yield_ms is None else args.yield_ms
        try:
            data = decode_keys(args.input)
        except KeyNotationError as exc:
            return _error(
                "invalid_arguments", f'invalid arguments for bash_input: argument "input": {exc}', BASH_INPUT
            )
        ended = anyio.Event()

        def task_done(task: BashTask) -> None:
            if task.id == task_id:
                ended.set()

        # Subscribed before the write: a task that ends after taking the input cannot be missed.
        unsubscribe = self._executor.on_task_done(task_done)
        try:
            try:
                refused = self._foreign(task_id, BASH_INPUT)
                if refused is not None:
                    return refused
                await self._executor.write_input(BashTaskId(task_id), data, owner=self._owner)
            except UnknownTaskError:
                return _unknown_task(task_id, BASH_INPUT)
            except TaskInputError as exc:
                return _input_refused(exc, task_id)
            except DshBashError as exc:
                return _failure(exc, "could not write to the task", BASH_INPUT, task_id=task_id)
            closed = False
            if close:
                # The write went through: a task that ended since then has no input left to close, which
                # the text says, instead of refusing a call whose input was sent.
                try:
                    closed = await self._executor.close_input(BashTaskId(task_id), owner=self._owner)
                except (TaskInputError, UnknownTaskError):
                    pass
                except DshBashError as exc:
                    what = f"wrote {len(data)} bytes to task {task_id}, but could not close its input"
                    return _failure(exc, what, BASH_INPUT, task_id=task_id, bytes_written=len(data))
            with anyio.move_on_after(yield_ms / 1000):
                # A loop, not one wait: a task that waits for input again (a REPL printed its answer and
                # its prompt) has said what it will say until it is answered. The write cleared the
                # previous verdict, so a wait seen here came after it; looking does not consume output.
                while not ended.is_set() and not self._waits_again(task_id):
                    with anyio.move_on_after(_INPUT_POLL_S):
                        await ended.wait()
        finally:
            unsubscribe()
        wrote = f"wrote {len(data)} {'byte' if len(data) == 1 else 'bytes'} to task {task_id}"
        if close:
            wrote += "; closed its input" if closed else "; its input was already closed"
        facts = {"bytes_written": len(data), "closed_input": closed}
        try:
            read = await self._read_output(task_id, BASH_INPUT)
        except DshBashError as exc:
            return _failure(
                exc, f"{wrote}, but could not read its output", BASH_INPUT, task_id=task_id, **facts
            )
        return ToolResult(text=f"{wrote}\n{read.text}", is_error=False, data={**read.data, **facts})

    def _waits_again(self, task_id: str) -> bool:
        try:
            return self._executor.waiting_for_input(BashTaskId(task_id)) is True
        except DshBashError:
            return False  # the read that follows reports what went wrong

    async def _kill(self, task_id: str) -> ToolResult:
        try:
            refused = self._foreign(task_id, BASH_KILL)
            if refused is not None:
                return refused
            killed = await self._executor.kill(BashTaskId(task_id))
        except UnknownTaskError:
            return _unknown_task(task_id, BASH_KILL)
        except DshBashError as exc:
            return _failure(exc, "could not kill the task", BASH_KILL, task_id=task_id)
        text = f"killed background task {task_id}" if killed else f"task {task_id} had already finished"
        return ToolResult(
            text=text, is_error=False, data={"tool": BASH_KILL, "task_id": task_id, "killed": killed}
        )

    # -- beyond the three tools -------------------------------------------------------------------------

    def running_tasks(self) -> list[BashTask]:
        """The running background tasks of this toolset's owner started through any ``BashToolset``."""
        return _book(self._executor, self._owner).running()

    async def kill_all(self) -> list[BashTaskId]:
        """Kill every running task of :meth:`running_tasks`; return the ids whose kill began.

        The kills are requested concurrently: each task's kill sequence starts without waiting for the
        requests of the others (100 tasks one after another took a noticeable part of the kill bound).
        """
        tasks = self.running_tasks()
        began = [False] * len(tasks)

        async def kill(index: int, task_id: BashTaskId) -> None:
            try:
                began[index] = await self._executor.kill(task_id)
            except DshBashError as exc:
                log.debug("kill_all: %s: %s", task_id, exc)

        async with anyio.create_task_group() as tg:
            for index, task in enumerate(tasks):
                tg.start_soon(kill, index, task.id)
        return [task.id for task, ok in zip(tasks, began, strict=True) if ok]

    def on_completion(self, callback: CompletionCallback) -> Callable[[], None]:
        """Call ``callback(text, task)`` whenever a background task of this toolset's owner ends.

        ``text`` is a one-line notice for the model. The callback runs synchronously in the executor's
        listener (schedule async work yourself); one that raises is logged and disturbs nothing else.
        Returns a callable that unsubscribes.
        """
        self._callbacks.append(callback)
        if self._unsubscribe_executor is None:
            self._unsubscribe_executor = self._executor.on_task_done(self._task_done)

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)
            if not self._callbacks and self._unsubscribe_executor is not None:
                self._unsubscribe_executor()
                self._unsubscribe_executor = None

        return unsubscribe

    def _task_done(self, task: BashTask) -> None:
        if task.owner != self._owner or task.id in _book(self._executor, task.owner).waited_on:
            return
        summary = status_summary(task.status, task.exit_code, task.signal, task.end_cause)
        text = completion_notice(task.id, summary)
        for callback in list(self._callbacks):
            try:
                callback(text, task)
            except Exception:
                log.exception("an on_completion callback raised for %s; ignored", task.id)

    def __repr__(self) -> str:
        return (
            f"BashToolset({type(self._executor).__name__}, owner={self._owner!r}, "
            f"background={self._background}, max_running={self._max_running})"
        )


# -- helpers --------------------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        messages = [str(error.get("msg", "")).removeprefix("Value error, ") for error in exc.errors()]
        return "; ".join(message for message in messages if message) or str(exc)
    return " ".join(str(exc).split()) or type(exc).__name__


_TOO_DEEP = f"nested too deeply (at most {MAX_ARGUMENT_DEPTH} levels of JSON arrays and objects)"


def too_deep() -> str:
    """The problem text of arguments nested too deeply (the MCP server's stdio reader reports it too)."""
    return _TOO_DEEP


def _too_large(size: str) -> str:
    return f"too large ({size}; at most {MAX_ARGUMENT_BYTES} bytes of JSON)"


def _object_bounds(value: object) -> str | None:
    """What makes an already-parsed value too deep or too large, or None. Estimates its JSON size (the
    UTF-8 bytes of strings and keys, digits, punctuation) without recursion, stopping at the first excess."""
    size = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            long = len(item) > MAX_ARGUMENT_BYTES  # too large already: spare the copy
            size += 2 + (len(item) if long else len(item.encode("utf-8", "surrogatepass")))
        elif isinstance(item, Mapping | list | tuple):
            if depth > MAX_ARGUMENT_DEPTH:
                return _TOO_DEEP
            size += 2 + len(item)
            if size > MAX_ARGUMENT_BYTES:
                break
            if isinstance(item, Mapping):
                for key, child in item.items():
                    stack.append((key, depth + 1))
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, bool) or item is None:
            size += 5
        elif isinstance(item, int):
            size += item.bit_length() // 3 + 2
        else:
            size += 24
        if size > MAX_ARGUMENT_BYTES:
            break
    if size > MAX_ARGUMENT_BYTES:
        return _too_large(f"more than {MAX_ARGUMENT_BYTES} bytes")
    return None


def _parse_arguments(arguments: object) -> dict[str, Any] | str:
    """A dict of arguments, or a string saying what is wrong with them.

    Hostile input is refused before it can cost much: JSON text larger than ``MAX_ARGUMENT_BYTES`` is not
    parsed; objects larger, or nested deeper than ``MAX_ARGUMENT_DEPTH``, are not validated. JSON nested
    deeper than the interpreter's recursion limit makes the parser raise ``RecursionError``: too deep too.
    """
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if len(arguments) > MAX_ARGUMENT_BYTES:
            return _too_large(f"{len(arguments)} characters")
        size = len(arguments.encode("utf-8", "surrogatepass"))
        if size > MAX_ARGUMENT_BYTES:
            return _too_large(f"{size} bytes")
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except RecursionError:
            return _TOO_DEEP
        except ValueError as exc:
            return f"not valid JSON ({exc})"
    if not isinstance(arguments, Mapping):
        return f"expected a JSON object, got {type(arguments).__name__}"
    problem = _object_bounds(arguments)
    if problem is not None:
        return problem
    return {str(key): value for key, value in arguments.items()}


def _unknown_task(task_id: str, tool: str) -> ToolResult:
    return _error("unknown_task", f'unknown bash task "{task_id}"', tool, task_id=task_id)


def _input_refused(exc: TaskInputError, task_id: str) -> ToolResult:
    reason = exc.reason
    texts = {
        "task_ended": f"task {task_id} has finished; its input is closed",
        "input_closed": f"the input of task {task_id} was closed (close: true); it takes no more input",
        "input_not_open": (
            f"task {task_id} was not started with open_stdin (start it with bash, run_in_background "
            "and open_stdin: true to answer it with bash_input)"
        ),
        "input_full": (
            f"task {task_id} has not read the input it was sent yet (at most {MAX_PENDING_INPUT} bytes may "
            "wait); nothing was sent: check with bash_output that it is still reading"
        ),
        "input_broken": f"task {task_id} closed its input",
        "other_owner": f"task {task_id} belongs to another session",
        "terminal_no_close": (
            f"task {task_id} runs on a terminal, whose input never closes: send \\^D (Ctrl-D) at a line "
            "start for end of file, or use bash_kill"
        ),
    }
    text = texts.get(reason, f"could not write to task {task_id}: {_one_line(exc)}")
    return _error(reason, text, BASH_INPUT, task_id=task_id)


def _failure(exc: DshBashError, what: str, tool: str, **facts: Any) -> ToolResult:
    if isinstance(exc, ExecutorClosedError):
        return _error("executor_closed", f"{what}: the shell executor is closed", tool, **facts)
    return _error("infrastructure", f"{what}: {_one_line(exc)}", tool, **facts)
