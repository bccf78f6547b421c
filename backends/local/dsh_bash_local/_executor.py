"""The local backend: commands run as local subprocesses of this process."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

import anyio.to_thread

from dsh_bash import BashExecutor, BashInfrastructureError
from dsh_bash.backend import CommandProcess, Killable, Launch, ProcScanner, SpillFile, signal_marked

from ._config import LocalConfig
from ._hints import INFRA_HINTS
from ._process import spawn_local
from ._spill import LocalSpillDir

__all__ = ["LocalBashExecutor"]


class _Leftovers:
    """Every live process carrying any marker of one executor."""

    def __init__(self, scanner: ProcScanner) -> None:
        self._scanner = scanner

    async def signal_all(self, sig: int) -> None:
        for entry in await self._scanner.entries():
            if entry.alive and entry.marker is not None:
                await anyio.to_thread.run_sync(signal_marked, entry.pid, self._scanner.prefix, sig, False)
        self._scanner.invalidate()

    async def remaining(self) -> list[str]:
        return [str(e.pid) for e in await self._scanner.entries() if e.alive and e.marker is not None]


class LocalBashExecutor(BashExecutor[LocalConfig]):
    """Runs each command as ``bash --noprofile --norc -c COMMAND`` in a new session on this host."""

    config_class = LocalConfig
    infra_hints = INFRA_HINTS  # what dsh-bash doctor says to do, by error reason (_hints.py)
    needs_setsid = False  # commands start in a session of their own without the setsid program

    def __init__(self, config: LocalConfig | None = None) -> None:
        config = config if config is not None else LocalConfig()
        if config.cwd is None:
            config = config.model_copy(update={"cwd": os.getcwd()})
        super().__init__(config)
        self._local_config = config
        self._scanner = ProcScanner(self._token)
        self._spill_dir: LocalSpillDir | None = None
        self._bash: str | None = None

    async def _open(self) -> None:
        self._spill_dir = LocalSpillDir(self._local_config.spill_dir)
        self._bash = shutil.which(self._local_config.bash)

    async def _release(self) -> None:
        if self._spill_dir is not None:
            self._spill_dir.remove()
            self._spill_dir = None

    def _default_cwd(self) -> str:
        cwd = self._config.cwd
        assert cwd is not None
        return cwd

    def _ambient_env(self) -> Mapping[str, str]:
        return os.environ

    async def _spawn(self, launch: Launch) -> CommandProcess:
        if self._bash is None:
            raise BashInfrastructureError(f"bash not found: {self._local_config.bash!r} is not on PATH")
        assert self._spill_dir is not None
        return await spawn_local(
            launch,
            bash=self._bash,
            spill_dir=self._spill_dir,
            scanner=self._scanner,
            start_helper=self._start_helper,
            wrap=self._wrap_command,
        )

    def _wrap_command(self, argv: list[str], launch: Launch) -> tuple[list[str], str]:
        """Hook for subclasses: the argv to exec for ``launch`` and the host directory to start it in.

        ``argv`` starts the command's bash (``bash --noprofile --norc -c COMMAND``, or a script
        file in the spill directory for a long command). A sandboxing subclass wraps it in its
        launcher and maps the spec's workdir to the host directory that is checked (an unusable
        one raises BashInfrastructureError) and used as the launcher's working directory. It runs
        in a new session with ``launch.env``, as the command would. Default: ``argv`` and the
        spec's workdir, unchanged.
        """
        return argv, launch.spec.workdir

    @property
    def spill_directory(self) -> str | None:
        """The directory of this executor's spill files (and long-command scripts) while it is open."""
        return None if self._spill_dir is None else self._spill_dir.path

    def _open_spill(self, command_marker: str, stream: str) -> SpillFile:
        if self._spill_dir is None:
            raise OSError("the spill directory is gone")
        return self._spill_dir.new_file(stream)

    def _leftovers(self) -> Killable:
        return _Leftovers(self._scanner)
