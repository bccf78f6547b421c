"""SSH-backend behaviour the conformance kit cannot see from outside (a real sshd, see ssh_support)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from dsh_bash_conformance import find_host_processes
from interactive_support import drive_python_repl
from ssh_support import TEST_USER, SshServer, keygen

from dsh_bash import BashExecRequest, BashInfrastructureError, BashTask, ConfigError

pytestmark = [pytest.mark.anyio, pytest.mark.ssh]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"sshtest-{os.urandom(6).hex()}"
    yield value
    for pid in find_host_processes(value):  # never leave a process behind, even when a test fails
        os.kill(pid, signal.SIGKILL)


def _marked_by(prefix: str) -> list[int]:
    """Live processes whose initial environment carries DSH_BASH_MARK=<prefix>..."""
    needle = f"DSH_BASH_MARK={prefix}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                environ = fh.read()
            with open(f"/proc/{name}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and any(entry.startswith(needle) for entry in environ.split(b"\0")):
            found.append(int(name))
    return found


def _session_sshds(server: SshServer, user: str) -> list[int]:
    """The sshd processes serving ``user``'s connections to ``server`` (children of its listener)."""
    uid = int(subprocess.run(["id", "-u", user], capture_output=True, text=True, check=True).stdout)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if comm != "sshd" or int(fields["Uid"].split()[0]) != uid:
            continue
        ancestor = pid
        while ancestor > 1:  # only children of this test's sshd, not of another one on the host
            try:
                stat = Path(f"/proc/{ancestor}/stat").read_text()
            except OSError:
                break
            ancestor = int(stat.rsplit(")", 1)[1].split()[1])
            if ancestor == server.process.pid:
                found.append(pid)
                break
    return found


async def test_fifty_concurrent_commands_queue_for_channels(ssh_server: SshServer) -> None:
    results: dict[int, str] = {}
    async with ssh_server.executor(grace_ms=300) as ex:

        async def one(i: int) -> None:
            result = await ex.exec(f"echo {i}")
            assert result.exit_code == 0, result
            results[i] = result.stdout.text

        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, i)
    assert results == {i: f"{i}\n" for i in range(50)}


async def test_rc_noise_and_login_environment_stay_out(ssh_server: SshServer) -> None:
    async with ssh_server.executor() as ex:
        result = await ex.exec("echo out; echo err >&2; bash -c 'echo nested'", stdin="ignored")
        assert (result.stdout.text, result.stderr.text) == ("out\nnested\n", "err\n")
        assert ex.resolve(BashExecRequest(command="true")).workdir == str(ssh_server.home)


async def test_root_login_kills_a_term_ignoring_background_task(ssh_server: SshServer, marker: str) -> None:
    # OpenSSH before 9.8 ignores channel signal requests for root: kills go through the kill channel.
    async with ssh_server.executor(root=True, grace_ms=300) as ex:
        assert (await ex.exec("id -u")).stdout.text == "0\n"
        loop = f"bash -c 'trap \"\" TERM; while :; do sleep 0.05; done' {marker}"
        task = await ex.start(ex.resolve(BashExecRequest(command=loop)))
        deadline = time.monotonic() + 5
        while not find_host_processes(marker):
            assert time.monotonic() < deadline, "the background loop never started"
            await anyio.sleep(0.02)
        assert await ex.kill(task.id)
        with anyio.fail_after(5):
            await task.wait()
        assert task.status == "killed"
        deadline = time.monotonic() + 2
        while find_host_processes(marker):
            assert time.monotonic() < deadline, "the TERM-ignoring loop survived the kill"
            await anyio.sleep(0.02)


async def test_no_remote_process_survives_aclose(ssh_server: SshServer, marker: str) -> None:
    async with ssh_server.executor(grace_ms=300) as ex:
        token = ex._token
        await ex.start(ex.resolve(BashExecRequest(command=f"bash -c 'sleep 60' {marker}-a; true")))
        await ex.start(
            ex.resolve(BashExecRequest(command=f"trap '' TERM; setsid bash -c 'sleep 60' {marker}-b & wait"))
        )
        # A leftover (of a background task: a foreground run's are killed when it ends).
        await ex.start(
            ex.resolve(BashExecRequest(command=f"bash -c 'sleep 60; true' {marker}-c >/dev/null 2>&1 &"))
        )
        deadline = time.monotonic() + 5
        while len(find_host_processes(marker)) < 3:
            assert time.monotonic() < deadline, "the commands never started"
            await anyio.sleep(0.02)
        assert _marked_by(token + "-")
    assert _marked_by(token + "-") == []
    assert find_host_processes(marker) == []


async def test_connection_drop_fails_the_run_and_the_next_call_reconnects(
    ssh_server: SshServer, marker: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with ssh_server.executor(grace_ms=300) as ex:
        assert (await ex.exec("echo before")).stdout.text == "before\n"
        failure: list[BaseException] = []

        async def victim() -> None:
            try:
                await ex.exec(f"bash -c 'sleep 30; true' {marker}")
            except BashInfrastructureError as exc:
                failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            deadline = time.monotonic() + 5
            while not find_host_processes(marker):
                assert time.monotonic() < deadline, "the command never started"
                await anyio.sleep(0.02)
            sshds = _session_sshds(ssh_server, TEST_USER)
            assert sshds, "no sshd process serves the executor's connection"
            dropped_at = time.monotonic()
            for pid in sshds:
                os.kill(pid, signal.SIGKILL)
        assert failure, "the run returned a result although its connection dropped"
        assert time.monotonic() - dropped_at < 3
        assert "SSH connection" in str(failure[0]) or "lost" in str(failure[0])
        result = await ex.exec("echo after")
        assert result.stdout.text == "after\n"
        assert any("reconnecting" in record.getMessage() for record in caplog.records)
        # The lost command was killed through the new connection (it carried the marker).
        deadline = time.monotonic() + 3
        while find_host_processes(marker):
            assert time.monotonic() < deadline, "the lost command kept running on the host"
            await anyio.sleep(0.05)


async def test_host_key_mismatch_says_host_key(ssh_server: SshServer, tmp_path: Path) -> None:
    keygen(tmp_path / "other")
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{ssh_server.port} {(tmp_path / 'other.pub').read_text()}")
    with pytest.raises(BashInfrastructureError, match="host key"):
        async with ssh_server.executor(known_hosts=str(known)):
            pass


async def test_wrong_client_key_says_authentication(ssh_server: SshServer, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger")
    with pytest.raises(BashInfrastructureError, match="authentication"):
        async with ssh_server.executor(client_keys=[str(tmp_path / "stranger")]):
            pass


async def test_unreachable_names_host_and_port(ssh_server: SshServer) -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BashInfrastructureError, match=f"127.0.0.1:{port}"):
        async with ssh_server.executor(port=port, connect_timeout_ms=2000):
            pass


def test_trio_is_refused_clearly(ssh_server: SshServer) -> None:
    async def body() -> None:
        async with ssh_server.executor():
            pass

    with pytest.raises(BashInfrastructureError, match="asyncio"):
        anyio.run(body, backend="trio")


def test_config_requires_a_way_to_trust_the_host() -> None:
    from dsh_bash_ssh import SshBashExecutor  # noqa: PLC0415

    with pytest.raises(ConfigError, match="known_hosts"):
        SshBashExecutor.from_fields(host="example.invalid", client_keys=["/nonexistent"])
    with pytest.raises(ConfigError, match="max_channels"):
        SshBashExecutor.from_fields(
            host="example.invalid", client_keys=["k"], known_hosts="kh", max_channels=1
        )


# -- background tasks detached on the host ----------------------------------------------------------


def _task_files(directory: str) -> list[str]:
    """The detached-task files (not spill files of foreground commands) in a spill directory."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        name
        for name in names
        if name.split(".", 1)[-1] in ("cmd", "in", "eof", "stdout", "stderr") or ".exit-" in name
    )


async def test_two_hundred_concurrent_background_tasks(ssh_server: SshServer, marker: str) -> None:
    """Detached tasks hold no channel: 200 run at once on the default 8 channels."""
    count = 200
    async with ssh_server.executor() as ex:
        assert ex.config.max_channels == 8
        gate = Path(ex.spill_dir) / "gate"  # no task ends before every task runs
        tasks: dict[int, BashTask] = {}

        async def start(i: int) -> None:
            command = f"until [ -e {gate} ]; do sleep 0.1; done; echo out-{i}; echo err-{i} >&2; exit {i % 5}"
            command += f" # {marker}"
            tasks[i] = await ex.start(ex.resolve(BashExecRequest(command=command)))

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(start, i)
        deadline = time.monotonic() + 20  # start returns once a task's supervisor runs
        while len(_marked_by(ex._token + "-")) < count:
            assert time.monotonic() < deadline, f"only {len(_marked_by(ex._token + '-'))} tasks run at once"
            await anyio.sleep(0.1)
        gate.touch()
        for i, task in tasks.items():
            with anyio.fail_after(30):
                await task.wait()
            read = await ex.read_output(task.id)
            assert (task.status, task.end_cause, task.exit_code) == ("completed", "exited", i % 5), task
            assert f"out-{i}\n" in read.delta and f"err-{i}\n" in read.delta, read.delta
        # Finished tasks leave no files behind (none of them needed a spill file).
        deadline = time.monotonic() + 5
        while _task_files(ex.spill_dir):
            assert time.monotonic() < deadline, f"task files left: {_task_files(ex.spill_dir)[:5]}"
            await anyio.sleep(0.05)
    assert find_host_processes(marker) == []


async def test_a_detached_task_outlives_a_connection_drop(ssh_server: SshServer, marker: str) -> None:
    async with ssh_server.executor(grace_ms=300) as ex:
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"echo before; sleep 1.5; echo after; exit 3 # {marker}"))
        )
        deadline = time.monotonic() + 5
        while not find_host_processes(marker):
            assert time.monotonic() < deadline, "the task never started"
            await anyio.sleep(0.02)
        for pid in _session_sshds(ssh_server, TEST_USER):
            os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(20):
            await task.wait()
        read = await ex.read_output(task.id)
        assert (task.status, task.end_cause, task.exit_code) == ("completed", "exited", 3), task
        assert read.delta == "before\nafter\n"


async def test_a_flooding_detached_task_reads_only_the_tail(ssh_server: SshServer) -> None:
    """50 MB of output with a 1000-byte window: the follower reads about the window per tick."""
    async with ssh_server.executor(max_output_bytes=1000) as ex:
        task = await ex.start(
            ex.resolve(BashExecRequest(command="head -c 50000000 /dev/zero | tr '\\0' y; echo; echo end"))
        )
        with anyio.fail_after(30):
            await task.wait()
        read = await ex.read_output(task.id)
        assert read.delta.endswith("yyy\nend\n") and len(read.delta) == 1000
        assert read.dropped_bytes == 50_000_005 - 1000
        assert task.exit_code == 0


async def test_without_sftp_background_tasks_stay_attached(
    server_without_sftp: SshServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Not even its sftp-server program over an exec channel (see tests/test_faults_ssh.py for that).
    async with server_without_sftp.executor(exec_sftp_server=False) as ex:
        tasks = [
            await ex.start(ex.resolve(BashExecRequest(command=f"sleep 0.2; echo {i}; exit {i}")))
            for i in range(3)
        ]
        for i, task in enumerate(tasks):
            with anyio.fail_after(10):
                await task.wait()
            assert task.exit_code == i
            assert (await ex.read_output(task.id)).delta == f"{i}\n"
        assert _task_files(ex.spill_dir) == []
    warnings = [r.getMessage() for r in caplog.records if "no SFTP subsystem" in r.getMessage()]
    assert len(warnings) == 1, warnings


async def test_a_lost_detached_spill_frees_its_disk_space(ssh_server: SshServer) -> None:
    """Past max_spill_bytes the task's output file keeps its size but gives its read part back."""
    total = 400_000_000
    async with ssh_server.executor(max_output_bytes=1000, max_spill_bytes=1_000_000) as ex:
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"head -c {total} /dev/zero | tr '\\0' y; sleep 30"))
        )
        spill_dir = Path(ex.spill_dir)
        deadline = time.monotonic() + 60
        while True:
            files = list(spill_dir.glob("*.stdout"))
            size = files[0].stat().st_size if files else 0
            if size >= total:
                break
            assert time.monotonic() < deadline, f"the task wrote only {size} bytes"
            await anyio.sleep(0.1)
        stat = files[0].stat()
        deadline = time.monotonic() + 20
        while stat.st_blocks * 512 > 200_000_000:
            assert time.monotonic() < deadline, f"{stat.st_blocks * 512} bytes still on disk"
            await anyio.sleep(0.1)
            stat = files[0].stat()
        assert stat.st_size == total  # offsets stay valid: holes, not truncation
        read = await ex.read_output(task.id)
        assert read.delta == "y" * 1000 and read.stdout_spill_path is None
        assert await ex.kill(task.id)


async def test_detached_tasks_and_commands_share_two_channels(ssh_server: SshServer) -> None:
    """With the smallest budget (one command slot), the follower's channel blocks nothing."""
    async with ssh_server.executor(max_channels=2) as ex:
        with anyio.fail_after(20):
            tasks = [
                await ex.start(ex.resolve(BashExecRequest(command=f"sleep 0.5; echo task-{i}")))
                for i in range(3)
            ]
            assert (await ex.exec("echo fg")).stdout.text == "fg\n"
            for i, task in enumerate(tasks):
                await task.wait()
                assert (await ex.read_output(task.id)).delta == f"task-{i}\n"


async def test_aclose_kills_many_live_detached_tasks(ssh_server: SshServer, marker: str) -> None:
    """Every task's kill and the kill by the executor's prefix share one kill channel: aclose
    neither raises (a refused kill channel would) nor leaves a task behind."""
    async with ssh_server.executor(grace_ms=500) as ex:
        token = ex._token
        for _ in range(40):
            await ex.start(ex.resolve(BashExecRequest(command=f"sleep 60; : {marker}")))
        deadline = time.monotonic() + 20
        while len(_marked_by(token + "-")) < 40:
            assert time.monotonic() < deadline, "the tasks never all started"
            await anyio.sleep(0.1)
    assert _marked_by(token + "-") == []
    assert find_host_processes(marker) == []


@pytest.mark.parametrize("containment", ["auto", "marker"])
async def test_detached_task_files_are_private(ssh_server: SshServer, containment: str) -> None:
    async with ssh_server.executor(containment=containment) as ex:
        spill_dir = Path(ex.spill_dir)
        gate = spill_dir / "gate"
        # The leftover `sleep` holds the output after the command's exit: the exit file is there
        # for a while before the eof file ends the task (and its files are removed).
        command = f"echo hi; until [ -e {gate} ]; do sleep 0.05; done; sleep 2 &"
        task = await ex.start(ex.resolve(BashExecRequest(command=command, stdin="x")))

        def modes() -> dict[str, int]:
            return {p.name.split(".", 1)[1]: p.stat().st_mode & 0o777 for p in spill_dir.glob("*.*")}

        await anyio.sleep(0.3)  # the supervisor runs the command
        if ex.containment == "subreaper":
            # dsh-supervise --detach: a short command runs as `bash -c`, its end is the status file.
            assert modes() == {"in": 0o600, "stdout": 0o600, "stderr": 0o600, "status": 0o600}
            gate.touch()
            with anyio.fail_after(10):
                await task.wait()
            assert set(modes().values()) == {0o600}, modes()
            return
        # The supervisor script runs the command from the .cmd file.
        assert modes() == {"cmd": 0o600, "in": 0o600, "stdout": 0o600, "stderr": 0o600}
        gate.touch()
        deadline = time.monotonic() + 10
        while not any(name.startswith("exit-") for name in modes()):
            assert time.monotonic() < deadline, "no exit file"
            await anyio.sleep(0.02)
        assert set(modes().values()) == {0o600}, modes()
        with anyio.fail_after(10):
            await task.wait()


async def test_the_boots_fast_unexport_holds_on_a_real_login(
    ssh_server: SshServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names SETUP saw are all that the login shell exports: BOOT's fast way alone gives the
    policy's environment (its fallback, the prefix sweep, is taken out here; tests/test_ssh_boot.py
    checks the fallback itself), the same as a warm channel's (an empty environment filled from its
    request)."""
    from dsh_bash_ssh import _scripts  # noqa: PLC0415

    def names(text: str) -> list[str]:  # values differ: SSH_CLIENT names each connection's port
        return [line.split("=", 1)[0] for line in text.splitlines() if "=" in line]

    def clear_caches() -> None:
        _scripts.boot_script.cache_clear()
        _scripts._quoted_boot.cache_clear()

    sweep = "builtin declare +x -- ${!_@}"
    with ssh_server.plant({"DSHTEST_PLANTED_TOKEN": "planted-value"}):
        async with ssh_server.executor(warm_channel=False) as ex:
            normal = await ex.exec("env | sort")
        assert sweep in _scripts._UNEXPORT
        monkeypatch.setattr(_scripts, "_UNEXPORT", _scripts._UNEXPORT.replace(sweep, "false"))
        clear_caches()
        try:
            for warm in (False, True):
                async with ssh_server.executor(warm_channel=warm) as ex:
                    assert await ex.warm_up() is warm
                    fast = await ex.exec("env | sort")
                assert "DSHTEST_PLANTED_TOKEN" not in normal.stdout.text
                assert names(fast.stdout.text) == names(normal.stdout.text), f"warm_channel={warm}"
        finally:
            monkeypatch.undo()
            clear_caches()


# -- the warm channel (dsh_bash_ssh._warm) -----------------------------------------------------------


def _waiters(user: str) -> list[int]:
    """Live processes of ``user`` waiting on a warm channel: `dsh-supervise --warm`, or a bash running
    WAITER (its text is on its command line)."""
    uid = int(subprocess.run(["id", "-u", user], capture_output=True, text=True, check=True).stdout)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            # The real uid: /proc/PID of a non-dumpable process (`dsh-supervise --warm`) is root's.
            status = Path(f"/proc/{name}/status").read_text()
            if int(status.split("\nUid:", 1)[1].split()[0]) != uid:
                continue
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (b"dsh-bash-ready" in cmdline or b"\0--warm\0" in cmdline):
            found.append(int(name))
    return found


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.02)
    return True


async def test_a_warm_channel_waits_while_open_and_is_gone_after_aclose(ssh_server: SshServer) -> None:
    # What this executor starts and leaves, apart from what another test of this worker's login left
    # (the login is shared by every test of a pytest-xdist worker).
    before = set(_waiters(TEST_USER))
    with ssh_server.plant({"DSHTEST_WARM_TOKEN": "warm-secret-value"}):
        async with ssh_server.executor() as ex:
            assert await ex.warm_up()
            waiters = [pid for pid in _waiters(TEST_USER) if pid not in before]
            assert len(waiters) == 2  # two spares (see dsh_bash_ssh._warm)
            for waiter in waiters:
                # The waiting process holds no value of the login's environment (env -i).
                assert b"warm-secret-value" not in Path(f"/proc/{waiter}/environ").read_bytes()
                assert b"warm-secret-value" not in Path(f"/proc/{waiter}/cmdline").read_bytes()
            result = await ex.exec("echo on a warm channel; env")  # takes one; then it is replaced
            assert result.stdout.text.startswith("on a warm channel\n")
            assert "DSHTEST_WARM_TOKEN" not in result.stdout.text
            assert await ex.warm_up()
            assert len(set(_waiters(TEST_USER)) - before) == 2
    assert await _until(lambda: not set(_waiters(TEST_USER)) - before), _waiters(TEST_USER)


async def test_without_a_warm_channel_none_waits(ssh_server: SshServer) -> None:
    before = set(_waiters(TEST_USER))  # another test's leftovers are not this executor's
    async with ssh_server.executor(warm_channel=False) as ex:
        assert not await ex.warm_up()
        assert (await ex.exec("echo cold")).stdout.text == "cold\n"
        assert set(_waiters(TEST_USER)) - before == set()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_warm_and_cold_channels_run_commands_alike(ssh_server: SshServer, warm: bool) -> None:
    async with ssh_server.executor(warm_channel=warm, grace_ms=300) as ex:
        for _ in range(2):  # the first may open its own channel; the second is on a warm one
            await ex.warm_up()
            result = await ex.exec(
                'printf \'%s|%s|\' "$DSHTEST_EXPLICIT" "$PWD"; cat; echo err >&2',
                env={"DSHTEST_EXPLICIT": "explicit value é"},
                stdin="from stdin\n",
                workdir="/tmp",
            )
            assert (result.exit_code, result.stdout.text, result.stderr.text) == (
                0,
                "explicit value é|/tmp|from stdin\n",
                "err\n",
            )
            await ex.warm_up()
            timed_out = await ex.exec("sleep 30", timeout_ms=300)
            assert timed_out.timed_out
            await ex.warm_up()
            with pytest.raises(BashInfrastructureError, match="does not exist"):
                await ex.exec("true", workdir="/nonexistent/dsh-bash")


async def test_a_spare_gives_its_channel_to_whoever_needs_one(ssh_server: SshServer) -> None:
    """With one command channel, a warm spare holds it: a helper script needing a channel reclaims
    the spare instead of waiting for the next command."""
    async with ssh_server.executor(max_channels=2) as ex:
        assert await ex.warm_up()
        with anyio.fail_after(10):
            code, out, _ = await ex._pool.run_script("echo helper")
        assert (code, out) == (0, b"helper\n")
        assert (await ex.exec("echo after")).stdout.text == "after\n"


async def test_a_killed_spare_is_replaced(ssh_server: SshServer) -> None:
    async with ssh_server.executor() as ex:
        assert await ex.warm_up()
        for pid in _waiters(TEST_USER):
            os.kill(pid, signal.SIGKILL)
        assert (await ex.exec("echo still runs")).stdout.text == "still runs\n"
        assert await ex.warm_up()
        assert (await ex.exec("echo and again")).stdout.text == "and again\n"


async def test_python_repl_through_a_terminal(ssh_server: SshServer) -> None:
    """Issue 17's drive: `python3 -i` on a terminal task on the SSH host; the task runs attached (open
    input needs a live channel)."""
    async with ssh_server.executor(grace_ms=300) as ex:
        await drive_python_repl(ex)
