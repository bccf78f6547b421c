"""dsh-supervise --frame (protocol version 2), driven as a real binary.

The supervisor holds one stream pair alone: requests in frames on its fd 0, the command's output and
its status records in frames on its fd 1 (decoded here with dsh_bash's FrameDecoder). Each test holds
the other ends (one socketpair for both, or two pipes where a test says so) and cleans up every
process it started. The containment helpers (marked command lines, escapee scripts) are those of
test_supervise.py, which also skips this module when the binary is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import anyio
import pytest
from test_supervise import (
    BASH,
    ESCAPEES,
    PYTHON,
    QEMU,
    SUPERVISE,
    _alive,
    _escapee_count,
    _marked,
    _start_time,
    _wait_for_lines,
    assert_set_for_the_command_alone,
)

from dsh_bash import BashExecSpec, BashInfrastructureError
from dsh_bash._output import SpillBudget
from dsh_bash.backend import (
    Launch,
    OutputStream,
    SpillFile,
)
from dsh_bash.supervisor import (
    FramedCommand,
    encode_frame,
)
from dsh_bash.supervisor._frames import FrameDecoder
from dsh_bash.supervisor._native import supervisor_binary, supervisor_problem

SH = (BASH, "--noprofile", "--norc", "-c")

Event = tuple[str, bytes | str]


class Framed:
    """One ``dsh-supervise --frame`` run: its process, the harness's ends of fds 0 and 1, what came."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        options: Sequence[str] = (),
        pipes: bool = False,
        binary: Sequence[str] = (SUPERVISE,),
        user: int | None = None,
        marker: str | None = None,
    ) -> None:
        self._sock: socket.socket | None = None
        if pipes:
            child_in, self._send_fd = os.pipe()
            self._recv_fd, child_out = os.pipe()
            child_fds = [child_in, child_out]
            if user is not None:
                # The supervisor's user owns them, as pipes it made itself would be: what keeps a
                # command of that user out of them is then the supervisor's non-dumpability alone.
                for fd in child_fds:
                    os.fchown(fd, user, user)
        else:
            self._sock, child = socket.socketpair()
            self._send_fd = self._recv_fd = self._sock.fileno()
            child_in = child_out = child.detach()
            child_fds = [child_in]
        try:
            self.process = subprocess.Popen(
                [*binary, "--frame", *options, "--", *command],
                stdin=child_in,
                stdout=child_out,
                stderr=subprocess.PIPE,
                user=user,
                group=user,
                extra_groups=[] if user is not None else None,
                cwd="/",
                env=None if marker is None else {**os.environ, "M": marker},
            )
        finally:
            for fd in child_fds:
                os.close(fd)  # the harness keeps no end of the supervisor's: EOF means it is gone
        self.events: list[Event] = []
        self.raw = bytearray()
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.capture = bytearray()
        self.at_eof = False
        self._decoder = FrameDecoder(
            on_stdout=self._on_stdout,
            on_stderr=self._on_stderr,
            on_status=lambda record: self.events.append(("s", record)),
            on_eof=lambda stream: self.events.append(("eof", stream)),
            on_capture=self.capture.extend,
        )

    def _on_stdout(self, data: memoryview) -> None:
        self.stdout += data
        self.events.append(("o", bytes(data)))

    def _on_stderr(self, data: memoryview) -> None:
        self.stderr += data
        self.events.append(("e", bytes(data)))

    @property
    def records(self) -> list[str]:
        """The status records so far, warnings left out (qemu-user says `warning no-subreaper`), the
        input records too (their number depends on how the writes to the command's stdin fell), and
        the `supervisor PID START` record every run begins with (``supervisor_records``)."""
        return [
            str(r)
            for kind, r in self.events
            if kind == "s" and not str(r).startswith(("warning ", "input ", "supervisor "))
        ]

    @property
    def supervisor_records(self) -> list[str]:
        return [str(r) for kind, r in self.events if kind == "s" and str(r).startswith("supervisor ")]

    @property
    def input_records(self) -> list[str]:
        """The `input drained N` / `input broken ERRNO` records so far (protocol 5)."""
        return [
            str(r)
            for kind, r in self.events
            if kind == "s" and str(r).startswith(("input drained ", "input broken "))
        ]

    @property
    def waiting_records(self) -> list[str]:
        """The `input waiting N` / `input busy N` records so far (the supervisor's samples)."""
        return [
            str(r)
            for kind, r in self.events
            if kind == "s" and str(r).startswith(("input waiting ", "input busy "))
        ]

    def drained(self) -> list[int]:
        return [int(r.split()[2]) for r in self.input_records if r.startswith("input drained ")]

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        data = memoryview(encode_frame(kind, payload))
        while data:
            select.select([], [self._send_fd], [], 5)
            data = data[os.write(self._send_fd, data) :]

    def close_input(self) -> None:
        """The harness's requests end (as a harness that went away, still reading its output)."""
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_WR)
        elif self._send_fd >= 0:
            os.close(self._send_fd)
            self._send_fd = -1

    def read_for(self, seconds: float) -> None:
        """Reads and decodes whatever comes within SECONDS."""
        deadline = time.monotonic() + seconds
        self.read_until(lambda: time.monotonic() >= deadline or self.at_eof, seconds + 5)

    def send_raw(self, data: bytes) -> None:
        os.write(self._send_fd, data)

    def close_all(self) -> None:
        """The harness is gone altogether: it neither sends nor reads."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        else:
            for fd in (self._send_fd, self._recv_fd):
                if fd >= 0:
                    os.close(fd)
        self._send_fd = self._recv_fd = -1

    def read_until(self, done: Callable[[], bool], timeout: float = 5.0) -> None:
        """Reads and decodes until DONE() holds; fails after TIMEOUT seconds or at an early EOF."""
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.at_eof:
                pytest.fail(f"{'EOF' if self.at_eof else 'timeout'} before the awaited frames: {self.events}")
            if select.select([self._recv_fd], [], [], min(remaining, 0.1))[0]:
                chunk = os.read(self._recv_fd, 1 << 20)
                if not chunk:
                    self.at_eof = True
                    continue
                self.raw += chunk
                self._decoder.feed(chunk)

    def expect(self, prefix: str, timeout: float = 5.0) -> str:
        """Reads until a status record starting with PREFIX arrived; returns it."""

        def found() -> str | None:
            return next(
                (str(r) for kind, r in self.events if kind == "s" and str(r).startswith(prefix)), None
            )

        self.read_until(lambda: found() is not None, timeout)
        record = found()
        assert record is not None
        return record

    def started_pid(self) -> int:
        return int(self.expect("started ").split()[1])

    def finish(self, timeout: float = 5.0) -> list[Event]:
        """Reads to EOF; the supervisor must exit 0 and `empty` must be the last frame."""
        self.read_until(lambda: self.at_eof, timeout)
        assert self.process.wait(timeout) == 0, self.process.stderr.read() if self.process.stderr else ""
        assert not self._decoder.mid_frame, "the stream ended inside a frame"
        assert self.events[-1] == ("s", "empty"), self.events
        return self.events

    def close(self) -> None:
        if self.process.poll() is None:
            # Its subtree first: a SIGKILL of the supervisor alone would hand the subtree to init.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGUSR2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.close_all()


@pytest.fixture
def runs() -> Iterator[list[Framed]]:
    started: list[Framed] = []
    yield started
    for run in started:
        run.close()


@pytest.fixture
def marker() -> Iterator[str]:
    mark = f"dshframemark{uuid.uuid4().hex}"
    yield mark
    for pid in _marked(mark):  # never leave a survivor behind, whatever the test said
        with contextlib.suppress(ProcessLookupError):  # it may end between the scan and the kill
            os.kill(pid, signal.SIGKILL)


def _frame_sizes(raw: bytes) -> list[tuple[bytes, int]]:
    """(type, payload length) of every frame in RAW, read from the headers alone."""
    sizes = []
    at = 0
    while at < len(raw):
        kind, length = struct.unpack_from(">cI", raw, at)
        sizes.append((kind, length))
        at += 5 + length
    assert at == len(raw)
    return sizes


def _kinds(events: list[Event]) -> list[str]:
    """The events with consecutive output chunks of one stream merged: ['s:started', 'o', 's:exit 0']."""
    kinds: list[str] = []
    for kind, value in events:
        if kind == "s" and str(value).startswith(("input waiting ", "input busy ")):
            continue  # the input sampler's: when they come depends on the timing of its looks
        name = kind if isinstance(value, bytes) else f"{kind}:{value}"  # output: its stream alone
        if name.startswith("s:started "):
            name = "s:started"
        if not kinds or kinds[-1] != name or kind == "s":
            kinds.append(name)
    return kinds


# ---- output and outcome --------------------------------------------------------------------------

WRITER = """
import sys
out = bytes(range(256)) * 12288  # 3 MiB
err = bytes(range(255, -1, -1)) * 4096  # 1 MiB
e = 0
for k in range(0, len(out), 100000):  # interleaved
    sys.stdout.buffer.write(out[k : k + 100000]); sys.stdout.flush()
    sys.stderr.buffer.write(err[e : e + 33000]); sys.stderr.flush()
    e += 33000
sys.stderr.buffer.write(err[e:]); sys.stderr.flush()
sys.exit(3)
"""


def test_streams_framed_apart_byte_exact(runs: list[Framed]) -> None:
    run = Framed([PYTHON, "-c", WRITER])
    runs.append(run)
    events = run.finish()
    assert bytes(run.stdout) == bytes(range(256)) * 12288
    assert bytes(run.stderr) == bytes(range(255, -1, -1)) * 4096
    assert run.records[0].startswith("started ")
    assert run.records[1:] == ["exit 3", "empty"]
    assert [e for e in events if e[0] == "eof"] in (
        [("eof", "stdout"), ("eof", "stderr")],
        [("eof", "stderr"), ("eof", "stdout")],
    )
    sizes = _frame_sizes(bytes(run.raw))
    assert max(length for kind, length in sizes if kind in (b"o", b"e")) <= 65536
    assert [kind for kind, length in sizes if length == 0] in ([b"o", b"e"], [b"e", b"o"])


@pytest.mark.parametrize(
    ("script", "outcome"), [("true", "exit 0"), ("exit 3", "exit 3"), ("kill -TERM $$", "signal 15")]
)
def test_outcome_is_the_observed_wait_status(runs: list[Framed], script: str, outcome: str) -> None:
    run = Framed([*SH, script])
    runs.append(run)
    run.finish()
    assert run.records[1:] == [outcome, "empty"]


def test_exec_failure(runs: list[Framed]) -> None:
    run = Framed(["/nonexistent/dsh-no-such-program"])
    runs.append(run)
    events = run.finish()
    assert run.records == ["execfail 2", "exit 127", "empty"]  # ENOENT
    assert sorted(str(v) for k, v in events if k == "eof") == ["stderr", "stdout"]
    assert run.stdout == run.stderr == b""


def test_output_before_exit_precedes_the_exit_record(runs: list[Framed]) -> None:
    for _ in range(10):
        run = Framed([*SH, "echo hi; exit 0"])
        runs.append(run)
        run.finish()
        kinds = _kinds(run.events)
        assert kinds.index("o") < kinds.index("s:exit 0"), kinds
        assert run.stdout == b"hi\n"


DELAYED_WRITER = """
import fcntl, os, sys, time
fcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 1 << 20)  # 200000 bytes fit: the write below never blocks
while not os.path.exists(sys.argv[1]):
    time.sleep(0.005)
os.write(1, b"x" * 200000)
"""


def test_everything_readable_at_exit_precedes_the_exit_record(runs: list[Framed], tmp_path: Path) -> None:
    # More than one read's worth sits in the pipe when the command's process ends: the supervisor,
    # stopped meanwhile, wakes with SIGCHLD and data at once, and must read all of it first.
    go = tmp_path / "go"
    run = Framed([PYTHON, "-c", DELAYED_WRITER, str(go)])
    runs.append(run)
    pid = run.started_pid()
    os.kill(run.process.pid, signal.SIGSTOP)
    try:
        go.touch()
        deadline = time.monotonic() + 5
        while _start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.005)  # until the command is a zombie
        assert _start_time(pid) is None
    finally:
        os.kill(run.process.pid, signal.SIGCONT)
    run.finish()
    exit_at = run.events.index(("s", "exit 0"))
    before = sum(len(v) for k, v in run.events[:exit_at] if k == "o")
    assert before == 200000, (before, _kinds(run.events))


SEND_STDIO = """
import socket, sys
print("before", flush=True)
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    socket.send_fds(s, [b"x"], [1, 2])
"""


def test_empty_does_not_wait_for_a_pipe_held_outside(runs: list[Framed], tmp_path: Path) -> None:
    # The command hands its stdout and stderr to a process outside its subtree (here: the test) and
    # exits. Nothing of the subtree is left, so the supervisor ends both streams itself.
    address = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(address)
        server.listen()
        server.settimeout(5)
        run = Framed([PYTHON, "-c", SEND_STDIO, address])
        runs.append(run)
        connection, _ = server.accept()
        with connection:
            _, fds, _, _ = socket.recv_fds(connection, 1, 2)
        try:
            run.finish()
            with pytest.raises(BrokenPipeError):
                os.write(fds[0], b"too late\n")  # the supervisor's read end is closed
        finally:
            for fd in fds:
                os.close(fd)
    assert run.stdout == b"before\n"
    assert _kinds(run.events)[-4:] in (
        ["s:exit 0", "eof:stdout", "eof:stderr", "s:empty"],
        ["s:exit 0", "eof:stderr", "eof:stdout", "s:empty"],
    ), run.events


def test_late_output_comes_between_exit_and_empty(runs: list[Framed]) -> None:
    run = Framed([*SH, "(sleep 0.2; echo late) & exit 0"])
    runs.append(run)
    run.finish()
    kinds = [kind for kind in _kinds(run.events) if not kind.startswith("s:supervisor ")]
    assert kinds[:2] == ["s:started", "s:exit 0"], kinds
    assert kinds.index("o") > 1
    assert kinds[-1] == "s:empty"
    assert run.stdout == b"late\n"


# ---- stdin ---------------------------------------------------------------------------------------


def test_stdin_frames_reach_the_command(runs: list[Framed]) -> None:
    data = bytes(range(256)) * 4096 + b"\0\0tail\0"  # 1 MiB and some, NULs included
    run = Framed(["cat"])
    runs.append(run)
    run.started_pid()
    for at in range(0, len(data), 50000):
        run.send(b"i", data[at : at + 50000])
    # Unknown types are skipped with their payload (which looks like a kill request here).
    run.send(b"x", encode_frame(b"K"))
    run.send(b"i", b"!")
    run.send(b"c")
    run.send(b"i", b"after close")  # dropped
    run.finish()
    assert bytes(run.stdout) == data + b"!"
    assert run.records[1:] == ["exit 0", "empty"]


def test_stdin_null_gives_the_command_dev_null_and_ignores_input_frames(runs: list[Framed]) -> None:
    """--stdin-null (version 6): a command that gets no input reads /dev/null, not an empty pipe (the
    contract's R-proc-stdin-empty); input frames have nothing to write to and are dropped."""
    # The sleep keeps the supervisor there to take the frame (it exits with the command: a write after
    # that is EPIPE, which a rehearsal saw).
    run = Framed(
        ["bash", "-c", 'readlink /proc/$$/fd/0; cat; echo "cat=$?"; sleep 2'], options=["--stdin-null"]
    )
    runs.append(run)
    run.started_pid()
    run.send(b"i", b"dropped\n")
    run.finish()
    assert bytes(run.stdout) == b"/dev/null\ncat=0\n"
    assert run.records[1:] == ["exit 0", "empty"]


def test_stdin_stays_open_without_a_close_frame(runs: list[Framed]) -> None:
    run = Framed(["cat"])
    runs.append(run)
    run.started_pid()
    run.send(b"i", b"one\n")
    run.read_until(lambda: run.stdout == b"one\n")
    run.read_for(0.3)
    assert run.records[1:] == [], "cat still waits for more"
    run.send(b"c")
    run.finish()
    assert run.records[1:] == ["exit 0", "empty"]


def test_stdin_closed_by_the_command_drops_the_queue(runs: list[Framed]) -> None:
    run = Framed([*SH, "exec 0<&-; sleep 0.2; echo done"])
    runs.append(run)
    run.started_pid()
    run.send(b"i", b"x" * 300000)
    run.finish()
    assert run.stdout == b"done\n"


def test_input_drained_counts_every_byte_written(runs: list[Framed]) -> None:
    run = Framed([*SH, "cat >/dev/null"])
    runs.append(run)
    run.started_pid()
    sizes = [1, 4095, 70000, 300000, 1 << 20, 17]
    for size in sizes:
        run.send(b"i", b"y" * size)
    total = sum(sizes)
    # stdin stays open: the count is what tells the harness that nothing waits unread in the supervisor.
    run.read_until(lambda: total in run.drained())
    counts = run.drained()
    assert counts == sorted(set(counts)), "cumulative, and only after progress"
    assert run.input_records == [f"input drained {n}" for n in counts]
    run.send(b"i", b"z" * 5)
    run.read_until(lambda: total + 5 in run.drained())
    run.send(b"c")
    run.finish()
    assert run.drained()[-1] == total + 5
    assert run.records[1:] == ["exit 0", "empty"]


def test_input_drained_waits_for_the_queue_to_empty(runs: list[Framed]) -> None:
    # The command reads nothing for a while: a pipe's worth goes in, the rest waits in the queue.
    run = Framed([*SH, "sleep 2; cat >/dev/null"])
    runs.append(run)
    run.started_pid()
    run.send(b"i", b"x" * 400000)
    run.read_for(0.5)
    # The frame reaches the queue in reads of 64 KiB, and the first ones fit into the pipe: the queue
    # was empty then. Never since: the pipe is full and the rest waits.
    before = run.drained()
    assert all(n <= 65536 for n in before), before
    run.read_until(lambda: 400000 in run.drained(), timeout=10)
    assert run.drained()[: len(before)] == before
    assert all(n == 400000 for n in run.drained()[len(before) :]), "one record once cat emptied the queue"
    run.send(b"c")
    run.finish()
    assert run.drained()[-1] == 400000


def test_input_broken_once_when_the_command_closed_its_stdin(runs: list[Framed]) -> None:
    run = Framed([*SH, "exec 0<&-; echo closed; sleep 1"])
    runs.append(run)
    run.started_pid()
    run.read_until(lambda: run.stdout == b"closed\n")
    run.send(b"i", b"x" * 1000)
    run.expect("input broken ")
    for _ in range(5):
        run.send(b"i", b"more")  # dropped: the command reads no stdin any more
    run.send(b"c")
    run.finish()
    assert run.input_records == ["input broken 32"]  # EPIPE, once; nothing was ever written
    assert run.records[1:] == ["exit 0", "empty"]


def test_input_broken_when_the_queue_cannot_grow(runs: list[Framed]) -> None:
    run = Framed([*SH, "sleep 30"])
    runs.append(run)
    run.started_pid()
    # The queue may grow by a few MiB at most (the command's process is spawned already: the limit
    # is the supervisor's alone), so that a command that never reads makes the growth fail.
    with open(f"/proc/{run.process.pid}/status") as status:
        vm = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
    resource.prlimit(run.process.pid, resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
    for _ in range(16):
        run.send(b"i", b"q" * (1 << 20))
    run.expect("input broken ", timeout=10)
    run.send(b"i", b"after")
    run.send(b"K")
    run.finish()
    # ENOMEM: no more stdin (never a stream with a hole), and no count after it.
    assert run.input_records[-1] == "input broken 12", run.input_records
    assert all(r.startswith("input drained ") for r in run.input_records[:-1]), run.input_records


# ---- kill requests and containment ---------------------------------------------------------------


def test_kill_frame_kills_every_escapee(runs: list[Framed], marker: str, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    run = Framed([*SH, ESCAPEES, "escapees", str(pids_file), PYTHON], marker=marker)
    runs.append(run)
    run.started_pid()
    run.expect("exit 0")  # the shell is done; its escapees live on
    pids = _wait_for_lines(pids_file, _escapee_count(), timeout=5)
    time.sleep(0.1)  # let the last ones reach their final exec
    starts = {pid: _start_time(pid) for pid in pids}
    assert _alive(starts) == pids
    run.send(b"K")
    assert int(run.expect("signalled ").split()[1]) >= len(pids)
    run.finish()
    # The escapees held the command's stdout and stderr: their EOF frames come with `empty`.
    assert _kinds(run.events)[-3:] in (
        ["eof:stdout", "eof:stderr", "s:empty"],
        ["eof:stderr", "eof:stdout", "s:empty"],
    )
    assert _alive(starts) == []
    assert _marked(marker) == []


def test_term_frame_then_kill_frame(runs: list[Framed], marker: str) -> None:
    script = (
        '( exec -a "$M-plain" sleep 600 & ); '
        '( trap "" TERM; exec -a "$M-trap" sleep 600 & ); '
        "sleep 0.1; exit 0"
    )
    run = Framed([*SH, script], marker=marker)
    runs.append(run)
    run.expect("exit 0")
    assert len(_marked(marker)) == 2
    run.send(b"T")
    assert run.expect("signalled ") == "signalled 2"
    deadline = time.monotonic() + 2
    while len(_marked(marker)) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_marked(marker)) == 1
    assert run.process.poll() is None, "the supervisor stays while a descendant lives"
    run.send(b"K")
    run.finish()
    assert run.records[-2:] == ["signalled 1", "empty"]
    assert _marked(marker) == []


def test_signals_still_work_in_frame_mode(runs: list[Framed], marker: str) -> None:
    run = Framed([*SH, 'exec -a "$M" sleep 600'], marker=marker)
    runs.append(run)
    run.started_pid()
    os.kill(run.process.pid, signal.SIGUSR2)
    run.finish()
    assert run.records[1:] == ["signalled 1", "signal 9", "empty"]
    assert _marked(marker) == []


@pytest.mark.parametrize("pipes", [False, True])
def test_input_eof_kills_everything(runs: list[Framed], marker: str, pipes: bool) -> None:
    script = '( exec -a "$M-leftover" sleep 600 & ); exec -a "$M" sleep 600'
    run = Framed([*SH, script], marker=marker, pipes=pipes)
    runs.append(run)
    run.started_pid()
    deadline = time.monotonic() + 2
    while len(_marked(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_marked(marker)) == 2
    run.close_input()
    run.finish()
    assert run.records[1:] == ["signalled 2", "signal 9", "empty"]
    assert _marked(marker) == []


def test_an_oversized_request_counts_as_eof(runs: list[Framed], marker: str) -> None:
    run = Framed([*SH, 'exec -a "$M" sleep 600'], marker=marker)
    runs.append(run)
    run.started_pid()
    run.send_raw(b"i" + struct.pack(">I", (1 << 20) + 1))
    run.finish()
    assert run.records[1:] == ["signalled 1", "signal 9", "empty"]
    assert _marked(marker) == []


def test_harness_gone_altogether(marker: str) -> None:
    # Nobody reads fd 1 any more either: the supervisor kills everything and exits, writing nothing.
    run = Framed([*SH, '( exec -a "$M-leftover" sleep 600 & ); exec -a "$M" yes'], marker=marker)
    try:
        run.started_pid()
        run.close_all()
        assert run.process.wait(5) == 0
        assert _marked(marker) == []
    finally:
        run.close()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return sum(int(field) for field in stat[stat.rindex(")") + 2 :].split()[11:13])


def test_backpressure_bounds_memory_and_kill_still_works(runs: list[Framed], marker: str) -> None:
    run = Framed([*SH, 'exec -a "$M" yes'], marker=marker)
    runs.append(run)
    pid = run.started_pid()
    supervisor = run.process.pid
    rss_start = _rss_kib(supervisor)

    def state() -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    # Nobody reads: the supervisor's buffer and the socket fill, then `yes` blocks on its pipe.
    deadline = time.monotonic() + 3
    while state() != "S" and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    rss_full, ticks = _rss_kib(supervisor), _cpu_ticks(supervisor)
    time.sleep(0.4)
    assert _cpu_ticks(supervisor) - ticks <= 3, "the supervisor spins while its output is blocked"
    rss_later = _rss_kib(supervisor)
    assert max(rss_full, rss_later) - rss_start < 2048, (rss_start, rss_full, rss_later)
    assert state() == "S", "yes blocks on its full pipe"
    run.send(b"K")  # still served while fd 1 is blocked
    deadline = time.monotonic() + 2
    while _start_time(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _start_time(pid) is None, "the kill request was not served"
    run.finish()
    assert run.records[1:] == ["signalled 1", "signal 9", "empty"]
    assert set(bytes(run.stdout)) == {ord("y"), ord("\n")}
    assert _marked(marker) == []


# ---- the channel cannot be forged ----------------------------------------------------------------


def test_output_that_looks_like_a_record_is_only_output(runs: list[Framed]) -> None:
    forged = b"s\0\0\0\x06exit 0s\0\0\0\x05empty"
    run = Framed([*SH, r"printf 's\0\0\0\006exit 0s\0\0\0\005empty'; printf 'o\0\0\0\0' >&2; exit 7"])
    runs.append(run)
    run.finish()
    assert run.stdout == forged
    assert run.stderr == b"o\0\0\0\0"
    assert run.records[1:] == ["exit 7", "empty"]


FORGE = r"""
printf 's\0\0\0\005empty' 2>/dev/null >/proc/$PPID/fd/1 && echo "reopened fd 1" >&2
{ exec 3</proc/$PPID/fd/0; } 2>/dev/null && echo "reopened fd 0" >&2
ls /proc/$PPID/fd >/dev/null 2>&1 && echo "listed the fds" >&2
exit 7
"""


def _forge(runs: list[Framed], binary: str, user: int | None) -> Framed:
    # Pipes, not a socket: a socket cannot be reopened through /proc at all (ENXIO); a pipe can, by
    # whoever may ptrace its holder.
    run = Framed([*SH, FORGE], binary=(binary,), user=user, pipes=True)
    runs.append(run)
    run.finish()
    return run


def test_command_cannot_reach_the_supervisors_stream(runs: list[Framed]) -> None:
    # PR_SET_DUMPABLE 0 closes /proc/SUPERVISOR/fd to same-user processes; root (CAP_SYS_PTRACE) is
    # exempt, so when root the supervisor and its command run as nobody.
    user = 65534 if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o755)
        binary = Path(directory) / "dsh-supervise"
        shutil.copy2(SUPERVISE, binary)
        binary.chmod(0o755)
        run = _forge(runs, str(binary), user)
    assert run.stderr == b"", run.stderr
    assert run.records[1:] == ["exit 7", "empty"]
    assert _kinds(run.events)[-1] == "s:empty" and run.records.count("empty") == 1


def _has_cap_sys_ptrace() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 19 & 1)
    return False


@pytest.mark.skipif(
    not _has_cap_sys_ptrace(), reason="the control case needs CAP_SYS_PTRACE (root on a host)"
)
def test_forgery_probe_works_where_nothing_protects(runs: list[Framed]) -> None:
    # The control for the test above: with CAP_SYS_PTRACE the probe reaches the supervisor's pipes.
    # If this stops forging, the test above proves nothing.
    run = _forge(runs, SUPERVISE, None)
    assert b"reopened fd 1" in run.stderr and b"reopened fd 0" in run.stderr, run.stderr
    assert run.records.count("empty") == 2, run.events  # one forged, one real


# ---- the side pipe ('P', 'G') ---------------------------------------------------------------------

needs_ptrace = pytest.mark.skipif(
    not _has_cap_sys_ptrace(),
    reason="opening a non-dumpable supervisor's fd through /proc needs CAP_SYS_PTRACE (root on a host)",
)


def _open_side(run: Framed) -> tuple[int, int]:
    """Asks for the side pipe and opens its read end through /proc, checking the inode: (fd, inode)."""
    run.send(b"P")
    words = run.expect("pipe ").split()
    fd = os.open(f"/proc/{run.process.pid}/fd/{words[1]}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    assert os.fstat(fd).st_ino == int(words[2])
    return fd, int(words[2])


def _read_side(run: Framed, fd: int, done: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Feeds the side pipe into RUN's decoder until DONE() holds or it reaches EOF (then True)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timeout on the side pipe: {run.events[-5:]}"
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return True
            run.raw += chunk
            run._decoder.feed(chunk)
    return False


@needs_ptrace
def test_side_pipe_takes_every_frame_after_switch(runs: list[Framed]) -> None:
    run = Framed([*SH, f"read -r go; exec {PYTHON} -c '{WRITER}'"])
    runs.append(run)
    run.started_pid()
    side, _ = _open_side(run)
    try:
        run.send(b"G", bytes(range(16)))
        run.expect("switch")
        before = len(run.events)
        run.send(b"i", b"go\n")
        assert _read_side(run, side, lambda: False)  # to EOF: the supervisor exited
        run.read_until(lambda: run.at_eof)  # fd 1 ends too, with nothing after `switch`
        assert run.process.wait(5) == 0
    finally:
        os.close(side)
    assert run.events[before] == ("s", "nonce " + bytes(range(16)).hex())
    assert bytes(run.stdout) == bytes(range(256)) * 12288
    assert bytes(run.stderr) == bytes(range(255, -1, -1)) * 4096
    assert run.records[-2:] == ["exit 3", "empty"]
    assert not run._decoder.mid_frame


@needs_ptrace
def test_side_pipe_output_left_at_exit_arrives_whole(runs: list[Framed]) -> None:
    # After the switch the command's pipes hold 1 MiB: it can end with much output still in them,
    # which the supervisor reads after the exit record. Once a flush left its buffer empty, it used
    # to wait in poll with nothing to wait for (the 2026-12-02 stall: the output's end never came).
    size = 2_500_000
    for _ in range(15):
        run = Framed([*SH, f"read -r go; head -c {size} /dev/zero"])
        runs.append(run)
        run.started_pid()
        side, _ = _open_side(run)
        try:
            run.send(b"G", b"n")
            run.expect("switch")
            run.send(b"i", b"go\n")
            assert _read_side(run, side, lambda: False, timeout=5)
        finally:
            os.close(side)
        assert len(run.stdout) == size and run.records[-1] == "empty", run.records
        assert run.process.wait(5) == 0


@needs_ptrace
def test_side_pipe_offered_but_not_taken_changes_nothing(runs: list[Framed]) -> None:
    run = Framed([*SH, f"read -r go; exec {PYTHON} -c '{WRITER}'"])
    runs.append(run)
    run.started_pid()
    side, _ = _open_side(run)
    try:
        run.send(b"P")  # a second offer is ignored
        run.send(b"i", b"go\n")
        run.finish(10)
        assert select.select([side], [], [], 0)[0] == [side] and os.read(side, 100) == b""  # EOF, unused
    finally:
        os.close(side)
    assert bytes(run.stdout) == bytes(range(256)) * 12288
    assert [r.split()[0] for r in run.records] == ["started", "pipe", "exit", "empty"]


@needs_ptrace
def test_side_pipe_closed_means_the_harness_is_gone(runs: list[Framed], marker: str) -> None:
    run = Framed([*SH, '( exec -a "$M-leftover" sleep 600 & ); exec -a "$M" yes'], marker=marker)
    runs.append(run)
    run.started_pid()
    side, _ = _open_side(run)
    run.send(b"G", b"x")
    run.expect("switch")
    _read_side(run, side, lambda: len(run.stdout) > 1 << 20)
    os.close(side)  # the harness stops reading: the next write fails, and everything is killed
    assert run.process.wait(5) == 0
    assert _marked(marker) == []


# ---- --spec: a spare that waits for its command ----------------------------------------------------


def _spec(argv: Sequence[str], env: dict[str, str], capture_fd: int = -1) -> bytes:
    strings = [
        ".",
        str(capture_fd),
        str(len(argv)),
        *argv,
        *(f"{name}={value}" for name, value in env.items()),
    ]
    return b"\0".join(text.encode() for text in strings) + b"\0"


def test_spec_runs_the_command_it_is_sent(runs: list[Framed]) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    run.read_for(0.2)
    assert run.events == [] and run.process.poll() is None  # it waits, saying nothing
    run.send(b"T")  # frames before the command are skipped
    run.send(b"x", _spec([*SH, 'echo "$A $B"; cat; exit 5'], {"A": "a=1", "B": ""}))
    run.send(b"i", b"in\n")
    run.send(b"c")
    run.finish()
    assert bytes(run.stdout) == b"a=1 \nin\n"
    assert run.records[1:] == ["exit 5", "empty"]


def test_spec_values_reach_the_command_alone(runs: list[Framed]) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    secret = f"dshspecvalue{uuid.uuid4().hex}"
    run.send(b"x", _spec([*SH, "sleep 0.3; echo done"], {"DSH_SPEC_VALUE": secret}))
    pid = run.started_pid()
    proc = Path(f"/proc/{run.process.pid}")
    own = ((proc / "environ").read_bytes(), (proc / "cmdline").read_bytes())
    child = Path(f"/proc/{pid}/environ").read_bytes()
    run.finish()
    assert secret.encode() in child
    assert all(secret.encode() not in part for part in own)


def test_spec_spare_ends_quietly_at_eof(runs: list[Framed]) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    run.close_input()
    assert run.process.wait(5) == 0
    assert run.process.stderr is not None and run.process.stderr.read() == b""


@pytest.mark.parametrize(
    "payload",
    [b"no-nul", b"/\0-1\01\0true\0", b".\03\01\0true\0", b".\0-1\01\0true\0NOEQUALS\0"],
    ids=["unterminated", "directory", "status-fd", "env-entry"],
)
def test_spec_refuses_an_unsound_command_frame(runs: list[Framed], payload: bytes) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    run.send(b"x", payload)
    assert run.process.wait(5) == 125
    assert run.process.stderr is not None and b"--spec" in run.process.stderr.read()


@pytest.mark.parametrize("extra", [["--", "true"], ["--setenv", "A=1"]], ids=["program", "setenv"])
def test_spec_takes_no_program_nor_setenv_on_the_command_line(extra: list[str]) -> None:
    argv = [SUPERVISE, "--frame", "--spec", *extra]
    done = subprocess.run(argv, capture_output=True, timeout=5, check=False)
    assert done.returncode == 125 and b"--spec" in done.stderr


# ---- usage, version, architectures ---------------------------------------------------------------


@pytest.mark.parametrize("option", [["--status-fd", "FD"], ["--control-fd", "FD"], ["--die-with-parent"]])
def test_frame_excludes_the_version_1_channels(option: list[str]) -> None:
    read_end, write_end = os.pipe()
    try:
        args = [SUPERVISE, "--frame", *(str(write_end) if a == "FD" else a for a in option), "--", "true"]
        done = subprocess.run(
            args, pass_fds=[write_end], capture_output=True, text=True, timeout=5, check=False
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert done.returncode == 125
    assert done.stderr.startswith("dsh-supervise: --frame "), done.stderr


@pytest.mark.skipif(
    QEMU is None,
    reason="backend unavailable: qemu-aarch64-static is not installed (apt-get install qemu-user-static)",
)
def test_aarch64_round_trip_under_qemu(runs: list[Framed]) -> None:
    binary = supervisor_binary("aarch64")
    assert binary is not None, supervisor_problem("aarch64")
    assert QEMU is not None
    run = Framed(
        ["/bin/sh", "-c", "cat; echo err >&2; exit 3"],
        binary=(QEMU, str(binary)),
        options=["--allow-no-subreaper"],
    )
    runs.append(run)
    run.send(b"i", b"\0in\xff")
    run.send(b"c")
    run.finish(10)
    assert run.stdout == b"\0in\xff"
    assert run.stderr == b"err\n"
    assert run.records[0].startswith("started ")
    assert run.records[1:] == ["exit 3", "empty"]


def test_setenv_in_frame_mode(runs: list[Framed]) -> None:
    assignment = f"DSH_BASH_MARK=dshsetenv{uuid.uuid4().hex}"
    run = Framed([*SH, 'printf %s "$DSH_BASH_MARK"; sleep 5; true'], options=["--setenv", assignment])
    runs.append(run)
    child = run.started_pid()
    # Not until the command's bash printed: during an exec /proc/PID/environ reads empty.
    run.read_until(lambda: len(run.stdout) > 0)
    assert_set_for_the_command_alone(run.process.pid, child, assignment)
    run.send(b"K")
    run.finish()
    assert bytes(run.stdout) == assignment.split("=", 1)[1].encode()


# ---- terminals: --tty, the 'x' payload's terminal field, 'W' (protocol 5) -------------------------


def _child_running(pid: int, comm: str, timeout: float = 5.0) -> None:
    """Waits until PID has a child whose command name is COMM (it exec'd, so a signal reaches it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if any(Path(f"/proc/{child}/comm").read_text().strip() == comm for child in children):
                return
        time.sleep(0.01)
    pytest.fail(f"no {comm} child of {pid} within {timeout} s")


def _lines(data: bytearray) -> list[str]:
    """A terminal's output as lines (the terminal writes CR LF for LF)."""
    return bytes(data).decode().split("\r\n")


def test_tty_is_the_commands_controlling_terminal(runs: list[Framed]) -> None:
    script = "tty; stty size; : </dev/tty && echo ctty; echo err >&2; exit 4"
    run = Framed([*SH, script], options=["--tty", "24x80"])
    runs.append(run)
    run.finish()
    device, size, ctty, err, rest = _lines(run.stdout)
    assert device.startswith("/dev/pts/") and device[9:].isdigit(), device
    assert (size, ctty, err, rest) == ("24 80", "ctty", "err", "")
    assert run.stderr == b""
    assert run.records[1:] == ["exit 4", "empty"]
    # stderr is the terminal too: its stream ends at once, before the terminal's.
    assert [e for e in run.events if e[0] == "eof"] == [("eof", "stderr"), ("eof", "stdout")]


def test_tty_from_the_spec_payload(runs: list[Framed]) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    payload = _spec([*SH, 'stty size; echo "$A"'], {"A": "a=1"})
    # The terminal field is the third string, after the directory and the status fd.
    run.send(b"x", payload.replace(b".\0-1\0", b".\0-1\x0030 100\0", 1))
    run.finish()
    assert _lines(run.stdout) == ["30 100", "a=1", ""]
    assert run.records[1:] == ["exit 0", "empty"]


def test_spec_terminal_field_dash_means_pipes(runs: list[Framed]) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    run.send(b"x", _spec([*SH, "echo err >&2; tty"], {}).replace(b".\0-1\0", b".\0-1\0-\0", 1))
    run.finish()
    assert run.stdout == b"not a tty\n" and run.stderr == b"err\n"
    assert run.records[1:] == ["exit 1", "empty"]


@pytest.mark.parametrize("field", [b"", b"30x100", b"0 80", b"24 65536", b"24 80 1", b" 24 80", b"a b"])
def test_spec_refuses_an_unsound_terminal_field(runs: list[Framed], field: bytes) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    run.send(b"x", b".\0-1\0" + field + b"\x001\0true\0")
    assert run.process.wait(5) == 125
    assert run.process.stderr is not None and b"terminal field" in run.process.stderr.read()


@pytest.mark.parametrize(
    "args",
    [
        ["--frame", "--tty", "24"],
        ["--frame", "--tty", "0x80"],
        ["--frame", "--tty", "24x80x1"],
        ["--frame", "--tty", "24x70000"],
        ["--frame", "--spec", "--tty", "24x80"],
        ["--tty", "24x80"],
        ["--frame", "--tty", "24x80", "--stdin-null"],
        ["--stdin-null"],
    ],
)
def test_tty_option_usage_errors(args: list[str]) -> None:
    done = subprocess.run(
        [SUPERVISE, *args, *([] if "--spec" in args else ["--", "true"])],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=5,
        check=False,
    )
    assert done.returncode == 125 and b"--tty" in done.stderr, done.stderr


def test_tty_ctrl_c_interrupts_the_foreground_job(runs: list[Framed]) -> None:
    run = Framed([*SH, "trap 'echo INT' INT; sleep 30; echo after"], options=["--tty", "24x80"])
    runs.append(run)
    _child_running(run.started_pid(), "sleep")
    run.send(b"i", b"\x03")
    run.finish()
    assert _lines(run.stdout)[-3:] == ["^CINT", "after", ""], run.stdout
    assert run.records[1:] == ["exit 0", "empty"]


def test_tty_resize_frame_sends_sigwinch(runs: list[Framed]) -> None:
    script = "stty size; trap 'stty size' WINCH; echo ready; sleep 30 & wait; wait"
    run = Framed([*SH, script], options=["--tty", "24x80"])
    runs.append(run)
    run.read_until(lambda: b"ready\r\n" in run.stdout)
    run.send(b"W", b"40 132")
    run.read_until(lambda: b"40 132\r\n" in run.stdout)
    assert _lines(run.stdout)[:3] == ["24 80", "ready", "40 132"]
    run.send(b"K")
    run.finish()


@pytest.mark.parametrize("payload", [b"", b"40", b"40x132", b"0 80", b"40 132 ", b"4" * 40 + b" 1"])
def test_tty_unsound_resize_changes_nothing(runs: list[Framed], payload: bytes) -> None:
    run = Framed([*SH, "read x; stty size"], options=["--tty", "24x80"])
    runs.append(run)
    run.send(b"W", payload)
    run.send(b"i", b"go\n")
    run.finish()
    assert _lines(run.stdout) == ["go", "24 80", ""]
    assert ("s", "warning resize 22") in run.events


def test_resize_frame_without_a_terminal_is_ignored(runs: list[Framed]) -> None:
    run = Framed([*SH, "cat"])
    runs.append(run)
    run.send(b"W", b"40 132")
    run.send(b"W", b"junk")
    run.send(b"i", b"in")
    run.send(b"c")
    run.finish()
    assert run.stdout == b"in"
    assert not [r for kind, r in run.events if kind == "s" and str(r).startswith("warning ")]


def test_tty_close_frame_leaves_the_terminal_open(runs: list[Framed]) -> None:
    run = Framed([*SH, 'read x; echo "got $x"'], options=["--tty", "24x80"])
    runs.append(run)
    run.started_pid()
    run.send(b"c")
    run.send(b"i", b"hi\n")
    run.finish()
    assert _lines(run.stdout) == ["hi", "got hi", ""]  # the terminal's echo, then the command's


def test_tty_output_ends_when_the_command_exits(runs: list[Framed]) -> None:
    # More than the terminal's buffers hold when the command exits: every byte still arrives, then EOF.
    run = Framed([*SH, "head -c 300000 /dev/zero | tr '\\0' a; exit 3"], options=["--tty", "24x80"])
    runs.append(run)
    run.finish(10)
    assert bytes(run.stdout) == b"a" * 300000
    assert run.records[1:] == ["exit 3", "empty"]
    # The terminal's EOF (EIO: no slave fd left) may be read before or after the exit is reaped.
    kinds = _kinds(run.events)
    assert kinds[-1] == "s:empty" and kinds.count("eof:stdout") == 1
    assert "o" not in kinds[kinds.index("eof:stdout") :]


def test_tty_kill_leaves_nothing(runs: list[Framed], marker: str) -> None:
    # A process that left the terminal's session still holds the slave (its stdio): the terminal's EOF
    # waits for it, and the kill finds it through the subreaper all the same.
    # (HUP ignored: the shell's exit hangs up its foreground group, which holds the subshell until
    # setsid ran.)
    script = '( trap "" HUP; setsid "$BASH" -c \'exec -a "$M-setsid" sleep 300\' & ); echo ok'
    run = Framed([*SH, script], options=["--tty", "24x80"], marker=marker)
    runs.append(run)
    run.expect("exit 0")
    deadline = time.monotonic() + 5
    while not _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_marked(marker)) == 1
    run.read_for(0.2)
    assert run.process.poll() is None and ("eof", "stdout") not in run.events
    run.send(b"K")
    run.finish()
    assert run.records[1:] == ["exit 0", "signalled 1", "empty"]
    assert _marked(marker) == []


FILL_TERMINAL = """
import os, sys, time
os.set_blocking(1, False)
total = stalls = 0
while stalls < 10:  # full for half a second: the supervisor reads no more (its buffer is full)
    try:
        total += os.write(1, b"a" * 4096)
        stalls = 0
    except BlockingIOError:
        stalls += 1
        time.sleep(0.05)
with open(sys.argv[1], "w") as f:
    f.write(str(total))
"""


@pytest.mark.parametrize("attempt", range(3))  # the terminal is not always that full when it exits
def test_tty_output_left_in_the_terminal_at_exit_arrives_whole(
    runs: list[Framed], tmp_path: Path, attempt: int
) -> None:
    # The command fills everything between it and a harness that does not read, then exits: the
    # terminal holds more than the 4 KiB FIONREAD counts, and all of it still comes before EOF.
    written = tmp_path / "written"
    run = Framed([PYTHON, "-c", FILL_TERMINAL, str(written)], options=["--tty", "24x80"], pipes=True)
    runs.append(run)
    deadline = time.monotonic() + 10
    while not written.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    run.finish(10)
    total = int(written.read_text())
    assert len(run.stdout) == total and bytes(run.stdout) == b"a" * total


def _can_unshare() -> bool:
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=5, check=False)
    return shutil.which("unshare") is not None and done.returncode == 0


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare(1) is not installed")
def test_tty_that_cannot_be_made_is_a_ptyfail_record(runs: list[Framed]) -> None:
    if not _can_unshare():
        pytest.skip("user namespaces are not allowed here (unshare -r fails)")
    # /dev/ptmx is /dev/null in a mount namespace of the supervisor's own: no terminal can be made.
    hide_ptmx = (
        "unshare",
        "-rm",
        BASH,
        "-c",
        'mount --bind /dev/null /dev/ptmx && exec "$0" "$@"',
        SUPERVISE,
    )
    run = Framed(["true"], options=["--tty", "24x80"], binary=hide_ptmx)
    runs.append(run)
    run.finish()
    failure, *rest = run.records
    assert failure.startswith("ptyfail ") and int(failure.split()[1]) > 0, failure
    assert rest == ["exit 127", "empty"]
    assert sorted(e for e in run.events if e[0] == "eof") == [("eof", "stderr"), ("eof", "stdout")]


@pytest.mark.skipif(
    QEMU is None,
    reason="backend unavailable: qemu-aarch64-static is not installed (apt-get install qemu-user-static)",
)
def test_aarch64_terminal_under_qemu(runs: list[Framed]) -> None:
    binary = supervisor_binary("aarch64")
    assert binary is not None, supervisor_problem("aarch64")
    assert QEMU is not None
    run = Framed(
        ["/bin/sh", "-c", 'read x; echo "got $x"; stty size; tty >/dev/null && echo tty'],
        binary=(QEMU, str(binary)),
        options=["--allow-no-subreaper", "--tty", "30x100"],
    )
    runs.append(run)
    run.send(b"W", b"31 101")
    run.send(b"i", b"in\n")
    run.finish(10)
    assert _lines(run.stdout) == ["in", "got in", "31 101", "tty", ""]
    assert run.records[1:] == ["exit 0", "empty"]


def test_tty_exec_failure(runs: list[Framed]) -> None:
    run = Framed(["/nonexistent/dsh-program"], options=["--tty", "24x80"])
    runs.append(run)
    run.finish()
    assert run.records == ["execfail 2", "exit 127", "empty"]
    assert run.stdout == b"" and sorted(e for e in run.events if e[0] == "eof") == [
        ("eof", "stderr"),
        ("eof", "stdout"),
    ]


# ---- a reader waiting for input: `input waiting N` / `input busy N` ---------------------------------


def test_reader_of_the_stdin_pipe_is_seen_waiting(runs: list[Framed]) -> None:
    run = Framed([*SH, 'read -r x; echo "got $x"; sleep 1; read -r y; echo "got $y"'])
    runs.append(run)
    run.started_pid()
    run.expect("input waiting ", timeout=1.5)
    run.read_for(0.5)  # edge-triggered: a wait that goes on is said once
    assert run.waiting_records == ["input busy 0", "input waiting 0"]
    run.send(b"i", b"a\n")
    run.expect("input busy ", timeout=1.5)  # it reads, then sleeps
    run.read_until(lambda: run.waiting_records[-1:] == ["input waiting 2"], 3.0)  # and reads again
    run.send(b"i", b"b\n")
    run.finish()
    assert run.stdout == b"got a\ngot b\n"
    assert run.waiting_records[:4] == ["input busy 0", "input waiting 0", "input busy 2", "input waiting 2"]


@pytest.mark.parametrize(
    "script",
    [
        "sleep 3",
        "sleep 3 | cat",  # cat reads, but another pipe
        "read x </dev/null; sleep 3",
    ],
)
def test_no_reader_of_the_input_is_never_waiting(runs: list[Framed], script: str) -> None:
    run = Framed([*SH, script])
    runs.append(run)
    run.started_pid()
    run.read_for(1.2)
    assert run.waiting_records == ["input busy 0"]


@pytest.mark.skipif(shutil.which("python3") is None, reason="no python3")
def test_python_input_is_seen_waiting(runs: list[Framed]) -> None:
    run = Framed(["python3", "-c", "print(input())"])
    runs.append(run)
    run.expect("input waiting 0", timeout=2.0)
    run.send(b"i", b"hello\n")
    run.finish()
    assert run.stdout == b"hello\n"


def test_closed_input_is_not_sampled(runs: list[Framed]) -> None:
    # The reader ends its wait at the close (EOF), but the input is closed: no `input busy` follows.
    run = Framed([*SH, "read -r x; sleep 1"])
    runs.append(run)
    run.expect("input waiting 0", timeout=2.0)
    run.send(b"c")
    run.finish()
    assert run.waiting_records == ["input busy 0", "input waiting 0"]


def test_reader_of_the_terminal_is_seen_waiting(runs: list[Framed]) -> None:
    run = Framed([*SH, 'read -r x; echo "got $x"'], options=["--tty", "24x80"])
    runs.append(run)
    run.expect("input waiting 0", timeout=2.0)
    assert run.waiting_records == ["input busy 0", "input waiting 0"]
    run.send(b"i", b"a\n")
    run.finish()
    assert "got a" in _lines(run.stdout)


def test_reader_of_dev_tty_is_seen_waiting(runs: list[Framed]) -> None:
    # Its stdin is not the terminal any more; the fd it reads was opened anew on /dev/tty.
    run = Framed(
        [*SH, 'exec </dev/null; read -r -u 3 x 3</dev/tty; echo "got $x"'], options=["--tty", "24x80"]
    )
    runs.append(run)
    run.expect("input waiting 0", timeout=2.0)
    run.send(b"i", b"a\n")
    run.finish()
    assert "got a" in _lines(run.stdout)


def test_terminal_without_a_reader_is_not_waiting(runs: list[Framed]) -> None:
    run = Framed([*SH, "sleep 3"], options=["--tty", "24x80"])
    runs.append(run)
    run.started_pid()
    run.read_for(1.2)
    assert run.waiting_records == ["input busy 0"]


class _PipedCommand(FramedCommand):
    """A FramedCommand over a real supervisor's stdin and stdout pipes (as a transport relays them)."""

    def __init__(self, launch: Launch, process: subprocess.Popen[bytes]) -> None:
        super().__init__(launch, fallback=_NoFallback(), registry=set(), where="in a test")
        self._process = process

    async def pump_output(self) -> None:
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        while data := await anyio.to_thread.run_sync(os.read, fd, 1 << 16, abandon_on_cancel=True):
            self.feed(data)
        self.stream_ended()

    async def _send_frame(self, frame: bytes, *, urgent: bool) -> bool:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(frame)
            self._process.stdin.flush()
        except BrokenPipeError:
            return False  # the supervisor is done (the command may end before the close frame)
        return True

    async def _lost(self) -> BashInfrastructureError:
        return BashInfrastructureError("the test's supervisor went away")


class _NoFallback:
    async def signal_all(self, sig: int) -> None:
        raise AssertionError("the supervisor's stream is there: no fallback")

    async def remaining(self) -> list[str]:
        raise AssertionError("the supervisor's stream is there: no fallback")


def _no_spill() -> SpillFile:
    raise AssertionError("the test's output is small: nothing spills")


def _small_streams() -> list[OutputStream]:
    """A command's stdout and stderr, kept in memory (1 MiB each), never spilled."""
    return [
        OutputStream(name, max_bytes=1 << 20, max_spill_bytes=0, budget=SpillBudget(0), open_spill=_no_spill)
        for name in ("stdout", "stderr")
    ]


def test_framed_command_samples_from_the_records() -> None:
    streams = _small_streams()
    script = 'read -r x; echo "$x"; read -r y; echo "$y"'
    spec = BashExecSpec(
        command=script, workdir="/", timeout_ms=10_000, owner=None, user=None, open_stdin=True
    )
    launch = Launch(spec, {}, "dshtestmark", streams[0], streams[1], background=True)
    process = subprocess.Popen(
        [SUPERVISE, "--frame", "--", *SH, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    command = _PipedCommand(launch, process)

    async def until_waiting() -> None:
        with anyio.fail_after(5):
            while not await command.sample_input_waiting():  # noqa: ASYNC110 (the executor polls so)
                await anyio.sleep(0.05)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            # No record yet: this supervisor may be one that cannot tell.
            assert await command.sample_input_waiting() is None
            tg.start_soon(command.pump_output)
            await until_waiting()
            await command.send_input(b"a\n")
            # The last record (`input waiting 0`) is older than this write: it counts for nothing.
            assert await command.sample_input_waiting() is False
            await until_waiting()  # `input waiting 2`: the second read
            await command.send_input(b"b\n")
            await command.end_input()
            assert (await command.wait()).code == 0

    try:
        anyio.run(main)
    finally:
        process.kill()
        process.wait()
    assert streams[0].collected().data == b"a\nb\n"


class _FedCommand(FramedCommand):
    """A FramedCommand fed by the test itself: no supervisor behind it."""

    def __init__(self) -> None:
        streams = _small_streams()
        spec = BashExecSpec(command="true", workdir="/", timeout_ms=10_000, owner=None, user=None)
        launch = Launch(spec, {}, "dshtestmark", streams[0], streams[1], background=False)
        super().__init__(launch, fallback=_NoFallback(), registry=set(), where="in a test")
        self.streams = streams

    async def pump_output(self) -> None:
        raise AssertionError("the test feeds it")

    async def _send_frame(self, frame: bytes, *, urgent: bool) -> bool:
        return False

    async def _lost(self) -> BashInfrastructureError:
        return BashInfrastructureError("the test's stream ended")


def test_a_stream_of_text_and_no_frame_is_reported_as_such(caplog: pytest.LogCaptureFixture) -> None:
    # A container engine that cannot start the exec (an unknown user) writes why on the exec's stream.
    caplog.set_level(logging.INFO, logger="dsh_bash")
    command = _FedCommand()
    command.feed(b"unable to find user nobody2: ")
    command.feed(b"no matching entries in passwd file\r\n")
    command.feed(encode_frame(b"o", b"never read"))
    command.stream_ended()
    said = command.unframed_output
    assert said is not None and said.startswith(
        "unable to find user nobody2: no matching entries in passwd file\r\n"
    ), said
    assert command.streams[0].collected().data == b""
    assert [r.levelno for r in caplog.records] == [logging.INFO], caplog.records


def test_a_frame_then_garbage_is_a_broken_stream(caplog: pytest.LogCaptureFixture) -> None:
    command = _FedCommand()
    command.feed(encode_frame(b"o", b"hi") + b"unable to find user")
    command.feed(encode_frame(b"o", b" there"))
    assert command.unframed_output is None
    assert command.streams[0].collected().data == b"hi"
    assert any(
        r.levelno == logging.WARNING and "broke its framing" in r.getMessage() for r in caplog.records
    ), caplog.records


def test_a_reader_that_reads_again_at_once_waits_anew(runs: list[Framed]) -> None:
    # It takes the line and waits again within one look: the count says it is a new wait.
    run = Framed([*SH, 'while read -r x; do echo "$x"; done'])
    runs.append(run)
    run.expect("input waiting 0", timeout=2.0)
    run.send(b"i", b"a\n")
    run.expect("input waiting 2", timeout=2.0)
    run.send(b"i", b"bc\n")
    run.expect("input waiting 5", timeout=2.0)
    run.send(b"c")
    run.finish()
    assert run.stdout == b"a\nbc\n"


def test_the_supervisor_names_itself_before_the_command_runs(runs: list[Framed]) -> None:
    """`supervisor PID START` comes first, and out before the command runs: a command that stops its
    supervisor at once still lets the harness continue it (SIGCONT from outside,
    R-proc-kill-stopped-helper)."""
    run = Framed([*SH, "kill -STOP $PPID; exit 0"])
    runs.append(run)
    record = run.expect("supervisor ")
    pid, start = (int(word) for word in record.split()[1:])
    assert run.events[0] == ("s", record)

    def fields() -> list[str]:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2 :].split()

    assert fields()[19] == str(start)
    deadline = time.monotonic() + 5
    while fields()[0] != "T" and time.monotonic() < deadline:  # the command stopped it
        time.sleep(0.01)
    assert fields()[0] == "T"
    os.kill(pid, signal.SIGCONT)
    run.finish()
    assert [r for r in run.records if r.startswith(("exit ", "signal "))] == ["exit 0"]


# ---- --capture-fd (protocol 8): a session's state comes back on a stream of its own -------------------


def test_capture_fd_relays_what_the_command_writes_there_apart_from_its_output(runs: list[Framed]) -> None:
    """The command gets a pipe at fd 19 and nothing else more; what it writes there (more than a
    pipe holds, so the supervisor must read while the command writes) comes back as `v` frames,
    byte for byte, never in the stdout or stderr stream."""
    script = (
        "ls /proc/$$/fd; echo out; "
        "head -c 300000 /dev/zero | tr '\\0' v >&19; printf 'end\\0' >&19; echo err >&2"
    )
    run = Framed([*SH, script], options=["--capture-fd", "19"])
    runs.append(run)
    run.finish()
    assert bytes(run.capture) == b"v" * 300000 + b"end\0"
    fds = bytes(run.stdout).split(b"out\n")[0].split()
    assert sorted(fds) == sorted([b"0", b"1", b"2", b"19"])
    assert bytes(run.stderr) == b"err\n"
    assert run.records[1:] == ["exit 0", "empty"]


def test_without_capture_fd_the_command_gets_no_such_descriptor(runs: list[Framed]) -> None:
    run = Framed([*SH, "echo >&19 && echo open || echo closed"])
    runs.append(run)
    run.finish()
    assert bytes(run.stdout) == b"closed\n" and bytes(run.capture) == b""


def test_spec_names_the_capture_fd_in_its_second_string(runs: list[Framed]) -> None:
    run = Framed([], options=["--spec"])
    runs.append(run)
    run.send(b"x", _spec([*SH, "echo state >&42; echo out"], {}, capture_fd=42))
    run.finish()
    assert bytes(run.capture) == b"state\n" and bytes(run.stdout) == b"out\n"


@pytest.mark.parametrize("value", ["2", "1024", "x"])
def test_capture_fd_refuses_a_number_outside_its_range(value: str) -> None:
    done = subprocess.run(
        [SUPERVISE, "--frame", "--capture-fd", value, "--", "true"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert done.returncode == 125 and "--capture-fd" in done.stderr
