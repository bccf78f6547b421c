"""dsh_bash_local: the executor contract on local subprocesses."""

from ._config import LocalConfig
from ._executor import LocalBashExecutor

__all__ = ["LocalBashExecutor", "LocalConfig"]
