"""dsh-supervise --detach (protocol version 3), driven as a real binary.

The harness's side of a detached task: the key goes in on the supervisor's stdin (a pipe here, the SSH
channel in the SSH backend), the starting process exits at once, and the outcome is read from the
status file, each line checked with Python's hmac (and by dsh_bash's SignedRecords). Every test kills
what it started: the detached supervisor through SIGUSR2 (it is no child of the test's), and
escapees by their recorded pids. The containment helpers come from test_supervise.py, which also
skips this module when the binary is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from test_supervise import (
    BASH,
    QEMU,
    SUPERVISE,
    _alive,
    _start_time,
    _wait_for_lines,
    assert_set_for_the_command_alone,
)

from dsh_bash.backend import ExitStatus
from dsh_bash.supervisor import (
    SignedRecords,
    SupervisorRecords,
)
from dsh_bash.supervisor._native import supervisor_binary, supervisor_problem

SH = (BASH, "--noprofile", "--norc", "-c")
LINE = re.compile(rb"(0|[1-9][0-9]*) ([\x20-\x7e]+) ([0-9a-f]{64})")


class Detached:
    """One detached task: the start (exit status, stderr, how long it took) and its status file."""

    def __init__(
        self,
        directory: Path,
        command: Sequence[str],
        *,
        key: bytes | None = None,
        options: Sequence[str] = (),
        binary: Sequence[str] = (SUPERVISE,),
        wrap: Sequence[str] = (),
        stdin_file: Path | None = None,
        stdout_file: Path | None = None,
        stderr_file: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.key = os.urandom(32) if key is None else key
        self.status = directory / "status"
        args = [*wrap, *binary, "--detach", "--status-file", str(self.status)]
        for option, path in (("--stdin-file", stdin_file), ("--stdout-file", stdout_file)):
            if path is not None:
                args += [option, str(path)]
        if stderr_file is not None:
            args += ["--stderr-file", str(stderr_file)]
        args += [*options, "--", *command]
        begin = time.monotonic()
        start = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env={**os.environ, **(env or {}), "STATUS": str(self.status)},
        )
        # The whole exchange of a start: the key in, EOF on stdout and stderr (nothing of the task
        # holds them once the parent exited), the parent's exit status.
        out, err = start.communicate(self.key, timeout=30)
        self.start_seconds = time.monotonic() - begin
        self.returncode = start.returncode
        self.stdout = out
        self.stderr = err.decode(errors="replace")
        self.verifier = SignedRecords(self.key)
        self.state = SupervisorRecords()
        self.records: list[str] = []

    def poll(self) -> None:
        try:
            with self.status.open("rb") as handle:
                handle.seek(self.verifier.fed)
                data = handle.read()
        except FileNotFoundError:
            return
        for record in self.verifier.feed(data):
            self.records.append(record)
            self.state.apply(record)

    def wait_for(self, done: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if done():
                return
            if time.monotonic() > deadline:
                pytest.fail(f"not within {timeout} s; records so far: {self.records}")
            time.sleep(0.01)

    def finish(self, timeout: float = 15.0) -> list[str]:
        self.wait_for(lambda: self.state.empty, timeout)
        self.wait_gone()
        return self.records

    @property
    def supervisor(self) -> tuple[int, str]:
        self.wait_for(lambda: self.state.supervisor_pid is not None)
        assert self.state.supervisor_pid is not None
        return self.state.supervisor_pid, str(self.state.supervisor_start_time)

    def alive(self) -> bool:
        if self.state.supervisor_pid is None:
            return False
        pid, start = self.supervisor
        return _start_time(pid) == start

    def wait_gone(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.alive(), "the supervisor exits after `empty`"

    def close(self) -> None:
        self.poll()
        pid, start = self.state.supervisor_pid, str(self.state.supervisor_start_time)
        if pid is None:
            # Records that do not verify (a broken supervisor): for the clean-up alone, the first
            # line's word, checked against the live process's start time.
            with contextlib.suppress(OSError, ValueError, IndexError):
                words = self.status.read_bytes().split(b"\n", 1)[0].split()
                if words[1] == b"supervisor":
                    pid, start = int(words[2]), words[3].decode()
        if pid is None or _start_time(pid) != start:
            return
        os.kill(pid, signal.SIGUSR2)  # its whole subtree, then it exits
        deadline = time.monotonic() + 10
        while _start_time(pid) == start and time.monotonic() < deadline:
            time.sleep(0.01)
        if _start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def tasks() -> Iterator[list[Detached]]:
    started: list[Detached] = []
    yield started
    for task in started:
        task.close()


@pytest.fixture
def survivors() -> Iterator[list[Path]]:
    """Files of pids (one a line) that a test's escapees wrote: whatever is left of them is killed."""
    files: list[Path] = []
    yield files
    for path in files:
        with contextlib.suppress(OSError):
            for pid in map(int, path.read_text().split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _check_lines(path: Path, key: bytes) -> list[bytes]:
    """Every line of the status file, verified here with hmac alone: (SEQ, RECORD) in order."""
    lines = path.read_bytes().split(b"\n")
    assert lines.pop() == b"", "the file ends with a whole line"
    records = []
    for seq, line in enumerate(lines):
        match = LINE.fullmatch(line)
        assert match is not None, line
        assert int(match[1]) == seq, line
        signed = f"{seq} ".encode() + match[2]
        assert hmac.compare_digest(hmac.new(key, signed, hashlib.sha256).hexdigest().encode(), match[3]), line
        records.append(match[2])
    return records


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "outcome"), [("exit 3", ExitStatus(code=3)), ("kill -TERM $$", None)])
def test_round_trip(tasks: list[Detached], tmp_path: Path, script: str, outcome: ExitStatus | None) -> None:
    task = Detached(tmp_path, [*SH, f"sleep 0.5; {script}"])
    tasks.append(task)
    assert (task.returncode, task.stderr, task.stdout) == (0, "", b"")
    assert task.start_seconds < 0.4, "the start returns while the command runs"
    task.poll()
    assert task.state.command_exit is None, "the command still runs"
    pid, start = task.supervisor
    assert _start_time(pid) == start, "the record names the live supervisor"
    records = task.finish()
    expected = "exit 3" if outcome else "signal 15"
    assert records[0] == f"supervisor {pid} {start}"
    assert records[1].startswith("started ")
    assert records[2:] == [expected, "empty"]
    assert task.state.command_exit == (outcome or ExitStatus(code=None, signal=15))
    assert task.verifier.forged == 0
    assert [r.decode() for r in _check_lines(task.status, task.key)] == records
    assert stat.S_IMODE(task.status.stat().st_mode) == 0o600


def test_supervisor_is_detached(tasks: list[Detached], tmp_path: Path) -> None:
    task = Detached(tmp_path, [*SH, "sleep 2"])
    tasks.append(task)
    assert task.returncode == 0
    pid, _ = task.supervisor
    task.wait_for(lambda: task.state.child is not None)  # its exec pipe is closed by then
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    ppid, pgid, sid = int(fields[1]), int(fields[2]), int(fields[3])
    assert pid == pgid == sid, "a session of its own"
    assert ppid != os.getpid()
    # Root may look (CAP_SYS_PTRACE): it holds nothing of the channel, and no key file.
    fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert fds[0] == fds[1] == fds[2] == "/dev/null", fds
    assert not [target for target in fds.values() if "pipe:" in target], fds
    assert task.state.child is not None
    child = Path(f"/proc/{task.state.child}/stat").read_text()
    assert int(child[child.rindex(")") + 2 :].split()[1]) == pid, "the command is the supervisor's child"


def test_stdio_files_byte_exact(tasks: list[Detached], tmp_path: Path) -> None:
    data = bytes(range(256)) * 300 + b"\0tail"
    stdin = tmp_path / "in"
    stdin.write_bytes(data)
    out, err = tmp_path / "out", tmp_path / "err"
    script = "cat; printf 'e\\0\\377rr' >&2; exit 0"
    task = Detached(tmp_path, [*SH, script], stdin_file=stdin, stdout_file=out, stderr_file=err)
    tasks.append(task)
    assert task.returncode == 0, task.stderr
    assert task.finish()[-2:] == ["exit 0", "empty"]
    assert out.read_bytes() == data
    assert err.read_bytes() == b"e\0\377rr"
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(err.stat().st_mode) == 0o600


def test_no_stdio_files_means_dev_null(tasks: list[Detached], tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    # readlink's own redirection: /proc/$$ is the shell's fds, which it leaves as they came.
    script = 'for fd in 0 1 2; do readlink /proc/$$/fd/$fd >>"$1"; done; read -r x; echo "[$x]" >>"$1"'
    task = Detached(tmp_path, [*SH, script, "probe", str(probe)])
    tasks.append(task)
    assert task.finish()[-2:] == ["exit 0", "empty"]
    assert probe.read_text() == "/dev/null\n" * 3 + "[]\n"


def test_exec_failure(tasks: list[Detached], tmp_path: Path) -> None:
    task = Detached(tmp_path, ["/nonexistent/dsh-no-such-program"])
    tasks.append(task)
    assert task.returncode == 0
    assert task.finish()[1:] == ["execfail 2", "exit 127", "empty"]


# ---- kills ---------------------------------------------------------------------------------------

ESCAPE = r"""
pids=$1
# An orphan in a session of its own, without the harness's variables.
env -u STATUS setsid sh -c 'echo $$ >>"$1"; exec sleep 1000' sh "$pids" &
# A loop that reads a FIFO for ever (it never gets EOF: it holds a write end itself) and shrugs
# off SIGTERM and SIGHUP.
fifo=$(mktemp -u)
mkfifo "$fifo"
( trap '' TERM HUP; exec 3<>"$fifo"; rm -f "$fifo"; echo $BASHPID >>"$pids";
  while read -r line <&3; do :; done ) &
exit 0
"""


def test_sigusr2_kills_escapees(tasks: list[Detached], survivors: list[Path], tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    survivors.append(pids_file)
    task = Detached(tmp_path, [*SH, ESCAPE, "escape", str(pids_file)])
    tasks.append(task)
    task.wait_for(lambda: task.state.command_exit is not None)
    assert task.state.command_exit == ExitStatus(code=0)
    pids = _wait_for_lines(pids_file, 2)
    time.sleep(0.2)  # let the orphan reach its exec
    starts = {pid: _start_time(pid) for pid in pids}
    assert _alive(starts) == pids
    assert not task.state.empty
    pid, _ = task.supervisor
    os.kill(pid, signal.SIGUSR2)
    records = task.finish()
    assert records[-2:] == [records[-2], "empty"]
    assert int(records[-2].removeprefix("signalled ")) >= 2
    assert _alive(starts) == []


def test_sigusr1_terminates(tasks: list[Detached], tmp_path: Path) -> None:
    task = Detached(tmp_path, [*SH, "exec sleep 1000"])
    tasks.append(task)
    task.wait_for(lambda: task.state.child is not None)
    pid, _ = task.supervisor
    os.kill(pid, signal.SIGUSR1)
    assert task.finish()[2:] == ["signalled 1", "signal 15", "empty"]


# ---- forgery -------------------------------------------------------------------------------------

FORGE = r"""
mac=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '2 exit 0 %s\n3 empty %s\n' "$mac" "$mac" >>"$STATUS"
# A copy of a real line, replayed where the exit record belongs.
sed -n 2p "$STATUS" | sed 's/^1 /2 /' >>"$STATUS"
exit 5
"""


def test_forged_lines_are_rejected(tasks: list[Detached], tmp_path: Path) -> None:
    task = Detached(tmp_path, [*SH, FORGE])
    tasks.append(task)
    records = task.finish()
    assert records[2:] == ["exit 5", "empty"]
    assert task.state.command_exit == ExitStatus(code=5)
    assert task.verifier.forged == 3
    raw = task.status.read_bytes()
    assert raw.count(b"\n2 exit 0 ") == 1, "the forged line is in the file: the verifier threw it out"


def test_command_cannot_glue_its_record_in(tasks: list[Detached], tmp_path: Path) -> None:
    # Junk without a newline in front of the real record: the record is found at the line's tail.
    task = Detached(tmp_path, [*SH, "printf 'junk 2 exit 0' >>\"$STATUS\"; exit 6"])
    tasks.append(task)
    assert task.finish()[2:] == ["exit 6", "empty"]
    assert task.verifier.forged == 1


def test_dropped_records_are_reported(tasks: list[Detached], tmp_path: Path) -> None:
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit")
    # The command lowers its supervisor's RLIMIT_FSIZE (prlimit works across same-user processes) to
    # 10 bytes past the file's end: the next record is written short, and those after it not at all.
    # The supervisor ignores SIGXFSZ, drops them and reuses their SEQ; once the limit is back, the
    # next record says how many were lost, glued to the partial one, and verifies. (The kill requests
    # are there for records to drop: `signalled N`.) The supervisor writes `started` while the command
    # already runs: the command waits for it, or a loaded machine lets it measure the file before
    # and set a limit below the file's size (no partial line then).
    script = (
        "trap '' TERM; "  # the kill requests' TERM passes reach the command too
        "until grep -q ' started ' \"$STATUS\"; do sleep 0.01; done; "
        'size=$(stat -c %s "$STATUS"); prlimit --pid $PPID --fsize=$((size + 10)):unlimited; '
        "kill -USR1 $PPID; sleep 0.3; kill -USR1 $PPID; sleep 0.3; "
        "prlimit --pid $PPID --fsize=unlimited:unlimited; exit 4"
    )
    task = Detached(tmp_path, [*SH, script])
    tasks.append(task)
    records = task.finish()
    assert records[2:] == ["warning dropped 2", "exit 4", "empty"], records
    assert task.verifier.forged == 1  # the partial line


# ---- start failures ------------------------------------------------------------------------------


def _start(tmp_path: Path, key: bytes, *options: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [SUPERVISE, "--detach", *options, "--", "true"],
        input=key,
        capture_output=True,
        timeout=10,
        check=False,
        cwd=tmp_path,
    )


def test_existing_status_file_or_link_is_refused(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("planted\n")
    done = _start(tmp_path, os.urandom(32), "--status-file", str(status))
    assert done.returncode == 125
    assert b"cannot create the status file" in done.stderr
    assert status.read_text() == "planted\n"
    target = tmp_path / "target"
    link = tmp_path / "link"
    link.symlink_to(target)
    done = _start(tmp_path, os.urandom(32), "--status-file", str(link))
    assert done.returncode == 125
    assert not target.exists(), "nothing was created through the link"
    dangling_to_existing = tmp_path / "link2"
    target.write_text("victim\n")
    dangling_to_existing.symlink_to(target)
    assert _start(tmp_path, os.urandom(32), "--status-file", str(dangling_to_existing)).returncode == 125
    assert target.read_text() == "victim\n"


def test_existing_output_file_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("mine\n")
    done = _start(tmp_path, os.urandom(32), "--status-file", str(tmp_path / "s"), "--stdout-file", str(out))
    assert done.returncode == 125
    assert b"stdout" in done.stderr
    assert out.read_text() == "mine\n"
    link = tmp_path / "in"
    link.symlink_to("/etc/hostname")
    done = _start(tmp_path, os.urandom(32), "--status-file", str(tmp_path / "s2"), "--stdin-file", str(link))
    assert done.returncode == 125


@pytest.mark.parametrize("key", [b"", b"k" * 31])
def test_short_key_is_refused(tmp_path: Path, key: bytes) -> None:
    status = tmp_path / "status"
    done = _start(tmp_path, key, "--status-file", str(status))
    assert done.returncode == 125
    assert b"32 bytes of key" in done.stderr
    assert not status.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--detach", "--", "true"],
        ["--detach", "--frame", "--status-file", "x", "--", "true"],
        ["--detach", "--status-fd", "3", "--status-file", "x", "--", "true"],
        ["--detach", "--die-with-parent", "--status-file", "x", "--", "true"],
        ["--status-file", "x", "--", "true"],
        ["--stdout-file", "x", "--frame", "--", "true"],
    ],
)
def test_usage_errors(tmp_path: Path, args: list[str]) -> None:
    done = subprocess.run(
        [SUPERVISE, *args], input=os.urandom(32), capture_output=True, timeout=10, check=False, cwd=tmp_path
    )
    assert done.returncode == 125
    assert done.stderr.startswith(b"dsh-supervise: ")
    assert not (tmp_path / "x").exists()


def test_child_failure_is_reported_by_the_parent(tmp_path: Path) -> None:
    # Without --allow-no-subreaper, a refused PR_SET_CHILD_SUBREAPER fails the child after its first
    # record; the waiting parent relays the reason. Only qemu-user refuses it here.
    if QEMU is None:
        pytest.skip("needs qemu-aarch64-static (the only place PR_SET_CHILD_SUBREAPER is refused)")
    binary = supervisor_binary("aarch64")
    assert binary is not None, supervisor_problem("aarch64")
    status = tmp_path / "status"
    done = subprocess.run(
        [QEMU, str(binary), "--detach", "--status-file", str(status), "--", "true"],
        input=os.urandom(32),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 125
    assert done.stderr.startswith(b"dsh-supervise: prctl(PR_SET_CHILD_SUBREAPER)"), done.stderr


# ---- the key -------------------------------------------------------------------------------------

PROBE = r"""
sup=$PPID
cat /proc/$sup/environ >/dev/null 2>&1 && echo "read environ"
exec 3</proc/$sup/mem 2>/dev/null && echo "opened mem"
cat /proc/$sup/cmdline | od -An -v -tx1 | tr -d ' \n' >"$1.cmdline"
head -c 0 /proc/$$/environ 2>/dev/null && cat /proc/$$/environ >/dev/null && echo "control: read own environ"
id -u
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv")
def test_command_cannot_read_the_key(tasks: list[Detached]) -> None:
    # Root has CAP_SYS_PTRACE: the supervisor and its command run as nobody, as a remote user would.
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        directory.chmod(0o777)
        binary = directory / "dsh-supervise"
        shutil.copy2(SUPERVISE, binary)
        binary.chmod(0o755)
        out = directory / "out"
        wrap = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        task = Detached(
            directory, [*SH, PROBE, "probe", str(out)], binary=(str(binary),), wrap=wrap, stdout_file=out
        )
        tasks.append(task)
        assert task.returncode == 0, task.stderr
        assert task.finish()[-2:] == ["exit 0", "empty"]
        said = out.read_text()
        assert "read environ" not in said and "opened mem" not in said, said
        assert "control: read own environ" in said, "the probe can read a dumpable process of its user"
        assert said.endswith("65534\n" if wrap else f"{os.getuid()}\n")
        cmdline = bytes.fromhex(Path(f"{out}.cmdline").read_text())
        assert task.key not in cmdline and task.key.hex().encode() not in cmdline
        assert cmdline.rstrip(b"\0") == str(binary).encode(), cmdline


# ---- SHA-256 and HMAC against the standard vectors -----------------------------------------------


def _digest(data: bytes, key: bytes | None = None) -> str:
    args = [SUPERVISE, "--sha256"] if key is None else [SUPERVISE, "--hmac-sha256", key.hex()]
    done = subprocess.run(args, input=data, capture_output=True, timeout=30, check=True)
    return done.stdout.decode().strip()


@pytest.mark.parametrize(
    ("message", "digest"),
    [
        # FIPS 180-4 examples (NIST CSRC "SHA256.pdf", "SHA256_2.pdf") and the long-message vector.
        (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
        (
            b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        ),
        (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
    ],
)
def test_sha256_vectors(message: bytes, digest: str) -> None:
    assert _digest(message) == digest


@pytest.mark.parametrize(
    ("key", "message", "mac"),
    [
        # RFC 4231, test cases 1, 2, 3, 4, 6 and 7 (HMAC-SHA-256).
        (
            b"\x0b" * 20,
            b"Hi There",
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
        ),
        (
            b"Jefe",
            b"what do ya want for nothing?",
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
        ),
        (
            b"\xaa" * 20,
            b"\xdd" * 50,
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
        ),
        (
            bytes(range(1, 26)),
            b"\xcd" * 50,
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
        ),
        (
            b"\xaa" * 131,
            b"Test Using Larger Than Block-Size Key - Hash Key First",
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
        ),
        (
            b"\xaa" * 131,
            b"This is a test using a larger than block-size key and a larger than block-size data. "
            b"The key needs to be hashed before being used by the HMAC algorithm.",
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
        ),
    ],
)
def test_hmac_rfc4231_vectors(key: bytes, message: bytes, mac: str) -> None:
    assert _digest(message, key) == mac


def test_every_padding_length_against_hashlib() -> None:
    # Lengths around every block boundary that padding cares about (55, 56, 63, 64, ...).
    rng = random.Random(3)
    key = rng.randbytes(32)
    for length in [*range(0, 140), 1000, 4095, 4096, 65537]:
        message = rng.randbytes(length)
        assert _digest(message) == hashlib.sha256(message).hexdigest(), length
        if length < 140 and length % 7 == 0:
            assert _digest(message, key) == hmac.new(key, message, hashlib.sha256).hexdigest(), length


# ---- aarch64 -------------------------------------------------------------------------------------


@pytest.mark.skipif(
    QEMU is None,
    reason="backend unavailable: qemu-aarch64-static is not installed (apt-get install qemu-user-static)",
)
def test_aarch64_round_trip_under_qemu(tasks: list[Detached], tmp_path: Path) -> None:
    binary = supervisor_binary("aarch64")
    assert binary is not None, supervisor_problem("aarch64")
    assert QEMU is not None
    out = tmp_path / "out"
    task = Detached(
        tmp_path,
        ["/bin/sh", "-c", "echo arm; exit 3"],
        binary=(QEMU, str(binary)),
        options=["--allow-no-subreaper"],
        stdout_file=out,
    )
    tasks.append(task)
    assert task.returncode == 0, task.stderr
    records = task.finish(60)
    assert records[0].startswith("supervisor ")
    # qemu-user emulates no PR_SET_CHILD_SUBREAPER: the binary says so and goes on.
    assert [r for r in records if not r.startswith("warning ")][1:] == [records[2], "exit 3", "empty"]
    assert records[1] == "warning no-subreaper 22"
    assert out.read_text() == "arm\n"
    assert [r.decode() for r in _check_lines(task.status, task.key)] == records


def test_setenv_in_detach_mode(tasks: list[Detached], tmp_path: Path) -> None:
    assignment = f"DSH_BASH_MARK=dshsetenv{uuid.uuid4().hex}"
    out = tmp_path / "out"
    task = Detached(
        tmp_path,
        [*SH, 'printf %s "$DSH_BASH_MARK"; sleep 5; true'],
        options=["--setenv", assignment],
        stdout_file=out,
    )
    tasks.append(task)
    assert task.returncode == 0, task.stderr
    pid, _ = task.supervisor
    # Not until the command's bash printed: during an exec /proc/PID/environ reads empty.
    task.wait_for(lambda: task.state.child is not None and out.exists() and out.stat().st_size > 0)
    assert task.state.child is not None
    # The detached supervisor is the start's child: its argument area was cleared before the fork.
    assert_set_for_the_command_alone(pid, task.state.child, assignment)
    os.kill(pid, signal.SIGUSR2)
    assert task.finish()[-2:] == ["signal 9", "empty"]
    assert out.read_text() == assignment.split("=", 1)[1]


# ---- --cap-bytes: the output files never hold more disk than the harness granted ------------------


def _disk(path: Path) -> int:
    return path.stat().st_blocks * 512


@pytest.mark.timeout(60)
def test_cap_bytes_bounds_the_files_until_space_is_freed_or_the_cap_raised(
    tasks: list[Detached], tmp_path: Path
) -> None:
    """The command writes 4 MiB to each stream; the files never hold more than 256 KiB of disk (plus
    a block) until the harness punches what it read or raises the caps in the cap file."""
    cap = 256 * 1024
    out, err, caps = tmp_path / "out", tmp_path / "err", tmp_path / "caps"
    script = "head -c 4194304 /dev/zero >&2 & head -c 4194304 /dev/zero; wait"
    task = Detached(
        tmp_path,
        [*SH, script],
        stdout_file=out,
        stderr_file=err,
        options=["--cap-bytes", str(cap), "--cap-file", str(caps)],
    )
    tasks.append(task)
    assert task.returncode == 0, task.stderr
    peak = 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # blocked at the cap: nothing more is written
        peak = max(peak, _disk(out), _disk(err))
        time.sleep(0.005)
    task.poll()
    assert not task.state.empty
    assert peak <= cap + 4096, peak
    assert out.stat().st_size >= cap - 2 * 4096  # it did write up to the cap
    # Punching the part read frees room: the writer goes on, still within the cap.
    for _ in range(40):
        for path in (out, err):
            size = path.stat().st_size
            subprocess.run(
                ["fallocate", "--punch-hole", "--offset", "0", "--length", str(size), str(path)], check=True
            )
            peak = max(peak, _disk(out), _disk(err))
        if out.stat().st_size >= 1 << 20 and err.stat().st_size >= 1 << 20:
            break
        time.sleep(0.02)
    assert out.stat().st_size >= 1 << 20 and err.stat().st_size >= 1 << 20
    assert peak <= cap + 4096, peak
    # Raised caps (written whole, then renamed into place): the rest fits, the task ends.
    (tmp_path / "caps.new").write_text("16777216 16777216\n")
    (tmp_path / "caps.new").rename(caps)
    assert task.finish()[-2:] == ["exit 0", "empty"]
    assert out.stat().st_size == err.stat().st_size == 4194304


@pytest.mark.timeout(60)
def test_cap_bytes_drops_output_after_a_kill_or_a_removal(tasks: list[Detached], tmp_path: Path) -> None:
    """A full file whose task is killed (SIGUSR2), or whose file was removed, keeps no supervisor."""
    for case in ("kill", "remove"):
        directory = tmp_path / case
        directory.mkdir()
        out, err = directory / "out", directory / "err"
        task = Detached(
            directory,
            [*SH, "head -c 4194304 /dev/zero; echo done >&2"],
            stdout_file=out,
            stderr_file=err,
            options=["--cap-bytes", "65536"],
        )
        tasks.append(task)
        assert task.returncode == 0, task.stderr
        pid, _ = task.supervisor
        time.sleep(0.3)
        if case == "kill":
            os.kill(pid, signal.SIGUSR2)
        else:
            out.unlink()
        task.finish()
        assert _disk(err) <= 65536 + 4096
