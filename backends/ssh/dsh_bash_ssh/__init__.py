"""dsh_bash_ssh: the executor contract on a host reached over SSH (asyncssh, asyncio only)."""

from ._config import SshConfig
from ._executor import SshBashExecutor

__all__ = ["SshBashExecutor", "SshConfig"]
