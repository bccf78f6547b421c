"""dsh-supervise, the per-command subreaper (native/supervise.c), driven as a real binary.

Each test starts the binary with subprocess, gives it a status channel (a socketpair unless a test
says otherwise) and reads its status records. Processes that try to escape record their pids (and
/proc start times) in a file, and carry a unique marker on their command lines, so a test can tell
that none of them survives. Needs Linux and the binary built by native/build.py (bin/test builds it);
without it the module skips with "backend unavailable:", which CI turns into a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dsh_bash.supervisor._native import (
    ARCHITECTURES,
    PROTOCOL_VERSION,
    normalize_arch,
    supervisor_binary,
    supervisor_problem,
)

ROOT = Path(__file__).resolve().parent.parent
BINARY = supervisor_binary()
if BINARY is None:
    pytest.skip(f"backend unavailable: {supervisor_problem()}", allow_module_level=True)
SUPERVISE = str(BINARY)
PYTHON = sys.executable
BASH = shutil.which("bash") or "/bin/bash"


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), or None when PID is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _marked(marker: str) -> list[int]:
    """Live, non-zombie processes whose command line holds MARKER."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and _start_time(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found


class Supervised:
    """One dsh-supervise run: its process, its status records, its control pipe (if asked for)."""

    def __init__(
        self,
        command: Sequence[str] | Callable[[int, int], Sequence[str]],
        *,
        options: Sequence[str] = (),
        control: bool = False,
        pipe_status: bool = False,
        user: int | None = None,
        binary: Sequence[str] = (SUPERVISE,),
        stdout: int | None = subprocess.DEVNULL,
        marker: str | None = None,
    ) -> None:
        if pipe_status:
            read_end, write_end = os.pipe()
            self.reader_fd = read_end
            self._reader_sock: socket.socket | None = None
            child_status = write_end
        else:
            self._reader_sock, child_sock = socket.socketpair()
            self.reader_fd = self._reader_sock.fileno()
            child_status = child_sock.detach()
        args = [*binary, "--status-fd", str(child_status)]
        pass_fds = [child_status]
        self.control_fd: int | None = None
        if control:
            control_read, self.control_fd = os.pipe()
            args += ["--control-fd", str(control_read)]
            pass_fds.append(control_read)
        if callable(command):  # told the status fd's number and the harness's reader fd
            command = command(child_status, self.reader_fd)
        args += [*options, "--", *command]
        self.status_fd_number = child_status
        try:
            self.process = subprocess.Popen(
                args,
                pass_fds=pass_fds,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.PIPE,
                user=user,
                cwd="/",
                # Scripts name the marker as $M: on no command line but their victims'.
                env=None if marker is None else {**os.environ, "M": marker},
            )
        finally:
            for fd in pass_fds:
                os.close(fd)  # the harness keeps no writer: EOF means the supervisor is gone
        self._buffer = b""
        self.records: list[str] = []

    def next_record(self, timeout: float = 10.0) -> str | None:
        """The next status record (warnings skipped), or None at EOF; fails after TIMEOUT seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                record = line.decode()
                self.records.append(record)
                if record.startswith("warning "):
                    continue
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no status record within {timeout} s; so far: {self.records}")
            ready, _, _ = select.select([self.reader_fd], [], [], remaining)
            if ready:
                chunk = os.read(self.reader_fd, 4096)
                if not chunk:
                    if self._buffer:
                        pytest.fail(f"an unterminated record at EOF: {self._buffer!r}")
                    return None
                self._buffer += chunk

    def expect(self, prefix: str, timeout: float = 10.0) -> str:
        record = self.next_record(timeout)
        assert record is not None and record.startswith(prefix), (
            f"expected {prefix!r}, got {record!r}; records: {self.records}"
        )
        return record

    def started_pid(self) -> int:
        return int(self.expect("started ").split()[1])

    def finish(self, timeout: float = 10.0) -> list[str]:
        """Reads the records up to EOF, waits for the supervisor; returns every record."""
        while self.next_record(timeout) is not None:
            pass
        assert self.process.wait(timeout) == 0, self.process.stderr.read() if self.process.stderr else ""
        return self.records

    def close(self) -> None:
        if self.process.poll() is None:
            # Its subtree first (a test that failed half-way may leave a fork chain under it): a
            # SIGKILL of the supervisor alone would hand the chain to init, forking for ever.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGUSR2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        if self._reader_sock is not None:
            self._reader_sock.close()
        else:
            os.close(self.reader_fd)
        if self.control_fd is not None:
            os.close(self.control_fd)


@pytest.fixture
def runs() -> Iterator[list[Supervised]]:
    started: list[Supervised] = []
    yield started
    for run in started:
        run.close()


@pytest.fixture
def marker() -> Iterator[str]:
    mark = f"dshsupmark{uuid.uuid4().hex}"
    yield mark
    for pid in _marked(mark):  # never leave a survivor behind, whatever the test said
        with contextlib.suppress(ProcessLookupError):  # it may end between the scan and the kill
            os.kill(pid, signal.SIGKILL)


def _wait_for_lines(path: Path, count: int, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text().split()
            if len(lines) >= count:
                return [int(line) for line in lines]
        time.sleep(0.02)
    pytest.fail(f"{path}: fewer than {count} pids within {timeout} s")


def _alive(pids_with_starts: dict[int, str | None]) -> list[int]:
    return [pid for pid, start in pids_with_starts.items() if start is not None and _start_time(pid) == start]


# ---- outcome records -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "outcome"),
    [("exit 0", "exit 0"), ("exit 3", "exit 3"), ("kill -TERM $$", "signal 15")],
)
def test_outcome_records(runs: list[Supervised], script: str, outcome: str) -> None:
    run = Supervised([BASH, "--noprofile", "--norc", "-c", script])
    runs.append(run)
    records = run.finish()
    assert records[1:] == [outcome, "empty"]
    assert records[0].startswith("started ")


def test_exec_failure(runs: list[Supervised]) -> None:
    run = Supervised(["/nonexistent/dsh-no-such-program"])
    runs.append(run)
    assert run.finish() == [f"execfail {2}", "exit 127", "empty"]  # ENOENT


def test_exec_failure_not_executable(runs: list[Supervised], tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    run = Supervised([str(script)])
    runs.append(run)
    assert run.finish() == ["execfail 13", "exit 127", "empty"]  # EACCES


def test_started_pid_leads_its_session_and_group(runs: list[Supervised]) -> None:
    code = "import os; print(os.getpid(), os.getpgrp(), os.getsid(0), os.getppid())"
    run = Supervised([PYTHON, "-c", code], stdout=subprocess.PIPE)
    runs.append(run)
    pid = run.started_pid()
    assert run.next_record() == "exit 0"
    assert run.process.stdout is not None
    got_pid, pgid, sid, ppid = map(int, run.process.stdout.read().split())
    assert got_pid == pgid == sid == pid
    assert ppid == run.process.pid
    run.process.stdout.close()
    assert run.finish()[-1] == "empty"


def _output_of(command: Sequence[str]) -> str:
    run = Supervised(command, control=True, stdout=subprocess.PIPE)
    try:
        run.started_pid()
        assert run.process.stdout is not None
        output = run.process.stdout.read().decode()
        run.process.stdout.close()
        assert run.finish()[-2:] == ["exit 0", "empty"]
    finally:
        run.close()
    return output


def test_command_gets_default_signal_dispositions() -> None:
    # The supervisor ignores SIGINT, SIGTERM and more and blocks SIGCHLD, SIGUSR1 and SIGUSR2:
    # none of that may reach the command (grep is exec'd directly and changes none of it).
    output = _output_of(["grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"])
    assert "SigIgn:\t0000000000000000" in output, output
    assert "SigBlk:\t0000000000000000" in output, output


def test_command_inherits_no_private_fds() -> None:
    # Only stdin, stdout, stderr, and ls's own directory fd: no status, control, signalfd or /proc fd.
    fds = set(_output_of(["ls", "-1", "/proc/self/fd"]).split())
    assert fds <= {"0", "1", "2", "3"}, fds


def test_exit_is_reported_at_once_and_empty_after_the_last_descendant(runs: list[Supervised]) -> None:
    run = Supervised([BASH, "--noprofile", "--norc", "-c", "(sleep 1.0; true) & exit 0"])
    runs.append(run)
    begin = time.monotonic()
    run.started_pid()
    assert run.next_record() == "exit 0"
    exited = time.monotonic() - begin
    # No busy loop while it waits: a second of waiting costs it (almost) no CPU.
    stat = Path(f"/proc/{run.process.pid}/stat").read_text()
    ticks = sum(int(field) for field in stat[stat.rindex(")") + 2 :].split()[11:13])
    assert run.next_record() == "empty"
    emptied = time.monotonic() - begin
    assert exited < 0.8, exited
    assert emptied >= 0.9, emptied
    assert ticks <= 5, f"the supervisor used {ticks} clock ticks of CPU while waiting"
    assert run.finish() == [run.records[0], "exit 0", "empty"]


# ---- containment ---------------------------------------------------------------------------------

ESCAPEES = r"""
set -u
pids=$1 python=$2 marker=$M
# 1. A 5-deep fork chain that calls setsid in every generation (every generation stays alive).
"$python" - "$pids" "$marker" <<'EOF' &
import os, sys, time
pids, marker = sys.argv[1], sys.argv[2]
for generation in range(5):
    if os.fork() != 0:
        break
    os.setsid()
with open(pids, "a") as f:
    f.write(f"{os.getpid()}\n")
os.execvp("sleep", [f"{marker}-chain", "600"])
EOF
# 2. An orphan that drops its whole environment.
( env -i /bin/bash -c 'echo $$ >>"$1"; exec -a "$2-envi" sleep 600' envi "$pids" "$marker" & )
# 3. A non-dumpable process (prctl PR_SET_DUMPABLE 0: /proc/PID/environ is closed to others).
"$python" -c '
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
open(sys.argv[1], "a").write(f"{os.getpid()}\n")
time.sleep(600)
' "$pids" "$marker-nodump" &
# 4. A process that rewrites its argv and environment area in place (when perl is there).
if command -v perl >/dev/null; then
    ( setsid perl -e 'open(my $f, ">>", $ARGV[0]); print $f "$$\n"; close $f;
        $0 = "x" x 4096; sleep 600' "$pids" "$marker-perl" & )
fi
exit 0
"""


def _escapee_count() -> int:
    return 5 + 1 + 1 + (1 if shutil.which("perl") else 0)


def test_sigusr2_kills_every_escapee_after_exit(runs: list[Supervised], marker: str, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    run = Supervised(
        [BASH, "--noprofile", "--norc", "-c", ESCAPEES, "escapees", str(pids_file), PYTHON], marker=marker
    )
    runs.append(run)
    run.started_pid()
    assert run.next_record() == "exit 0"  # the direct child is done; its escapees live on
    pids = _wait_for_lines(pids_file, _escapee_count())
    time.sleep(0.2)  # let the last ones reach their final exec
    starts = {pid: _start_time(pid) for pid in pids}
    assert _alive(starts) == pids, "every escapee runs before the kill"
    os.kill(run.process.pid, signal.SIGUSR2)
    signalled = int(run.expect("signalled ").split()[1])
    assert signalled >= len(pids)
    assert run.next_record() == "empty"
    assert run.process.wait(10) == 0
    assert _alive(starts) == []
    assert _marked(marker) == []


def _grows(path: Path, seconds: float) -> bool:
    before = path.stat().st_size if path.exists() else 0
    time.sleep(seconds)
    return (path.stat().st_size if path.exists() else 0) > before


def test_sigkill_passes_outrun_a_fork_chain(runs: list[Supervised], tmp_path: Path) -> None:
    # Every generation forks and exits at once: the live pid keeps changing, and each new process
    # is an orphan the supervisor adopts. Repeated kill passes must still catch up. Each generation
    # appends its pid to a file: the chain is dead once the file stops growing.
    beats = tmp_path / "beats"
    runner = (
        "import os, sys\n"
        "while True:\n"
        "    if os.fork() != 0:\n"
        "        os._exit(0)\n"
        "    with open(sys.argv[1], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
    )
    script = f'"{PYTHON}" -c "$1" "$2" & sleep 0.3; exit 0'
    run = Supervised([BASH, "--noprofile", "--norc", "-c", script, "x", runner, str(beats)])
    runs.append(run)
    run.started_pid()
    assert run.next_record() == "exit 0"
    assert _grows(beats, 0.2), "the fork chain runs"
    os.kill(run.process.pid, signal.SIGUSR2)
    run.expect("signalled ")
    assert run.next_record(15) == "empty"
    assert run.process.wait(10) == 0
    generations = len(beats.read_text().split())
    assert not _grows(beats, 0.5), f"the fork chain lives on after {generations} generations"


def test_sigusr1_terminates_but_a_trapping_process_survives_until_sigusr2(
    runs: list[Supervised], marker: str
) -> None:
    script = (
        '( exec -a "$M-plain" sleep 600 & ); '
        '( trap "" TERM; exec -a "$M-trap" sleep 600 & ); '
        "sleep 0.3; exit 0"
    )
    run = Supervised([BASH, "--noprofile", "--norc", "-c", script], marker=marker)
    runs.append(run)
    run.started_pid()
    assert run.next_record() == "exit 0"
    assert len(_marked(marker)) == 2
    os.kill(run.process.pid, signal.SIGUSR1)
    assert run.expect("signalled ") == "signalled 2"
    deadline = time.monotonic() + 5
    while len(_marked(marker)) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    survivors = _marked(marker)
    assert len(survivors) == 1
    assert f"{marker}-trap".encode() in Path(f"/proc/{survivors[0]}/cmdline").read_bytes()
    time.sleep(0.2)
    assert run.process.poll() is None, "the supervisor stays while a descendant lives"
    os.kill(run.process.pid, signal.SIGUSR2)
    assert run.expect("signalled ") == "signalled 1"
    assert run.next_record() == "empty"
    assert run.process.wait(10) == 0
    assert _marked(marker) == []


@pytest.mark.parametrize("grace_ms", [None, 300])
def test_grace_ms_turns_a_sigterm_request_into_the_whole_sequence(
    runs: list[Supervised], marker: str, grace_ms: int | None
) -> None:
    """--grace-ms: a SIGTERM request alone is followed by SIGKILL once the grace is over, by the
    supervisor's own clock (an SSH harness's SIGKILL request may come seconds late on a loaded host);
    without it, a SIGTERM-proof member lives until SIGKILL is asked for."""
    script = '( trap "" TERM; exec -a "$M-trap" sleep 600 & ); sleep 0.3; exit 0'
    options = [] if grace_ms is None else ["--grace-ms", str(grace_ms)]
    run = Supervised([BASH, "--noprofile", "--norc", "-c", script], options=options, marker=marker)
    runs.append(run)
    run.started_pid()
    assert run.next_record() == "exit 0"
    os.kill(run.process.pid, signal.SIGUSR1)
    asked = time.monotonic()
    assert run.expect("signalled ") == "signalled 1"
    if grace_ms is None:
        time.sleep(1.0)
        assert len(_marked(marker)) == 1, "SIGKILL came though nobody asked for it"
        os.kill(run.process.pid, signal.SIGUSR2)
    assert run.expect("signalled ") == "signalled 1"
    if grace_ms is not None:
        # Never before the grace (the supervisor's clock started once it read the request: later).
        assert time.monotonic() - asked >= grace_ms / 1000
    assert run.next_record() == "empty"
    assert run.process.wait(10) == 0
    assert _marked(marker) == []


def test_control_fd_requests_and_eof(runs: list[Supervised], marker: str) -> None:
    script = '( trap "" TERM; exec -a "$M-a" sleep 600 & ); ( exec -a "$M-b" sleep 600 & ); sleep 0.3; exit 0'
    run = Supervised([BASH, "--noprofile", "--norc", "-c", script], control=True, marker=marker)
    runs.append(run)
    run.started_pid()
    assert run.next_record() == "exit 0"
    assert run.control_fd is not None
    os.write(run.control_fd, b"T")
    assert run.expect("signalled ") == "signalled 2"
    time.sleep(0.3)
    assert len(_marked(marker)) == 1
    # EOF: the harness is gone, so everything dies and the supervisor exits.
    os.close(run.control_fd)
    run.control_fd = None
    assert run.expect("signalled ") == "signalled 1"
    assert run.next_record() == "empty"
    assert run.process.wait(10) == 0
    assert _marked(marker) == []


def test_control_fd_kill_byte(runs: list[Supervised], marker: str) -> None:
    run = Supervised(
        [BASH, "--noprofile", "--norc", "-c", 'exec -a "$M" sleep 600'], control=True, marker=marker
    )
    runs.append(run)
    run.started_pid()
    assert run.control_fd is not None
    os.write(run.control_fd, b"K")
    assert run.expect("signalled ") == "signalled 1"
    assert run.next_record() == "signal 9"
    assert run.next_record() == "empty"
    assert _marked(marker) == []


def test_die_with_parent(marker: str) -> None:
    reader, child_end = socket.socketpair()
    fd = child_end.fileno()
    # A parent that starts the supervisor and is then SIGKILLed: the supervisor gets SIGUSR2
    # (PR_SET_PDEATHSIG), kills its subtree, says so and exits.
    parent_code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(sys.argv[1:], pass_fds=[int(sys.argv[3])])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    command = [SUPERVISE, "--status-fd", str(fd), "--die-with-parent", "--", BASH, "-c"]
    command.append('( exec -a "$M-orphan" sleep 600 & ); exec -a "$M-child" sleep 600')
    parent = subprocess.Popen(
        [PYTHON, "-c", parent_code, *command],
        pass_fds=[fd],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "M": marker},
    )
    child_end.close()
    try:
        assert parent.stdout is not None
        supervisor_pid = int(parent.stdout.readline())
        run_records = b""
        deadline = time.monotonic() + 10
        while b"started" not in run_records and time.monotonic() < deadline:
            if select.select([reader], [], [], 0.5)[0]:
                run_records += reader.recv(4096)
        deadline = time.monotonic() + 10
        while len(_marked(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_marked(marker)) == 2
        parent.kill()
        parent.wait()
        reader.settimeout(10)
        while True:
            chunk = reader.recv(4096)
            if not chunk:
                break
            run_records += chunk
        records = run_records.decode().splitlines()
        assert records[0].startswith("started ")
        assert records[1:] == ["signalled 2", "signal 9", "empty"]
        deadline = time.monotonic() + 10
        while _start_time(supervisor_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _start_time(supervisor_pid) is None, "the supervisor exited"
        assert _marked(marker) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout:
            parent.stdout.close()
        reader.close()


# ---- the status channel cannot be forged ---------------------------------------------------------

FORGE = r"""
fd=$1 harness=$2 reader=$3
forged='exit 0\nempty\n'
printf "$forged" 2>/dev/null >&"$fd" && echo "wrote to the inherited fd $fd"
printf "$forged" 2>/dev/null >/proc/$PPID/fd/"$fd" && echo "reopened the supervisor's fd"
printf "$forged" 2>/dev/null >/proc/"$harness"/fd/"$reader" && echo "reopened the harness's reader"
exit 7
"""


def _forge(fd: int, reader: int) -> list[str]:
    return [BASH, "--noprofile", "--norc", "-c", FORGE, "forge", str(fd), str(os.getpid()), str(reader)]


def _forge_outcome(run: Supervised) -> tuple[list[str], str]:
    assert run.process.stdout is not None
    said = run.process.stdout.read().decode()
    run.process.stdout.close()
    return run.finish(), said


def test_command_cannot_write_the_status_channel(runs: list[Supervised]) -> None:
    # Same user as the harness; the channel is a socketpair: /proc/PID/fd/N of a socket cannot be
    # opened (ENXIO), not even by root, neither the supervisor's end nor the harness's reader.
    run = Supervised(_forge, stdout=subprocess.PIPE)
    runs.append(run)
    records, said = _forge_outcome(run)
    assert said == "", said
    assert records[1:] == ["exit 7", "empty"], records


def test_supervisor_fds_closed_to_a_same_user_command(runs: list[Supervised]) -> None:
    # With a pipe as the channel, /proc/SUPERVISOR/fd/N can be reopened for writing by anything
    # allowed to ptrace the supervisor; PR_SET_DUMPABLE 0 denies that to same-user processes. Root
    # (CAP_SYS_PTRACE) is exempt, so when root the supervisor and its command run as nobody.
    user = 65534 if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o755)
        binary = Path(directory) / "dsh-supervise"
        shutil.copy2(SUPERVISE, binary)
        binary.chmod(0o755)
        run = Supervised(
            lambda fd, _reader: _forge(fd, 0),
            binary=(str(binary),),
            pipe_status=True,
            user=user,
            stdout=subprocess.PIPE,
        )
        runs.append(run)
        records, said = _forge_outcome(run)
    assert said == "", said
    assert records[1:] == ["exit 7", "empty"], records


@pytest.mark.skipif(os.geteuid() != 0, reason="the control case needs root's CAP_SYS_PTRACE")
def test_forgery_probe_works_where_nothing_protects(runs: list[Supervised]) -> None:
    # The control for the two tests above: a root command facing a pipe reaches the reader both
    # through /proc/$PPID/fd/N and through the harness's own /proc/PID/fd. If this stops forging,
    # the probes above prove nothing.
    run = Supervised(_forge, pipe_status=True, stdout=subprocess.PIPE)
    runs.append(run)
    records, said = _forge_outcome(run)
    assert "reopened the supervisor's fd" in said
    assert "reopened the harness's reader" in said
    assert records.count("empty") == 3, records  # two forged, one real


# ---- --setenv (version 4) ------------------------------------------------------------------------


def _proc_bytes(pid: int, name: str) -> bytes:
    """/proc/PID/NAME; skips where this process may not read a non-dumpable one's environ."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except PermissionError:
        pytest.skip(f"/proc/{pid}/{name} of the non-dumpable supervisor needs CAP_SYS_PTRACE (root)")


def assert_set_for_the_command_alone(supervisor: int, command: int, assignment: str) -> None:
    """ASSIGNMENT (NAME=VALUE, from --setenv) is in the environment of the COMMAND process, and
    neither in the SUPERVISOR's environment nor on its command line (nor is --setenv)."""
    # The control: the same read of the command's environ finds it (else the checks below prove nothing).
    # It reads empty while the command's exec is under way (`started` comes as close-on-exec fds
    # close, before the new image's environment is in place).
    deadline = time.monotonic() + 5
    while not (environ := _proc_bytes(command, "environ")) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert assignment.encode() in environ.split(b"\0")
    value = assignment.split("=", 1)[1].encode()
    own_environ = _proc_bytes(supervisor, "environ")
    own_cmdline = _proc_bytes(supervisor, "cmdline")
    assert value not in own_environ, "the supervisor's own environment holds the --setenv value"
    assert value not in own_cmdline and b"--setenv" not in own_cmdline, own_cmdline


def test_setenv_reaches_the_command(runs: list[Supervised], marker: str) -> None:
    # M is inherited (the marker) and replaced; a value may hold '=' or be empty; the later one of
    # two for one NAME wins.
    script = 'printf "%s|%s|%s|%s" "$M" "$DSH_SETENV_A" "${DSH_SETENV_B-unset}" "$DSH_SETENV_C"'
    options = ["--setenv", "M=replaced", "--setenv", "DSH_SETENV_A=x=y", "--setenv", "DSH_SETENV_B="]
    options += ["--setenv", "DSH_SETENV_C=first", "--setenv", "DSH_SETENV_C=second"]
    run = Supervised(
        [BASH, "--noprofile", "--norc", "-c", script], options=options, stdout=subprocess.PIPE, marker=marker
    )
    runs.append(run)
    run.started_pid()
    assert run.process.stdout is not None
    output = run.process.stdout.read().decode()
    run.process.stdout.close()
    assert run.finish()[-2:] == ["exit 0", "empty"]
    assert output == "replaced|x=y||second"


def test_setenv_is_for_the_command_alone(runs: list[Supervised]) -> None:
    """A kill by marker reads /proc/PID/environ: the supervisor must never carry the marker there,
    nor show it on its command line."""
    assignment = f"DSH_BASH_MARK=dshsetenv{uuid.uuid4().hex}"
    run = Supervised([BASH, "--noprofile", "--norc", "-c", "sleep 5; true"], options=["--setenv", assignment])
    runs.append(run)
    child = run.started_pid()
    assert_set_for_the_command_alone(run.process.pid, child, assignment)
    os.kill(run.process.pid, signal.SIGUSR2)
    assert run.finish()[-1] == "empty"


@pytest.mark.parametrize(
    "args",
    [
        ["--setenv", "dshsecretNOEQUALS", "--", "true"],
        ["--setenv", "=dshsecretvalue", "--", "true"],
        ["--frame", "--setenv", "dshsecretNOEQUALS", "--", "true"],
        ["--detach", "--status-file", "status", "--setenv", "=dshsecretvalue", "--", "true"],
        ["--setenv"],
    ],
)
def test_setenv_usage_errors(tmp_path: Path, args: list[str]) -> None:
    done = subprocess.run(
        [SUPERVISE, *args], input=b"k" * 32, capture_output=True, timeout=10, check=False, cwd=tmp_path
    )
    assert done.returncode == 125
    assert done.stderr.startswith(b"dsh-supervise: ") and b"--setenv" in done.stderr, done.stderr
    assert b"dshsecret" not in done.stderr, "the refused argument is not echoed"
    assert not (tmp_path / "status").exists()


# ---- usage, architectures, build -----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--"],
        ["--status-fd", "1", "--", "true"],
        ["--status-fd", "999", "--", "true"],
        ["--status-fd", "x", "--", "true"],
        ["--bogus", "--", "true"],
        ["--grace-ms", "-1", "--", "true"],
        ["--grace-ms", "1.5", "--", "true"],
        ["--grace-ms", "86400001", "--", "true"],
        ["--fork-server", "--grace-ms", "100"],
        ["--warm", "/bin/bash", "--frame"],
        ["--warm", "/bin/bash", "--", "true"],
        ["--warm", "/bin/bash", "--grace-ms", "100"],
    ],
)
def test_usage_errors_exit_125(args: list[str]) -> None:
    done = subprocess.run([SUPERVISE, *args], capture_output=True, text=True, timeout=10, check=False)
    assert done.returncode == 125
    assert done.stderr.startswith("dsh-supervise: ")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--self-fd", "FD", "--", "true"], "--self-fd goes with --frame or --detach"),
        (["--warm", "/bin/bash", "--self-fd", "FD"], "--warm BASH waits for one request"),
        (
            ["--self-fd", "2", "--frame", "--", "true"],
            "--self-fd wants a file descriptor number of 3 or more",
        ),
    ],
)
def test_self_fd_goes_with_a_commands_supervisor_only(args: list[str], said: str) -> None:
    """``--self-fd N``: the sealed copy ``--warm`` leaves to BOOT, for the supervisor of a command."""
    read_end, write_end = os.pipe()
    try:
        argv = [SUPERVISE, *(str(read_end) if arg == "FD" else arg for arg in args)]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=10, check=False, pass_fds=(read_end,)
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert done.returncode == 125
    assert done.stderr.startswith(f"dsh-supervise: {said}"), done.stderr


def test_version() -> None:
    done = subprocess.run([SUPERVISE, "--version"], capture_output=True, text=True, timeout=10, check=True)
    assert done.stdout == "dsh-supervise 13\n"
    assert done.stdout == f"dsh-supervise {PROTOCOL_VERSION}\n"  # what the backends expect of it


def test_arch_names() -> None:
    assert normalize_arch("x86_64") == normalize_arch("AMD64") == "x86_64"
    assert normalize_arch("arm64") == normalize_arch("aarch64") == "aarch64"
    assert normalize_arch("armv7l") is None
    assert supervisor_binary("armv7l") is None
    assert "armv7l" in (supervisor_problem("armv7l") or "")
    assert set(ARCHITECTURES) == {"x86_64", "aarch64"}


QEMU = shutil.which("qemu-aarch64-static")


@pytest.mark.skipif(
    QEMU is None,
    reason="backend unavailable: qemu-aarch64-static is not installed (apt-get install qemu-user-static)",
)
@pytest.mark.parametrize(("script", "outcome"), [("exit 0", "exit 0"), ("exit 3", "exit 3")])
def test_aarch64_binary_under_qemu(runs: list[Supervised], script: str, outcome: str) -> None:
    binary = supervisor_binary("aarch64")
    assert binary is not None, supervisor_problem("aarch64")
    assert QEMU is not None
    # qemu-user emulates no PR_SET_CHILD_SUBREAPER: the binary says so and goes on when allowed to.
    run = Supervised(["/bin/sh", "-c", script], binary=(QEMU, str(binary)), options=["--allow-no-subreaper"])
    runs.append(run)
    records = run.finish(30)
    assert [r for r in records if not r.startswith("warning ")][1:] == [outcome, "empty"]


def test_source_is_warnings_clean(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler")
    sources = sorted(str(path) for path in (ROOT / "native").glob("*.c"))
    done = subprocess.run(
        [cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", *sources],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def glibc_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dsh-supervise built by the host's cc against glibc (the build.py fallback without ziglang)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler")
    out = tmp_path_factory.mktemp("glibc") / "dsh-supervise"
    sources = sorted(str(path) for path in (ROOT / "native").glob("*.c"))
    subprocess.run([cc, "-std=gnu11", "-Os", "-o", str(out), *sources], check=True, timeout=120)
    return out


@pytest.mark.parametrize("build", ["static-musl", "host-glibc"])
def test_a_terminal_on_stdin_becomes_the_commands_controlling_terminal(
    build: str, request: pytest.FixtureRequest
) -> None:
    """Plain mode, stdin a terminal: the command opens /dev/tty. glibc's posix_spawn addopen closes fd 0
    before it opens the path, so reopening "/proc/self/fd/0" failed every such command with ENOENT
    (issue 29: every terminal task of a cc-built helper), which musl's order hid."""
    binary = SUPERVISE if build == "static-musl" else str(request.getfixturevalue("glibc_binary"))
    master, slave = os.openpty()
    try:
        done = subprocess.run(
            [binary, "--", BASH, "--noprofile", "--norc", "-c", "exec 3</dev/tty && echo has-ctty"],
            stdin=slave,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(slave)
        os.close(master)
    assert (done.returncode, done.stdout, done.stderr) == (0, "has-ctty\n", "")


def top_level_blocks(source: str) -> list[tuple[int, int]]:
    """(first line, line count) of each top-level brace block of a C source (functions, tables):
    braces in strings, character constants and comments do not count."""
    blocks: list[tuple[int, int]] = []
    depth, line, start = 0, 1, 0
    index, end = 0, len(source)
    while index < end:
        char = source[index]
        if source.startswith("/*", index):
            close = source.index("*/", index + 2) + 2
            line += source.count("\n", index, close)
            index = close
            continue
        if source.startswith("//", index):
            index = source.find("\n", index)
            index = end if index < 0 else index
            continue
        if char in "\"'":
            index += 1
            while source[index] != char:
                index += 2 if source[index] == "\\" else 1
        elif char == "\n":
            line += 1
        elif char == "{":
            depth += 1
            start = line if depth == 1 else start
        elif char == "}":
            depth -= 1
            if depth == 0:
                blocks.append((start, line - start + 1))
        index += 1
    return blocks


def test_the_block_counter_counts() -> None:
    source = (
        'int f(void)\n{\n    char *s = "}{";\n    /* } */\n    return 0; // {\n}\n'
        "int g(void) { return '}'; }\n"
    )
    assert top_level_blocks(source) == [(2, 5), (7, 1)]


def test_native_sources_stay_small() -> None:
    """No file of native/ over 900 lines, no function over 150 (issue 28): the supervisor stays
    readable file by file."""
    sizes = {path.name: path.read_text().count("\n") for path in (ROOT / "native").glob("*.[ch]")}
    assert {name: lines for name, lines in sizes.items() if lines > 900} == {}
    long_blocks = {
        f"{path.name}:{first}": lines
        for path in (ROOT / "native").glob("*.c")
        for first, lines in top_level_blocks(path.read_text())
        if lines > 150
    }
    assert long_blocks == {}


def _build_script() -> Any:
    """native/build.py as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("dsh_native_build", ROOT / "native" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def test_binaries_are_up_to_date() -> None:
    build = _build_script()
    host = normalize_arch(os.uname().machine)
    assert host is not None
    assert not build.is_stale(host), f"dsh-supervise-{host} is older than its sources: run native/build.py"
    assert build.output_path(host) == BINARY


def test_a_binary_built_another_way_or_from_other_sources_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: a binary the host's cc built stayed after ziglang was installed (its time was newer than
    its sources). The stamp beside it names the toolchain and the sources' digest; any difference is stale."""
    build = _build_script()
    source = tmp_path / "a.c"
    source.write_text("int main(void) { return 0; }\n")
    monkeypatch.setattr(build, "inputs", lambda: [source])
    out = tmp_path / "out"
    out.mkdir()
    build.output_path("x86_64", out).write_bytes(b"binary")
    assert build.is_stale("x86_64", out), "no stamp: how it was built is not known"
    zig = build.have_ziglang()
    build.stamp_path("x86_64", out).write_text(build.build_stamp(zig))
    assert not build.is_stale("x86_64", out)
    build.stamp_path("x86_64", out).write_text(build.build_stamp(not zig))
    assert build.is_stale("x86_64", out), "built by the other toolchain"
    build.stamp_path("x86_64", out).write_text(build.build_stamp(zig))
    source.write_text("int main(void) { return 1; }\n")
    assert build.is_stale("x86_64", out), "built from other sources"


def test_missing_binary_has_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import dsh_bash.supervisor._native as native  # noqa: PLC0415

    monkeypatch.setattr(native, "_DIR", tmp_path)
    assert native.supervisor_binary("x86_64") is None
    assert "not built" in (native.supervisor_problem("arm64") or "")
    (tmp_path / "dsh-supervise-aarch64").write_text("")
    assert "not executable" in (native.supervisor_problem("aarch64") or "")


def test_supervisor_shows_no_command_on_its_command_line(runs: list[Supervised], marker: str) -> None:
    """Only the command's own processes carry its text: a supervisor outliving the shell must not
    read like one of them to whoever finds processes by command line (the kit, ``ps``)."""
    run = Supervised(["bash", "-c", "sleep 2; true", marker])
    runs.append(run)
    child = run.started_pid()
    with open(f"/proc/{run.process.pid}/cmdline", "rb") as handle:
        own = handle.read()
    with open(f"/proc/{child}/cmdline", "rb") as handle:
        command = handle.read()
    assert marker.encode() in command
    assert marker.encode() not in own and b"sleep" not in own and b"--status-fd" not in own, own
    assert own.split(b"\0")[0].endswith(b"dsh-supervise-" + os.uname().machine.encode()), own


def test_supervisor_holds_none_of_the_commands_stdio(runs: list[Supervised], marker: str) -> None:
    """The command's output reaches EOF once its processes closed it, although the supervisor lives on
    for a leftover that holds no end of it."""
    read_end, write_end = os.pipe()
    try:
        # The leftover outlives any EOF a test could wait for: were EOF to wait for it, it would be
        # gone when looked for below (no wall-clock assertion, which a loaded CI machine can break).
        script = f"(exec -a {marker} sleep 120) </dev/null >/dev/null 2>&1 & echo hi"
        run = Supervised(["bash", "-c", script], stdout=write_end)
        runs.append(run)
    finally:
        os.close(write_end)
    try:
        run.started_pid()
        data = b""
        while chunk := os.read(read_end, 4096):  # blocks until EOF
            data += chunk
        assert data == b"hi\n"
        # The subshell let go of the pipe before its exec renamed it: give the exec a moment.
        deadline = time.monotonic() + 10
        while not _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _marked(marker), "EOF waited for the leftover (it no longer runs)"
        assert run.process.poll() is None, "the supervisor should live on for its leftover"
    finally:
        os.close(read_end)
        os.kill(run.process.pid, signal.SIGUSR2)
