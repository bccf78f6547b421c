"""Security: spill files are never written through a planted link, and are private to their owner.

Spill names are random; to plant a link at the exact path a spill will take, the tests replace
``secrets.token_hex`` in the modules that name spill files (the local backend's ``_spill`` and the
shared ``dsh_bash.remote._bash_protocol``) with a predictable source. A first run proves the name was indeed
predicted (so the planted cases cannot pass by missing the path). The links are planted by a command
of the same executor: the same user, inside the private directory, the strongest attacker there is.
"""

from __future__ import annotations

import glob
import os
import posixpath
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import anyio
import pytest
from security_support import (
    BACKENDS,
    OTHER_USER,
    PredictableTokens,
    as_other_user,
    ensure_other_user,
    make_executor,
)

from dsh_bash import BashExecRequest, BashExecutor, BashInfrastructureError, BashRunResult, BashTask

pytestmark = [pytest.mark.faults, pytest.mark.anyio]

#: Output bigger than the kept tail: it spills.
BIG = 5000
MAX_OUTPUT = 1000
BIG_OUTPUT = f"head -c {BIG} /dev/zero | tr '\\0' x"

LEARN = "a" * 24
PLANTED = "b" * 24
LATER = "c" * 24


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the SSH backend is asyncio-only


#: Where the victims live (local and SSH: this host's /tmp; Docker: the container's, removed with it).
#: This process's own (its pid in the name): each test removes them all at its end, and a test of
#: another pytest worker may be using its own meanwhile (a rehearsal's victim vanished mid-test).
VICTIM_DIRS = f"/tmp/dshsec-victim-{os.getpid()}-XXXXXX"


@pytest.fixture(autouse=True)
def _remove_victims() -> Iterator[None]:
    yield
    for path in glob.glob(VICTIM_DIRS.replace("XXXXXX", "*")):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> Iterator[PredictableTokens]:
    import dsh_bash.host._spill_dir  # noqa: PLC0415
    import dsh_bash.remote._bash_protocol  # noqa: PLC0415

    source = PredictableTokens(12, [LEARN, PLANTED, LATER])
    monkeypatch.setattr(dsh_bash.host._spill_dir, "secrets", source)
    monkeypatch.setattr(dsh_bash.remote._bash_protocol, "secrets", source)
    yield source


async def _sh(ex: BashExecutor, command: str) -> str:
    result = await ex.exec(command, timeout_ms=20_000)
    assert result.exit_code == 0, (command, result)
    return result.stdout.text


async def _assert_private_spill(ex: BashExecutor, path: str, size: int) -> None:
    """``path`` is a real file (no link), mode 0600, holding ``size`` bytes."""
    facts = await _sh(ex, f'p={path}; if [ -L "$p" ]; then echo link; else stat -c "%F %a %s" "$p"; fi')
    assert facts.split() == ["regular", "file", "600", str(size)], f"spill file {path}: {facts!r}"


async def _big_run(ex: BashExecutor) -> BashRunResult:
    with anyio.fail_after(60):
        return await ex.exec(BIG_OUTPUT, timeout_ms=40_000)


LinkKind = Literal["victim_file", "dangling", "fifo"]


async def _big_background(ex: BashExecutor) -> tuple[str | None, int]:
    """A background task writing BIG bytes: (stdout spill path its final read names, bytes read)."""
    task = await ex.start(ex.resolve(BashExecRequest(command=BIG_OUTPUT)))
    with anyio.fail_after(60):
        await task.wait()
    read = await ex.read_output(task.id)
    assert task.status == "completed" and task.exit_code == 0, task
    return read.stdout_spill_path, len(read.delta.encode()) + read.dropped_bytes


async def _make_victim(ex: BashExecutor, link: LinkKind) -> str:
    """Where the planted link points: a file, nothing (dangling), or a FIFO."""
    victim = (await _sh(ex, f"mktemp -d {VICTIM_DIRS}")).strip() + "/victim"
    if link == "victim_file":
        await _sh(ex, f"printf original > {victim}")
    elif link == "fifo":
        await _sh(ex, f"mkfifo {victim}")
    return victim


async def _assert_link_not_followed(ex: BashExecutor, link: LinkKind, planted: str, victim: str) -> None:
    """The planted link is still a link to the victim, and the victim is as it was planted."""
    assert (await _sh(ex, f"[ -L {planted} ] && readlink {planted}")).strip() == victim
    if link == "victim_file":
        assert await _sh(ex, f"cat {victim}") == "original"
    elif link == "dangling":
        assert await _sh(ex, f"[ -e {victim} ] || [ -L {victim} ] || echo absent") == "absent\n"
    else:
        assert (await _sh(ex, f"[ -p {victim} ] && echo fifo")) == "fifo\n"


@pytest.mark.parametrize("mode", ["foreground", "background"])
@pytest.mark.parametrize("link", ["victim_file", "dangling", "fifo"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_planted_link_at_the_spill_path_is_never_followed(
    request: pytest.FixtureRequest, tokens: PredictableTokens, backend: str, link: LinkKind, mode: str
) -> None:
    async with make_executor(request, backend, max_output_bytes=MAX_OUTPUT) as ex:
        first = await _big_run(ex)
        learned = first.stdout.spill_path
        assert learned is not None and posixpath.basename(learned) == f"{LEARN}.stdout", (
            "the spill name was not predicted: the planted cases would test nothing",
            learned,
        )
        directory = posixpath.dirname(learned)
        planted = f"{directory}/{PLANTED}.stdout"
        victim = await _make_victim(ex, link)
        await _sh(ex, f"ln -s {victim} {planted}")

        # The caller is told the truth: the stream was cut, all bytes counted, and the whole stream
        # is either in a real private file or reported lost; never "in" the planted link.
        if mode == "foreground":
            result = await _big_run(ex)
            assert result.exit_code == 0
            assert result.stdout.truncated and result.stdout.total_bytes == BIG
            spill_path = result.stdout.spill_path
        else:
            spill_path, accounted = await _big_background(ex)
            assert accounted == BIG
        if spill_path is not None:
            await _assert_private_spill(ex, spill_path, BIG)
        # The link was not followed: the victim is as it was and the link is still a link.
        await _assert_link_not_followed(ex, link, planted, victim)
        if backend == "ssh" and mode == "background":
            # A detached task writes its own files (their links are refused too:
            # test_planted_link_at_a_detached_task_file_is_refused), so the planted name is still
            # unused: the next foreground spill meets it, and is refused.
            refused = await _big_run(ex)
            assert refused.stdout.truncated and refused.stdout.spill_path is None
        # The executor keeps working, and its next spill is a real private file.
        after = await _big_run(ex)
        assert after.stdout.spill_path is not None
        await _assert_private_spill(ex, after.stdout.spill_path, BIG)


@pytest.mark.parametrize("link", ["victim_file", "dangling", "fifo"])
async def test_planted_link_at_a_detached_task_file_is_refused(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, link: LinkKind
) -> None:
    """SSH background tasks write BASE.stdout/BASE.stderr in the spill directory (BASE from an
    8-byte nonce): a link planted there makes the start fail, and nothing is written through it."""
    import dsh_bash_ssh._ssh_executor as ssh_executor  # noqa: PLC0415

    nonce = "c" * 16
    async with make_executor(request, "ssh", max_output_bytes=MAX_OUTPUT) as ex:
        assert isinstance(ex, ssh_executor.SshBashExecutor)
        victim = await _make_victim(ex, link)
        planted = f"{ex.spill_dir}/{nonce}.stdout"
        await _sh(ex, f"ln -s {victim} {planted}")
        monkeypatch.setattr(ssh_executor, "secrets", PredictableTokens(8, [nonce]))
        with pytest.raises(BashInfrastructureError, match="cannot create the task files"):
            await ex.start(ex.resolve(BashExecRequest(command=BIG_OUTPUT)))
        await _assert_link_not_followed(ex, link, planted, victim)


@pytest.mark.parametrize("link", ["victim_file", "dangling", "fifo"])
async def test_planted_link_at_a_detached_task_cap_file_is_never_followed(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, link: LinkKind
) -> None:
    """An SSH background task's supervisor reads its raised output caps from BASE.cap, which the
    executor writes under a fresh name (O_EXCL) and renames into place: a link planted at BASE.cap is
    replaced, never written through, and the supervisor never reads through it."""
    import dsh_bash_ssh._ssh_executor as ssh_executor  # noqa: PLC0415

    nonce = "d" * 16
    size = 1 << 20  # past half of the first grant (256 KiB): the caps are raised
    async with make_executor(request, "ssh", max_output_bytes=MAX_OUTPUT) as ex:
        assert isinstance(ex, ssh_executor.SshBashExecutor)
        victim = await _make_victim(ex, link)
        planted = f"{ex.spill_dir}/{nonce}.cap"
        await _sh(ex, f"ln -s {victim} {planted}")
        monkeypatch.setattr(ssh_executor, "secrets", PredictableTokens(8, [nonce]))
        task = await ex.start(ex.resolve(BashExecRequest(command=f"head -c {size} /dev/zero | tr '\\0' x")))
        with anyio.fail_after(60):
            await task.wait()
        read = await ex.read_output(task.id)
        assert task.status == "completed" and task.exit_code == 0, task
        assert read.stdout_spill_path is not None and len(read.delta.encode()) + read.dropped_bytes == size
        await _assert_private_spill(ex, read.stdout_spill_path, size)
        if link == "victim_file":
            assert await _sh(ex, f"cat {victim}") == "original"
        elif link == "dangling":
            assert await _sh(ex, f"[ -e {victim} ] || [ -L {victim} ] || echo absent") == "absent\n"
        else:
            assert (await _sh(ex, f"[ -p {victim} ] && echo fifo")) == "fifo\n"


@pytest.mark.parametrize("backend", ["local", "docker"])
async def test_planted_link_at_the_long_command_script_path_is_never_followed(
    request: pytest.FixtureRequest, tokens: PredictableTokens, backend: str
) -> None:
    """A command over 100 KB runs from a script file in the spill directory: same rule."""
    async with make_executor(request, backend, max_output_bytes=MAX_OUTPUT) as ex:
        first = await _big_run(ex)
        learned = first.stdout.spill_path
        assert learned is not None and posixpath.basename(learned) == f"{LEARN}.stdout", learned
        planted = f"{posixpath.dirname(learned)}/{PLANTED}.sh"
        victim = (await _sh(ex, f"mktemp -d {VICTIM_DIRS}")).strip() + "/victim"
        await _sh(ex, f"printf original > {victim}; ln -s {victim} {planted}")
        long_command = "# " + "x" * 110_000 + "\necho long-command-ran\n"
        try:
            with anyio.fail_after(60):
                result = await ex.exec(long_command, timeout_ms=20_000)
        except BashInfrastructureError as exc:
            assert "long command" in str(exc) or "exist" in str(exc), exc
        else:
            assert result.exit_code == 0 and result.stdout.text == "long-command-ran\n", result
        assert await _sh(ex, f"cat {victim}") == "original"
        assert (await _sh(ex, f"readlink {planted}")).strip() == victim


async def test_planted_link_at_the_local_spill_directory_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local backend makes its directory under a parent it is given: a link there is skipped."""
    from dsh_bash_local import LocalBashExecutor, LocalConfig  # noqa: PLC0415

    parent = tmp_path / "parent"
    parent.mkdir()
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (parent / "dsh-bash-planted").symlink_to(victim_dir)
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: iter(["planted", "fresh"]))
    config = LocalConfig(spill_dir=str(parent), max_output_bytes=MAX_OUTPUT, grace_ms=300)
    async with LocalBashExecutor(config) as ex:
        assert ex.spill_directory == str(parent / "dsh-bash-fresh")
        info = os.lstat(ex.spill_directory)
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        result = await _big_run(ex)
        assert result.stdout.spill_path is not None
        assert os.path.dirname(result.stdout.spill_path) == ex.spill_directory
    assert list(victim_dir.iterdir()) == []
    assert (parent / "dsh-bash-planted").is_symlink()


async def _spill_paths(ex: BashExecutor, mode: str) -> tuple[list[str], BashTask | None]:
    """Both streams' spill paths of a command writing BIG bytes to each: after a foreground run, or
    while a background task still runs (once both files hold every byte)."""
    both = f"{BIG_OUTPUT}; {BIG_OUTPUT} >&2"
    if mode == "foreground":
        result = await ex.exec(both, timeout_ms=40_000)
        paths = [result.stdout.spill_path, result.stderr.spill_path]
        assert None not in paths, result
        return [str(path) for path in paths], None
    task = await ex.start(ex.resolve(BashExecRequest(command=f"{both}; sleep 30")))
    with anyio.fail_after(30):
        while True:
            read = await ex.read_output(task.id)
            paths = [read.stdout_spill_path, read.stderr_spill_path]
            if None not in paths:
                # A remote writer creates the file a moment after the path is known.
                sizes = await ex.exec(f"wc -c < {paths[0]}; wc -c < {paths[1]}", timeout_ms=20_000)
                if sizes.stdout.text.split() == [str(BIG), str(BIG)]:
                    break
            await anyio.sleep(0.05)
    assert task.status == "running"
    return [str(path) for path in paths], task


# -- other users ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_user() -> str:
    if os.geteuid() != 0:
        # The prefix makes CI (CI=true) fail instead of skipping: the case must run there.
        pytest.skip(f"backend unavailable: a second user ({OTHER_USER}) and runuser need root")
    ensure_other_user()
    control = as_other_user("cat", "/etc/hostname")
    assert control.returncode == 0, f"runuser cannot run commands as {OTHER_USER}: {control.stderr}"
    return OTHER_USER


@pytest.mark.parametrize("mode", ["foreground", "background"])
@pytest.mark.parametrize("backend", ["local", "ssh"])
async def test_spill_files_are_unreadable_to_another_user_on_the_host(
    request: pytest.FixtureRequest, other_user: str, backend: str, mode: str
) -> None:
    async with make_executor(request, backend, max_output_bytes=MAX_OUTPUT) as ex:
        paths, _ = await _spill_paths(ex, mode)
        directory = os.path.dirname(str(paths[0]))
        dir_info = os.lstat(directory)
        assert stat.S_ISDIR(dir_info.st_mode) and stat.S_IMODE(dir_info.st_mode) == 0o700
        for path in paths:
            assert path is not None and os.path.dirname(path) == directory
            info = os.lstat(path)
            assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
            assert info.st_uid == dir_info.st_uid and info.st_size == BIG
            denied = as_other_user("cat", path)
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
        listing = as_other_user("ls", directory)
        assert listing.returncode != 0 and "Permission denied" in listing.stderr, listing


@pytest.mark.parametrize("mode", ["foreground", "background"])
async def test_spill_files_are_unreadable_to_another_user_in_the_container(
    request: pytest.FixtureRequest, mode: str
) -> None:
    import docker  # noqa: PLC0415
    from dsh_bash_docker import DockerBashExecutor  # noqa: PLC0415

    async with make_executor(request, "docker", max_output_bytes=MAX_OUTPUT) as ex:
        assert isinstance(ex, DockerBashExecutor)
        paths, _ = await _spill_paths(ex, mode)
        directory = posixpath.dirname(str(paths[0]))
        assert (await _sh(ex, f"stat -c %a {directory}")).strip() == "700"
        for path in paths:
            assert path is not None
            await _assert_private_spill(ex, path, BIG)
        client = docker.from_env()
        try:
            container = client.containers.get(ex.container_id)
            control = container.exec_run(["ls", "/"], user="65534")
            assert control.exit_code == 0, control.output
            for path in paths:
                denied = container.exec_run(["cat", str(path)], user="65534")
                assert denied.exit_code != 0 and b"Permission denied" in denied.output, denied
            listing = container.exec_run(["ls", directory], user="65534")
            assert listing.exit_code != 0 and b"Permission denied" in listing.output, listing
        finally:
            client.close()


def test_a_spill_lost_behind_the_scenes_frees_its_budget_and_is_no_longer_fed() -> None:
    """A remote writer that failed (a refused path) marks its file ``lost``: the stream reports no
    spill path, stops queueing into it (it would hold up to ``max_spill_bytes`` in memory for
    nothing) and gives its reservation back to the executor-wide budget."""
    from dsh_bash._output import OutputStream, SpillBudget  # noqa: PLC0415

    class QueuedFile:
        path = "/spill/file.stdout"

        def __init__(self) -> None:
            self.lost = False
            self.pending = False
            self.queued = 0
            self.deleted = False

        def write(self, data: bytes | bytearray | memoryview) -> None:
            self.queued += len(data)

        def close(self) -> None:
            pass

        def delete(self, gone: Callable[[], None]) -> None:
            self.deleted = True
            gone()  # removed at once here; a real remote file confirms its removal later

    spill = QueuedFile()
    budget = SpillBudget(1_000_000)
    stream = OutputStream(
        "stdout", max_bytes=10, max_spill_bytes=100_000, budget=budget, open_spill=lambda: spill
    )
    stream.feed(b"x" * 50)
    assert stream.spill_path == spill.path and budget.used == 50 and spill.queued == 50
    spill.lost = True
    assert stream.spill_path is None
    stream.feed(b"y" * 50)
    assert spill.queued == 50 and spill.deleted and budget.used == 0
    stream.close()
    assert stream.collected().spill_path is None and stream.total_bytes == 100


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_bash_tool_tells_the_model_a_refused_spill_is_unavailable(
    request: pytest.FixtureRequest, tokens: PredictableTokens, backend: str
) -> None:
    from dsh_tool_bash import BashToolset  # noqa: PLC0415

    async with make_executor(request, backend, max_output_bytes=MAX_OUTPUT) as ex:
        learned = (await _big_run(ex)).stdout.spill_path
        assert learned is not None and posixpath.basename(learned) == f"{LEARN}.stdout", learned
        planted = f"{posixpath.dirname(learned)}/{PLANTED}.stdout"
        await _sh(ex, f"ln -s /nonexistent-dshsec-target {planted}")
        with anyio.fail_after(60):
            result = await BashToolset(ex).call("bash", {"command": BIG_OUTPUT})
        assert not result.is_error, result
        assert "[output truncated; full output: (unavailable)]" in result.text, result.text
        assert result.data["stdout_spill_path"] is None and result.data["stdout_total_bytes"] == BIG
