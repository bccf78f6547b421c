"""Local-backend behaviour the conformance kit cannot see from outside."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import anyio
import pytest
from dsh_bash_conformance import find_host_processes
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import BashExecRequest, BashInfrastructureError, ConfigError, ExecutorClosedError

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _alive(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``: the kit's own probe."""
    return find_host_processes(marker)


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"localtest-{os.urandom(6).hex()}"
    yield value
    for pid in _alive(value):  # never leave a process behind, even when a test fails
        os.kill(pid, 9)


def _executor(**fields: object) -> LocalBashExecutor:
    return LocalBashExecutor(LocalConfig(grace_ms=300, **fields))  # type: ignore[arg-type]


async def test_leftover_holding_the_pipe_keeps_running_and_can_keep_writing(marker: str) -> None:
    # The leftover writes after the drain bound: the executor keeps draining, so no SIGPIPE kills it.
    ticks = "for i in $(seq 40); do echo tick; sleep 0.02; done"
    command = f"bash -c '{ticks}; while :; do sleep 0.05; done' {marker} & echo started"
    # foreground_leftovers = "keep": with the default, the run's end kills the leftover.
    async with _executor(foreground_leftovers="keep") as ex:
        started = time.monotonic()
        result = await ex.exec(command)
        assert time.monotonic() - started < 1.0  # the drain bound, not the leftover's life
        # The leftover may print its first tick before `echo started` runs (it is forked first).
        assert "started" in result.stdout.text.splitlines(), result.stdout.text
        await anyio.sleep(1.2)  # past the ticks: a SIGPIPE would have killed it by now
        assert _alive(marker), "the leftover died although nobody killed it"
    assert not _alive(marker), "aclose left the leftover running"


async def test_spill_directory_is_private_and_removed_at_close() -> None:
    async with _executor(max_output_bytes=10) as ex:
        result = await ex.exec("printf '%050d' 0")
        path = result.stdout.spill_path
        assert path is not None
        directory = os.path.dirname(path)
        assert os.stat(directory).st_mode & 0o777 == 0o700
        assert os.stat(path).st_mode & 0o777 == 0o600
        with open(path, "rb") as fh:
            assert fh.read() == b"0" * 50
    assert not os.path.exists(directory)


async def test_spill_dir_config_sets_the_parent(tmp_path: os.PathLike[str]) -> None:
    async with _executor(spill_dir=str(tmp_path), max_output_bytes=10) as ex:
        result = await ex.exec("printf '%050d' 0")
        assert result.stdout.spill_path is not None
        assert os.path.dirname(os.path.dirname(result.stdout.spill_path)) == str(tmp_path)


async def test_long_command_script_file_is_removed_after_the_run() -> None:
    async with _executor() as ex:
        result = await ex.exec(": " + "x" * 150_000 + '\necho "$0"')
        script = result.stdout.text.strip()
        assert result.exit_code == 0
        assert script.endswith(".sh")
        assert not os.path.exists(script)


async def test_missing_bash_is_an_infrastructure_error() -> None:
    async with _executor(bash="no-such-shell-anywhere") as ex:
        with pytest.raises(BashInfrastructureError, match="no-such-shell-anywhere"):
            await ex.exec("true")


async def test_reconfigure_applies_from_the_next_command_and_refuses_bad_values() -> None:
    async with _executor() as ex:
        ex.reconfigure(max_output_bytes=5)
        result = await ex.exec("printf 0123456789")
        assert result.stdout.text == "56789"
        assert result.stdout.truncated
        with pytest.raises(ConfigError, match="grace_ms"):
            ex.reconfigure(grace_ms=-1)
        with pytest.raises(ConfigError, match="timeout_ms"):
            ex.reconfigure(timeout_ms=10**9)  # above max_timeout_ms
        with pytest.raises(ConfigError, match="cwd"):
            ex.reconfigure(cwd="/")
        assert ex.config.max_output_bytes == 5
        assert ex.config.grace_ms == 300


def test_from_fields_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match="max_output_bytes"):
        LocalBashExecutor.from_fields(max_output_bytes=0)
    with pytest.raises(ConfigError, match="no_such_field"):
        LocalBashExecutor.from_fields(no_such_field=1)


def test_executor_made_outside_a_loop_works_in_one() -> None:
    ex = _executor()

    async def use() -> str:
        async with ex:
            return (await ex.exec("echo ok")).stdout.text

    assert anyio.run(use) == "ok\n"


async def test_cwd_defaults_to_the_working_directory_when_made() -> None:
    ex = _executor()
    async with ex:
        spec = ex.resolve(BashExecRequest(command="pwd"))
        assert spec.workdir == os.getcwd()


async def test_entering_twice_is_refused() -> None:
    ex = _executor()
    async with ex:
        pass
    with pytest.raises(ExecutorClosedError):
        async with ex:
            pass


async def test_foreground_true_has_no_process_scan_cost() -> None:
    # The fast path must not scan /proc: 50 runs of `true` well under the cost of 50 scans.
    async with _executor() as ex:
        started = time.monotonic()
        for _ in range(50):
            assert (await ex.exec("true")).exit_code == 0
        assert ex._scanner._taken_at < 0  # never scanned
        assert time.monotonic() - started < 10


class _FailsOnceOpen(LocalBashExecutor):
    """A subclass whose own part of the open fails after the local part succeeded (as a sandboxing
    backend's probe does): it records what the local part had made."""

    made: list[str | None]

    async def _open(self) -> None:
        await super()._open()
        self.made = [self.spill_directory, None if self._server is None else "fork server"]
        raise BashInfrastructureError("the subclass's own setup failed", reason="start_failed")


def _fork_servers() -> list[int]:
    """This process's children that run dsh-supervise (its fork server, while an executor is open)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"dsh-supervise" in cmdline:
            found.append(int(entry))
    return found


@pytest.mark.timeout(30)
async def test_a_failed_open_leaves_no_spill_directory_and_no_fork_server() -> None:
    # Issue 16: an open that fails after the backend acquired something releases it (the base
    # class runs _release), so that nothing is left behind by a failed open.
    before = _fork_servers()
    executor = _FailsOnceOpen(LocalConfig(grace_ms=300))
    with pytest.raises(BashInfrastructureError, match="own setup failed"):
        async with executor:
            pass
    spill, server = executor.made
    assert spill is not None and server == "fork server"  # the local part had made both
    assert not os.path.exists(spill)
    deadline = time.monotonic() + 5
    while (left := sorted(set(_fork_servers()) - set(before))) and time.monotonic() < deadline:  # noqa: ASYNC110 - a process's end is polled
        await anyio.sleep(0.02)
    assert left == []


async def test_a_session_command_that_cannot_change_the_state_runs_without_the_capture() -> None:
    # `git`-like commands of plain words are most of an agent's: they run with the state replayed
    # and no capture (dsh_bash._session.leaves_state_as_is), and leave the state as it stood.
    async with _executor() as ex:
        session = ex.session()

        async def run(command: str, **fields: object) -> object:
            return await ex.run(ex.resolve(BashExecRequest(command=command, session=session, **fields)))

        await run("cd /tmp && export KEPT=1")
        # Without the capture no descriptor 19 is opened for the command (with it, `ls` inherits it).
        plain = await run("ls /proc/self/fd")
        assert "19" not in plain.stdout.text.split(), plain.stdout.text
        assert plain.session is not None
        assert plain.session.cwd == "/tmp" and plain.session.kept_previous is None
        captured = await run("ls /proc/self/fd; cd .")
        assert "19" in captured.stdout.text.split(), captured.stdout.text
        timed_out = await run("sleep 5", timeout_ms=200)
        assert timed_out.session is not None and timed_out.session.kept_previous == "the command timed out"
        after = await run('echo "$PWD $KEPT"')
        assert after.stdout.text == "/tmp 1\n"


async def test_a_function_imported_from_the_environment_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    # bash imports `BASH_FUNC_name%%` of its environment (here the harness's, which commands inherit)
    # as a function `name`: a command `ls` then runs it, not the program, and what it changes is the
    # session's.
    monkeypatch.setenv("BASH_FUNC_ls%%", "() {  export FROM_IMPORTED=yes\n}")
    async with _executor() as ex:
        session = ex.session()
        await ex.run(ex.resolve(BashExecRequest(command="ls", session=session)))
        after = await ex.run(
            ex.resolve(BashExecRequest(command='echo "${FROM_IMPORTED-unset}"', session=session))
        )
        assert after.stdout.text == "yes\n"
