"""dsh_bash_docker: the executor contract inside a Docker container."""

from dsh_bash.remote import quiet_asyncssh_import

quiet_asyncssh_import()  # an ssh:// engine imports asyncssh when it first connects

from ._docker_config import DockerConfig  # noqa: E402
from ._docker_executor import MANAGED_LABEL, DockerBashExecutor, sweep_orphaned_containers  # noqa: E402

__all__ = ["MANAGED_LABEL", "DockerBashExecutor", "DockerConfig", "sweep_orphaned_containers"]
