"""The framed channel of ``dsh-supervise --frame``: one byte stream each way, records in frames.

A backend that reaches its commands through a single stream pair (Docker's exec, an SSH channel)
starts the command under ``dsh-supervise --frame``. The supervisor then holds that stream alone:
the command's stdout and stderr are pipes to the supervisor, which frames them together with its
status records (``started``, ``exit``, ``signal``, ``empty``...). Nothing the command writes can pose
as a record, and the exit status is the wait status the supervisor observed.

A frame is a type byte, a 4-byte big-endian payload length, and the payload. From the supervisor:

- ``o`` / ``e``: the command's stdout / stderr bytes; an empty payload means that stream reached
  end of file (every holder closed it), sent once per stream;
- ``s``: one status record, ASCII, without a newline (the records of ``native/README.md``).

To the supervisor: ``i`` (bytes for the command's stdin), ``c`` (close the command's stdin), ``T``
(SIGTERM to every process of the command), ``K`` (SIGKILL until none is left), ``P`` and ``G`` (the
side pipe: :meth:`~dsh_bash.supervisor.FramedCommand.take_side_pipe`). End of file on the supervisor's
input means the harness is gone: it kills everything. ``empty`` is the last frame.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Mapping, Sequence

from .._protocol import ExitStatus

__all__ = [
    "FRAME_HEADER",
    "MAX_FRAME_PAYLOAD",
    "FrameDecoder",
    "FrameError",
    "SupervisorRecords",
    "command_payload",
    "encode_frame",
]

log = logging.getLogger("dsh_bash")

_HEADER = struct.Struct(">cI")
#: Bytes before a frame's payload: its type and its length.
FRAME_HEADER = _HEADER.size
#: The largest payload a supervisor sends; anything larger means the stream is not a supervisor's.
MAX_FRAME_PAYLOAD = 1 << 20

Sink = Callable[[memoryview], None]


class FrameError(ValueError):
    """The stream broke the framing: it cannot come from a sound supervisor."""


def encode_frame(kind: bytes, payload: bytes = b"") -> bytes:
    """One frame to the supervisor: ``kind`` is ``b"i"``, ``b"c"``, ``b"T"`` or ``b"K"``."""
    if len(kind) != 1:
        raise ValueError(f"a frame type is one byte, not {kind!r}")
    return _HEADER.pack(kind, len(payload)) + payload


def _discard(part: memoryview) -> None:
    """Where a capture stream goes that nobody asked for."""


class FrameDecoder:
    """Splits the supervisor's stream into the command's stdout, its stderr, and status records.

    ``feed`` takes bytes as they arrive, in any split; each sink is called with whole payloads of
    the frames completed so far (a large frame may reach its sink in several parts, never mixed
    with another frame's). End-of-file frames call ``on_eof`` with ``"stdout"`` or ``"stderr"``.
    ``on_capture`` takes the ``v`` stream (protocol 8, ``--capture-fd``: what the command wrote to
    its capture descriptor, a session's state); without it that stream is dropped.
    """

    __slots__ = ("_buffer", "_kind", "_left", "_on_eof", "_on_status", "_sinks", "_status_part", "framed")

    def __init__(
        self,
        *,
        on_stdout: Sink,
        on_stderr: Sink,
        on_status: Callable[[str], None],
        on_eof: Callable[[str], None],
        on_capture: Sink | None = None,
    ) -> None:
        self._sinks = {b"o": on_stdout, b"e": on_stderr, b"v": on_capture or _discard}
        self._on_status = on_status
        self._on_eof = on_eof
        self._buffer = b""  # a partial header
        self._kind = b""  # the frame whose payload is being read, while _left > 0
        self._left = 0
        self._status_part = b""
        #: A valid frame header was read: the stream holds frames (until then, it may be a
        #: transport's own words, such as a container engine's refusal to start the exec).
        self.framed = False

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        at = 0
        end = len(view)
        while at < end:
            if self._left:
                take = min(self._left, end - at)
                self._payload(view[at : at + take])
                self._left -= take
                at += take
                if not self._left and self._kind == b"s":
                    self._status_done()
                continue
            need = FRAME_HEADER - len(self._buffer)
            if need > end - at:
                self._buffer += bytes(view[at:end])
                return
            header = self._buffer + bytes(view[at : at + need])
            self._buffer = b""
            at += need
            kind, length = _HEADER.unpack(header)
            self._start(kind, length)

    def _start(self, kind: bytes, length: int) -> None:
        if kind not in (b"o", b"e", b"s", b"v"):
            raise FrameError(f"unknown frame type {kind!r}")
        if length > MAX_FRAME_PAYLOAD:
            raise FrameError(f"a frame of {length} bytes (at most {MAX_FRAME_PAYLOAD})")
        self.framed = True
        if length == 0:
            if kind == b"s":
                self._status_done()
            elif kind != b"v":  # the capture's end says nothing the exit record does not
                self._on_eof("stdout" if kind == b"o" else "stderr")
            return
        self._kind = kind
        self._left = length

    def _payload(self, part: memoryview) -> None:
        if self._kind == b"s":
            self._status_part += bytes(part)
        else:
            self._sinks[self._kind](part)

    def _status_done(self) -> None:
        record, self._status_part = self._status_part, b""
        self._on_status(record.decode("ascii", "replace"))

    @property
    def mid_frame(self) -> bool:
        """True when the bytes fed so far end inside a frame (a stream cut there was cut short)."""
        return bool(self._buffer or self._left)


class SupervisorRecords:
    """What the supervisor's status records said so far: one reading for every channel that carries them.

    ``apply`` takes one record (``"exit 3"``, ``"signal 15 core"``); the fields say what is known.
    With ``--detach``, only records a :class:`~dsh_bash.supervisor.SignedRecords` verified belong here.
    A record this version cannot read is logged and ignored.
    """

    __slots__ = (
        "child",
        "command_exit",
        "empty",
        "exec_failed",
        "input_broken",
        "input_drained",
        "input_waiting",
        "pty_failed",
        "side_pipe",
        "supervisor_pid",
        "supervisor_start_time",
        "switched",
        "workdir_failed",
    )

    def __init__(self) -> None:
        #: The command's bash (pid, process group and session) once ``started``.
        self.child: int | None = None
        #: The errno of a failed exec (``execfail``).
        self.exec_failed: int | None = None
        #: The errno of a failed change to the command's directory (``cwdfail``, --fork-server only).
        self.workdir_failed: int | None = None
        #: The errno of a terminal the supervisor could not make (``ptyfail``; nothing started).
        self.pty_failed: int | None = None
        #: How the command's bash ended (``exit`` / ``signal``).
        self.command_exit: ExitStatus | None = None
        #: True once no process of the command is left (``empty``, the supervisor's last record).
        self.empty = False
        #: The supervisor's pid, from its first record (``supervisor``): with ``--detach`` its start time
        #: too (field 22 of ``/proc/PID/stat``, clock ticks since boot): signal the pid only while both
        #: still match. A ``--fork-server`` supervisor sends its pid alone (``pidfd PID``) with a
        #: pidfd of itself, the only handle to signal it by.
        self.supervisor_pid: int | None = None
        self.supervisor_start_time: int | None = None
        #: The side pipe the supervisor made on request (``pipe FD INODE``): its read end's fd number
        #: in the supervisor and the pipe's inode, for a harness that may open the supervisor's fds.
        self.side_pipe: tuple[int, int] | None = None
        #: True once ``switch`` came: every later frame is on the side pipe.
        self.switched = False
        #: Bytes of ``i`` frames the supervisor has written into the command's stdin so far, as of its
        #: last ``input drained N`` (sent when its queue emptied): the bytes sent minus this are still
        #: on their way to the supervisor or in its queue (what the pipe holds counts as written).
        self.input_drained = 0
        #: The errno that ended writing the command's stdin (``input broken``: 32, EPIPE, once the
        #: command closed it; 12, ENOMEM, for a queue that could not grow); the rest was dropped.
        self.input_broken: int | None = None
        #: The last ``input waiting N`` (True, N) or ``input busy N`` (False, N): whether a process of
        #: the command was blocked reading its open input with nothing queued, N being the ``i`` bytes
        #: the supervisor had received then (a report older than the harness's last write has a smaller
        #: N). None until one came: a supervisor sends ``input busy 0`` first when it samples at all.
        self.input_waiting: tuple[bool, int] | None = None

    def apply(self, record: str) -> None:
        words = record.split()
        if not words:
            return
        kind, args = words[0], words[1:]
        try:
            if kind == "started":
                self.child = int(args[0])
            elif kind == "execfail":
                self.exec_failed = int(args[0])
            elif kind in ("exit", "signal") and self.command_exit is None:
                # The first one is the command's: a supervisor nested in a launcher's sandbox reports
                # it before the outer supervisor reports the launcher's own end.
                number = int(args[0])
                self.command_exit = ExitStatus(code=number) if kind == "exit" else ExitStatus(None, number)
            elif kind == "empty":
                self.empty = True
            elif kind == "supervisor":
                pid, start_time = int(args[0]), int(args[1])
                self.supervisor_pid, self.supervisor_start_time = pid, start_time
            elif kind == "pidfd":
                self.supervisor_pid = int(args[0])
            elif kind == "pipe" and self.side_pipe is None:
                self.side_pipe = (int(args[0]), int(args[1]))
            elif kind == "switch":
                self.switched = True
            elif kind == "cwdfail":
                self.workdir_failed = int(args[0])
            elif kind == "ptyfail":
                self.pty_failed = int(args[0])
            elif kind == "input" and args[:1] == ["drained"]:
                self.input_drained = _count(args[1])
            elif kind == "input" and args[:1] == ["broken"]:
                number = _count(args[1])
                if self.input_broken is None:
                    self.input_broken = number
            elif kind == "input" and args[:1] in (["waiting"], ["busy"]):
                self.input_waiting = (args[0] == "waiting", _count(args[1]))
            elif kind == "warning":
                log.info("dsh-supervise: %s", record)
        except (IndexError, ValueError):
            log.warning("dsh-supervise wrote an unreadable record: %r", record)


def _count(word: str) -> int:
    """A record's decimal count or errno: digits alone (``int`` would take ``-3``, ``+3``, ``1_000``)."""
    if not (word.isascii() and word.isdigit()):
        raise ValueError(word)
    return int(word)


def command_payload(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    status_in_program: int = -1,
    terminal: tuple[int, int] | None = None,
) -> bytes:
    """A command for dsh-supervise as NUL-terminated strings: the directory, the fd the program gets
    the status socket as (-1: none), the argument count, the arguments, then NAME=VALUE entries.
    The payload of a ``--fork-server`` request, and of the ``x`` frame of ``--frame --spec``.

    ``terminal`` (``x`` frames only): run the command on a pseudo-terminal of (rows, columns) that
    the supervisor makes and owns; it goes as a field of its own after the status fd."""
    fields = [
        cwd,
        str(status_in_program),
        *([f"{terminal[0]} {terminal[1]}"] if terminal is not None else []),
        str(len(argv)),
        *argv,
        *(f"{key}={value}" for key, value in env.items()),
    ]
    return ("\0".join(fields) + "\0").encode("utf-8", "surrogateescape")
