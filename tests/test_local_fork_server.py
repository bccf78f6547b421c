"""The local backend's dsh-supervise fork server, seen from the executor.

Every command of a ``LocalBashExecutor`` is a request to one ``dsh-supervise --fork-server``; these
tests check that requests in a row and at once all come back right, that a command which kills the
server or stops its spare does not stall the next command, and that a bash which cannot be exec'd
is reported at start. Each test is bounded by a few seconds (``anyio.fail_after``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import anyio
import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import BashExecRequest, BashInfrastructureError
from dsh_bash.supervisor._native import supervisor_binary, supervisor_problem

pytestmark = pytest.mark.anyio

if supervisor_binary() is None:
    pytest.skip(f"backend unavailable: {supervisor_problem()}", allow_module_level=True)

BOUND_S = 3.0

#: From a command: its supervisor is $PPID (bash's parent), the fork server is the supervisor's parent.
SERVER_PID = "$(awk '/^PPid:/{print $2}' /proc/$PPID/status)"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _executor(**fields: object) -> LocalBashExecutor:
    return LocalBashExecutor(LocalConfig(grace_ms=300, **fields))  # type: ignore[arg-type]


def _server_pid(ex: LocalBashExecutor) -> int:
    """The fork server's pid, as the executor knows it (a test's look inside)."""
    server = ex._server
    assert server is not None and server._popen is not None, "no fork server: containment is not subreaper"
    return server._popen.pid


async def test_many_commands_in_a_row() -> None:
    async with _executor() as ex:
        assert ex.containment == "subreaper"
        with anyio.fail_after(BOUND_S * 2):
            for i in range(50):
                result = await ex.exec(f"echo {i}; echo e{i} >&2")
                assert (result.exit_code, result.stdout.text, result.stderr.text) == (0, f"{i}\n", f"e{i}\n")


async def test_concurrent_commands() -> None:
    results: dict[int, tuple[int | None, str]] = {}
    async with _executor() as ex:

        async def one(i: int) -> None:
            result = await ex.exec(f"sleep 0.0{i % 10}; echo {i}; exit {i % 7}")
            results[i] = (result.exit_code, result.stdout.text)

        with anyio.fail_after(BOUND_S):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
    assert results == {i: (i % 7, f"{i}\n") for i in range(20)}


async def test_requests_that_fill_the_servers_socket_wait_their_turn() -> None:
    """Requests too large for the socket's buffer at once (a large environment each, many commands
    started together): each waits for room in turn, whole, never interleaved with another's bytes
    (two waits on the socket at once failed one start with anyio's BusyResourceError)."""
    results: dict[int, tuple[int | None, str]] = {}
    async with _executor(env_allow=["DSH_BIG_*"]) as ex:

        async def one(i: int) -> None:
            env = {"DSH_BIG_VALUE": str(i) * 60_000}
            result = await ex.exec(f"echo {i} ${{#DSH_BIG_VALUE}}", env=env)
            results[i] = (result.exit_code, result.stdout.text)

        with anyio.fail_after(BOUND_S * 4):
            async with anyio.create_task_group() as tg:
                for i in range(1, 41):
                    tg.start_soon(one, i)
    assert results == {i: (0, f"{i} {60_000 * len(str(i))}\n") for i in range(1, 41)}


async def test_commands_run_under_a_supervisor_of_the_server() -> None:
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            result = await ex.exec(f"echo {SERVER_PID}")
        assert int(result.stdout.text) == _server_pid(ex)


async def test_stdin_is_passed() -> None:
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            result = await ex.exec("cat", stdin="hello")
            assert (result.exit_code, result.stdout.text) == (0, "hello")
            # No stdin given: /dev/null, so cat ends at once.
            result = await ex.exec("cat; echo done")
            assert result.stdout.text == "done\n"


async def test_workdir_and_env_reach_the_command(tmp_path: Path) -> None:
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            result = await ex.exec(
                'pwd; echo "$DSH_FS_TEST"', workdir=str(tmp_path), env={"DSH_FS_TEST": "v 1"}
            )
        assert result.stdout.text == f"{tmp_path}\nv 1\n"


async def test_a_command_that_kills_the_server_ends_and_the_next_runs() -> None:
    async with _executor() as ex:
        first = _server_pid(ex)
        with anyio.fail_after(BOUND_S):
            # SIGKILL of the server: its supervisors get SIGUSR2 (PDEATHSIG) and kill their commands.
            # It ends either way: a result (killed by a signal) or an infrastructure error (lost).
            with contextlib.suppress(BashInfrastructureError):
                result = await ex.exec(f"kill -9 {SERVER_PID}; sleep 100")
                assert result.exit_code != 0
        with anyio.fail_after(BOUND_S):
            result = await ex.exec("echo after")
        assert (result.exit_code, result.stdout.text) == (0, "after\n")
        assert _server_pid(ex) != first, "a new server was started"
        with anyio.fail_after(BOUND_S):
            for i in range(3):
                assert (await ex.exec(f"echo {i}")).stdout.text == f"{i}\n"


async def test_a_stopped_spare_is_continued_before_the_next_request() -> None:
    # The spare is the server's child that is not this command's supervisor ($PPID). It is forked a
    # little after a request was taken: wait for it, then stop it.
    stop_spares = (
        f"s={SERVER_PID}; n=0; "
        "for _ in $(seq 100); do "
        "  for c in $(cat /proc/$s/task/$s/children); do "
        '    if [ "$c" != "$PPID" ]; then kill -STOP "$c" && n=$((n+1)); fi; '
        "  done; "
        '  [ "$n" -gt 0 ] && break; sleep 0.01; '
        "done; echo $n"
    )
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            result = await ex.exec(stop_spares)
        assert int(result.stdout.text) >= 1, "no spare was found to stop"
        with anyio.fail_after(BOUND_S):
            for i in range(3):
                assert (await ex.exec(f"echo {i}")).stdout.text == f"{i}\n"


def _alive(pid: int) -> bool:
    try:
        state = next(
            line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:")
        )
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split(":", 1)[1]


async def test_a_stopped_spare_does_not_outlive_the_executor() -> None:
    # A stopped spare cannot act on the SIGUSR2 its server's death sends it: closing must not rely on it.
    stop_the_spare = (
        f"s={SERVER_PID}; "
        "for _ in $(seq 100); do "
        "  for c in $(cat /proc/$s/task/$s/children); do "
        '    [ "$c" != "$PPID" ] && kill -STOP "$c" && echo "$c" && exit 0; '
        "  done; sleep 0.01; "
        "done; exit 1"
    )
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            result = await ex.exec(stop_the_spare)
        assert result.exit_code == 0, "no spare was found to stop"
        spare = int(result.stdout.text)
    with anyio.fail_after(BOUND_S):
        while _alive(spare):  # noqa: ASYNC110 - a process, not an event
            await anyio.sleep(0.02)


async def test_a_stopped_server_does_not_stall_later_commands() -> None:
    # A command of the same user may stop the server itself: no next spare is forked until the
    # server runs again (the stopping command's own request was taken before).
    stalled = False
    async with _executor() as ex:
        server = _server_pid(ex)
        try:
            with anyio.fail_after(BOUND_S):
                await ex.exec(f"kill -STOP {SERVER_PID}")
            with anyio.fail_after(0.5):
                for i in range(3):
                    assert (await ex.exec(f"echo {i}")).stdout.text == f"{i}\n"
        except TimeoutError:
            stalled = True
        finally:
            os.kill(server, signal.SIGCONT)  # so that closing the executor does not wait for it
    assert not stalled, "a command after the server was stopped never ran"


async def test_a_killed_spare_is_replaced() -> None:
    kill_spares = (
        f"s={SERVER_PID}; sleep 0.1; "
        "for c in $(cat /proc/$s/task/$s/children); do "
        '  [ "$c" != "$PPID" ] && kill -9 "$c"; '
        "done; true"
    )
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            await ex.exec(kill_spares)
            for i in range(3):
                assert (await ex.exec(f"echo {i}")).stdout.text == f"{i}\n"


async def test_missing_bash_is_shell_missing() -> None:
    async with _executor(bash="/nonexistent/bash") as ex:
        with anyio.fail_after(BOUND_S), pytest.raises(BashInfrastructureError) as caught:
            await ex.exec("true")
        assert caught.value.reason == "shell_missing"


def _unexecutable_bash(tmp_path: Path) -> str:
    """A 'bash' found on the path (executable) whose exec fails: its interpreter is missing (ENOENT),
    so the supervisor reports ``execfail 2``."""
    fake = tmp_path / "bash"
    fake.write_text("#!/nonexistent/dsh-interpreter\n")
    fake.chmod(0o755)
    return str(fake)


async def test_bash_that_cannot_exec_is_shell_missing_in_the_foreground(tmp_path: Path) -> None:
    async with _executor(bash=_unexecutable_bash(tmp_path)) as ex:
        with anyio.fail_after(BOUND_S), pytest.raises(BashInfrastructureError) as caught:
            await ex.exec("true")
        assert caught.value.reason == "shell_missing"
        assert "No such file" in str(caught.value)


async def test_bash_that_cannot_exec_is_shell_missing_at_background_start(tmp_path: Path) -> None:
    async with _executor(bash=_unexecutable_bash(tmp_path)) as ex:
        with anyio.fail_after(BOUND_S), pytest.raises(BashInfrastructureError) as caught:
            await ex.start(ex.resolve(BashExecRequest(command="sleep 1")))
        assert caught.value.reason == "shell_missing"


async def test_missing_workdir_is_reported(tmp_path: Path) -> None:
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S), pytest.raises(BashInfrastructureError) as caught:
            await ex.exec("true", workdir=str(tmp_path / "gone"))
        assert caught.value.reason == "workdir_missing"


async def test_background_command_runs_and_its_output_is_read() -> None:
    async with _executor() as ex:
        with anyio.fail_after(BOUND_S):
            task = await ex.start(ex.resolve(BashExecRequest(command="echo bg; exit 3")))
            while task.status == "running":  # noqa: ASYNC110 - a property, not an event
                await anyio.sleep(0.01)
            read = await ex.read_output(task.id)
        assert task.exit_code == 3
        assert "bg" in read.delta


async def test_the_server_ends_when_the_executor_closes() -> None:
    async with _executor() as ex:
        await ex.exec("true")
        pid = _server_pid(ex)
        pidfd = os.pidfd_open(pid)
    try:
        # Reaped by aclose: the pidfd is readable (the process is gone).
        with anyio.fail_after(BOUND_S):
            await anyio.wait_readable(pidfd)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    finally:
        os.close(pidfd)


async def test_a_command_cancelled_before_its_supervisor_answered_is_released_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _executor() as ex:
        server = _server_pid(ex)
        try:
            with anyio.fail_after(BOUND_S):
                await ex.exec(f"kill -STOP {SERVER_PID}")
            with anyio.move_on_after(0.3):
                await ex.exec("echo never")
        finally:
            os.kill(server, signal.SIGCONT)
    failed = [
        r.getMessage() for r in caplog.records if "failed" in r.getMessage() or "leftovers" in r.getMessage()
    ]
    assert not failed, failed
