"""Spill files inside the container, written by a lazily started ``cat`` exec."""

from __future__ import annotations

from dsh_bash._remote_bash import QueuedSpillFile, SpillWriter

from ._engine import EngineClient, ExecStream
from ._process import SCRIPT_ENV, run_script
from ._scripts import SPILL_WRITER

__all__ = ["DockerSpillFile"]


class _ExecWriter:
    def __init__(self, stream: ExecStream) -> None:
        self._stream = stream

    async def send(self, data: bytes) -> None:
        await self._stream.send_stdin(data)

    async def finish(self) -> None:
        await self._stream.close_stdin()
        await self._stream.pump(lambda _: None, lambda _: None)  # until cat exits

    async def aclose(self) -> None:
        await self._stream.aclose()


class DockerSpillFile(QueuedSpillFile):
    def __init__(self, engine: EngineClient, container: str, user: str | None, path: str) -> None:
        super().__init__(path)
        self._engine = engine
        self._container = container
        self._user = user

    async def _open_writer(self) -> SpillWriter:
        exec_id = await self._engine.exec_create(
            self._container,
            ["bash", "--noprofile", "--norc", "-c", SPILL_WRITER, "dsh-bash", self.path],
            env=SCRIPT_ENV,
            stdin=True,
            user=self._user,
        )
        return _ExecWriter(await self._engine.exec_start(exec_id))

    async def _remove(self) -> None:
        await run_script(self._engine, self._container, self._user, 'rm -f -- "$1"', self.path)
