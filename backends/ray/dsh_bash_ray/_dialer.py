"""``inner = "docker"``: the Docker backend's executor, its engine connections relayed by a node.

The Ray backend is then the placement and the transport only. The executor is the Docker
backend's own (got by name from the registry: no backend imports another), with an
``engine_dialer`` whose every connection is a unix-socket connection opened by the node host on the
chosen node to that node's engine, its bytes carried by actor calls. The container, its commands,
their spill files and the supervisor live on that node's engine; every truth about a command stays
in the Docker executor, which treats the engine as one on another host (nothing of it is read
from this host's ``/proc``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from dsh_bash import BashExecutor, BashInfrastructureError, ConfigError, backend_factory
from dsh_bash.backend import Dialer

from ._node import Node, NodeLease, fitting_node_ids, lease_again, lease_node, lease_node_id
from ._ray_config import RAY_FIELDS, RayConfig

__all__ = ["RayDialer", "docker_on_a_node"]

#: How long one read of a connection waits on the node before it is asked again.
_POLL_S = 30.0
#: How long closing a connection may wait for the node host (shielded from cancellation).
_CLOSE_BOUND_S = 5.0
_DEFAULT_SOCKET = "/var/run/docker.sock"


def docker_on_a_node(fields: dict[str, Any]) -> BashExecutor:
    """The Docker backend's executor for ``fields`` less Ray's own (placement), connected to the
    engine of the node the placement chooses (at its first connection: its open)."""
    if "spill_parent" in fields:
        raise ConfigError(
            "spill_parent: applies to inner = 'local' only (with 'docker' the Docker backend keeps "
            "spill files in the container)"
        )
    placement = {name: fields.pop(name) for name in list(fields) if name in RAY_FIELDS}
    config = RayConfig(**placement)
    docker_host = fields.pop("docker_host", None)
    if docker_host is None:
        path = _DEFAULT_SOCKET
    elif isinstance(docker_host, str) and docker_host.startswith("unix:///"):
        path = docker_host[len("unix://") :]
    else:
        raise ConfigError(
            f"docker_host: with inner = 'docker' the node's own engine is reached on the node, by its "
            f"unix socket: unix:///PATH (default unix://{_DEFAULT_SOCKET}), not {docker_host!r}"
        )
    return backend_factory("docker")(**fields, engine_dialer=RayDialer(config, path))


class RayDialer(Dialer):
    """Connections to a Docker engine's socket on one node, each relayed by that node's node host.

    The node is chosen at the first connection (the placement of ``config``) and kept: every later
    connection goes to the same engine; when that node is gone they fail with ``node_lost``. Each
    connection holds a lease of the node host, which waits idle only once the last one closed. The
    node host serves the egress proxies of ``network = "allow-list"`` on the node, in a directory
    there that the Docker backend mounts into its container.
    """

    def __init__(self, config: RayConfig, socket_path: str, *, node_id: str | None = None) -> None:
        self._config = config
        self._path = socket_path
        self._node_id = node_id
        self._node: Node | None = None
        self._lock = threading.Lock()
        self._owner = f"dial-{uuid.uuid4().hex[:12]}"
        self._numbers = itertools.count()
        #: Clients holding this dialer (Dialer.hold), and the lease kept for them meanwhile: the
        #: node host lives from their first connection to the last one's close, not per connection
        #: (an executor's open makes and ends many; each node host costs a worker's start).
        self._holders = 0
        self._kept: NodeLease | None = None
        self._egress_lock = anyio.Lock()
        self._egress_dir: str | None = None

    def describe(self) -> str:
        node = self._node
        if node is None:
            return f"the Docker engine at unix://{self._path} of a node of the Ray cluster (chosen at open)"
        info = node.info
        return (
            f"the Docker engine at unix://{self._path} of Ray node {info.node_id} "
            f"({info.address}, host {info.hostname})"
        )

    def hold(self) -> Callable[[], None]:
        with self._lock:
            self._holders += 1
        released = False

        def let_go() -> None:
            nonlocal released
            if released:
                return
            released = True
            with self._lock:
                self._holders -= 1
                kept = self._kept if self._holders == 0 else None
                if kept is not None:
                    self._kept = None
            if kept is not None:
                if self._egress_dir is not None and kept.node.lost is None:
                    # Its proxies and their directory end with the last client (not waited for:
                    # this runs in a close, and the node host does it before it answers the next).
                    self._egress_dir = None
                    kept.node.actor.release_owner.remote(self._owner)
                kept.release()

        return let_go

    async def dial(self) -> anyio.abc.ByteStream:
        lease = await self._lease()
        with self._lock:
            if self._holders > 0 and (self._kept is None or self._kept.node is not lease.node):
                stale, self._kept = self._kept, lease.another()
            else:
                stale = None
        if stale is not None:
            stale.release()
        stream_id = f"{self._owner}-{next(self._numbers)}"
        try:
            problem: str = await lease.node.call("connect", stream_id, self._owner, self._path)
        except BaseException:
            lease.release()
            raise
        if problem:
            lease.release()
            raise OSError(problem)
        return _RelayedConnection(lease, stream_id)

    async def _lease(self) -> NodeLease:
        node = self._node
        if node is not None:
            lease = await lease_again(self._config, node)
            self._node = lease.node  # a node host made anew on the same node
            return lease
        if self._node_id is not None:
            lease = await lease_node_id(self._config, self._node_id)
        else:
            lease = await lease_node(self._config)
        with self._lock:
            if self._node is None:
                self._node = lease.node
                return lease
            chosen = self._node
        if chosen.info.node_id == lease.node.info.node_id:
            return lease
        lease.release()  # two first connections at once chose two nodes: the first choice holds
        return await lease_again(self._config, chosen)

    async def egress_directory(self) -> str | None:
        async with self._egress_lock:
            if self._egress_dir is None:
                lease = await self._lease()
                try:
                    self._egress_dir = await lease.node.call("egress_directory", self._owner)
                finally:
                    lease.release()
            return self._egress_dir

    async def egress_socket(self, allow_hosts: tuple[str, ...]) -> tuple[str, str]:
        directory = await self.egress_directory()
        assert directory is not None
        lease = await self._lease()
        try:
            path, key = await lease.node.call(
                "egress_socket", self._owner, list(allow_hosts), directory, 0o666
            )
        finally:
            lease.release()
        return path, key

    async def every_place(self) -> Sequence[Dialer]:
        if self._node_id is not None:
            return [self]
        return [
            RayDialer(self._config, self._path, node_id=node_id)
            for node_id in await fitting_node_ids(self._config)
        ]


class _RelayedConnection(anyio.abc.ByteStream):
    """One connection to the engine's socket on the node: reads are long polls from an offset
    (a repeated call neither loses nor doubles a byte), writes are whole and in order."""

    def __init__(self, lease: NodeLease, stream_id: str) -> None:
        self._lease = lease
        self._node = lease.node
        self._id = stream_id
        self._offset = 0
        self._buffer = b""
        self._ended = False
        self._closed = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while not self._buffer:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._ended:
                raise anyio.EndOfStream
            data, ended, _ = await self._node.call(
                "read", self._id, self._offset, _POLL_S, (0.0, 0.0), idempotent=True
            )
            self._offset += len(data)
            self._buffer += data
            self._ended = ended
        data, self._buffer = self._buffer[:max_bytes], self._buffer[max_bytes:]
        return data

    async def send(self, item: bytes) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if not await self._node.call("write", self._id, bytes(item)):
            raise anyio.BrokenResourceError("the engine's connection on the node is closed")

    async def send_eof(self) -> None:
        if not self._closed:
            await self._node.call("write_eof", self._id)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(_CLOSE_BOUND_S),
                contextlib.suppress(BashInfrastructureError),
            ):
                await self._node.call("disconnect", self._id)
        finally:
            self._lease.release()
