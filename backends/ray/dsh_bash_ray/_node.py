"""The harness's side of a node host: its actor, shared by this process's executors on one node.

One node host per node and per harness process (an actor costs about half a second of a worker's
start; an executor is an owner id inside one). The first executor placed on a node starts it; when
the last one closes, it waits ``node_host_idle_ms`` for the next and then ends itself (0: it is
ended with the last). It is not detached: Ray ends it with the process that owns it, so a harness
that dies leaves nothing running (its supervisors see their input close and kill all).
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

from ._channel import ChannelAddress, ChannelBroken, ChannelClient
from ._node_host import CHANNEL_METHODS, NodeHost, NodeInfo
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


@dataclass
class _Host:
    """This process's node host on one node."""

    actor: Any
    leases: int = 0
    #: Its busy and idle turns, counted: what the node host's idle wait is told apart by.
    epoch: int = 0
    #: It was told to wait idle once: its death may be its own end, not its node's.
    idled: bool = False


_lock = threading.Lock()
#: node id -> its node host (one that ended itself while idle stays here until the next lease)
_hosts: dict[str, _Host] = {}


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
    _divert_cluster_messages()


def _divert_cluster_messages() -> None:
    """Ray prints the cluster's messages to a driver (a node marked dead, say) on ``sys.stdout``,
    from a thread of its own, whenever they come: into the middle of what the harness writes there
    (a CLI's JSON, an MCP server's stdio). Sent to the ``dsh_bash.ray`` logger instead, for a
    connection this backend made (a harness that connected itself keeps Ray's ways)."""
    try:
        from ray._private import worker  # noqa: PLC0415
    except ImportError:
        return
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "dsh_bash_diverted", False):
        return

    def to_the_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            printer(data, ignore_prefix)
            return
        for line in data.get("lines", []):
            log.warning("Ray: %s", line)

    to_the_log.dsh_bash_diverted = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_the_log


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
                return await _lease(fitting, _idle_s(config))
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
        return await _lease([node_id], _idle_s(config))
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
        host = _hosts.get(node.info.node_id)
        if host is not None and host.actor is node.actor and host.leases > 0:
            host.leases += 1
            return NodeLease(node, _idle_s(config))
    return await lease_node_id(config, node.info.node_id)


async def lease_every_node(config: RayConfig) -> list[NodeLease]:
    """A lease of the node host of every live node that fits ``config`` (the conformance kit's hooks)."""
    node_ids = await fitting_node_ids(config)
    leases: list[NodeLease] = []
    try:
        for node_id in node_ids:
            try:
                leases.append(await _lease([node_id], _idle_s(config)))
            except _DiedAtOpen:
                continue  # dead, not yet noticed by the cluster: nothing runs there
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return leases


def _idle_s(config: RayConfig) -> float:
    return config.node_host_idle_ms / 1000


async def _lease(node_ids: list[str], idle_s: float) -> NodeLease:
    """A lease of the node host of whichever of ``node_ids`` this process has the fewest leases on.
    One that ended itself while idle is replaced by a new one on its node, once."""
    node_id, actor, epoch, idled = _take(node_ids)
    while True:
        try:
            leased: tuple[NodeInfo, ChannelAddress] | None = await actor.lease.remote(epoch)
        except BaseException as exc:
            if not (isinstance(exc, Exception) and _is_actor_error(exc)):
                _give_back(node_id, idle_s)
                raise
            if not idled:
                _give_back(node_id, 0, dead=True)
                raise _DiedAtOpen(node_id, exc) from exc
            leased = None
        if leased is not None:
            return NodeLease(Node(actor, *leased), idle_s)
        if not idled:  # a new node host that is ending at once: not its idle wait
            _give_back(node_id, 0, dead=True)
            raise _DiedAtOpen(node_id, RuntimeError("it ended at once"))
        actor, epoch = _renew(node_id, actor)
        idled = False


def _new_actor(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    return (
        _ray()
        .remote(NodeHost)
        .options(
            num_cpus=0,
            max_concurrency=100_000,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote()
    )


def _take(node_ids: list[str]) -> tuple[str, Any, int, bool]:
    """The choice and a lease, at once (executors opened together spread): the node, its node
    host, the busy turn, and whether the node host was idle once."""
    with _lock:
        node_id = min(node_ids, key=lambda each: _hosts[each].leases if each in _hosts else 0)
        host = _hosts.get(node_id)
        if host is None:
            host = _hosts[node_id] = _Host(_new_actor(node_id))
        if host.leases == 0:
            host.epoch += 1
        host.leases += 1
        return node_id, host.actor, host.epoch, host.idled


def _renew(node_id: str, ended: Any) -> tuple[Any, int]:
    """A new node host on ``node_id`` in place of ``ended`` (ended by its idle wait), unless a
    concurrent lease made one already."""
    with _lock:
        host = _hosts[node_id]  # this lease's count keeps it
        if host.actor is ended:
            host.actor, host.idled = _new_actor(node_id), False
        return host.actor, host.epoch


def _give_back(node_id: str, idle_s: float, *, dead: bool = False) -> None:
    """One lease less; at none, the node host waits ``idle_s`` for the next and ends (0: at once).

    A live node host ends itself (its ``idle``), after the calls this process sent it before: the
    last executor's release of its proxies' directory among them (a ``ray.kill`` sent from here
    could overtake it and leave the directory on the node). A ``dead`` one (lost, or ending as it
    was leased) is killed from here."""
    with _lock:
        host = _hosts.get(node_id)
        if host is None:
            return
        host.leases -= 1
        if host.leases > 0:
            return
        host.epoch += 1
        epoch = host.epoch
        if idle_s > 0 and not dead:
            host.idled = True
        else:
            del _hosts[node_id]
    try:
        if dead:
            _ray().kill(host.actor, no_restart=True)
        else:
            host.actor.idle.remote(epoch, idle_s)  # its reply is not waited for: nothing to wait for
    except Exception as exc:  # the cluster may be gone already
        log.debug("ending the node host on %s: %s", node_id[:12], exc)


def _is_actor_error(exc: BaseException) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError  # noqa: PLC0415

    return isinstance(exc, RayActorError | ActorUnavailableError)


#: Node hosts' channel addresses (host, port) this process could not connect to at all (a Ray
#: Client far from the nodes, a firewall): their later leases go over Ray at once, without another
#: connect's wait.
_unreachable: set[tuple[str, int]] = set()


class Node:
    """A node host's actor and what it said of its node; every call through :meth:`call`, which
    turns the actor's death into ``node_lost`` (and remembers it: :attr:`lost`)."""

    def __init__(self, actor: Any, info: NodeInfo, channel: ChannelAddress | None = None) -> None:
        self.actor = actor
        self.info = info
        #: Why the node host is gone, once a call found it so.
        self.lost: BaseException | None = None
        #: The direct connections to the node host (None: every call over Ray).
        self._channel = None
        if channel is not None and channel[:2] not in _unreachable:
            self._channel = ChannelClient(channel)
        #: The leases holding this node (its channel closes with the last).
        self.holders = 0

    @property
    def where(self) -> str:
        return f"node {self.info.node_id[:12]} ({self.info.address})"

    async def call(self, method: str, *args: Any, idempotent: bool = False) -> Any:
        """The node host's ``method(*args)``, over the channel when it can be (``_channel``), else
        over Ray. An actor Ray calls unavailable (its node may be going, or the network hiccuped)
        is asked again for up to ``_UNAVAILABLE_S`` when the call may be repeated (``idempotent``:
        a read from an offset, a look); any other call's failure is the node's loss, as is the
        actor's death."""
        if self.lost is not None:
            raise node_lost_error(self.where, self.lost)
        channel = self._channel
        if channel is not None and method in CHANNEL_METHODS:
            try:
                return await channel.call(method, args)
            except ChannelBroken as exc:
                # Left for Ray from here on: it tells a node host that died from a connection
                # that broke (which it then carries).
                self.close_channel()
                if not channel.reached:
                    _unreachable.add(channel.address[:2])
                if exc.sent and not idempotent:
                    await self._ray_call("exists", ("/",), idempotent=True)
                    self.lost = exc
                    raise node_lost_error(
                        self.where, f"the connection to it broke during {method} (its effect is unknown)"
                    ) from exc
                log.info("the channel to the node host on %s broke (%s): Ray from here on", self.where, exc)
        return await self._ray_call(method, args, idempotent=idempotent)

    async def _ray_call(self, method: str, args: tuple[Any, ...], *, idempotent: bool) -> Any:
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

    def close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


@dataclass
class NodeLease:
    node: Node
    #: How long the node host waits for another lease once this process holds none.
    idle_s: float
    released: bool = False

    def __post_init__(self) -> None:
        self.node.holders += 1

    def another(self) -> NodeLease:
        """One more lease of this lease's node host (which this one keeps alive meanwhile)."""
        with _lock:
            host = _hosts.get(self.node.info.node_id)
            assert host is not None and host.actor is self.node.actor and not self.released
            host.leases += 1
        return NodeLease(self.node, self.idle_s)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.node.holders -= 1
            if self.node.holders == 0:
                self.node.close_channel()
            # A node host found dead is ended at once (its replacement starts at the next lease).
            lost = self.node.lost is not None
            _give_back(self.node.info.node_id, 0 if lost else self.idle_s, dead=lost)
