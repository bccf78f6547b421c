"""``dsh-bash run``: one command, its output passed through as it comes, its stdin forwarded.

The command runs as a background task of a fresh executor (``start``): that is what lets its stdin
stay open for what this process reads (``write_input``), as ``docker exec -i`` does. Its output reaches
this process's stdout and stderr through the spec's ``on_output`` tap (``R-output-tap``), one chunk at a
time in the order the executor received them, written by one task that never blocks the event loop on
a pipe. The timeout is the executor's configured one (``resolve`` clamps it), enforced here with
``kill``, since a background task has none of its own.

``--json`` is the other way: ``run`` to the end, then the whole ``BashRunResult`` as JSON (stdin, when
it is not a terminal, is read to its end first and given as the spec's ``stdin``).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import math
import os
import select
import signal
import stat
import sys
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TextIO

import anyio
import anyio.to_thread

from ._fds import CLOSED_AT_START
from ._text import one_line, write

if TYPE_CHECKING:
    from dsh_bash import BashExecutor, BashTask

__all__ = ["RunFailed", "finish_streamed", "keep_spill", "run_json", "run_streaming"]

PROG = "dsh-bash"
EXIT_TIMED_OUT = 124
EXIT_ERROR = 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

#: The most of the command's output waiting for a slow reader of this process's stdout or stderr;
#: beyond it, output is not passed through (counted, and named at the end with the spill file).
PASSTHROUGH_LIMIT = 16 * 1024 * 1024
#: The most ``--json`` reads from a piped stdin (the whole input goes into the spec).
JSON_STDIN_LIMIT = 16 * 1024 * 1024
_PIPE_WRITE = 4096  # a pipe that polled writable takes this much without blocking (one free page)
_FILE_WRITE = 1 << 20
_STDIN_READ = 65_536
_INPUT_FULL_PAUSE_S = 0.02
#: How often an idle pipe on stdout is looked at for a reader that went away.
_READER_GONE_CHECK_S = 0.1

StreamName = Literal["stdout", "stderr"]


class RunFailed(Exception):
    """A problem to report as one ``dsh-bash: error:`` line."""


# -- where the output goes ------------------------------------------------------------------------------


class _Sink:
    """This process's stdout or stderr: a descriptor (as a rule), or a text object without one
    (``main`` called with ``sys.stdout`` replaced)."""

    def __init__(self, name: StreamName, stream: TextIO | None, fd_number: int) -> None:
        self.name = name
        self.closed = stream is None or fd_number in CLOSED_AT_START
        self.fd: int | None = None
        self.text: TextIO | None = None
        self.pollable = False
        self.fifo = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if stream is None:
            return
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self.text = stream
            return
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # whatever the program wrote there before comes first
        self.fd = fd
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            self.closed = True
            return
        # Pipes, sockets and terminals can make a writer wait: those are polled first, so that a slow
        # reader never blocks the event loop (and with it the timeout and the kill). Files and
        # /dev/null never keep a writer waiting long.
        self.pollable = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)
        self.fifo = stat.S_ISFIFO(mode)

    def same_file(self, other: _Sink) -> bool:
        if self.fd is None or other.fd is None:
            return self.text is not None and self.text is other.text
        try:
            mine, theirs = os.fstat(self.fd), os.fstat(other.fd)
        except OSError:
            return False
        return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)

    def reader_gone(self) -> bool:
        """Whether this is a pipe whose reading end was closed (poll reports POLLERR)."""
        if not self.fifo or self.fd is None:
            return False
        poller = select.poll()
        poller.register(self.fd, 0)  # no events asked: only POLLERR and POLLHUP can come
        return any(events & select.POLLERR for _, events in poller.poll(0))

    async def write(self, data: bytes) -> int:
        """Write a prefix of ``data``; how much was written. ``OSError`` when the sink cannot take it."""
        if self.closed:
            raise OSError(errno.EBADF, "it was closed when dsh-bash started")
        if self.text is not None:
            write(self.text, self._decoder.decode(data))
            return len(data)
        assert self.fd is not None
        if self.pollable:
            await anyio.wait_writable(self.fd)
        try:
            return os.write(self.fd, data[: _PIPE_WRITE if self.pollable else _FILE_WRITE])
        except BlockingIOError:  # another holder of the file description made it non-blocking
            if not self.pollable:
                await anyio.sleep(0.01)
            return 0

    def finish(self) -> None:
        if self.text is not None:
            write(self.text, self._decoder.decode(b"", final=True))
            with contextlib.suppress(OSError, ValueError):
                self.text.flush()


class _Passthrough:
    """The ``on_output`` tap and the one writer behind it: chunks in the order they came, both streams
    through one queue, so that ``2>&1`` keeps the command's interleaving as far as two pipes allow."""

    def __init__(self, stdout: _Sink, stderr: _Sink) -> None:
        self._sinks: dict[StreamName, _Sink] = {"stdout": stdout, "stderr": stderr}
        self._queue: deque[tuple[_Sink, bytes]] = deque()
        self._queued = 0
        self._wake = anyio.Event()
        self._finishing = False
        self.total: dict[StreamName, int] = {"stdout": 0, "stderr": 0}
        self.held_back: dict[StreamName, int] = {"stdout": 0, "stderr": 0}
        self.failure: tuple[StreamName, OSError] | None = None
        self.failed = anyio.Event()
        self._ended_line: dict[StreamName, bool] = {"stdout": True, "stderr": True}
        self._last_written: StreamName | None = None

    def mid_line(self) -> bool:
        """Whether what stderr shows ends inside a line: notices then start on a line of their own.
        With stdout and stderr one file (``2>&1``), the last byte written to either counts."""
        name = self._last_written if self._sinks["stdout"].same_file(self._sinks["stderr"]) else "stderr"
        return name is not None and not self._ended_line[name]

    def tap(self, stream: StreamName, data: bytes) -> None:
        self.total[stream] += len(data)
        if self.failure is not None:
            return
        if self._queued + len(data) > PASSTHROUGH_LIMIT:
            self.held_back[stream] += len(data)
            return
        self._queue.append((self._sinks[stream], data))
        self._queued += len(data)
        self._wake.set()

    async def run(self) -> None:
        while True:
            if not self._queue:
                if self._finishing:
                    for sink in self._sinks.values():
                        sink.finish()
                    return
                stdout = self._sinks["stdout"]
                with anyio.move_on_after(_READER_GONE_CHECK_S if stdout.fifo else math.inf):
                    await self._wake.wait()
                    self._wake = anyio.Event()
                if stdout.reader_gone():
                    # `dsh-bash run LONG | head -1`: head is done, so is the command (as if it had
                    # written once more and died of SIGPIPE), now rather than at its next write.
                    self._fail("stdout", BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)))
                    return
                continue
            sink, data = self._queue[0]
            try:
                written = await sink.write(data)
            except OSError as exc:
                self._fail(sink.name, exc)
                return
            self._queued -= written
            if written:
                self._ended_line[sink.name] = data[written - 1 : written] == b"\n"
                self._last_written = sink.name
            if written == len(data):
                self._queue.popleft()
            else:
                self._queue[0] = (sink, data[written:])

    def _fail(self, name: StreamName, exc: OSError) -> None:
        self.failure = (name, exc)
        self._queue.clear()
        self._queued = 0
        self.failed.set()

    def finish(self) -> None:
        """No more chunks will come: write what is queued, then return from :meth:`run`."""
        self._finishing = True
        self._wake.set()


# -- stdin ----------------------------------------------------------------------------------------------


def stdin_to_forward() -> bool:
    """Whether fd 0 holds input for the command: open, not a terminal, not /dev/null."""
    if 0 in CLOSED_AT_START:
        return False
    try:
        mode = os.fstat(0)
        if os.isatty(0):
            return False
        null = os.stat(os.devnull)
    except OSError:
        return False
    return not (stat.S_ISCHR(mode.st_mode) and mode.st_rdev == null.st_rdev)


def _pollable(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)


async def _forward_stdin(executor: BashExecutor, task: BashTask) -> None:
    """Copy fd 0 to the task's stdin until end of file, then close it; stop quietly once the task
    takes no more input. A refusal for a full queue waits for the command to read."""
    from dsh_bash import TaskInputError, UnknownTaskError

    pollable = _pollable(0)
    while True:
        if pollable:
            await anyio.wait_readable(0)
        try:
            data = os.read(0, _STDIN_READ)
        except BlockingIOError:
            continue
        except OSError as exc:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(
                    f"{PROG}: cannot read stdin: {exc.strerror or exc}; the command gets no more\n"
                )
            break
        if not data:
            break
        while True:
            try:
                await executor.write_input(task.id, data, owner=None)
                break
            except TaskInputError as exc:
                if exc.reason != "input_full":
                    return  # the command ended, or closed its stdin: nothing more to give it
                await anyio.sleep(_INPUT_FULL_PAUSE_S)
    with contextlib.suppress(TaskInputError, UnknownTaskError):
        await executor.close_input(task.id, owner=None)


# -- the run --------------------------------------------------------------------------------------------


@dataclass
class Streamed:
    """How a streamed run ended, for the exit status and the closing notices."""

    task: BashTask
    timeout_ms: float
    timed_out: bool
    failure: tuple[StreamName, OSError] | None
    total: dict[StreamName, int]
    held_back: dict[StreamName, int]
    spilled: dict[StreamName, str | None]
    max_output_bytes: int
    #: stderr (or stdout, when it is the same file) was left inside a line.
    mid_line: bool


async def _until_ended_or_failed(task: BashTask, failed: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:

        async def ended() -> None:
            await task.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(ended)
        await failed.wait()
        tg.cancel_scope.cancel()


async def run_streaming(executor: BashExecutor, command: str) -> Streamed:
    from dsh_bash import BashExecRequest, BashInfrastructureError

    forward = stdin_to_forward()
    passthrough = _Passthrough(
        _Sink("stdout", sys.stdout, 1),
        _Sink("stderr", sys.stderr, 2),
    )
    async with executor:
        spec = executor.resolve(
            BashExecRequest(command=command, open_stdin=forward, on_output=passthrough.tap)
        )
        try:
            task = await executor.start(spec)
        except BashInfrastructureError as exc:
            if exc.reason == "interactive_unsupported" and forward:
                raise RunFailed(
                    f"{one_line(exc)}; dsh-bash run forwards its stdin when it is not a terminal: give it "
                    "none with '< /dev/null'"
                ) from exc
            raise
        timed_out = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(passthrough.run)
            forwarding = anyio.CancelScope()
            if forward:

                async def forward_stdin() -> None:
                    with forwarding:
                        await _forward_stdin(executor, task)

                tg.start_soon(forward_stdin)
            with anyio.move_on_after(spec.timeout_ms / 1000) as deadline:
                await _until_ended_or_failed(task, passthrough.failed)
            if task.status == "running":
                timed_out = deadline.cancelled_caught and passthrough.failure is None
                await executor.kill(task.id)
                await task.wait()
            forwarding.cancel()
            passthrough.finish()
        read = await executor.read_output(task.id)
        spilled: dict[StreamName, str | None] = {}
        keep_dir: list[str] = []
        limit = executor.config.max_output_bytes
        paths: tuple[tuple[StreamName, str | None], ...] = (
            ("stdout", read.stdout_spill_path),
            ("stderr", read.stderr_spill_path),
        )
        for name, path in paths:
            if passthrough.total[name] > limit or passthrough.held_back[name]:
                spilled[name] = await anyio.to_thread.run_sync(keep_spill, path, name, keep_dir)
    return Streamed(
        task=task,
        timeout_ms=spec.timeout_ms,
        timed_out=timed_out,
        failure=passthrough.failure,
        total=passthrough.total,
        held_back=passthrough.held_back,
        spilled=spilled,
        max_output_bytes=limit,
        mid_line=passthrough.mid_line(),
    )


def finish_streamed(outcome: Streamed) -> int:
    """The closing notices on stderr; the exit status."""
    if outcome.failure is not None:
        name, exc = outcome.failure
        if exc.errno == errno.EPIPE:
            return EXIT_BROKEN_PIPE  # the reader went away: say nothing, as other tools do
        raise RunFailed(f"cannot write the command's {name}: {exc.strerror or exc}; the command was killed")
    task = outcome.task
    if task.end_cause == "lost":
        raise RunFailed("the backend lost the command (its connection or container went away)")
    notices: list[str] = []
    if outcome.timed_out:
        notices.append(f"{PROG}: timed out after {round(outcome.timeout_ms)}ms")
    for name, path in outcome.spilled.items():
        where = path or "(unavailable)"
        held = outcome.held_back[name]
        if held:
            notices.append(
                f"{PROG}: {name}: {held} bytes were not passed through (its reader fell behind); "
                f"full output: {where}"
            )
        else:
            notices.append(
                f"{PROG}: {name}: {outcome.total[name]} bytes, more than the executor keeps "
                f"({outcome.max_output_bytes}); full output: {where}"
            )
    if notices:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(("\n" if outcome.mid_line else "") + "".join(f"{line}\n" for line in notices))
            sys.stderr.flush()
    return exit_status(outcome.timed_out, task.signal, task.exit_code)


def exit_status(timed_out: bool, signal_name: str | None, exit_code: int | None) -> int:
    """124 when the timeout killed the command, 128+n for signal n, else its exit code."""
    if timed_out:
        return EXIT_TIMED_OUT
    if signal_name is not None:
        return _signal_status(signal_name)
    return exit_code if exit_code is not None else 1


def _signal_status(name: str) -> int:
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        digits = name.removeprefix("SIG")
        return 128 + int(digits) if digits.isdigit() else 128


# -- --json ---------------------------------------------------------------------------------------------


def _read_stdin_whole() -> bytes | None:
    if not stdin_to_forward():
        return None
    chunks: list[bytes] = []
    size = 0
    while chunk := os.read(0, _STDIN_READ):
        size += len(chunk)
        if size > JSON_STDIN_LIMIT:
            raise RunFailed(
                f"stdin is more than {JSON_STDIN_LIMIT} bytes: --json takes its input whole (without "
                "--json it is streamed)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def run_json(executor: BashExecutor, command: str) -> int:
    """Run to the end; print the result as JSON (kept spill files in place of the executor's)."""
    import json

    stdin = await anyio.to_thread.run_sync(_read_stdin_whole)
    async with executor:
        result = await executor.exec(command, stdin=stdin)
        keep_dir: list[str] = []
        document = result.model_dump(mode="json")
        for name, output in (("stdout", result.stdout), ("stderr", result.stderr)):
            if output.spill_path is not None:
                kept = await anyio.to_thread.run_sync(keep_spill, output.spill_path, name, keep_dir)
                document[name]["spill_path"] = kept
    text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    write(sys.stdout, text)
    sys.stdout.flush()
    return exit_status(result.timed_out, result.signal, result.exit_code)


# -- spill files ----------------------------------------------------------------------------------------


def keep_spill(spill_path: str | None, name: str, keep_dir: list[str]) -> str | None:
    """Preserve a spill file beyond the executor's close; return its new path, or None if it is gone."""
    import shutil
    import tempfile

    if spill_path is None:
        return None
    try:
        if not keep_dir:
            keep_dir.append(tempfile.mkdtemp(prefix=f"{PROG}-output-"))
        target = os.path.join(keep_dir[0], name)
        try:
            os.link(spill_path, target, follow_symlinks=False)
        except OSError:  # another filesystem, or links not allowed: copy
            shutil.copyfile(spill_path, target, follow_symlinks=False)
    except OSError:
        return None
    return target
