"""A backend composed on another: the connections of an inner backend made by an outer one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import anyio.abc

__all__ = ["Dialer"]


class Dialer(ABC):
    """Connections to where an inner backend's endpoint listens, made by an outer backend.

    The Ray backend with ``inner = "docker"`` hands the Docker backend one (its config's
    ``engine_dialer``): each connection to the engine is then a byte stream relayed by the node
    the Ray backend chose, and the inner backend keeps every other truth. An endpoint reached so is
    never taken to be on this host (its processes are not in this host's ``/proc``).
    """

    @abstractmethod
    def describe(self) -> str:
        """Where the connections lead, for messages and ``doctor`` (``node 1a2b3c (10.0.0.5) via Ray``)."""

    @abstractmethod
    async def dial(self) -> anyio.abc.ByteStream:
        """A new connection: ``send_eof`` half-closes it (an exec's stdin ends while its output is
        read), ``receive`` raises ``anyio.EndOfStream`` at its end. A failure to reach the place
        raises :class:`dsh_bash.BashInfrastructureError` with the outer backend's reason
        (``node_lost``, ``cluster_unreachable``, ...), which the inner backend's errors keep."""

    def hold(self) -> Callable[[], None]:
        """Called by each client of the inner backend that will dial (one Docker engine client: an
        executor's, a kit hook's), before its first connection; it calls what this returns once,
        when it closes. What the connections need on the outer side (Ray: the node host) is then
        kept from that client's first connection to its close, not started and ended with each
        connection. Default: nothing to keep."""
        return _nothing

    async def egress_directory(self) -> str | None:
        """A private directory on the place's host (``0711``: names in it are reached, not listed)
        for the socket files of the egress proxies :meth:`egress_socket` serves there; the same at
        every call, removed when the last :meth:`hold` lets go. An inner backend mounts it where its
        commands run. None (the default): the place serves no egress proxy, and the inner backend
        refuses ``network = "allow-list"`` (``policy_unenforceable``)."""
        return None

    async def egress_socket(self, allow_hosts: tuple[str, ...]) -> tuple[str, str]:
        """The path of the socket file (in :meth:`egress_directory`, mode ``0666``) of the place's
        egress proxy for ``allow_hosts``, started at the first call for that list, and its key (a
        client sends it first: ``EgressRoute.key``). Only when :meth:`egress_directory` gave one."""
        raise NotImplementedError(f"{type(self).__name__} serves no egress proxy")

    async def every_place(self) -> Sequence[Dialer]:
        """For the conformance kit, which must look everywhere the inner backend's commands may run
        (one dialer may be placed on any of several nodes): a dialer fixed on each such place.
        Default: this one."""
        return [self]


def _nothing() -> None:
    pass
