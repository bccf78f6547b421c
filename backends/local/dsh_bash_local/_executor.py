"""The local backend: commands run as local subprocesses of this process.

Its mechanics are :class:`dsh_bash.backend.HostBashExecutor`'s, shared with every backend whose
commands are processes of this host; this backend adds only its config class.
"""

from __future__ import annotations

from dsh_bash.backend import HostBashExecutor

from ._config import LocalConfig

__all__ = ["LocalBashExecutor"]


class LocalBashExecutor(HostBashExecutor[LocalConfig]):
    """Runs each command as ``bash --noprofile --norc -c COMMAND`` in a new session on this host."""

    config_class = LocalConfig

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config if config is not None else LocalConfig())
