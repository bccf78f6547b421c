"""Configuration of the Ray backend."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from dsh_bash import BudgetConfig

__all__ = ["RAY_FIELDS", "RayConfig"]


#: The fields that place an executor (with ``inner = "docker"`` every other field is the Docker
#: backend's).
RAY_FIELDS = frozenset(
    {
        "address",
        "namespace",
        "resources",
        "labels",
        "placement_group",
        "bundle_index",
        "placement_timeout_ms",
        "node_host_idle_ms",
        "inner",
    }
)


class RayConfig(BudgetConfig):
    """Which cluster, and which of its nodes the executor's commands run on.

    ``cwd`` defaults to the working directory of the node host (the Ray worker's, on that node).
    """

    #: ``"auto"``: the cluster this process is connected to (``ray.init`` done by the caller), else
    #: ``RAY_ADDRESS``, else a cluster already running on this machine (none is started); or an
    #: address (``HOST:PORT``) that ``ray.init`` takes. A process connects once: in a process already
    #: connected, every executor uses that cluster.
    address: str = "auto"
    #: The Ray namespace of the node hosts (None: Ray's anonymous one of this job).
    namespace: str | None = None
    #: Custom or built-in resources a node must have in total (``{"sandbox": 1}``, ``{"GPU": 1}``).
    #: The node host reserves none of them: they choose the node, they do not ration it.
    resources: dict[str, float] = Field(default_factory=dict)
    #: Node labels a node must carry, each exactly (``{"ray.io/node-id": "..."}``, a label of yours).
    labels: dict[str, str] = Field(default_factory=dict)
    #: A placement group (its name, in ``namespace``) and the index of its bundle whose node runs
    #: the commands.
    placement_group: str | None = None
    bundle_index: int = 0
    #: How long to wait for a node that fits to be alive; then ``no_node_fits``.
    placement_timeout_ms: float = 60_000
    #: How long a node host (this process's actor on a node, shared by its executors there) waits
    #: for the next executor once the last one there closed, before it ends itself: an executor
    #: opened meanwhile starts in milliseconds instead of the half second of a Ray worker's start.
    #: Nothing of a closed executor runs meanwhile. 0: it ends with the last executor.
    node_host_idle_ms: float = 30_000
    #: The directory on the node the executor's private spill directory is made in (None: the
    #: node's temporary directory, ``TMPDIR`` or ``/tmp``).
    spill_parent: str | None = None
    #: What runs the commands on the node: ``local``, the node's own processes (each under the
    #: node's ``dsh-supervise``, as the local backend does); ``docker``, a container on the node's
    #: Docker engine, made and run by the Docker backend (every field but the placement fields
    #: above is then the Docker backend's: ``image``, ``user``, ``policy``, the budgets).
    inner: Literal["local", "docker"] = "local"

    @model_validator(mode="after")
    def _check_placement(self) -> Self:
        if self.placement_group is None and self.bundle_index != 0:
            raise ValueError("bundle_index needs placement_group")
        if self.bundle_index < 0:
            raise ValueError("bundle_index must be 0 or more")
        if not self.placement_timeout_ms > 0:
            raise ValueError("placement_timeout_ms must be positive")
        if not self.node_host_idle_ms >= 0:
            raise ValueError("node_host_idle_ms must be 0 or more")
        for name, amount in self.resources.items():
            if not amount > 0:
                raise ValueError(f"resources[{name!r}] must be positive")
        return self
