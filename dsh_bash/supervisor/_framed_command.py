"""The transport-independent half of a command under ``dsh-supervise --frame``.

A backend that reaches its commands through one stream pair (Docker's exec, an SSH channel) runs
each under ``dsh-supervise --frame`` and subclasses :class:`FramedCommand`: it feeds the bytes the
supervisor writes to :meth:`FramedCommand.feed`, says when that stream ended
(:meth:`FramedCommand.stream_ended`), and sends frames with :meth:`FramedCommand._send_frame`. The
base class reads the frames (the command's output goes to the launch's streams, the status records
to :class:`SupervisorRecords`), tells the exit status, and kills through the supervisor, falling back
to the marker (``fallback``) once the supervisor is gone.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import secrets
import signal
import stat
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import anyio.lowlevel

from .._errors import (
    BashInfrastructureError,
    InfraReason,
)
from .._protocol import (
    CoalescedRuns,
    CommandProcess,
    ExitStatus,
    Killable,
    Launch,
    while_watching,
)
from .._types import TerminalSize
from ._frames import (
    FrameDecoder,
    FrameError,
    SupervisorRecords,
    encode_frame,
)

__all__ = ["CONTINUE_SUPERVISOR", "STDIN_FRAME_BYTES", "FramedCommand", "continue_runs"]

T = TypeVar("T")

log = logging.getLogger("dsh_bash")

#: On the side pipe (output past its first MiB, a stream that is about rate, not latency): a read
#: shorter than this is followed by a pause of _SIDE_PAUSE_S, so that the reader wakes once per
#: batch, not once per write of the command (which on two CPUs took more of them than the command).
_SIDE_BATCH = 256 * 1024
_SIDE_PAUSE_S = 0.002
#: What one read of the side pipe feeds before it awaits the spill files' room.
_SIDE_FEED = 256 * 1024

#: What is kept of a stream's first bytes until its first frame, to report a stream that has none.
_UNFRAMED_KEPT = 4096

#: A bash script, run where the commands run as the commands' user: SIGCONT to every stopped process
#: whose name begins with ``dsh-supervise`` or that shares this script's parent (the other channels
#: of its SSH connection, the other execs of its container, whose parent is outside it). A command can
#: stop (SIGSTOP) its own supervisor, or a warm spare before it named itself, which then hears no
#: request: this continues them all at once, so one run serves every command of the user (see
#: :class:`dsh_bash.backend.CoalescedRuns`). None of them is ever meant to be stopped, and a command
#: that made one of its own look so gains only a continue. Exit status 0 whatever it found.
CONTINUE_SUPERVISOR = r"""
for dir in /proc/[0-9]*; do
    read -r stat 2>/dev/null < "$dir/stat" || continue
    name=${stat#*(}
    fld=(${stat##*) })
    [ "${fld[0]}" = T ] || continue
    case ${name%%)*} in
    dsh-supervise*) ;;
    *) [ "${fld[1]}" = "$PPID" ] || continue ;;
    esac
    kill -CONT "${dir#/proc/}" 2>/dev/null
done
exit 0
"""
#: Between two continues of one supervisor from outside (each costs a process where commands run).
_CONTINUE_EVERY_S = 0.5
#: The most one continue from outside may take before the SIGKILL request goes out anyway.
_CONTINUE_BOUND_S = 5.0

#: The command's stdin goes to the supervisor in frames of at most this size, so that a kill request
#: waits behind one chunk at most.
STDIN_FRAME_BYTES = 64 * 1024


def continue_runs(action: Callable[[], Awaitable[None]]) -> CoalescedRuns:
    """The runs of :data:`CONTINUE_SUPERVISOR` (``action``: one run where the commands run) that an
    executor shares among its commands (their ``continues``): one at a time, and one stuck for
    longer than the interval between two continues (a command stopped its process too) no longer
    holds back the next."""
    return CoalescedRuns(action, stale_after_s=_CONTINUE_EVERY_S)


class FramedCommand(CommandProcess):
    """One command whose supervisor's stream this process reads: output, outcome and kills through it.

    ``registry``: the executor's set of live supervised commands; this one is in it from
    :meth:`running` until the supervisor said that no process is left (``_leftovers`` returns
    ``SupervisedLeftovers(registry, fallback)``). ``where`` names the place in messages.
    ``continues``: the executor's runs of :data:`CONTINUE_SUPERVISOR` where the commands run, as
    this command's user, shared by all its commands of that user (a command may stop its supervisor,
    which then hears no request); None where the backend cannot run it.
    """

    def __init__(
        self,
        launch: Launch,
        *,
        fallback: Killable,
        registry: set[Any],
        where: str,
        continues: CoalescedRuns | None = None,
    ) -> None:
        self._launch = launch
        self._continues = continues
        self._fallback = fallback
        self._registry = registry
        self._where = where
        self._records = SupervisorRecords()
        self._decoder = FrameDecoder(
            on_stdout=self._on_stdout,
            on_stderr=self._on_stderr,
            on_status=self._on_status,
            on_eof=self._on_eof,
            on_capture=None if launch.session is None else launch.session.feed,
        )
        #: Released (or the pump gave up): the command's output has nowhere to go any more.
        self._discard = False
        #: Why the stream cannot be read any further (it broke the framing), or None.
        self._broken: str | None = None
        #: The stream's first bytes, kept until a frame header was read (``_UNFRAMED_KEPT`` at most).
        self._stream_head = bytearray()
        self._abandoned = False
        #: Bytes of open input (``send_input``) sent to the supervisor so far.
        self._input_sent = 0
        self._stream_done = False
        self._eof: set[str] = set()
        #: Set once the supervisor started the command, could not, or its stream ended.
        self._decided = anyio.Event()
        self._exit_or_end = anyio.Event()
        #: Set once the supervisor said that no process is left, or its stream ended.
        self._settled = anyio.Event()
        #: Set once both output streams reached their end (or the stream did).
        self._output_done = anyio.Event()
        self._side: Literal["none", "asked", "declined", "taken"] = "none"
        self._side_fd = -1
        self._side_expected = b""  # the side pipe's first frame: `nonce HEX`
        self._continued_at = -math.inf

    # -- what the transport calls -------------------------------------------------------------------

    def feed(self, data: bytes | memoryview) -> None:
        """Bytes the supervisor wrote, in any split."""
        decoder = self._decoder
        if not decoder.framed and len(self._stream_head) < _UNFRAMED_KEPT:
            self._stream_head += data[: _UNFRAMED_KEPT - len(self._stream_head)]
        if self._broken is not None:
            return
        try:
            decoder.feed(data)
        except FrameError as exc:
            if decoder.framed:
                self._break(f"the supervisor's stream broke its framing: {exc}")
                return
            # No frame at all: what came is the transport's own words (an engine that could not
            # start the exec writes why on its stream), not a supervisor's stream gone wrong. The
            # rest of them is kept as it comes.
            self._break(f"the stream began with no frame but {bytes(self._stream_head)!r}", quiet=True)
            return
        if decoder.framed and self._stream_head:
            self._stream_head = bytearray()

    @property
    def unframed_output(self) -> str | None:
        """What the stream carried instead of frames, when it broke before its first one (a
        transport's own message, such as an engine's "unable to find user"), else None: for the
        start failure's message."""
        if self._broken is None or self._decoder.framed:
            return None
        return bytes(self._stream_head).decode("utf-8", "replace").strip()

    def stream_ended(self) -> None:
        """The supervisor's stream ended (it exited, was killed, or the transport dropped)."""
        if self._stream_done:
            return
        self._stream_done = True
        if not self._records.empty and not self._abandoned and self._broken is None:
            log.warning(
                "command %s: the supervisor's stream %s ended before it reported that no process is left "
                "(it was killed, or the transport dropped); its leftovers are looked for by marker",
                self._launch.marker,
                self._where,
            )
        self._decided.set()
        self._exit_or_end.set()
        self._settled.set()
        self._output_done.set()
        self._output_finished()

    # -- hooks ---------------------------------------------------------------------------------------

    @abstractmethod
    async def _send_frame(self, frame: bytes, *, urgent: bool) -> bool:
        """Send one whole frame to the supervisor; False when its stream is gone. ``urgent``: a kill
        request, which must not wait behind flow control the command's stdin waits for."""

    @abstractmethod
    async def _lost(self) -> BashInfrastructureError:
        """The error for a stream that ended without the command's exit status (the transport's
        view: its connection dropped, its container is gone, or the supervisor was killed)."""

    def _stream_broken(self) -> None:
        """Hook: the stream broke its framing; the default does nothing more. A transport closes it."""

    def _output_finished(self) -> None:
        """Hook: both output streams (or the whole stream) ended; a pump that waits on it wakes up."""

    # -- the side pipe -------------------------------------------------------------------------------
    #
    # A transport that relays the supervisor's fd 1 (a container engine copies each byte twice more)
    # can read the frames from a pipe of the supervisor's instead, where this process may open the
    # supervisor's fds (``/proc/PID/fd/FD``: root on the same host, or the owner of a rootless
    # engine's user namespace; a command of the supervisor's user may not, it being non-dumpable).
    # The backend asks (:meth:`request_side_pipe`), opens the offered fd in its own way, and hands it
    # over (:meth:`take_side_pipe`); once :attr:`switched`, it reads the rest with
    # :meth:`read_side_pipe`. Requests and kills still go the usual way.

    async def request_side_pipe(self) -> None:
        """Ask the supervisor for a side pipe, once; its answer is :attr:`side_pipe_offer`."""
        if self._side == "none" and not self._stream_done and self._records.command_exit is None:
            self._side = "asked"
            await self._send_frame(encode_frame(b"P"), urgent=False)

    @property
    def side_pipe_offer(self) -> tuple[int, int] | None:
        """(fd number in the supervisor, inode) of the pipe it offered, until taken or declined.

        None once the command's exit is known: what is left is drained under the executor's bound,
        which the round trips of a switch would only spend.
        """
        if self._side != "asked" or self._records.side_pipe is None:
            return None
        if self._records.command_exit is not None:
            self._side = "declined"
            return None
        return self._records.side_pipe

    def decline_side_pipe(self) -> None:
        """The backend cannot open the offered pipe: everything goes on as before."""
        if self._side == "asked":
            self._side = "declined"

    async def take_side_pipe(self, fd: int) -> bool:
        """``fd``: a read end the backend opened of the offered pipe; this object owns it from now on.

        Checks that it is that pipe (a FIFO of the offered inode), then asks the supervisor to move
        its frames there with a fresh nonce, which the pipe's first frame must repeat. False (and
        ``fd`` closed) when it is another file: nothing changes then.
        """
        offer = self.side_pipe_offer
        info = os.fstat(fd)
        if offer is None or not stat.S_ISFIFO(info.st_mode) or info.st_ino != offer[1]:
            os.close(fd)
            self.decline_side_pipe()
            return False
        os.set_blocking(fd, False)
        nonce = secrets.token_bytes(16)
        self._side_fd = fd
        self._side = "taken"
        self._side_expected = encode_frame(b"s", b"nonce " + nonce.hex().encode("ascii"))
        if not await self._send_frame(encode_frame(b"G", nonce), urgent=False):
            self._close_side()
        return True

    @property
    def switched(self) -> bool:
        """True once the supervisor said that every later frame goes to the side pipe."""
        return self._records.switched

    async def read_side_pipe(self, wait_room: Callable[[], Awaitable[None]]) -> None:
        """Once :attr:`switched`: read the side pipe to its end (the supervisor exited).

        ``wait_room`` is awaited after each read whose output is kept (the spill files' room). A
        pipe whose first frame is not the nonce is not the supervisor's: the stream counts as broken.
        """
        fd = self._side_fd
        if fd < 0 or not self._records.switched:
            return
        log.debug(
            "command %s: the rest of its output through the supervisor's side pipe",
            self._launch.marker,
        )
        head = b""
        try:
            while self._broken is None:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not data:
                    if len(head) < len(self._side_expected):
                        self._break("the side pipe ended before the supervisor's nonce")
                    return
                if len(head) < len(self._side_expected):
                    take = len(self._side_expected) - len(head)
                    head += data[:take]
                    if not self._side_expected.startswith(head):
                        self._break("the side pipe did not start with the supervisor's nonce")
                        return
                    data = data[take:]
                view = memoryview(data)
                for at in range(0, len(view), _SIDE_FEED):
                    # In slices, with the room awaited after each: one 1 MiB read must not queue
                    # a whole MiB more for a spill file that is already at its high-water mark.
                    self.feed(view[at : at + _SIDE_FEED])
                    if not self._discard:
                        await wait_room()
                if len(data) < _SIDE_BATCH:
                    # A trickle: let it gather (the pipe holds 1 MiB) rather than wake per write.
                    await anyio.sleep(_SIDE_PAUSE_S)
                else:
                    await anyio.lowlevel.checkpoint()
        except OSError as exc:
            log.warning("command %s: reading the side pipe failed: %s", self._launch.marker, exc)
        finally:
            self._close_side()

    def _close_side(self) -> None:
        if self._side_fd >= 0:
            anyio.notify_closing(self._side_fd)
            os.close(self._side_fd)
            self._side_fd = -1

    def _break(self, why: str, *, quiet: bool = False) -> None:
        self._broken = why
        log.log(logging.INFO if quiet else logging.WARNING, "command %s: %s", self._launch.marker, why)
        self._stream_broken()

    # -- the supervisor's frames ---------------------------------------------------------------------

    def _on_stdout(self, data: memoryview) -> None:
        if not self._discard:
            self._launch.stdout.feed(data)

    def _on_stderr(self, data: memoryview) -> None:
        if not self._discard:
            self._launch.stderr.feed(data)

    def _on_status(self, record: str) -> None:
        records = self._records
        records.apply(record)
        if records.child is not None or records.exec_failed is not None or records.pty_failed is not None:
            self._decided.set()
        if records.command_exit is not None:
            self._decided.set()
            self._exit_or_end.set()
        if records.empty:
            self._registry.discard(self)
            self._settled.set()

    def _on_eof(self, stream: str) -> None:
        self._eof.add(stream)
        if len(self._eof) == 2:
            self._output_done.set()
            self._output_finished()

    # -- start ----------------------------------------------------------------------------------------

    def start_failure(self) -> BashInfrastructureError | None:
        """Once :attr:`_decided` is set: why the supervisor could not start the command, or None."""
        failed = self._records.pty_failed
        if failed is not None:
            return BashInfrastructureError(
                f"cannot make the command's terminal {self._where}: {errno.errorcode.get(failed, failed)}",
                reason="start_failed",
            )
        code = self._records.exec_failed
        if code is not None:
            reason: InfraReason = "shell_missing" if code in (errno.ENOENT, errno.EACCES) else "start_failed"
            return BashInfrastructureError(
                f"cannot start the command's bash {self._where}: {errno.errorcode.get(code, code)}",
                reason=reason,
            )
        return None

    async def wait_started(self) -> bool:
        """Wait (continuing the supervisor from outside meanwhile: the command may stop it before it
        reported the start) until the supervisor started the command: True; said why it could not:
        that :meth:`start_failure` is raised; or its stream ended first: False (the transport says
        why)."""
        await self._continued_until(self._decided.wait)
        if self._records.child is not None:
            return True
        failure = self.start_failure()
        if failure is not None:
            raise failure
        return False

    def running(self) -> None:
        """The command runs: its supervisor is one the executor's leftovers must reach until it is empty."""
        if not self._records.empty and not self._stream_done:
            self._registry.add(self)

    def abandon(self) -> None:
        """A start given up: whatever the transport does to drop the stream makes the supervisor kill
        everything; no warning is due when it ends."""
        self._abandoned = True

    # -- the process protocol -------------------------------------------------------------------------

    async def wait(self) -> ExitStatus:
        await self._exit_or_end.wait()
        if self._records.command_exit is not None:
            return self._records.command_exit
        if self._broken is not None:
            raise BashInfrastructureError(
                f"{self._broken}; the command's exit status is lost", reason="command_lost"
            )
        raise await self._lost()

    async def send_stdin(self) -> None:
        """Send the spec's stdin in frames, then close the command's stdin (``c``). With ``open_stdin``
        nothing: the executor sends everything through :meth:`send_input` and :meth:`end_input`."""
        if self._launch.spec.open_stdin:
            return
        stdin = self._launch.spec.stdin
        data = b"" if stdin is None else (stdin.encode() if isinstance(stdin, str) else bytes(stdin))
        for at in range(0, len(data), STDIN_FRAME_BYTES):
            if not await self._send_frame(
                encode_frame(b"i", data[at : at + STDIN_FRAME_BYTES]), urgent=False
            ):
                return
        await self._send_frame(encode_frame(b"c"), urgent=False)

    async def send_input(self, data: bytes) -> None:
        for at in range(0, len(data), STDIN_FRAME_BYTES):
            if self._records.input_broken is not None:
                raise BrokenPipeError(self._records.input_broken, "the command closed its stdin")
            chunk = data[at : at + STDIN_FRAME_BYTES]
            if self._stream_done or not await self._send_frame(encode_frame(b"i", chunk), urgent=False):
                raise BrokenPipeError(f"the supervisor's stream {self._where} ended")
            self._input_sent += len(chunk)

    async def end_input(self) -> None:
        await self._send_frame(encode_frame(b"c"), urgent=False)

    async def resize(self, size: TerminalSize) -> None:
        await self._send_frame(encode_frame(b"W", f"{size.rows} {size.cols}".encode()), urgent=False)

    def input_pending(self) -> int:
        # The supervisor queues what the command has not read yet; its `input drained N` says how much
        # of what was sent went into the command's pipe.
        return max(0, self._input_sent - self._records.input_drained)

    async def sample_input_waiting(self) -> bool | None:
        # The supervisor samples its subtree itself (`input waiting N` / `input busy N`); a report
        # counts only when it saw every byte sent so far, so one from before the last write is none.
        # None until a first record came: a supervisor that does not sample never sends one.
        reported = self._records.input_waiting
        if reported is None:
            return None
        waiting, received = reported
        return waiting and received == self._input_sent

    @property
    def ended(self) -> bool:
        """True once the supervisor's stream ended: it holds nothing any more (or was killed)."""
        return self._stream_done

    async def signal_all(self, sig: int) -> None:
        if self._records.empty:
            return
        request = encode_frame(b"K" if sig == signal.SIGKILL else b"T")
        if not self._stream_done and await self._send_frame(request, urgent=True):
            if sig == signal.SIGKILL and not self._stream_done:
                # The SIGTERM request had its grace and the supervisor still holds processes: it may
                # be stopped (by the command: same user), when it hears the request only once
                # continued. After the request, not before: a process where the commands run for
                # each of many kills at once (aclose) must not hold back the requests themselves.
                await self._continue_from_outside()
            return
        await self._fallback.signal_all(sig)

    async def _continued_until(self, wait: Callable[[], Awaitable[T]]) -> T:
        """``await wait()``, continuing the supervisor from outside every half second meanwhile: the
        command may stop it (SIGSTOP, same user) before it reported the start, and the start must not
        wait for ever."""

        async def nudge() -> None:
            while True:
                await anyio.sleep(_CONTINUE_EVERY_S)
                await self._continue_from_outside()

        return await while_watching(wait, nudge)

    async def _continue_from_outside(self) -> None:
        if self._continues is None:
            return
        now = time.monotonic()
        if now - self._continued_at < _CONTINUE_EVERY_S:
            return
        self._continued_at = now
        try:
            with anyio.move_on_after(_CONTINUE_BOUND_S):
                await self._continues.run()
        except Exception as exc:
            log.warning("continuing the supervisor %s failed: %s", self._where, exc)

    async def left_behind(self, settle_s: float) -> list[str]:
        with anyio.move_on_after(settle_s):
            await self._settled.wait()
        return await self.remaining()

    async def remaining(self) -> list[str]:
        if self._records.empty:
            return []
        if not self._stream_done:
            return [f"processes under dsh-supervise {self._where} ({self._launch.marker})"]
        return await self._fallback.remaining()
