"""Spill files inside the container, written by a lazily started ``cat`` exec."""

from __future__ import annotations

import anyio

from dsh_bash.remote import (
    QueuedSpillFile,
    SpillWriter,
)

from ._engine import EngineClient, ExecStream
from ._process import SCRIPT_ENV, run_script
from ._scripts import SPILL_WRITER

__all__ = ["DockerSpillFile"]


class _ExecWriter:
    """Feeds one ``cat`` exec; its exit status tells whether the file is complete."""

    def __init__(self, engine: EngineClient, exec_id: str, stream: ExecStream) -> None:
        self._engine = engine
        self._exec_id = exec_id
        self._stream = stream
        self._errors = bytearray()

    async def wait_created(self) -> None:
        """Until SPILL_WRITER said that the file exists (its "."); OSError when it ended first."""
        said = bytearray()
        await self._stream.pump_until(said.extend, self._errors.extend, lambda: bool(said))
        if not said:
            detail = bytes(self._errors[-500:]).decode("utf-8", "replace").strip()
            raise OSError(f"the spill writer did not create the file: {detail or 'no message'}")

    async def send(self, data: bytes) -> None:
        await self._stream.send_stdin(data)

    async def finish(self) -> None:
        await self._stream.close_stdin()
        await self._stream.pump(lambda _: None, self._errors.extend)  # until cat exits
        code = await self._engine.exec_exit_code(self._exec_id)
        if code != 0:
            detail = bytes(self._errors[-500:]).decode("utf-8", "replace").strip()
            raise OSError(f"the spill writer exited with status {code}: {detail or 'no message'}")

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
        writer = _ExecWriter(self._engine, exec_id, await self._engine.exec_start(exec_id))
        try:
            await writer.wait_created()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await writer.aclose()
            raise
        return writer

    async def _remove(self) -> None:
        code, _, err = await run_script(self._engine, self._container, self._user, 'rm -f -- "$1"', self.path)
        if code != 0:
            raise OSError(f"rm exited with status {code}: {err[-300:].decode('utf-8', 'replace').strip()}")
