"""The harness's side of a node host: its actor, shared by this process's executors on one node.

One node host per node and per harness process (an actor costs about half a second of a worker's
start; an executor is an owner id inside one). The first executor placed on a node starts it, the
last one to close ends it. It is not detached: Ray ends it with the process that owns it, so a
harness that dies leaves nothing running (its supervisors see their input close and kill all).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from dsh_bash import BashInfrastructureError

from ._node_host import NodeHost, NodeInfo
from ._ray_config import RayConfig

__all__ = [
    "Node",
    "NodeLease",
    "connect",
    "fitting_node_ids",
    "lease_again",
    "lease_every_node",
    "lease_node",
    "lease_node_id",
    "node_lost_error",
]

log = logging.getLogger("dsh_bash.ray")

_lock = threading.Lock()
#: node id -> [actor handle, leases]
_hosts: dict[str, list[Any]] = {}


def _ray() -> Any:
    import ray  # noqa: PLC0415

    return ray


#: How long an idempotent call is repeated while Ray says the node host is unavailable.
_UNAVAILABLE_S = 10.0
#: How long the look for a cluster's GCS port may take before ``ray.init`` (which waits for minutes).
_PROBE_S = 5.0


def _probe(address: str) -> None:
    """``HOST:PORT`` answers a TCP connect, else ``cluster_unreachable`` at once: ``ray.init`` waits
    for minutes for an address where nothing listens."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT (a ray:// address, say): ray.init says what it makes of it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S).close()
    except OSError as exc:
        raise BashInfrastructureError(
            f"cannot reach the Ray cluster at {address!r}: {exc}", reason="cluster_unreachable"
        ) from exc


def connect(config: RayConfig) -> None:
    """Connect this process to the config's cluster, once (``cluster_unreachable`` when it cannot)."""
    ray = _ray()
    if ray.is_initialized():
        return
    if config.address != "auto":
        _probe(config.address)
    try:
        ray.init(
            address=config.address,
            namespace=config.namespace,
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BashInfrastructureError(
            f"cannot connect to the Ray cluster at {config.address!r}: {exc}", reason="cluster_unreachable"
        ) from exc


def node_lost_error(where: str, cause: object) -> BashInfrastructureError:
    return BashInfrastructureError(
        f"the node host on {where} is gone (the node died, or its actor was killed): {cause}; the "
        "sandbox's processes and files died with it",
        reason="node_lost",
    )


def _fits(node: Mapping[str, Any], config: RayConfig) -> bool:
    if not node.get("Alive"):
        return False
    total = node.get("Resources") or {}
    if any(total.get(name, 0) < amount for name, amount in config.resources.items()):
        return False
    labels = node.get("Labels") or {}
    return all(labels.get(name) == value for name, value in config.labels.items())


def _placement_group_node(config: RayConfig) -> str | None:
    from ray.util import placement_group_table  # noqa: PLC0415
    from ray.util.placement_group import get_placement_group  # noqa: PLC0415

    assert config.placement_group is not None
    try:
        group = get_placement_group(config.placement_group)
    except ValueError:
        return None
    if not group.wait(0):
        return None
    table = placement_group_table(group)
    node: str | None = table.get("bundles_to_node_id", {}).get(config.bundle_index)
    return node


def _fitting_nodes(config: RayConfig) -> list[str]:
    """The ids of the live nodes that fit (blocking: it asks the cluster)."""
    if config.placement_group is not None:
        node = _placement_group_node(config)
        return [] if node is None else [node]
    return [node["NodeID"] for node in _ray().nodes() if _fits(node, config)]


async def lease_node(config: RayConfig) -> NodeLease:
    """Connect, choose a node, and take a lease of its node host (started when there is none).

    A node the cluster still lists as alive may be dead already (its death is noticed after missed
    heartbeats, up to half a minute): a node host that dies before it answered is taken for that,
    and another node that fits is tried, until ``placement_timeout_ms``."""
    await anyio.to_thread.run_sync(connect, config)
    deadline = anyio.current_time() + config.placement_timeout_ms / 1000
    dead: set[str] = set()
    while True:
        fitting = [
            node for node in await anyio.to_thread.run_sync(_fitting_nodes, config) if node not in dead
        ]
        if fitting:
            try:
                return await _lease(fitting)
            except _DiedAtOpen as exc:
                log.info("the node host on %s died before it answered; trying another node", exc.node_id[:12])
                dead.add(exc.node_id)
                continue
        if anyio.current_time() >= deadline:
            wanted = {
                "resources": config.resources,
                "labels": config.labels,
                "placement_group": config.placement_group,
            }
            raise BashInfrastructureError(
                f"no live node of the Ray cluster fits { ({k: v for k, v in wanted.items() if v})!r} "
                f"within {config.placement_timeout_ms / 1000:.0f} s"
                + (f" ({len(dead)} that did died at once)" if dead else ""),
                reason="no_node_fits",
            )
        await anyio.sleep(0.5)


class _DiedAtOpen(Exception):
    def __init__(self, node_id: str, cause: BaseException) -> None:
        super().__init__(f"the node host on {node_id} died before it answered: {cause}")
        self.node_id = node_id


async def fitting_node_ids(config: RayConfig) -> list[str]:
    """The ids of the live nodes that fit ``config`` (connected first)."""
    await anyio.to_thread.run_sync(connect, config)
    return await anyio.to_thread.run_sync(_fitting_nodes, config)


async def lease_node_id(config: RayConfig, node_id: str) -> NodeLease:
    """A lease of the node host on the node ``node_id`` (a place chosen earlier); ``node_lost`` when
    the node host cannot start or answer there (the node died)."""
    await anyio.to_thread.run_sync(connect, config)
    try:
        return await _lease([node_id])
    except _DiedAtOpen as exc:
        raise node_lost_error(f"node {node_id[:12]}", exc.__cause__) from exc


async def lease_again(config: RayConfig, node: Node) -> NodeLease:
    """Another lease of ``node``'s node host, without asking it anything while it lives (a
    connection of a dialer placed there); when it was ended meanwhile (its last lease released), a
    new one on the same node. ``node_lost`` at once when a call found it dead: what it relayed (a
    container's execs) died with it, and a new node host would hide that."""
    if node.lost is not None:
        raise node_lost_error(node.where, node.lost)
    with _lock:
        entry = _hosts.get(node.info.node_id)
        if entry is not None and entry[0] is node.actor:
            entry[1] += 1
            return NodeLease(node)
    return await lease_node_id(config, node.info.node_id)


async def lease_every_node(config: RayConfig) -> list[NodeLease]:
    """A lease of the node host of every live node that fits ``config`` (the conformance kit's hooks)."""
    node_ids = await fitting_node_ids(config)
    leases: list[NodeLease] = []
    try:
        for node_id in node_ids:
            try:
                leases.append(await _lease([node_id]))
            except _DiedAtOpen:
                continue  # dead, not yet noticed by the cluster: nothing runs there
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return leases


async def _lease(node_ids: list[str]) -> NodeLease:
    """A lease of the node host of whichever of ``node_ids`` this process has the fewest leases on."""
    node_id, actor = _take(node_ids)
    try:
        info: NodeInfo = await actor.describe.remote()
    except BaseException as exc:
        _give_back(node_id)
        if isinstance(exc, Exception) and _is_actor_error(exc):
            raise _DiedAtOpen(node_id, exc) from exc
        raise
    return NodeLease(Node(actor, info))


def _take(node_ids: list[str]) -> tuple[str, Any]:
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    with _lock:  # the choice and the lease at once: executors opened together spread
        node_id = min(node_ids, key=lambda each: _hosts[each][1] if each in _hosts else 0)
        entry = _hosts.get(node_id)
        if entry is None:
            remote = ray.remote(NodeHost).options(
                num_cpus=0,
                max_concurrency=100_000,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            entry = _hosts[node_id] = [remote.remote(), 0]
        entry[1] += 1
        return node_id, entry[0]


def _give_back(node_id: str) -> None:
    with _lock:
        entry = _hosts.get(node_id)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _hosts[node_id]
    try:
        _ray().kill(entry[0], no_restart=True)
    except Exception as exc:  # the cluster may be gone already
        log.debug("ending the node host on %s: %s", node_id[:12], exc)


def _is_actor_error(exc: BaseException) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError  # noqa: PLC0415

    return isinstance(exc, RayActorError | ActorUnavailableError)


class Node:
    """A node host's actor and what it said of its node; every call through :meth:`call`, which
    turns the actor's death into ``node_lost`` (and remembers it: :attr:`lost`)."""

    def __init__(self, actor: Any, info: NodeInfo) -> None:
        self.actor = actor
        self.info = info
        #: Why the node host is gone, once a call found it so.
        self.lost: BaseException | None = None

    @property
    def where(self) -> str:
        return f"node {self.info.node_id[:12]} ({self.info.address})"

    async def call(self, method: str, *args: Any, idempotent: bool = False) -> Any:
        """The node host's ``method(*args)``. An actor Ray calls unavailable (its node may be going,
        or the network hiccuped) is asked again for up to ``_UNAVAILABLE_S`` when the call may be
        repeated (``idempotent``: a read from an offset, a look); any other call's failure is the
        node's loss, as is the actor's death."""
        if self.lost is not None:
            raise node_lost_error(self.where, self.lost)
        from ray.exceptions import ActorUnavailableError  # noqa: PLC0415

        deadline = anyio.current_time() + _UNAVAILABLE_S
        while True:
            try:
                return await getattr(self.actor, method).remote(*args)
            except ActorUnavailableError as exc:
                if idempotent and anyio.current_time() < deadline:
                    await anyio.sleep(0.2)
                    continue
                self.lost = exc
                raise node_lost_error(self.where, exc) from exc
            except Exception as exc:
                if _is_actor_error(exc):
                    self.lost = exc
                    raise node_lost_error(self.where, exc) from exc
                raise


@dataclass
class NodeLease:
    node: Node
    released: bool = False

    def another(self) -> NodeLease:
        """One more lease of this lease's node host (which this one keeps alive meanwhile)."""
        with _lock:
            entry = _hosts.get(self.node.info.node_id)
            assert entry is not None and entry[0] is self.node.actor and not self.released
            entry[1] += 1
        return NodeLease(self.node)

    def release(self) -> None:
        if not self.released:
            self.released = True
            _give_back(self.node.info.node_id)
