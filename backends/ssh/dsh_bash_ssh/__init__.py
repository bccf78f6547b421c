"""dsh_bash_ssh: the executor contract on a host reached over SSH (asyncssh, asyncio only)."""

from ._ssh_config import SshConfig
from ._ssh_executor import SshBashExecutor

__all__ = ["SshBashExecutor", "SshConfig"]
