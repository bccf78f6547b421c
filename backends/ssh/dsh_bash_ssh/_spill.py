"""Spill files on the SSH host, written by a lazily started ``cat`` over a channel of the pool.

A spill exists only for streams that outgrow ``max_output_bytes``, so most commands never pay
for one. Writes are queued in memory (bounded by ``max_spill_bytes``) and sent by a helper task;
a command's release waits until its spill files are complete, so the next command can read them.
"""

from __future__ import annotations

import logging

import anyio
import asyncssh

from dsh_bash import BashInfrastructureError

from ._connection import ChannelPool
from ._scripts import SPILL_WRITER, cmdline

__all__ = ["SshSpillFile"]

log = logging.getLogger("dsh_bash.ssh")


class SshSpillFile:
    def __init__(self, pool: ChannelPool, path: str) -> None:
        self.path = path
        self._pool = pool
        self._queue: list[bytes] = []
        self._wake = anyio.Event()
        self._closed = False
        self._deleted = False
        self.done = anyio.Event()

    # SpillFile protocol (synchronous: called from output accounting) -----------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._queue.append(bytes(data))
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def delete(self) -> None:
        self._deleted = True
        self._closed = True
        self._queue.clear()
        self._wake.set()

    # the writer ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Stream queued bytes into the file; on delete, stop and remove it. Sets ``done`` at the end."""
        try:
            channel = await self._pool.open(cmdline(SPILL_WRITER, self.path, begin_marker=False))
            try:
                stdin = channel.process.stdin
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    queue, self._queue = self._queue, []
                    for chunk in queue:
                        if self._deleted:
                            break
                        stdin.write(chunk)
                        await stdin.drain()
                    if self._closed and not self._queue:
                        break
                stdin.write_eof()
                with anyio.move_on_after(30):
                    await channel.process.wait_closed()
            finally:
                with anyio.CancelScope(shield=True):
                    await channel.close()
        except (BashInfrastructureError, asyncssh.Error, OSError) as exc:
            log.warning("spill file %s: writing failed: %s", self.path, exc)
        finally:
            if self._deleted:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    try:
                        await self._pool.run_script('rm -f -- "$1"', self.path)
                    except (BashInfrastructureError, OSError) as exc:
                        log.warning("spill file %s: removing failed: %s", self.path, exc)
            self.done.set()
