"""dsh_bash_ssh: the executor contract on a host reached over SSH (asyncssh, asyncio only)."""

from dsh_bash.remote import quiet_asyncssh_import

quiet_asyncssh_import()  # before any module of this package imports asyncssh

from ._ssh_config import SshConfig  # noqa: E402
from ._ssh_executor import SshBashExecutor  # noqa: E402

__all__ = ["SshBashExecutor", "SshConfig"]
