"""dsh-supervise's --confine step (protocol 10, native/confine.c; docs/design/policy.md section 2): the
command's own process restricts itself with Landlock, no_new_privs and rlimits, then execs the
command. Each test runs the installed binary on this machine (Landlock ABI 1 or later), as root: the
rules hold for root too."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from security_support import scan_cmdlines

from dsh_bash._policy import step_variables
from dsh_bash.backend import ConfinementProbe
from dsh_bash.supervisor import confine_probe_argv, confinement_from_probe, supervisor_binary

BINARY = str(supervisor_binary())  # bin/test builds it before the tests run


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, cwd="/")


def _confined(options: list[str], script: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BINARY, "--confine", *options, "--", "bash", "--noprofile", "--norc", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """work/ (writable), home/.ssh/id (denied), home/readme, other/ (neither)."""
    for name in ("work", "home/.ssh", "other"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "home/.ssh/id").write_text("secret")
    (tmp_path / "home/readme").write_text("fine")
    (tmp_path / "other/present").write_text("present")
    return tmp_path


def test_the_probe_names_the_landlock_abi() -> None:
    done = subprocess.run(
        [BINARY, "--confine", "--probe"], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 0
    word, abi = done.stdout.split()[:2]
    assert word == "landlock" and int(abi) >= 1  # MECHANICS.md: ABI 7 on these machines
    assert confinement_from_probe(done.returncode, done.stdout.encode()).landlock_abi == int(abi)
    # A binary without the step (protocol 9 and older) answers with a usage error: no Landlock.
    assert confinement_from_probe(125, b"").landlock_abi == 0
    assert confinement_from_probe(0, b"dsh-supervise 9\n").landlock_abi == 0
    assert confine_probe_argv(BINARY) == [BINARY, "--confine", "--probe"]


def test_writes_go_only_beneath_the_writable_paths(tree: Path) -> None:
    script = f"""
    cd {tree}
    echo in > work/new && echo wrote-inside
    echo out > other/new || echo refused-new
    echo out >> other/present || echo refused-append
    mv work/new other/moved || echo refused-move-out
    mv other/present work/taken || echo refused-move-in
    ln other/present work/hard || echo refused-link
    rm other/present || echo refused-remove
    mkdir other/d || echo refused-mkdir
    """
    done = _confined(["--write", str(tree / "work")], script)
    assert done.stdout.split() == [
        "wrote-inside", "refused-new", "refused-append", "refused-move-out", "refused-move-in",
        "refused-link", "refused-remove", "refused-mkdir",
    ], done.stderr  # fmt: skip
    assert (tree / "other/present").read_text() == "present"
    assert sorted(p.name for p in (tree / "other").iterdir()) == ["present"]


def test_a_denied_path_cannot_be_read_by_any_way_in_nor_written(tree: Path) -> None:
    (tree / "work/link").symlink_to(tree / "home/.ssh/id")
    secret = tree / "home/.ssh/id"
    unshare = shutil.which("unshare")  # util-linux: a child in new user and mount namespaces
    assert unshare is not None
    script = f"""
    cat {secret} || echo refused-direct
    cat {tree}/work/link || echo refused-link
    cat /proc/self/root{secret} || echo refused-proc-root
    cat {tree}/home/../home/.ssh/id || echo refused-dotdot
    ln {secret} {tree}/work/hard || echo refused-hard-link
    {unshare} -Urm cat {secret} || echo refused-namespace
    echo planted > {tree}/home/.ssh/authorized_keys || echo refused-write
    cat {tree}/home/readme; echo
    ls -A {tree}/home | tr '\\n' ' '; echo
    """
    done = _confined(["--write", str(tree / "work"), "--deny-read", str(tree / "home/.ssh")], script)
    lines = done.stdout.splitlines()
    assert lines[:7] == [
        "refused-direct", "refused-link", "refused-proc-root", "refused-dotdot", "refused-hard-link",
        "refused-namespace", "refused-write",
    ], done.stderr  # fmt: skip
    assert lines[7:] == ["fine", ".ssh readme "], "the rest of the tree reads as before"
    assert "secret" not in done.stdout
    assert not (tree / "home/.ssh/authorized_keys").exists()


def test_a_writable_directory_on_the_way_to_a_denied_one_keeps_its_other_entries_writable(tree: Path) -> None:
    """The working directory is the user's home, and ~/.ssh is denied: home's entries stay writable,
    ~/.ssh is neither readable nor writable; a new entry right in home is refused (listing only)."""
    home = tree / "home"
    (home / "project").mkdir()
    script = f"""
    echo ok > {home}/project/f && echo wrote-beneath
    echo more >> {home}/readme && echo appended-sibling
    cat {home}/.ssh/id || echo refused-read
    echo x > {home}/.ssh/id || echo refused-write
    echo x > {home}/new-entry || echo refused-new-entry
    """
    done = _confined(["--write", str(home), "--deny-read", str(home / ".ssh")], script)
    assert done.stdout.split() == [
        "wrote-beneath",
        "appended-sibling",
        "refused-read",
        "refused-write",
        "refused-new-entry",
    ], done.stderr
    assert (home / ".ssh/id").read_text() == "secret"


def test_a_command_cannot_lift_the_rules_for_itself_or_its_children(tree: Path) -> None:
    """A nested --confine that names more writable paths adds a layer: it narrows, never widens;
    no_new_privs holds (a setuid program cannot shed the rules); signals to processes outside are
    refused (Landlock's scoping, ABI 6), to its own children not."""
    script = f"""
    {BINARY} --confine --write / -- bash -c 'echo x > {tree}/other/new' || echo refused-after-nesting
    grep -q '^NoNewPrivs:[[:space:]]*1' /proc/self/status && echo no-new-privs
    kill -0 {os.getpid()} || echo refused-signal-out
    sleep 30 & kill $! && wait $!; echo own-child-$?
    """
    done = _confined(["--write", str(tree / "work")], script)
    assert done.stdout.split() == [
        "refused-after-nesting",
        "no-new-privs",
        "refused-signal-out",
        f"own-child-{128 + signal.SIGTERM}",
    ], done.stderr
    assert not (tree / "other/new").exists()


def test_limits_hold_soft_and_hard(tree: Path) -> None:
    script = f"""
    ulimit -n; ulimit -Hn; ulimit -v; ulimit -f
    ulimit -Hn 4096 || echo refused-raise
    head -c 4096 /dev/zero > {tree}/work/big; echo file-status-$?
    """
    limits = ["--open-files", "64", "--memory-bytes", str(2**30), "--file-bytes", "2048"]
    done = _confined(["--write", str(tree / "work"), *limits], script)
    # bash's ulimit -f counts KiB: 2048 bytes are 2; the write past them dies of SIGXFSZ.
    assert done.stdout.split() == [
        "64",
        "64",
        str(2**30 // 1024),
        "2",
        "refused-raise",
        f"file-status-{128 + signal.SIGXFSZ}",
    ], done.stderr
    assert (tree / "work/big").stat().st_size == 2048


def test_cpu_time_is_limited() -> None:
    done = _confined(["--cpu-seconds", "1"], "while :; do :; done", timeout=30)
    assert done.returncode == -signal.SIGXCPU, done  # bash itself was exec'd: it dies of the signal


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--write", "relative", "--", "true"], "absolute"),
        (["--cpu-seconds", "-1", "--", "true"], "number"),
        (["--bogus", "x", "--", "true"], "not one of its options"),
        (["--network", "some", "--", "true"], "none, loopback or allow-list"),
        (["--write", "/tmp"], "usage"),
        (["--", "/no/such/program"], "cannot run"),
    ],
)
def test_what_cannot_be_applied_is_refused_and_nothing_runs(options: list[str], said: str) -> None:
    done = subprocess.run(
        [BINARY, "--confine", *options], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 125 and said in done.stderr, done


def test_a_path_that_does_not_exist_is_skipped(tree: Path) -> None:
    done = _confined(
        ["--write", str(tree / "work"), "--write", "/no/such/dir", "--deny-read", "/no/such/secret"],
        f"echo x > {tree}/work/f && echo ran",
    )
    assert done.stdout == "ran\n", done.stderr


def test_a_path_under_home_is_the_commands_home(tree: Path) -> None:
    done = subprocess.run(
        [BINARY, "--confine", "--write", "/", "--deny-read", "~/.ssh", "--", "cat", f"{tree}/home/.ssh/id"],
        env={**os.environ, "HOME": str(tree / "home")},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert done.returncode == 1 and "Permission denied" in done.stderr, done


# -- network (protocol 11) ---------------------------------------------------------------------------

_SOCKETS = """
import ctypes, errno, socket
def attempt(name, make):
    try:
        make().close()
        print(name, "ok")
    except OSError as exc:
        print(name, errno.errorcode.get(exc.errno, exc.errno))
attempt("tcp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
attempt("udp6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
attempt("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
attempt("socketpair", lambda: socket.socketpair()[0])
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 1, params)  # io_uring_setup: its socket operation would pass by seccomp
print("io_uring", "ok" if fd >= 0 else errno.errorcode.get(ctypes.get_errno()))
"""


def test_network_none_leaves_no_socket() -> None:
    """Not even a unix one: a socket file (a Docker engine's) is reached by its path, and nothing
    here can tell one path from another; a socketpair reaches nothing and stays."""
    done = subprocess.run(
        [BINARY, "--confine", "--write", "/", "--network", "none", "--", sys.executable, "-c", _SOCKETS],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.stdout.split("\n")[:-1] == [
        "tcp EACCES", "udp6 EACCES", "netlink EACCES", "unix EACCES", "socketpair ok", "io_uring EACCES"
    ], done.stderr  # fmt: skip
    unconfined = _run([sys.executable, "-c", _SOCKETS])
    assert unconfined.stdout.split("\n")[:5] == [
        "tcp ok",
        "udp6 ok",
        "netlink ok",
        "unix ok",
        "socketpair ok",
    ]


_LOOPBACK = """
echo x > /dev/udp/127.0.0.1/9 && echo own-loopback
echo x > /dev/udp/198.51.100.1/9 && echo outside
tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '
id -u
"""


@pytest.mark.parametrize("uid", [0, 65534])
def test_network_loopback_is_a_network_of_its_own(uid: int) -> None:
    """Its own loopback, up; no other interface, so no route out."""
    as_user = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    argv = [*as_user, BINARY, "--confine", "--write", "/", "--network", "loopback", "--", "bash", "-c"]
    done = _run([*argv, _LOOPBACK])
    assert done.stdout.split() == ["own-loopback", "lo", str(uid)], done.stderr
    assert "Network is unreachable" in done.stderr
    # Unconfined, the same user sees this machine's interfaces (and reaches the outside where it has a
    # route: not asserted, a machine may have none).
    baseline = _run([*as_user, "bash", "-c", _LOOPBACK]).stdout.split()
    assert baseline[0] == "own-loopback"
    assert set(baseline) - {"own-loopback", "outside", "lo", str(uid)}, baseline


def test_root_under_network_loopback_keeps_its_files_and_cannot_go_back(tmp_path: Path) -> None:
    """Every id maps to itself (root reads another user's private file as before); root of the new
    user namespace has no right over the host's network namespace."""
    private = tmp_path / "private"
    private.write_text("mine")
    os.chown(private, 65534, 65534)
    private.chmod(0o600)
    script = f"cat {private}; echo; stat -c %u {private}; nsenter --net=/proc/1/ns/net true || echo refused"
    done = _confined(["--write", "/", "--network", "loopback"], script)
    assert done.stdout.split() == ["mine", "65534", "refused"], done.stderr


def test_the_probe_says_where_loopback_can_hold() -> None:
    done = subprocess.run([BINARY, "--confine", "--probe"], capture_output=True, timeout=10, check=False)
    probe = confinement_from_probe(done.returncode, done.stdout)
    assert probe.loopback is True  # user namespaces work on this host (MECHANICS.md)
    assert confinement_from_probe(0, b"landlock 7\n") == ConfinementProbe(landlock_abi=7, loopback=False)
    assert confinement_from_probe(0, b"landlock 7\nloopback 0\n").loopback is False
    assert confinement_from_probe(1, b"landlock 7\nloopback 1\n") == ConfinementProbe()


# -- processes (protocol 11) -------------------------------------------------------------------------

#: Forks a subshell at a time (each sleeps) and counts aloud; dash gives up at the first fork that
#: fails ("Cannot fork"), where bash would retry for seconds.
_FORKS = "n=0; while [ $n -lt 40 ]; do (sleep 5) >/dev/null 2>&1 & n=$((n+1)); echo $n; done; echo all"


def _pids_cgroups() -> set[str]:
    base = Path("/sys/fs/cgroup/pids/dsh-bash")
    return {p.name for p in base.iterdir() if p.name.startswith("cmd-")} if base.is_dir() else set()


def test_processes_are_limited_in_a_pids_cgroup_of_the_commands_own() -> None:
    done = _run(
        [
            BINARY,
            "--confine",
            "--write",
            "/",
            "--processes",
            "12",
            "--",
            "sh",
            "-c",
            _FORKS + "; cat /proc/self/cgroup",
        ]
    )
    counted = [line for line in done.stdout.split() if line.isdigit()]
    assert "Cannot fork" in done.stderr and "all" not in done.stdout.split(), done
    assert 8 <= len(counted) < 12, counted  # the step's shell and its subshells count too
    unconfined = _run(["sh", "-c", _FORKS.replace("sleep 5", "true")])
    assert unconfined.stdout.split()[-1] == "all"


def test_a_cgroup_left_empty_is_removed_by_the_next_step() -> None:
    first = _run([BINARY, "--confine", "--write", "/", "--processes", "4", "--", "cat", "/proc/self/cgroup"])
    [mine] = [line.split(":", 2)[2] for line in first.stdout.splitlines() if ":pids:" in line]
    left = mine.rsplit("/", 1)[-1]
    assert left.startswith("cmd-") and left in _pids_cgroups(), (mine, _pids_cgroups())
    _run([BINARY, "--confine", "--write", "/", "--processes", "4", "--", "true"])
    assert left not in _pids_cgroups()


_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.parametrize(
    ("network", "nested"),
    [([], False), (["--network", "loopback"], False), ([], True)],
    ids=["alone", "loopback", "nested"],
)
def test_processes_of_a_user_without_cgroups_are_counted_in_a_user_namespace_of_their_own(
    network: list[str], nested: bool
) -> None:
    """Protocol 12: RLIMIT_NPROC in a user namespace of the command's own (the network rule's, where
    it makes one) counts that command's processes only: twenty sleeping processes of the same user
    outside do not use up its limit, and a namespace nested inside still counts at its own."""
    assert os.geteuid() == 0, "the test becomes uid 65534 with setpriv"
    outside = subprocess.Popen(
        [*_AS_NOBODY, "sh", "-c", "for i in $(seq 20); do sleep 30 & done; echo started; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert outside.stdout is not None and outside.stdout.readline() == "started\n"
        forks = f"unshare -U sh -c '{_FORKS}'" if nested else _FORKS
        argv = [*_AS_NOBODY, BINARY, "--confine", "--write", "/", "--processes", "12", *network, "--"]
        done = _run([*argv, "sh", "-c", forks])
        counted = [line for line in done.stdout.split() if line.isdigit()]
        assert "all" not in done.stdout.split() and 6 <= len(counted) < 12, done
        probe = confinement_from_probe(0, _run([*_AS_NOBODY, BINARY, "--confine", "--probe"]).stdout.encode())
        assert (probe.processes, probe.loopback) == (True, True)
    finally:
        os.killpg(outside.pid, signal.SIGKILL)
        outside.wait()


# -- network allow-list: the forwarder (protocol 11) ------------------------------------------------

_VIA_PROXY = """
echo "proxy $HTTPS_PROXY $http_proxy $NO_PROXY"
exec 3<>/dev/tcp/127.0.0.1/3128 && printf 'hello proxy\\n' >&3 && IFS= read -r line <&3 && echo "got $line"
"""


def test_allow_list_hands_each_connection_to_the_proxy_and_leaves_nothing() -> None:
    """127.0.0.1:3128 in the command's own network: each connection reaches the proxy (here: a
    server that answers on each descriptor it is handed), the proxy variables name it, and the
    forwarder ends with the command."""
    name = f"@dsh-test-{os.getpid()}-{time.monotonic_ns()}"
    server = subprocess.Popen([sys.executable, "-c", _FD_SERVER, name], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", name, "--"]
        done = _run([*argv, "bash", "-c", _VIA_PROXY + _VIA_PROXY.split("\n", 2)[2]])
        assert done.stdout.splitlines() == [
            "proxy http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1,::1",
            "got proxy-side: hello proxy",
            "got proxy-side: hello proxy",
        ], done.stderr
        time.sleep(0.2)  # SIGKILL at its parent's death: the kernel's, at once; then reaped by init
        assert [pid for pid, _, _ in scan_cmdlines([name.encode()]) if pid != server.pid] == []
    finally:
        server.kill()
        server.wait()


def test_allow_list_without_its_proxy_runs_nothing() -> None:
    argv = [
        BINARY,
        "--confine",
        "--write",
        "/",
        "--network",
        "allow-list",
        "--proxy",
        "@dsh-test-nobody-listens",
    ]
    done = _run([*argv, "--", "echo", "ran"])
    assert done.returncode == 125 and "cannot reach the egress proxy" in done.stderr and done.stdout == ""


# -- network allow-list through a proxy's socket file (protocol 12: an SSH host's) ------------------

#: In the command's network: an exchange through the forwarder that half-closes (what it sent, then
#: EOF), and one that sends 4 MB while the other end echoes it back (a relay that waits on one
#: direction at a time would stall there).
_THROUGH_FILE = """
import hashlib, socket, threading
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"hello")
s.shutdown(socket.SHUT_WR)
print(b"".join(iter(lambda: s.recv(65536), b"")).decode())
big = bytes(range(256)) * (4 * 4096)
s = socket.create_connection(("127.0.0.1", 3128))
threading.Thread(target=lambda: (s.sendall(big), s.shutdown(socket.SHUT_WR)), daemon=True).start()
back = b"".join(iter(lambda: s.recv(65536), b""))
print(len(back), back == big)
"""

#: Each connection to the socket file: "half:" and what came before EOF, or (past 1000 bytes) all
#: of it echoed as it comes.
_FILE_SERVER = """
import os, socket, sys, threading
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("listening", flush=True)
def answer(conn):
    with conn:
        first = conn.recv(65536)
        if len(first) < 1000:
            rest = b"".join(iter(lambda: conn.recv(65536), b""))
            conn.sendall(b"half:" + first + rest)
            return
        while first:
            conn.sendall(first)
            first = conn.recv(65536)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=answer, args=(conn,), daemon=True).start()
"""


def test_allow_list_relays_each_connection_to_a_proxy_file(tmp_path: Path) -> None:
    """--proxy PATH: each connection the forwarder accepts goes through a connection of its own to
    the socket file, both ways at once, and an EOF is passed on as a half close; nothing is left."""
    path = str(tmp_path / "egress.sock")
    server = subprocess.Popen([sys.executable, "-c", _FILE_SERVER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", path, "--"]
        done = _run([*argv, sys.executable, "-c", _THROUGH_FILE])
        assert done.stdout.splitlines() == ["half:hello", f"{4 * 4096 * 256} True"], done.stderr
        time.sleep(0.2)  # SIGKILL at its parent's death: the kernel's, at once; then reaped by init
        assert [pid for pid, _, _ in scan_cmdlines([path.encode()]) if pid != server.pid] == []
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("kind", ["missing", "not a socket", "too long"])
def test_allow_list_without_its_proxy_file_runs_nothing(tmp_path: Path, kind: str) -> None:
    path = {
        "missing": str(tmp_path / "nobody.sock"),
        "not a socket": str(tmp_path),
        "too long": "/" + "x" * 120,
    }[kind]
    argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", path]
    done = _run([*argv, "--", "echo", "ran"])
    assert done.returncode == 125 and done.stdout == "", done
    expected = "a unix socket's path is at most" if kind == "too long" else "cannot reach the egress proxy"
    assert expected in done.stderr and (kind != "not a socket" or "not a socket" in done.stderr), done.stderr


#: Answers on every descriptor it is handed (as the egress proxy is), on an abstract socket.
_FD_SERVER = """
import array, socket, sys, threading
listener = socket.socket(socket.AF_UNIX)
listener.bind("\\0" + sys.argv[1][1:])
listener.listen()
print("listening", flush=True)
def answer(conn):
    with conn:
        conn.sendall(b"proxy-side: " + conn.recv(1024))
def control(conn):
    while True:
        msg, fds, _, _ = socket.recv_fds(conn, 1, 1)
        if not msg:
            return
        threading.Thread(target=answer, args=(socket.socket(fileno=fds[0]),), daemon=True).start()
while True:
    conn, _ = listener.accept()
    threading.Thread(target=control, args=(conn,), daemon=True).start()
"""


@pytest.mark.parametrize(
    "options",
    [
        ["--network", "allow-list"],
        ["--proxy", "/tmp/x.sock"],
        ["--network", "loopback", "--proxy", "/tmp/x.sock"],
    ],
)
def test_allow_list_and_its_proxy_go_together(options: list[str]) -> None:
    done = _run([BINARY, "--confine", "--write", "/", *options, "--", "echo", "ran"])
    assert done.returncode == 125 and "go together" in done.stderr and done.stdout == "", done


# -- the proxy's key (protocol 13): a confined command cannot use another list's socket file ---------

#: One connection to the socket file: prints what came before the first request byte (the relay's
#: key line), then answers "ok".
_KEY_SERVER = """
import socket, sys
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("listening", flush=True)
conn, _ = listener.accept()
seen = b""
while not seen.endswith(b"REQUEST"):
    got = conn.recv(65536)
    if not got:
        break
    seen += got
print(repr(seen), flush=True)
conn.sendall(b"ok")
conn.close()
"""

#: In the command's network, through the forwarder: whether the key is in its environment, a
#: request, and whether the forwarder's initial environment (which held the key) can be read.
_SEND_REQUEST = """
import os, socket
print("key in environment" if "DSH_TEST_KEY" in os.environ else "no key in environment")
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"REQUEST")
print(s.recv(100).decode())
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if b"--proxy-key-env" in cmdline and int(pid) != os.getpid():
        try:
            open(f"/proc/{pid}/environ", "rb").read()
            print("forwarder readable")
        except OSError as exc:
            print("forwarder unreadable", exc.errno)
"""


def test_each_relay_sends_the_proxy_key_first_and_the_command_never_has_it(tmp_path: Path) -> None:
    """--proxy-key-env NAME: the key is taken out of the environment (the command never sees it)
    and sent with a newline before the first byte of each relayed connection; the forwarder's initial
    environment (which /proc shows, a copy of the step's) has it zeroed."""
    key = "0123456789abcdef" * 2
    path = str(tmp_path / "egress.sock")
    server = subprocess.Popen([sys.executable, "-c", _KEY_SERVER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", path]
        argv += ["--proxy-key-env", "DSH_TEST_KEY", "--", sys.executable, "-c", _SEND_REQUEST]
        env = {**os.environ, "DSH_TEST_KEY": key}
        # The command waits on its stdin until this process has looked at its forwarder's initial
        # environment (as root: whatever the forwarder's dumpability) for the key's bytes.
        step = subprocess.Popen(
            [*argv[:-1], "import sys; sys.stdin.readline()\n" + _SEND_REQUEST],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        forwarders_environ: list[bytes] = []
        deadline = time.monotonic() + 10
        while not forwarders_environ and time.monotonic() < deadline:
            time.sleep(0.05)
            for pid, _, _ in scan_cmdlines([b"--proxy-key-env"]):
                if pid != step.pid:
                    with contextlib.suppress(OSError):
                        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                        named = [entry for entry in entries if entry.startswith(b"DSH_TEST_KEY=")]
                        forwarders_environ += [entry.removeprefix(b"DSH_TEST_KEY=") for entry in named]
        out, err = step.communicate("go\n", timeout=30)
        done = subprocess.CompletedProcess(argv, step.returncode, out, err)
        lines = done.stdout.splitlines()
        assert lines[:2] == ["no key in environment", "ok"], done.stderr
        assert forwarders_environ == [b""], forwarders_environ
        # The forwarder and a relay still ending: root of its own user namespace here, the command
        # holds no capability over their memory, which belongs to the first namespace.
        assert lines[2:] and set(lines[2:]) == {f"forwarder unreadable {errno.EACCES}"}, done.stdout
        assert server.stdout.readline() == repr(f"{key}\nREQUEST".encode()) + "\n"
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, "the environment has no such variable"),
        ("short", "not a key"),
        ("0123456789ABCDEF0123", "not a key"),  # lowercase only
        ("0123456789abcdef" * 9, "not a key"),  # 144 digits
        ("", "not a key"),
    ],
)
def test_a_key_that_is_missing_or_no_key_runs_nothing(tmp_path: Path, value: str | None, said: str) -> None:
    path = tmp_path / "egress.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    env = {name: v for name, v in os.environ.items() if name != "DSH_TEST_KEY"}
    if value is not None:
        env["DSH_TEST_KEY"] = value
    try:
        argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", str(path)]
        argv += ["--proxy-key-env", "DSH_TEST_KEY", "--", "echo", "ran"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=False)
    finally:
        listener.close()
    assert done.returncode == 125 and done.stdout == "" and said in done.stderr, done


def test_a_key_goes_only_with_a_proxy_file() -> None:
    argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", "@abstract"]
    done = _run([*argv, "--proxy-key-env", "DSH_TEST_KEY", "--", "echo", "ran"])
    assert done.returncode == 125 and "goes with --proxy PATH" in done.stderr and done.stdout == "", done


def test_the_variables_the_step_sets_are_those_a_session_knows_as_its(tmp_path: Path) -> None:
    """The step sets the proxy variables (native/egress.c); dsh_bash._policy.step_variables says
    which of a command's variables hold what it set, so that a session does not keep them: the two
    lists of names must be one. In a network of its own the step listens on 3128."""
    path = tmp_path / "egress.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    try:
        argv = [BINARY, "--confine", "--write", "/", "--network", "allow-list", "--proxy", str(path)]
        done = _run(
            [*argv, "--", sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]
        )
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout)
    set_by_step = {
        name: value
        for name, value in env.items()
        if "proxy" in name.lower() and os.environ.get(name) != value
    }
    assert set_by_step and step_variables(env) == set_by_step, set_by_step
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:3128"
