"""dsh_bash_docker: the executor contract inside a Docker container."""

from ._docker_config import DockerConfig
from ._docker_executor import MANAGED_LABEL, DockerBashExecutor, sweep_orphaned_containers

__all__ = ["MANAGED_LABEL", "DockerBashExecutor", "DockerConfig", "sweep_orphaned_containers"]
