"""dsh_bash_local: the executor contract on local subprocesses."""

from ._local_config import LocalConfig
from ._local_executor import LocalBashExecutor

__all__ = ["LocalBashExecutor", "LocalConfig"]
