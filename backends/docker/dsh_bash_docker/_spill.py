"""Spill files inside the container, written by a lazily started ``cat`` exec."""

from __future__ import annotations

from dsh_bash._remote_bash import QueuedSpillFile, SpillWriter

from ._engine import EngineClient, ExecStream
from ._process import SCRIPT_ENV, run_script
from ._scripts import SPILL_WRITER

__all__ = ["DockerSpillFile"]


class _ExecWriter:
    """Feeds one ``cat`` exec; a refused path or a failed write marks the file lost."""

    def __init__(self, spill: DockerSpillFile, exec_id: str, stream: ExecStream) -> None:
        self._spill = spill
        self._exec_id = exec_id
        self._stream = stream
        self._errors = bytearray()

    async def send(self, data: bytes) -> None:
        try:
            await self._stream.send_stdin(data)
        except BaseException:
            self._spill.lost = True
            raise

    async def finish(self) -> None:
        await self._stream.close_stdin()
        try:
            await self._stream.pump(lambda _: None, self._errors.extend)  # until cat exits
            code = (await self._spill.engine.exec_inspect(self._exec_id)).get("ExitCode")
        except BaseException:
            self._spill.lost = True
            raise
        if code != 0:
            self._spill.lost = True
            detail = bytes(self._errors[-500:]).decode("utf-8", "replace").strip()
            raise OSError(f"the spill writer exited with status {code}: {detail or 'no message'}")

    async def aclose(self) -> None:
        await self._stream.aclose()


class DockerSpillFile(QueuedSpillFile):
    """A spill file in the container. ``lost`` turns true when its writer failed or was refused
    (a path that already exists, such as a planted link): the stream then reports no spill path."""

    def __init__(self, engine: EngineClient, container: str, user: str | None, path: str) -> None:
        super().__init__(path)
        self.engine = engine
        self._container = container
        self._user = user
        self.lost = False

    async def _open_writer(self) -> SpillWriter:
        try:
            exec_id = await self.engine.exec_create(
                self._container,
                ["bash", "--noprofile", "--norc", "-c", SPILL_WRITER, "dsh-bash", self.path],
                env=SCRIPT_ENV,
                stdin=True,
                user=self._user,
            )
            return _ExecWriter(self, exec_id, await self.engine.exec_start(exec_id))
        except BaseException:
            self.lost = True
            raise

    async def _remove(self) -> None:
        await run_script(self.engine, self._container, self._user, 'rm -f -- "$1"', self.path)
