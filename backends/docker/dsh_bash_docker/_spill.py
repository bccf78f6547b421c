"""Spill files inside the container, written by a lazily started ``cat`` exec.

A spill exists only for streams that outgrow ``max_output_bytes``, so most commands never pay
for one. Writes are queued in memory (bounded by ``max_spill_bytes``) and sent by a helper task;
a command's release waits until its spill files are complete, so the next command can read them.
"""

from __future__ import annotations

import logging

import anyio

from ._engine import EngineClient, EngineError
from ._process import SCRIPT_ENV, run_script
from ._scripts import SPILL_WRITER

__all__ = ["DockerSpillFile"]

log = logging.getLogger("dsh_bash.docker")


class DockerSpillFile:
    def __init__(self, engine: EngineClient, container: str, user: str | None, path: str) -> None:
        self.path = path
        self._engine = engine
        self._container = container
        self._user = user
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
            exec_id = await self._engine.exec_create(
                self._container,
                ["bash", "--noprofile", "--norc", "-c", SPILL_WRITER, "dsh-bash", self.path],
                env=SCRIPT_ENV,
                stdin=True,
                user=self._user,
            )
            stream = await self._engine.exec_start(exec_id)
            try:
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    queue, self._queue = self._queue, []
                    for chunk in queue:
                        if self._deleted:
                            break
                        await stream.send_stdin(chunk)
                    if self._closed and not self._queue:
                        break
                await stream.close_stdin()
                await stream.pump(lambda _: None, lambda _: None)
            finally:
                await stream.aclose()
        except (EngineError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            log.warning("spill file %s: writing failed: %s", self.path, exc)
        finally:
            if self._deleted:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    try:
                        await run_script(
                            self._engine, self._container, self._user, 'rm -f -- "$1"', self.path
                        )
                    except (EngineError, OSError) as exc:
                        log.warning("spill file %s: removing failed: %s", self.path, exc)
            self.done.set()
