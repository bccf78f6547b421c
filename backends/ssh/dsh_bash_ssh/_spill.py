"""Spill files on the SSH host, written by a lazily started ``cat`` over a channel of the pool."""

from __future__ import annotations

import anyio

from dsh_bash.backend import QueuedSpillFile, SpillWriter

from ._connection import Channel, ChannelPool
from ._scripts import SPILL_WRITER

__all__ = ["SshSpillFile"]


class _ChannelWriter:
    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    async def send(self, data: bytes) -> None:
        stdin = self._channel.process.stdin
        stdin.write(data)
        await stdin.drain()

    async def finish(self) -> None:
        process = self._channel.process
        process.stdin.write_eof()
        with anyio.move_on_after(30):
            await process.wait_closed()  # until cat exits
        if process.exit_status != 0:
            # SPILL_WRITER refused the path (it existed: a planted link, say), or cat failed.
            raise OSError(f"the spill writer exited with status {process.exit_status}")

    async def aclose(self) -> None:
        await self._channel.close()


class SshSpillFile(QueuedSpillFile):
    def __init__(self, pool: ChannelPool, path: str) -> None:
        super().__init__(path)
        self._pool = pool

    async def _open_writer(self) -> SpillWriter:
        line = self._pool.helper_line(SPILL_WRITER, self.path, begin_marker=False)
        return _ChannelWriter(await self._pool.open(line))

    async def _remove(self) -> None:
        code, _, err = await self._pool.run_script('rm -f -- "$1"', self.path)
        if code != 0:
            raise OSError(f"rm exited with status {code}: {err[-300:].decode('utf-8', 'replace').strip()}")
