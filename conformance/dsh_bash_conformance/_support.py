"""Small tools the checks share: marked commands, captured concurrent calls, bounded waits."""

from __future__ import annotations

import shlex
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc

from dsh_bash import BashExecutor, BashRunResult, BashTask, BashTaskId

from ._harness import CheckContext, CheckFailed

T = TypeVar("T")


#: How long a task that only sets the scene (it leaves a process behind and exits) may take to end:
#: not what a check bounds.
SETUP_S = 10.0


def loop(mark: str, *, trap_term: bool = False, prelude: str = "", iterations: int | None = None) -> str:
    """A ``bash -c`` process that keeps ``mark`` in its command line (as ``$0``) while it loops.

    ``trap_term`` makes it ignore SIGTERM (only SIGKILL ends it); ``prelude`` runs first (write a
    ready file there); ``iterations`` bounds the loop (about 50 ms each), else it never ends.
    A body of more than one command keeps bash from exec'ing its last command, which would drop
    the marker.
    """
    parts = []
    if trap_term:
        parts.append('trap "" TERM')
    if prelude:
        parts.append(prelude)
    if iterations is None:
        parts.append("while :; do sleep 0.05; done")
    else:
        parts.append(f"i=0; while [ $i -lt {iterations} ]; do sleep 0.05; i=$((i+1)); done")
    return f"bash -c {shlex.quote('; '.join(parts))} {mark}"


def touch(path: str) -> str:
    """A prelude for :func:`loop` that creates ``path`` (proof that the process started)."""
    return f": > {shlex.quote(path)}"


def escapee(mark: str, *, prelude: str = "") -> str:
    """A background process that leaves the command's session with ``setsid`` (ends in ``&``)."""
    return f"setsid {loop(mark, prelude=prelude)} >/dev/null 2>&1 &"


def repeat(char: str, count: int) -> str:
    """A shell snippet printing ``char`` (one ASCII letter or digit) ``count`` times.

    Built from bytes (``head -c`` of ``/dev/zero`` through ``tr``), so its cost is linear and the
    same under every locale: bash's ``${s// /x}`` is quadratic under a UTF-8 locale (1.45 s for
    30,000 characters where ``LC_ALL=C`` takes 17 ms).
    """
    if len(char) != 1 or not (char.isascii() and char.isalnum()):
        raise ValueError(f"repeat() takes one ASCII letter or digit, not {char!r}")
    if count < 0:
        raise ValueError(f"repeat() needs a count >= 0, not {count}")
    return f"head -c {count} /dev/zero | tr '\\000' '{char}'"


def elapsed(since: float) -> float:
    return time.monotonic() - since


@dataclass
class Box(Generic[T]):
    """The outcome of a call run in another task: its value or its exception, and when it ended."""

    value: T | None = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    ended_at: float = 0.0

    def describe(self) -> str:
        if not self.done.is_set():
            return "still running"
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {self.error}"
        return f"returned {self.value!r}"


def spawn(tg: anyio.abc.TaskGroup, fn: Callable[..., Awaitable[T]], *args: Any) -> Box[T]:
    """Run ``fn(*args)`` in ``tg`` without ever letting its exception reach the task group."""
    box: Box[T] = Box()

    async def runner() -> None:
        try:
            box.value = await fn(*args)
        except Exception as exc:
            box.error = exc
        finally:
            box.ended_at = time.monotonic()
            box.done.set()

    tg.start_soon(runner)
    return box


async def within(awaitable: Awaitable[T], seconds: float, what: str) -> T:
    """Await with a bound; fail the check naming ``what`` if it does not finish in time."""
    result: list[T] = []
    with anyio.move_on_after(seconds):
        result.append(await awaitable)
    if not result:
        raise CheckFailed(f"{what} did not finish within {seconds:g} s")
    return result[0]


def _not_a_group(exc: BaseException, what: str) -> None:
    if isinstance(exc, BaseExceptionGroup):
        raise CheckFailed(
            f"{what} let an ExceptionGroup escape (the contract forbids it): {type(exc).__name__}: {exc} "
            f"[{'; '.join(f'{type(e).__name__}: {e}' for e in exc.exceptions)}]"
        )


async def expect_raises(
    exc_type: type[BaseException] | tuple[type[BaseException], ...],
    call: Callable[[], Awaitable[Any]],
    what: str,
) -> BaseException:
    """``await call()`` must raise ``exc_type`` (and not inside an ExceptionGroup)."""
    try:
        value = await call()
    except Exception as exc:
        _not_a_group(exc, what)
        if not isinstance(exc, exc_type):
            raise CheckFailed(
                f"{what} raised {type(exc).__name__}: {exc}, expected {_names(exc_type)}"
            ) from exc
        return exc
    raise CheckFailed(f"{what} did not raise {_names(exc_type)}; it returned {value!r}")


def expect_raises_sync(
    exc_type: type[BaseException] | tuple[type[BaseException], ...], call: Callable[[], Any], what: str
) -> BaseException:
    """``call()`` must raise ``exc_type``."""
    try:
        value = call()
    except Exception as exc:
        _not_a_group(exc, what)
        if not isinstance(exc, exc_type):
            raise CheckFailed(
                f"{what} raised {type(exc).__name__}: {exc}, expected {_names(exc_type)}"
            ) from exc
        return exc
    raise CheckFailed(f"{what} did not raise {_names(exc_type)}; it returned {value!r}")


def _names(exc_type: type[BaseException] | tuple[type[BaseException], ...]) -> str:
    if isinstance(exc_type, tuple):
        return " or ".join(t.__name__ for t in exc_type)
    return exc_type.__name__


def show(result: BashRunResult) -> str:
    """A compact description of a run result for failure messages."""
    return (
        f"exit_code={result.exit_code!r} signal={result.signal!r} timed_out={result.timed_out!r} "
        f"aborted={result.aborted!r} timeout_ms={result.timeout_ms!r} stdout={result.stdout.text[:200]!r} "
        f"stderr={result.stderr.text[:200]!r}"
    )


def show_task(task: BashTask) -> str:
    return (
        f"status={task.status!r} end_cause={task.end_cause!r} exit_code={task.exit_code!r} "
        f"signal={task.signal!r}"
    )


async def sh(ex: BashExecutor, command: str, **fields: Any) -> str:
    """Run a helper command that must succeed; return its stdout text."""
    result = await ex.exec(command, **fields)
    if result.exit_code != 0:
        raise CheckFailed(f"helper command {command[:120]!r} failed: {show(result)}")
    return result.stdout.text


async def marked_flags(ctx: CheckContext, ex: BashExecutor, count: int) -> tuple[str, list[str]]:
    """A fresh marker and ``count`` paths in a new temporary directory of ``ex``: the files that a
    check's marked processes create to say they run (see :func:`touch`, :func:`wait_files`)."""
    tmp = await ctx.tempdir(ex)
    return ctx.marker(), [f"{tmp}/{chr(ord('a') + n)}" for n in range(count)]


async def wait_files(ex: BashExecutor, paths: Iterable[str], within_s: float = 5.0) -> None:
    """Poll (through ``ex``) until every path exists: proof that the processes writing them started."""
    quoted = " ".join(shlex.quote(p) for p in paths)
    deadline = time.monotonic() + within_s
    while True:
        result = await ex.exec(f'for f in {quoted}; do [ -e "$f" ] || exit 1; done')
        if result.exit_code == 0:
            return
        if time.monotonic() >= deadline:
            raise CheckFailed(f"these files never appeared within {within_s:g} s: {quoted} ({show(result)})")
        await anyio.sleep(0.02)


async def exists(ex: BashExecutor, path: str) -> bool:
    out = await sh(ex, f"if [ -e {shlex.quote(path)} ]; then echo yes; else echo no; fi")
    return out == "yes\n"


async def wait_task(task: BashTask, within_s: float, what: str = "") -> None:
    """``task.wait()`` must return within ``within_s``."""
    await within(task.wait(), within_s, f"{what or 'task'} {task.id}: wait()")


async def read_to_end(ctx: CheckContext, ex: BashExecutor, task_id: BashTaskId) -> str:
    """Everything the task still has: one read after it ended, and a check that the next is empty."""
    first = await ex.read_output(task_id)
    second = await ex.read_output(task_id)
    ctx.expect(
        second.delta == "",
        f"a read after the task ended delivered {first.delta[:200]!r}, and the next read delivered "
        f'{second.delta[:200]!r} again instead of ""',
    )
    return first.delta


async def gone(ctx: CheckContext, mark: str, within_s: float, what: str) -> None:
    """Every process carrying ``mark`` must be gone within ``within_s``."""
    survivors = await ctx.wait_gone(mark, within_s)
    ctx.expect(
        not survivors, f"{what}: processes {survivors} carrying {mark} still alive after {within_s:g} s"
    )


async def alive(ctx: CheckContext, mark: str, what: str) -> None:
    """At least one process carrying ``mark`` must be alive now."""
    found = await ctx.processes(mark)
    ctx.expect(found, f"{what}: no live process carries {mark}")


async def started(
    ctx: CheckContext, mark: str, what: str, within_s: float | None = None, task: BashTask | None = None
) -> None:
    """A process carrying ``mark`` must show up within ``within_s`` (default: :data:`SETUP_S`).

    For a process just sent to the background (``cmd &``): the shell that forked it may have exited
    before the child exec'd and took ``mark`` into its command line, so a look at once could miss it.
    The default bound is a setup bound, not a measurement: a loaded machine may take more than the
    latency allowance to fork and exec (a CI run once did), and the look ends as soon as it is seen.
    ``task``: the task that should have started it, whose state a failure says (a task that ended
    early tells a command that failed to start from a process that is there but unseen).
    """
    deadline = time.monotonic() + (SETUP_S if within_s is None else within_s)
    while not await ctx.processes(mark) and time.monotonic() < deadline:  # noqa: ASYNC110 - processes are polled
        await anyio.sleep(0.02)
    await alive(ctx, mark, what if task is None else f"{what} (task {task.id}: {show_task(task)})")


def differing_chars(a: str, b: str) -> int:
    """Positions at which two strings differ, counting the extra length of the longer one."""
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
