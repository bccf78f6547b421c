"""Spill files on the SSH host, written by a lazily started ``cat`` over a channel of the pool."""

from __future__ import annotations

import asyncio

import anyio

from dsh_bash.remote import (
    QueuedSpillFile,
    SpillWriter,
)

from ._connection import Channel, ChannelPool
from ._scripts import SCRIPT_BEGIN, SPILL_WRITER

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
        line = self._pool.helper_line(SPILL_WRITER, self.path)
        channel = await self._pool.open(line)
        try:
            # SPILL_WRITER prints "." once the file exists (no spill path is named before), after
            # the begin marker (rc noise before it is not the writer's).
            try:
                await channel.process.stdout.readuntil(SCRIPT_BEGIN + b".")
            except asyncio.IncompleteReadError as exc:
                raise OSError("the spill writer did not create the file") from exc
        except BaseException:
            with anyio.CancelScope(shield=True):
                await channel.close()
            raise
        return _ChannelWriter(channel)

    async def _remove(self) -> None:
        code, _, err = await self._pool.run_script('rm -f -- "$1"', self.path)
        if code != 0:
            raise OSError(f"rm exited with status {code}: {err[-300:].decode('utf-8', 'replace').strip()}")
