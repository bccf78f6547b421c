"""Backpressure of remote spill files: the output pump waits for the spill writer, so its queue stays small.

Without it a remote spill (``QueuedSpillFile``) queues whatever the transport delivers faster than
its writer sends it, up to ``max_spill_bytes`` per stream (measured: about 65 MiB of memory growth
while streaming 1 GiB through Docker). The helper tests drive a real ``QueuedSpillFile`` whose
writer is a gate the test opens and closes; the Docker and SSH tests stream through a real engine
and a real sshd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import anyio.abc
import pytest
from docker_support import docker_config
from dsh_bash_docker import DockerBashExecutor
from ssh_support import SshServer

from dsh_bash.remote._bash_protocol import (
    SPILL_HIGH_WATER_BYTES,
    CommandSpills,
    QueuedSpillFile,
    SpillWriter,
)

if TYPE_CHECKING:
    from dsh_bash_ssh import SshBashExecutor

pytestmark = pytest.mark.anyio

MIB = 1024 * 1024


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _GatedWriter:
    """Sends only while the gate is open; can be made to fail."""

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.sent = 0
        self.fail = False

    async def send(self, data: bytes) -> None:
        await self.open.wait()
        if self.fail:
            raise OSError("the transport broke")
        self.sent += len(data)

    async def finish(self) -> None:
        await self.open.wait()

    async def aclose(self) -> None:
        pass


class _GatedSpill(QueuedSpillFile):
    def __init__(self, writer: _GatedWriter) -> None:
        super().__init__("/nowhere/spill.out")
        self.writer = writer
        self.removed = False

    async def _open_writer(self) -> SpillWriter:
        return self.writer

    async def _remove(self) -> None:
        self.removed = True


async def _returns_within(seconds: float, spills: CommandSpills, marker: str) -> bool:
    with anyio.move_on_after(seconds):
        await spills.wait_writable(marker)
        return True
    return False


async def _backlogged_spill(tg: anyio.abc.TaskGroup) -> tuple[CommandSpills, _GatedSpill, _GatedWriter]:
    spills = CommandSpills(tg.start_soon)
    writer = _GatedWriter()
    spill = _GatedSpill(writer)
    spills.add("cmd-1", spill)
    for _ in range(3):
        spill.write(b"x" * (SPILL_HIGH_WATER_BYTES // 2))
    return spills, spill, writer


async def test_wait_writable_returns_at_once_without_spills_or_under_the_mark() -> None:
    async with anyio.create_task_group() as tg:
        spills = CommandSpills(tg.start_soon)
        assert await _returns_within(0.5, spills, "no-such-command")
        writer = _GatedWriter()
        spill = spills.add("cmd-1", _GatedSpill(writer))
        spill.write(b"x" * (SPILL_HIGH_WATER_BYTES - 1))
        assert await _returns_within(0.5, spills, "cmd-1")
        writer.open.set()
        spill.close()


async def test_wait_writable_waits_until_the_writer_drains_below_the_mark() -> None:
    async with anyio.create_task_group() as tg:
        spills, spill, writer = await _backlogged_spill(tg)
        assert not await _returns_within(0.3, spills, "cmd-1")
        writer.open.set()
        assert await _returns_within(5, spills, "cmd-1")
        spill.close()
        with anyio.fail_after(5):
            await spill.done.wait()
        assert writer.sent == 3 * (SPILL_HIGH_WATER_BYTES // 2)


async def test_wait_writable_never_waits_on_a_deleted_spill() -> None:
    async with anyio.create_task_group() as tg:
        spills, spill, writer = await _backlogged_spill(tg)
        waiter_done = anyio.Event()

        async def waiter() -> None:
            await spills.wait_writable("cmd-1")
            waiter_done.set()

        tg.start_soon(waiter)
        await anyio.sleep(0.1)
        assert not waiter_done.is_set()
        spill.delete(lambda: None)  # a waiter already blocked is released too
        with anyio.fail_after(5):
            await waiter_done.wait()
        writer.open.set()
        with anyio.fail_after(5):
            await spill.done.wait()
        assert spill.removed


async def test_wait_writable_never_waits_on_a_failed_spill_and_it_stops_queueing() -> None:
    async with anyio.create_task_group() as tg:
        spills, spill, writer = await _backlogged_spill(tg)
        writer.fail = True
        writer.open.set()
        with anyio.fail_after(5):
            await spill.done.wait()
        assert await _returns_within(0.5, spills, "cmd-1")
        spill.write(b"x" * 2 * SPILL_HIGH_WATER_BYTES)  # after the failure: dropped, not queued
        assert not spill.backlogged
        assert spill._queue == []


async def _stream_and_watch_the_spill_queue(ex: DockerBashExecutor | SshBashExecutor) -> None:
    """32 MiB of stdout spills (under max_spill_bytes); the queue never holds much more than the mark."""
    size = 32 * MIB
    peak = 0
    samples = 0
    streaming = True

    async def watch_queues() -> None:
        nonlocal peak, samples
        while streaming:
            for spills in list(ex._spills._by_marker.values()):
                for spill in spills:
                    peak = max(peak, spill._queued_bytes)
                    samples += 1
            await anyio.sleep(0.002)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_queues)
        result = await ex.exec(f"head -c {size} /dev/zero", timeout_ms=90_000)
        streaming = False
    assert result.exit_code == 0
    assert result.stdout.total_bytes == size
    assert result.stdout.spill_path is not None
    assert samples > 10, "the watcher never saw the spill while it was written"
    # One read of the transport (256 KiB at most) may land on top of a queue just under the mark.
    assert peak <= SPILL_HIGH_WATER_BYTES + 512 * 1024, f"spill queue peaked at {peak / MIB:.1f} MiB"
    spilled = await ex.exec(f"wc -c < {result.stdout.spill_path}")
    assert int(spilled.stdout.text.strip()) == size


async def _stream_past_the_spill_cap(ex: DockerBashExecutor | SshBashExecutor) -> None:
    """Past max_spill_bytes the spill is deleted: the pump must not wait on it any longer."""
    with anyio.fail_after(60):
        result = await ex.exec(f"head -c {16 * MIB} /dev/zero; echo done >&2", timeout_ms=60_000)
    assert result.exit_code == 0
    assert not result.timed_out
    assert result.stdout.total_bytes == 16 * MIB
    assert result.stdout.spill_path is None
    assert result.stderr.text == "done\n"
    assert all(not spills for spills in ex._spills._by_marker.values())


@pytest.mark.docker
async def test_docker_streaming_keeps_the_spill_queue_bounded(docker_test_image: str) -> None:
    config = docker_config(docker_test_image)
    async with DockerBashExecutor(config) as ex:
        await _stream_and_watch_the_spill_queue(ex)


@pytest.mark.docker
async def test_docker_stream_outgrowing_its_spill_is_not_held_back(docker_test_image: str) -> None:
    config = docker_config(docker_test_image, max_spill_bytes=2 * MIB)
    async with DockerBashExecutor(config) as ex:
        await _stream_past_the_spill_cap(ex)


@pytest.mark.ssh
async def test_ssh_streaming_keeps_the_spill_queue_bounded(ssh_server: SshServer) -> None:
    """The SSH session feeds output from callbacks: a backlog pauses the channel's reading instead."""
    async with ssh_server.executor(grace_ms=300) as ex:
        await _stream_and_watch_the_spill_queue(ex)


@pytest.mark.ssh
async def test_ssh_stream_outgrowing_its_spill_is_not_held_back(ssh_server: SshServer) -> None:
    async with ssh_server.executor(grace_ms=300, max_spill_bytes=2 * MIB) as ex:
        await _stream_past_the_spill_cap(ex)
