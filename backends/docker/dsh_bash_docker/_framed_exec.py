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
import os
from collections.abc import Awaitable, Callable

import anyio

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    CoalescedRuns,
    InfraReason,
    Launch,
)
from dsh_bash.remote import (
    BOOT_FAIL,
    BOOT_OK,
    boot_failure,
)
from dsh_bash.supervisor import FramedCommand

from ._engine import EngineClient, EngineError, ExecStream
from ._process import ContainerMarked, StartHelper, diagnose_refusal, lost_in_container, run_script

__all__ = ["FramedDockerProcess", "SidePipes", "SupervisorMissing"]

log = logging.getLogger("dsh_bash.docker")

#: How long a failed start waits for the rest of the boot script's report.
_REPORT_BOUND_S = 5.0

#: Output relayed by the engine before the supervisor's side pipe is asked for: below it, the exec
#: inspect that finds the supervisor's pid costs more than the engine's relay.
SIDE_PIPE_AFTER = 1 << 20


def _killed_by_signal(exit_code: int | None) -> bool:
    # The engine reports an exec killed by signal N as 128 + N, as a shell does.
    return exit_code is not None and 128 < exit_code <= 128 + 64


class SidePipes:
    """Whether this executor's commands may move their output off the engine's stream.

    The engine copies every byte of an exec's stream twice (its shim, then the daemon), which bounds
    a command's output rate by the engine's CPU. Where this process may open the supervisor's fds
    through this host's ``/proc`` (the engine on this host, and this process root or the owner of a
    rootless engine's user namespace), a command with much output asks its supervisor for a side
    pipe and reads the rest of the frames from it. The first refusal turns it off for the executor.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def refused(self, why: object) -> None:
        if self.enabled:
            self.enabled = False
            log.info("reading output through /proc is not possible here (%s): the engine's stream it is", why)


class SupervisorMissing(BashInfrastructureError):
    """The engine could not start the supervisor: its file is gone from the container."""


class FramedDockerProcess(FramedCommand):
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
        supervisor: str,
        side_pipes: SidePipes,
        continues: CoalescedRuns,
    ) -> None:
        super().__init__(
            launch,
            fallback=marked,
            registry=registry,
            where=f"in container {container[:12]}",
            continues=continues,
        )
        self._marked = marked
        self._engine = engine
        self._container = container
        self._exec_id = exec_id
        self._supervisor = supervisor
        self._stream = stream
        self._start_helper = start_helper
        self._on_release = on_release
        self._wait_writable = wait_writable
        self._head = bytearray()  # stdout before the boot script's verdict
        self._booted = False
        self._supervisor_said = bytearray()
        self._fed = False
        self._send_lock = anyio.Lock()
        self._side_pipes = side_pipes
        self._relayed = 0  # output bytes that came through the engine's stream
        self._side_done = False

    # -- the stream -----------------------------------------------------------------------------------

    def _on_stdout(self, data: memoryview) -> None:
        self._fed = True
        self._relayed += len(data)
        # The boot script runs under the supervisor: its verdict is the first thing on stdout.
        if self._booted:
            super()._on_stdout(data)
            return
        self._head += data
        if len(self._head) >= len(BOOT_OK) and self._head.startswith(BOOT_OK):
            self._booted = True
            rest = bytes(self._head[len(BOOT_OK) :])
            self._head.clear()
            if rest:
                super()._on_stdout(memoryview(rest))

    def _on_stderr(self, data: memoryview) -> None:
        self._fed = True
        self._relayed += len(data)
        super()._on_stderr(data)

    def _engine_stderr(self, data: memoryview) -> None:
        # The supervisor's own stderr: only its usage and set-up errors, before the command runs.
        if len(self._supervisor_said) < 4096:
            self._supervisor_said += data

    def _fed_since_wait(self) -> bool:
        return self._fed or self._broken is not None

    def _reader_wakes(self) -> bool:
        if self._side_done:
            return self._fed_since_wait()
        return self._fed_since_wait() or self.switched or self.side_pipe_offer is not None

    async def _send_frame(self, frame: bytes, *, urgent: bool) -> bool:
        try:
            # Whole frames only: anyio refuses concurrent sends, and a frame cut by another's
            # would break the stream.
            async with self._send_lock:
                await self._stream.send_stdin(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def _lost(self) -> BashInfrastructureError:
        return await lost_in_container(
            self._engine,
            self._container,
            "the command's supervisor in the container died before it reported how the command ended "
            "(killed by the command itself?); its exit status is lost",
        )

    # -- start ----------------------------------------------------------------------------------------

    async def read_preamble(self, user: str | None) -> None:
        """Wait for the boot script's verdict; raise BashInfrastructureError when the command cannot start."""
        records = self._records

        def decided() -> bool:
            return self._booted or records.exec_failed is not None or self._head.startswith(BOOT_FAIL)

        started = await self._continued_until(
            lambda: self._stream.pump_until(self.feed, self._engine_stderr, decided)
        )
        if started and self._booted:
            return
        if self._head.startswith(BOOT_FAIL):
            with anyio.move_on_after(_REPORT_BOUND_S):
                await self._stream.pump_until(self.feed, self._engine_stderr, self._report_complete)
            report = bytes(self._head[len(BOOT_FAIL) :]).split(b"\0", 1)[0].decode("utf-8", "replace")
            raise boot_failure(report, workdir=self._launch.spec.workdir, where=self._where)
        failure = self.start_failure()
        if failure is not None:
            raise failure
        said = bytes(self._head + self._supervisor_said).decode("utf-8", "replace").strip("\0 \n")
        # An engine that could not start the exec (an unknown user) says why where frames were due.
        detail = "; ".join(part for part in (self.unframed_output, said) if part)
        exit_code = await self._engine.exec_exit_code(self._exec_id, within_s=_REPORT_BOUND_S)
        reason: InfraReason = "unclassified"
        if exit_code in (126, 127):  # the engine could not start the supervisor itself
            if self._records.child is None and not await self._supervisor_present():
                raise SupervisorMissing(
                    f"dsh-supervise is missing {self._where} ({self._supervisor})", reason="start_failed"
                )
            reason = await diagnose_refusal(self._engine, self._container, user, self._launch.env.get("PATH"))
        elif not detail and (self._records.child is not None or _killed_by_signal(exit_code)):
            # The supervisor started and then died silently: its child may have run the command
            # (and killed it, `kill -9 $PPID`, before the boot verdict was relayed), so the command's
            # outcome is unknown, never "could not start".
            raise await self._lost()
        raise BashInfrastructureError(
            f"the command could not start {self._where}: {detail or 'no output'}", reason=reason
        )

    async def _supervisor_present(self) -> bool:
        # Looked at from inside (as root): the engine's archive API does not see into a tmpfs, and
        # image mode's install directory is one.
        try:
            code, _, _ = await run_script(self._engine, self._container, "0", '[ -e "$1" ]', self._supervisor)
        except EngineError:
            return True  # not known: the start's failure is then reported as it is
        return code == 0

    def _report_complete(self) -> bool:
        return self._head.find(b"\0", len(BOOT_FAIL)) >= 0

    def start_reading(self) -> None:
        """Hand the stream to a reader of its own, which reads it to its end (past this command's release)."""
        self.running()
        self._start_helper(self._read_to_end)

    async def _read_to_end(self) -> None:
        try:
            # pump_until returns after each read that fed output (True) or at end of stream.
            while self._broken is None and await self._stream.pump_until(
                self.feed, self._engine_stderr, self._reader_wakes
            ):
                self._fed = False
                if self.switched and not self._side_done:
                    self._side_done = True
                    await self.read_side_pipe(self._wait_room)
                    continue  # then the engine's stream to its end (nothing more comes there)
                if self.side_pipe_offer is not None:
                    await self._take_side_pipe()
                elif self._relayed >= SIDE_PIPE_AFTER and self._side_pipes.enabled and not self._discard:
                    await self.request_side_pipe()
                await self._wait_room()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, EngineError) as exc:
            log.warning("command %s: reading the supervisor's stream failed: %s", self._launch.marker, exc)
        finally:
            with anyio.CancelScope(shield=True):
                self.stream_ended()
                await self._stream.aclose()

    async def _wait_room(self) -> None:
        if not self._discard:
            await self._wait_writable()

    async def _take_side_pipe(self) -> None:
        offer = self.side_pipe_offer
        assert offer is not None
        try:
            # The exec's process is the supervisor (a wrapper bash `exec`s into it): its host pid.
            pid = int((await self._engine.exec_inspect(self._exec_id)).get("Pid") or 0)
            if pid <= 0:
                raise OSError("the engine gave no pid for the exec")
            fd = os.open(f"/proc/{pid}/fd/{offer[0]}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, EngineError, ValueError) as exc:
            self.decline_side_pipe()
            # No such process or fd: the supervisor just exited; anything else holds for every command.
            if not (isinstance(exc, OSError) and exc.errno in (errno.ENOENT, errno.ESRCH)):
                self._side_pipes.refused(exc)
            return
        if not await self.take_side_pipe(fd):
            self._side_pipes.refused("the pid's fd is another pipe: the engine runs elsewhere")

    # -- the process protocol -------------------------------------------------------------------------

    async def pump_output(self) -> None:
        try:
            await self.send_stdin()
        finally:
            await self._output_done.wait()

    async def release(self) -> None:
        # The reader goes on until the supervisor exits (leftovers may live until the executor
        # closes); their output has nowhere to go now.
        self._discard = True
        await self._on_release()
