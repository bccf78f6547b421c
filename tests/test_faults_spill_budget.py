"""Faults: spill budgets bound the disk in use at every moment, on every backend, in both modes.

Four streams (two commands, each writing stdout and stderr at once) of ``STREAM`` bytes each run at
the same time under ``max_spill_total_bytes = TOTAL`` and ``max_spill_bytes = PER_STREAM``: every
stream outgrows its own cap, and together they outgrow the total many times over. A thread samples
the executor's private spill directory every ``SAMPLE_S`` while they run, as the disk sees it: the
sum of ``st_blocks * 512`` over its files (what the file system allocated, holes not counted). The
files live on this host for every backend here: local and SSH (the test sshd is on loopback) in
``/tmp``, Docker inside the container, reached as root through ``/proc/PID/root`` of the container's
init process. The bound allows one file system block of rounding per file present (the budget
counts bytes, the disk allocates blocks).
"""

from __future__ import annotations

import os
import posixpath
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio
import pytest

from dsh_bash import BashExecRequest, BashExecutor

pytestmark = [pytest.mark.faults, pytest.mark.anyio]

MIB = 1 << 20
TOTAL = 8 * MIB
PER_STREAM = 16 * MIB
STREAM = 40 * MIB
MAX_OUTPUT = 64_000
#: One block of rounding per file: the budget counts bytes, the file system allocates 4 KiB blocks.
BLOCK = 4096
SAMPLE_S = 0.002
#: Both streams of one command at once (stderr in a background job, stdout in the foreground).
WORKLOAD = f"head -c {STREAM} /dev/zero >&2 & head -c {STREAM} /dev/zero; wait"

Backend = Literal["local", "docker-image", "docker-container", "ssh"]
Mode = Literal["foreground", "background"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the SSH backend is asyncio-only


@dataclass
class DiskSampler:
    """Samples the disk use of one directory's files until stopped; keeps the worst moments."""

    directory: str
    peak_total: int = 0
    peak_files: int = 0
    peak_file: int = 0
    over: list[tuple[int, int]] = field(default_factory=list)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        total = files = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the listing
            used = info.st_blocks * 512
            total += used
            files += 1
            self.peak_file = max(self.peak_file, used)
        self.samples += 1
        if total > self.peak_total:
            self.peak_total, self.peak_files = total, files
        if total > TOTAL + BLOCK * files:
            self.over.append((total, files))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(SAMPLE_S)

    @contextmanager
    def running(self) -> Iterator[DiskSampler]:
        thread = threading.Thread(target=self._run, name="spill-disk-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(10)
            self.sample()


@asynccontextmanager
async def _executor(
    request: pytest.FixtureRequest, backend: Backend
) -> AsyncIterator[tuple[BashExecutor, Callable[[str], str]]]:
    """An open executor of ``backend`` with the budgets, and how a spill path reads from this host."""
    fields = {
        "max_output_bytes": MAX_OUTPUT,
        "max_spill_bytes": PER_STREAM,
        "max_spill_total_bytes": TOTAL,
        "grace_ms": 300,
    }
    if backend == "local":
        from dsh_bash_local import LocalBashExecutor, LocalConfig  # noqa: PLC0415

        async with LocalBashExecutor(LocalConfig(**fields)) as ex:
            yield ex, lambda path: path
    elif backend == "ssh":
        server = request.getfixturevalue("ssh_server")
        async with server.executor(**fields) as ex:
            yield ex, lambda path: path  # the test sshd runs on this host
    else:
        import docker  # noqa: PLC0415
        from docker_support import SESSION_ID, SESSION_LABEL  # noqa: PLC0415
        from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

        label = f"dsh-spill-budget-{os.getpid()}-{time.monotonic_ns()}"
        if backend == "docker-image":
            config = DockerConfig(
                image=request.getfixturevalue("docker_test_image"),
                labels={SESSION_LABEL: SESSION_ID, label: "1"},
                **fields,  # type: ignore[arg-type]
            )
        else:
            config = DockerConfig(
                container=request.getfixturevalue("docker_session_container"),
                **fields,  # type: ignore[arg-type]
            )
        client = docker.from_env()
        try:
            async with DockerBashExecutor(config) as ex:
                if backend == "docker-image":
                    (container,) = client.containers.list(filters={"label": label})
                else:
                    container = client.containers.get(config.container)
                root = f"/proc/{container.attrs['State']['Pid']}/root"
                yield ex, lambda path: root + path
        finally:
            client.close()


async def _spill_directory(ex: BashExecutor, on_host: Callable[[str], str]) -> str:
    """The executor's private spill directory, learned from a small spill, as this host reaches it."""
    result = await ex.exec(f"head -c {MAX_OUTPUT + 1} /dev/zero", timeout_ms=30_000)
    assert result.stdout.spill_path is not None, result
    directory = on_host(posixpath.dirname(result.stdout.spill_path))
    assert os.path.isdir(directory), directory
    return directory


async def _run_four_streams(ex: BashExecutor, mode: Mode) -> None:
    if mode == "foreground":
        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(lambda: ex.exec(WORKLOAD, timeout_ms=60_000))
        return
    tasks = [await ex.start(ex.resolve(BashExecRequest(command=WORKLOAD))) for _ in range(2)]
    for task in tasks:
        await task.wait()
        assert task.status == "completed", task
        await ex.read_output(task.id)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["foreground", "background"])
@pytest.mark.parametrize("backend", ["local", "docker-image", "docker-container", "ssh"])
async def test_spill_budget_bounds_the_disk_at_every_moment(
    request: pytest.FixtureRequest, backend: Backend, mode: Mode
) -> None:
    async with _executor(request, backend) as (ex, on_host):
        directory = await _spill_directory(ex, on_host)
        sampler = DiskSampler(directory)
        started = time.monotonic()
        with sampler.running(), anyio.fail_after(90):
            await _run_four_streams(ex, mode)
        took = time.monotonic() - started
    report = (
        f"{backend} {mode}: peak {sampler.peak_total / MIB:.2f} MiB in {sampler.peak_files} files, "
        f"largest file {sampler.peak_file / MIB:.2f} MiB, {sampler.samples} samples in {took:.1f} s"
    )
    print(report)
    assert sampler.samples >= 20, report  # the sampler really watched the run
    assert not sampler.over, f"{report}; over the total: {sampler.over[:5]}"
    assert sampler.peak_file <= PER_STREAM + BLOCK, report
