"""The local backend: commands run as local subprocesses of this process.

Its mechanics are :class:`dsh_bash.host.HostBashExecutor`'s, shared with every backend whose
commands are processes of this host; this backend adds only its config class.
"""

from __future__ import annotations

from dsh_bash.host import HostBashExecutor

from ._hints import INFRA_HINTS
from ._local_config import LocalConfig

__all__ = ["LocalBashExecutor"]


class LocalBashExecutor(HostBashExecutor[LocalConfig]):
    """Runs each command as ``bash --noprofile --norc -c -- COMMAND`` in a new session on this host."""

    config_class = LocalConfig
    infra_hints = INFRA_HINTS  # what dsh-bash doctor says to do, by error reason (_hints.py)
    needs_setsid = False  # commands start in a session of their own without the setsid program

    def __init__(self, config: LocalConfig | None = None) -> None:
        super().__init__(config if config is not None else LocalConfig())
