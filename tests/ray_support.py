"""Ray test support: a two-node local Ray cluster in this process, and kit targets on it.

The cluster (``ray.cluster_utils.Cluster``: a head node and one more, each a raylet of its own on
this machine) starts for a test module in each test process that runs its tests (3-15 s), and this
process connects to it as its driver; it is shut down after the module's last test there. The
executors of :meth:`RayCluster.executor` run their commands on the second node (the resource
``dsh_second`` only it has), so every command crosses from the driver to another node's worker.
Without the ``ray`` package the fixture skips with a reason starting ``backend unavailable:`` (a
failure in CI).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
from dsh_bash_conformance import KitTarget

if TYPE_CHECKING:
    from dsh_bash_ray import RayBashExecutor

__all__ = ["RayCluster", "ray_cluster", "ray_target"]

BACKEND_UNAVAILABLE = "backend unavailable:"
#: The custom resource only the second node has: an executor that asks for it runs there.
SECOND = "dsh_second"


@dataclass
class RayCluster:
    cluster: Any
    address: str

    def executor(self, **overrides: Any) -> RayBashExecutor:
        from dsh_bash_ray import RayBashExecutor  # noqa: PLC0415

        return RayBashExecutor.from_fields(**{"resources": {SECOND: 1}, **overrides})

    def add_node(self, **resources: float) -> Any:
        node = self.cluster.add_node(num_cpus=1, resources=dict(resources))
        self.cluster.wait_for_nodes()
        return node


def start_cluster() -> RayCluster:
    try:
        import ray  # noqa: PLC0415
        from ray.cluster_utils import Cluster  # noqa: PLC0415
    except ImportError as exc:
        pytest.skip(f"{BACKEND_UNAVAILABLE} ray cannot be imported (pip install 'dsh-bash[ray]'): {exc}")
    # Ray's own noise (its usage stats prompt, its dashboard) has no part in these tests.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={SECOND: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return RayCluster(cluster=cluster, address=cluster.address)


def stop_cluster(started: RayCluster) -> None:
    import ray  # noqa: PLC0415

    ray.shutdown()
    started.cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A two-node cluster for the module's tests in this test process, shut down after its last
    one: a cluster's raylets, GCS and workers keep a share of the two cores busy while they live,
    which stretched a whole run of the suite from 10 to 22 minutes when each worker kept its own."""
    started = start_cluster()
    try:
        yield started
    finally:
        stop_cluster(started)


def ray_target(cluster: RayCluster, *, check_timeout_s: float = 30.0) -> KitTarget:
    """A kit target whose executors run their commands on the cluster's second node."""
    from dsh_bash_ray import RayBashExecutor  # noqa: PLC0415

    probe = RayBashExecutor.from_fields(resources={SECOND: 1})
    return KitTarget(
        name="ray[asyncio]",
        make_executor=cluster.executor,
        plant_ambient=lambda variables: _no_overrides(probe.kit_plant_ambient(variables)),
        find_processes=probe.kit_find_processes,
        anyio_backend="asyncio",
        check_timeout_s=check_timeout_s,
    )


class _no_overrides:
    """The hook's context manager, yielding nothing (the kit's ``plant_ambient`` yields None)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __enter__(self) -> None:
        self._inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)
