"""dsh-supervise --fork-server (native/supervise.c), driven at the protocol level.

Each test starts the binary itself (``--fork-server --die-with-parent``, an empty environment, fd 0
one end of a Unix stream socket), sends requests with ``socket.send_fds`` (a 4-byte big-endian length,
then NUL-terminated cwd, the program's status fd (-1: none), argc, argv..., NAME=VALUE...; the status
socket and the command's stdin, stdout and stderr attached) and reads the server's ``spare PID``
announcements and each supervisor's status records. Processes that must not survive carry a unique
marker in their environment (or command line), which a scan of /proc finds. Every wait is bounded by
a few seconds.

``DSH_TEST_SUPERVISE_BINARY`` (unset normally) points the tests at another build of the binary: a
deliberately broken one, to see that they catch the breakage.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from dsh_bash.supervisor._native import supervisor_binary, supervisor_problem

_override = os.environ.get("DSH_TEST_SUPERVISE_BINARY")
BINARY = _override or supervisor_binary()
if BINARY is None:
    pytest.skip(f"backend unavailable: {supervisor_problem()}", allow_module_level=True)
SUPERVISE = str(BINARY)
PYTHON = sys.executable
BOUND_S = 2.5  # the longest any single wait of these tests may take


def _status_field(pid: int, name: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _live(pid: int) -> bool:
    state = _status_field(pid, "State")
    return state is not None and not state.startswith(("Z", "X"))


def _marked(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line or environment holds MARKER."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in text and _live(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_until(predicate: Callable[[], object], timeout: float = BOUND_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def _recv(sock: socket.socket, deadline: float, what: str) -> tuple[bytes, list[int]]:
    left = deadline - time.monotonic()
    ready, _, _ = select.select([sock], [], [], max(left, 0))
    if not ready:
        pytest.fail(f"nothing came within the bound: {what}")
    data, ancdata, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 8))
    fds: list[int] = []
    for level, kind, blob in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            values = array.array("i")
            values.frombytes(blob[: len(blob) - len(blob) % values.itemsize])
            fds.extend(values)
    return data, fds


def _payload(argv: Sequence[str], env: Mapping[str, str], cwd: str, status_in_program: int = -1) -> bytes:
    fields = [cwd, str(status_in_program), str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())]
    payload = ("\0".join(fields) + "\0").encode()
    return len(payload).to_bytes(4, "big") + payload


class Status:
    """A supervisor's status socket: its records, and the fds that came with them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.records: list[str] = []
        self.fds: list[int] = []
        self.first_message: bytes | None = None
        self.first_fds: list[int] = []
        self._buffer = b""
        self.eof = False

    def next_record(self, timeout: float = BOUND_S) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if self.eof:
                assert not self._buffer, f"an unterminated record at EOF: {self._buffer!r}"
                return None
            data, fds = _recv(self.sock, deadline, f"status record; so far {self.records}")
            if self.first_message is None:
                self.first_message, self.first_fds = data, fds
            self.fds += fds
            if not data:
                self.eof = True
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        record = line.decode()
        self.records.append(record)
        return record

    def expect(self, prefix: str, timeout: float = BOUND_S) -> str:
        record = self.next_record(timeout)
        assert record is not None and record.startswith(prefix), f"wanted {prefix!r}: {self.records}"
        return record

    def all(self, timeout: float = BOUND_S) -> list[str]:
        """Every record up to EOF."""
        deadline = time.monotonic() + timeout
        while self.next_record(max(deadline - time.monotonic(), 0.01)) is not None:
            pass
        return self.records

    def supervisor(self) -> tuple[int, int]:
        """The supervisor's pid and pidfd from the first message (`pidfd PID` with a pidfd)."""
        record = self.records[0] if self.records else self.expect("pidfd ")
        assert record.startswith("pidfd "), self.records
        assert self.first_message is not None and self.first_message.startswith(record.encode() + b"\n")
        assert len(self.first_fds) == 1, f"the first message carries one fd, got {self.first_fds}"
        return int(record.split()[1]), self.first_fds[0]

    def close(self) -> None:
        self.sock.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


class Server:
    """One `dsh-supervise --fork-server --die-with-parent` with an empty environment."""

    def __init__(self, *, user: int | None = None) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen(
                [SUPERVISE, "--fork-server", "--die-with-parent"],
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env={},
                start_new_session=True,
                close_fds=True,
                user=user,
                cwd="/",
            )
        finally:
            theirs.close()
        self.pid = self.process.pid
        self._announced = b""
        self.spare_fds: list[int] = []
        self.statuses: list[Status] = []

    def next_spare(self, timeout: float = BOUND_S) -> tuple[int, int]:
        """The next `spare PID` announcement and its pidfd."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._announced:
            data, fds = _recv(self.sock, deadline, "a spare announcement")
            assert data, "the server closed its socket"
            self.spare_fds += fds
            self._announced += data
        line, self._announced = self._announced.split(b"\n", 1)
        text = line.decode()
        assert text.startswith("spare "), text
        assert self.spare_fds, f"{text!r} came without a pidfd"
        return int(text.split()[1]), self.spare_fds[-1]

    def request(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        *,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        nfds: int = 4,
        status_in_program: int = -1,
    ) -> Status:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_RDWR)
        try:
            fds = [theirs.fileno()]
            fds += [null if fd is None else fd for fd in (stdin, stdout, stderr)]
            message = _payload(argv, {} if env is None else env, cwd, status_in_program)
            # The header and the fds first, the rest (a large environment) as the spare reads it.
            sent = socket.send_fds(self.sock, [message[:4096]], fds[:nfds])
            if sent < len(message):
                self.sock.sendall(message[sent:])
        finally:
            theirs.close()
            os.close(null)
        status = Status(ours)
        self.statuses.append(status)
        return status

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        if self.process.stderr is not None:
            self.process.stderr.close()
        for status in self.statuses:
            status.close()
        for fd in self.spare_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.close()


@pytest.fixture
def server(servers: list[Server]) -> Server:
    started = Server()
    servers.append(started)
    return started


@pytest.fixture
def marker() -> Iterator[str]:
    mark = f"dshforksrv{uuid.uuid4().hex}"
    yield mark
    for pid in _marked(mark):  # never leave a survivor behind, whatever the test said
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _read_all(fd: int, timeout: float = BOUND_S) -> bytes:
    """Everything from pipe FD up to EOF (bounded), then close it."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                pytest.fail(f"no EOF within {timeout} s; got {b''.join(chunks)!r}")
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


# ---- one request ---------------------------------------------------------------------------------

_PROBE = r"""
import json, os, sys
data = sys.stdin.read()
sys.stderr.write("err:" + data.upper())
print(json.dumps({
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0")[:-1],
    "environ": sorted(x for x in open("/proc/self/environ", "rb").read().decode().split("\0") if x),
    "cwd": os.getcwd(),
    "stdin": data,
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "sid": os.getsid(0),
}))
"""


def test_request_runs_exactly_its_argv_env_cwd_and_stdio(
    servers: list[Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Something in our environment that must not reach the command (the server starts with env={}).
    monkeypatch.setenv("DSH_TEST_LEAK", "leaked")
    server = Server()
    servers.append(server)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    argv = [PYTHON, "-c", _PROBE, "two words", "", "ünï", "-x=1"]
    env = {"ALPHA": "1", "EQ": "a=b=c", "EMPTY": ""}
    status = server.request(argv, env, str(tmp_path), stdin=in_r, stdout=out_w, stderr=err_w)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    os.write(in_w, b"hello")
    os.close(in_w)
    out = json.loads(_read_all(out_r))
    assert _read_all(err_r) == b"err:HELLO"
    assert out["cmdline"] == argv
    assert out["environ"] == sorted(f"{k}={v}" for k, v in env.items())
    assert out["cwd"] == str(tmp_path)
    assert out["stdin"] == "hello"
    supervisor, _ = status.supervisor()
    assert status.expect("started ") == f"started {out['pid']}"
    assert out["ppid"] == supervisor, "the command's parent is its supervisor"
    assert out["sid"] == out["pid"], "the command leads a session of its own"
    assert status.all()[1:] == [f"started {out['pid']}", "exit 0", "empty"]


def test_first_message_carries_a_pidfd_of_the_supervisor(server: Server) -> None:
    status = server.request(["sleep", "5"], {"PATH": "/usr/bin:/bin"})
    supervisor, pidfd = status.supervisor()
    child = int(status.expect("started ").split()[1])
    assert _status_field(supervisor, "PPid") == str(server.pid), "the supervisor is the server's child"
    assert _status_field(child, "PPid") == str(supervisor)
    # The fd is a pidfd of that very process: signal 0 goes through, and its fdinfo names the pid.
    signal.pidfd_send_signal(pidfd, 0)
    assert f"Pid:\t{supervisor}" in Path(f"/proc/self/fdinfo/{pidfd}").read_text()
    signal.pidfd_send_signal(pidfd, signal.SIGUSR2)  # kill its subtree: it ends after `empty`
    assert status.all()[2:] == ["signalled 1", "signal 9", "empty"]
    assert _wait_until(lambda: select.select([pidfd], [], [], 0)[0]), "the pidfd never turned readable"


def test_missing_program_is_execfail(server: Server) -> None:
    status = server.request(["/nonexistent/dsh-no-such-program"])
    records = status.all()
    assert records[0].startswith("pidfd ")
    assert records[1:] == ["execfail 2", "exit 127", "empty"]


def test_missing_cwd_is_cwdfail(server: Server, tmp_path: Path) -> None:
    status = server.request(["true"], {"PATH": "/usr/bin:/bin"}, str(tmp_path / "gone"))
    records = status.all()
    assert records[0].startswith("pidfd ")
    assert records[1:] == ["cwdfail 2", "exit 127", "empty"]


def test_killed_command_is_reported_as_signal(server: Server) -> None:
    status = server.request(
        ["bash", "--noprofile", "--norc", "-c", "kill -TERM $$"], {"PATH": "/usr/bin:/bin"}
    )
    records = status.all()
    assert records[1].startswith("started ")
    assert records[2:] == ["signal 15", "empty"]


def test_orphan_in_a_new_session_is_killed_on_sigusr2(server: Server, marker: str) -> None:
    script = "import os, sys, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(100); os._exit(0)\n"
    status = server.request([PYTHON, "-c", script, marker])
    supervisor, pidfd = status.supervisor()
    status.expect("started ")
    assert status.next_record() == "exit 0"
    orphans = _marked(marker)
    assert len(orphans) == 1, orphans
    assert _status_field(orphans[0], "PPid") == str(supervisor), "the orphan re-parents to the subreaper"
    assert os.getsid(orphans[0]) == orphans[0], "the orphan left the command's session"
    signal.pidfd_send_signal(pidfd, signal.SIGUSR2)
    assert status.all() == [f"pidfd {supervisor}", status.records[1], "exit 0", "signalled 1", "empty"]
    assert _wait_until(lambda: not _marked(marker)), "the orphan survived"


# ---- spares and several requests -----------------------------------------------------------------


def test_spare_is_announced_and_renewed_after_a_request(server: Server) -> None:
    spare, spare_fd = server.next_spare()
    assert _status_field(spare, "PPid") == str(server.pid)
    signal.pidfd_send_signal(spare_fd, 0)
    assert f"Pid:\t{spare}" in Path(f"/proc/self/fdinfo/{spare_fd}").read_text()
    status = server.request(["true"], {"PATH": "/usr/bin:/bin"})
    supervisor, _ = status.supervisor()
    assert supervisor == spare, "the announced spare took the request"
    assert status.all()[1:] == [status.records[1], "exit 0", "empty"]
    following, following_fd = server.next_spare()
    assert following != spare
    assert _status_field(following, "PPid") == str(server.pid)
    signal.pidfd_send_signal(following_fd, 0)


def test_two_requests_in_a_row(server: Server) -> None:
    outputs = []
    for word in ("first", "second"):
        out_r, out_w = os.pipe()
        status = server.request(["echo", word], {"PATH": "/usr/bin:/bin"}, stdout=out_w)
        os.close(out_w)
        outputs.append(_read_all(out_r))
        assert status.all()[2:] == ["exit 0", "empty"]
    assert outputs == [b"first\n", b"second\n"]
    assert server.process.poll() is None


def test_concurrent_requests_each_get_their_own_supervisor(server: Server) -> None:
    statuses = [server.request(["sleep", "0.3"], {"PATH": "/usr/bin:/bin"}) for _ in range(3)]
    supervisors = {status.supervisor()[0] for status in statuses}
    assert len(supervisors) == 3
    for status in statuses:
        assert status.all()[2:] == ["exit 0", "empty"]


def test_large_environment_is_passed_whole(server: Server) -> None:
    # 1.5 MB: far more than the socket holds, so the spare reads it while we write.
    env = {f"BIG{k:04d}": str(k % 10) * 1000 for k in range(1500)}
    out_r, out_w = os.pipe()
    code = "import hashlib; print(hashlib.sha256(open('/proc/self/environ','rb').read()).hexdigest())"
    status = server.request([PYTHON, "-c", code], env, stdout=out_w)
    os.close(out_w)
    expected = hashlib.sha256(b"".join(f"{k}={v}\0".encode() for k, v in env.items())).hexdigest()
    assert _read_all(out_r).decode().strip() == expected
    assert status.all()[2:] == ["exit 0", "empty"]


# ---- the server's end ----------------------------------------------------------------------------


def test_closing_the_socket_ends_the_server_and_its_commands(server: Server, marker: str) -> None:
    status = server.request(["sleep", "100"], {"PATH": "/usr/bin:/bin", "M": marker})
    status.expect("pidfd ")
    status.expect("started ")
    assert _marked(marker)
    server.sock.close()
    assert server.process.wait(BOUND_S) == 0
    assert status.all() == [status.records[0], status.records[1], "signalled 1", "signal 9", "empty"]
    assert _wait_until(lambda: not _marked(marker), 2.0), "the command outlived the server"


def test_closing_the_socket_returns_once_the_commands_are_gone(server: Server, marker: str) -> None:
    # The harness waits for the server's exit at close: by then, every process of its commands must be
    # gone, even one that ignores SIGTERM in a session of its own.
    script = "trap '' TERM; (setsid sleep 100 &); sleep 100"
    status = server.request(["bash", "-c", script], {"PATH": "/usr/bin:/bin", "M": marker})
    supervisor, _ = status.supervisor()
    status.expect("started ")
    assert _wait_until(lambda: len(_marked(marker)) >= 2), _marked(marker)
    exited = os.pidfd_open(server.process.pid)
    try:
        server.sock.close()
        assert select.select([exited], [], [], BOUND_S)[0], "the server did not exit"
        # Looked at the moment the server is gone (a pidfd wakes us), not some polling later.
        assert not _live(supervisor), "the command's supervisor outlived the server's exit"
    finally:
        os.close(exited)
    assert server.process.wait(BOUND_S) == 0
    assert not _marked(marker), "processes of a command outlived the server's exit"


def test_closing_the_socket_ends_the_commands_of_a_stopped_supervisor(server: Server, marker: str) -> None:
    # A command can stop its own supervisor (same user): it would never act on its PDEATHSIG.
    status = server.request(
        ["bash", "-c", "(setsid sleep 100 &); sleep 100"], {"PATH": "/usr/bin:/bin", "M": marker}
    )
    supervisor, pidfd = status.supervisor()
    status.expect("started ")
    assert _wait_until(lambda: len(_marked(marker)) >= 2), _marked(marker)
    signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
    assert _wait_until(lambda: (_status_field(supervisor, "State") or "").startswith("T"))
    server.sock.close()
    assert server.process.wait(BOUND_S) == 0
    assert _wait_until(lambda: not _marked(marker), 2.0), f"survivors: {_marked(marker)}"


def test_sigkill_of_the_server_kills_running_commands(server: Server, marker: str) -> None:
    script = "sleep 100 & (setsid sleep 100 &) ; sleep 100"
    status = server.request(["bash", "-c", script], {"PATH": "/usr/bin:/bin", "M": marker})
    supervisor, _ = status.supervisor()
    status.expect("started ")
    assert _wait_until(lambda: len(_marked(marker)) >= 3), _marked(marker)  # bash may exec the last sleep
    spare, _ = server.next_spare()
    server.process.kill()
    server.process.wait(BOUND_S)
    assert _wait_until(lambda: not _marked(marker), 2.0), f"survivors: {_marked(marker)}"
    assert _wait_until(lambda: not _live(supervisor) and not _live(spare), 2.0)
    assert status.all()[-1] == "empty"


def test_malformed_request_ends_the_server_with_125(server: Server) -> None:
    server.next_spare()
    status = server.request(["echo", "never"], {"PATH": "/usr/bin:/bin"}, nfds=3)
    assert server.process.wait(BOUND_S) == 125
    assert status.all() == []


def test_server_has_an_empty_environment_and_is_not_dumpable(servers: list[Server]) -> None:
    nobody = 65534
    server = Server(user=nobody if os.geteuid() == 0 else None)
    servers.append(server)
    spare, _ = server.next_spare()
    for pid in (server.pid, spare):
        if os.geteuid() == 0:
            # Root reads it anyway: its content is what counts; and non-dumpable, its /proc files
            # belong to root although the process runs as nobody.
            assert Path(f"/proc/{pid}/environ").read_bytes() == b""
            assert os.stat(f"/proc/{pid}/environ").st_uid == 0
            assert (_status_field(pid, "Uid") or "").split()[:1] == [str(nobody)]
            # A process of the same user cannot read it.
            probe = subprocess.run(
                ["cat", f"/proc/{pid}/environ"],
                user=nobody,
                capture_output=True,
                timeout=BOUND_S,
                check=False,
            )
            assert probe.returncode != 0 and b"Permission denied" in probe.stderr, probe.stderr
        else:
            with pytest.raises(PermissionError):
                Path(f"/proc/{pid}/environ").read_bytes()


def test_a_request_with_five_fds_is_refused(server: Server) -> None:
    server.next_spare()
    extra = os.open(os.devnull, os.O_RDONLY)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    try:
        message = _payload(["echo", "ran"], {"PATH": "/usr/bin:/bin"}, "/")
        socket.send_fds(server.sock, [message], [theirs.fileno(), extra, out_w, extra, extra])
    finally:
        for fd in (extra, out_w):
            os.close(fd)
        theirs.close()
    status = Status(ours)
    server.statuses.append(status)
    assert status.all() == [], "a supervisor took a request with 5 fds"
    assert _read_all(out_r) == b""
    assert server.process.wait(BOUND_S) == 125


def test_a_lone_malformed_header_ends_the_server(server: Server) -> None:
    server.next_spare()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        socket.send_fds(server.sock, [(0).to_bytes(4, "big")], [null, null, null])
    finally:
        os.close(null)
    assert server.process.wait(1.0) == 125


def test_the_program_can_get_the_status_socket(server: Server) -> None:
    # status_in_program N (>= 3): the program holds the status socket as fd N; its records come first.
    # (after a pause: the supervisor's own first message must not race the program's writes)
    script = 'sleep 0.2; echo "exit 7" >&5; echo "empty" >&5'
    status = server.request(
        ["bash", "--noprofile", "--norc", "-c", script], {"PATH": "/usr/bin:/bin"}, status_in_program=5
    )
    records = status.all()
    assert records[0].startswith("pidfd ") and records[1].startswith("started ")
    assert records[2:] == ["exit 7", "empty", "exit 0", "empty"]


@pytest.mark.parametrize("value", ["0", "2", "-2", "1024", "x"])
def test_a_bad_status_in_program_is_refused(server: Server, value: str) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        payload = "\0".join(["/", value, "1", "true", "PATH=/usr/bin:/bin"]).encode() + b"\0"
        socket.send_fds(
            server.sock, [len(payload).to_bytes(4, "big") + payload], [theirs.fileno(), null, null, null]
        )
    finally:
        theirs.close()
        os.close(null)
    status = Status(ours)
    server.statuses.append(status)
    records = status.all()
    assert records[1:] == ["execfail 22", "exit 127", "empty"]  # EINVAL: nothing ran
