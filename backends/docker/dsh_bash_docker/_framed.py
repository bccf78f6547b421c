"""One command under ``dsh-supervise --frame`` in the container: the exec's stream is the supervisor's alone.

The exec runs the supervisor, which runs the boot script (``BOOT_SUPERVISED``), which becomes the
command's bash. The command's stdout and stderr are pipes to the supervisor; the exec's stdout
carries the supervisor's frames (the command's output, and its status records), and the exec's
stdin carries ours (the command's stdin, kill requests). So:

- the outcome is the wait status the supervisor observed (a self-kill is a signal), and nothing the
  command writes or reads can forge it;
- a kill reaches every process of the command however it hides (session, group, environment):
  orphans re-parent to the supervisor, a subreaper, which signals its whole subtree;
- when the stream drops (the harness died, the connection broke), the supervisor kills everything.

The supervisor exits once the command's last process is gone; a stream that ends without its
``empty`` record means it was killed (by the command itself: same user), and then only the marker,
the last hint, finds what is left.
"""

from __future__ import annotations

import errno
import logging
import signal
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    BOOT_FAIL,
    BOOT_OK,
    CommandProcess,
    ExitStatus,
    FrameDecoder,
    FrameError,
    InfraReason,
    Launch,
    SupervisorRecords,
    boot_failure,
    encode_frame,
)

from ._engine import EngineClient, EngineError, ExecStream
from ._process import ContainerMarked, StartHelper, diagnose_refusal

__all__ = ["FramedDockerProcess"]

log = logging.getLogger("dsh_bash.docker")

#: Stdin goes to the supervisor in frames of at most this size, so that a kill request waits for
#: one chunk at most.
_STDIN_CHUNK = 64 * 1024
#: How long a command whose stream ended without an exit record waits for its container to show
#: whether it is ending (then ``container_gone``, else ``command_lost``).
_GONE_SETTLE_S = 1.0
#: How long a failed start waits for the rest of the boot script's report.
_REPORT_BOUND_S = 5.0


class FramedDockerProcess(CommandProcess):
    def __init__(
        self,
        *,
        engine: EngineClient,
        container: str,
        exec_id: str,
        stream: ExecStream,
        launch: Launch,
        marked: ContainerMarked,
        start_helper: StartHelper,
        on_release: Callable[[], Awaitable[None]],
        wait_writable: Callable[[], Awaitable[None]],
        registry: set[FramedDockerProcess],
    ) -> None:
        self._engine = engine
        self._container = container
        self._exec_id = exec_id
        self._stream = stream
        self._launch = launch
        self._marked = marked
        self._start_helper = start_helper
        self._on_release = on_release
        self._wait_writable = wait_writable
        self._registry = registry
        self._records = SupervisorRecords()
        self._decoder = FrameDecoder(
            on_stdout=self._on_stdout,
            on_stderr=self._on_stderr,
            on_status=self._on_status,
            on_eof=self._on_eof,
        )
        self._head = bytearray()  # stdout before the boot script's verdict
        self._supervisor_said = bytearray()
        self._booted = False
        self._discard = False  # released: output has nowhere to go any more
        self._fed = False
        self._eof: set[str] = set()
        self._broken: str | None = None  # why the stream cannot be read any further
        self._stream_ended = False
        self._exit_or_end = anyio.Event()
        self._output_done = anyio.Event()
        self._ended = anyio.Event()
        self._send_lock = anyio.Lock()

    # -- the supervisor's frames ----------------------------------------------------------------------

    def _on_stdout(self, data: memoryview) -> None:
        if not self._booted:
            self._head += data
            if len(self._head) >= len(BOOT_OK) and self._head.startswith(BOOT_OK):
                self._booted = True
                rest = bytes(self._head[len(BOOT_OK) :])
                self._head.clear()
                if rest:
                    self._on_stdout(memoryview(rest))
            return
        self._fed = True
        if not self._discard:
            self._launch.stdout.feed(data)

    def _on_stderr(self, data: memoryview) -> None:
        self._fed = True
        if not self._discard:
            self._launch.stderr.feed(data)

    def _on_status(self, record: str) -> None:
        self._records.apply(record)
        if self._records.command_exit is not None:
            self._exit_or_end.set()
        if self._records.empty:
            self._registry.discard(self)

    def _on_eof(self, stream: str) -> None:
        self._eof.add(stream)
        if len(self._eof) == 2:
            self._output_done.set()

    def _engine_stderr(self, data: memoryview) -> None:
        # The supervisor's own stderr: only its usage and set-up errors, before the command runs.
        if len(self._supervisor_said) < 4096:
            self._supervisor_said += data

    def _feed(self, data: memoryview) -> None:
        if self._broken is not None:
            return
        try:
            self._decoder.feed(data)
        except FrameError as exc:
            self._broken = f"the supervisor's stream broke its framing: {exc}"
            log.warning("command %s: %s", self._launch.marker, self._broken)

    def _fed_since_wait(self) -> bool:
        return self._fed or self._broken is not None

    def _mark_stream_end(self) -> None:
        self._stream_ended = True
        if not self._records.empty:
            log.warning(
                "command %s: the supervisor's stream ended before it reported that no process is left "
                "(it was killed); its leftovers are looked for by marker",
                self._launch.marker,
            )
        self._exit_or_end.set()
        self._output_done.set()
        self._ended.set()

    # -- start ----------------------------------------------------------------------------------------

    async def read_preamble(self, user: str | None) -> None:
        """Wait for the boot script's verdict; raise BashInfrastructureError when the command cannot start."""
        records = self._records

        def decided() -> bool:
            return self._booted or records.exec_failed is not None or self._head.startswith(BOOT_FAIL)

        started = await self._stream.pump_until(self._feed, self._engine_stderr, decided)
        if started and self._booted:
            return
        if self._head.startswith(BOOT_FAIL):
            with anyio.move_on_after(_REPORT_BOUND_S):
                await self._stream.pump_until(
                    self._feed, self._engine_stderr, lambda: self._head.find(b"\0", len(BOOT_FAIL)) >= 0
                )
        where = f"in container {self._container[:12]}"
        if self._head.startswith(BOOT_FAIL):
            report = bytes(self._head[len(BOOT_FAIL) :]).split(b"\0", 1)[0].decode("utf-8", "replace")
            raise boot_failure(report, workdir=self._launch.spec.workdir, where=where)
        if records.exec_failed is not None:
            code = records.exec_failed
            reason: InfraReason = "shell_missing" if code in (errno.ENOENT, errno.EACCES) else "start_failed"
            raise BashInfrastructureError(f"cannot start bash {where}: errno {code}", reason=reason)
        detail = bytes(self._head + self._supervisor_said).decode("utf-8", "replace").strip("\0 \n")
        exit_code = (await self._engine.exec_inspect(self._exec_id)).get("ExitCode")
        reason = "unclassified"
        if exit_code in (126, 127):  # the engine could not start the supervisor itself
            reason = await diagnose_refusal(self._engine, self._container, user, self._launch.env.get("PATH"))
        raise BashInfrastructureError(
            f"the command could not start {where}: {detail or 'no output'}", reason=reason
        )

    def _report_complete(self) -> bool:
        return self._head.find(b"\0", len(BOOT_FAIL)) >= 0

    def start_reading(self) -> None:
        """Hand the stream to a reader of its own, which reads it to its end (past this command's release)."""
        self._registry.add(self)
        self._start_helper(self._read_to_end)

    async def _read_to_end(self) -> None:
        try:
            # pump_until returns after each read that fed output (True) or at end of stream.
            while self._broken is None and await self._stream.pump_until(
                self._feed, self._engine_stderr, self._fed_since_wait
            ):
                self._fed = False
                if not self._discard:
                    await self._wait_writable()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, EngineError) as exc:
            log.warning("command %s: reading the supervisor's stream failed: %s", self._launch.marker, exc)
        finally:
            with anyio.CancelScope(shield=True):
                self._mark_stream_end()
                await self._stream.aclose()

    # -- the process protocol ---------------------------------------------------------------------------

    async def wait(self) -> ExitStatus:
        await self._exit_or_end.wait()
        if self._records.command_exit is not None:
            return self._records.command_exit
        if self._broken is not None:
            raise BashInfrastructureError(
                self._broken + "; the command's exit status is lost", reason="command_lost"
            )
        with anyio.move_on_after(_GONE_SETTLE_S):
            while True:
                if not await self._container_runs():
                    raise BashInfrastructureError(
                        f"container {self._container[:12]} stopped under the command", reason="container_gone"
                    )
                await anyio.sleep(0.05)
        raise BashInfrastructureError(
            "the command's supervisor in the container died before it reported how the command ended "
            "(killed by the command itself?); its exit status is lost",
            reason="command_lost",
        )

    async def _container_runs(self) -> bool:
        try:
            state = (await self._engine.container_inspect(self._container)).get("State", {})
        except EngineError as exc:
            reason: InfraReason = exc.reason
            if exc.status == 404:
                reason = "container_gone"
            elif exc.status is None:
                reason = "connection_lost"
            raise BashInfrastructureError(f"lost the command: {exc}", reason=reason) from exc
        return bool(state.get("Running")) and state.get("Status") not in ("removing", "dead")

    async def pump_output(self) -> None:
        stdin = self._launch.spec.stdin
        data = b"" if stdin is None else (stdin.encode() if isinstance(stdin, str) else stdin)
        try:
            for at in range(0, len(data), _STDIN_CHUNK):
                if not await self._send(encode_frame(b"i", data[at : at + _STDIN_CHUNK])):
                    break
            else:
                await self._send(encode_frame(b"c"))
        finally:
            await self._output_done.wait()

    async def _send(self, frame: bytes) -> bool:
        """Send one frame to the supervisor; False when its stream is gone."""
        if self._stream_ended:
            return False
        try:
            async with self._send_lock:
                await self._stream.send_stdin(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    @property
    def ended(self) -> bool:
        """True once the supervisor's stream ended: it has nothing left to hold (or was killed)."""
        return self._stream_ended

    async def signal_all(self, sig: int) -> None:
        if self._records.empty:
            return
        if await self._send(encode_frame(b"K" if sig == signal.SIGKILL else b"T")):
            return
        await self._marked.signal_all(sig)

    async def remaining(self) -> list[str]:
        if self._records.empty:
            return []
        if not self._stream_ended:
            return [f"processes under dsh-supervise in container {self._container[:12]}"]
        return await self._marked.remaining()

    async def release(self) -> None:
        # The reader goes on until the supervisor exits (leftovers may live until the executor
        # closes); their output has nowhere to go now.
        self._discard = True
        await self._on_release()

    async def abandon(self) -> None:
        """A start that failed or was cancelled: drop the stream (the supervisor then kills everything)."""
        await self._stream.aclose()
