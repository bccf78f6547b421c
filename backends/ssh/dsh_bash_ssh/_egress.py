"""The egress proxies of ``network = "allow-list"`` for an SSH host's commands.

The proxy runs in the harness (:class:`dsh_bash.backend.EgressProxy`, one per allow-list), behind a
unix socket file in a private local directory. On the host, a socket file in the executor's spill
directory is forwarded to it by the server (``streamlocal-forward@openssh.com``, which OpenSSH's
``AllowStreamLocalForwarding`` allows by default), one connection at a time; the confinement step's
``--proxy PATH`` names that file, and its forwarder relays each of the command's connections
through it, each after the proxy's key (which the step takes from the command's environment, where
the header on the channel's stdin put it: ``--proxy-key-env``), without which the proxy refuses a
connection: a confined command that finds another list's file cannot use it. The server makes the
file 0600 (``StreamLocalBindMask``): other users of the host cannot use the proxy. A reconnect
loses the forwarding: the next command forwards a new file.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from collections.abc import Callable

import anyio
import asyncssh

from dsh_bash.backend import EgressProxies, EgressRoute

from ._connection import ChannelPool

__all__ = ["RemoteEgress"]

log = logging.getLogger("dsh_bash.ssh")

#: The longest path a unix socket can have (``sun_path`` less its NUL).
_SOCKET_PATH_MAX = 107


class RemoteEgress:
    """The proxies and their forwarded socket files, by allow-list."""

    def __init__(self, pool: ChannelPool, start_helper: Callable[..., None]) -> None:
        self._pool = pool
        self._proxies = EgressProxies(start_helper)
        self._lock = anyio.Lock()
        self._directory: str | None = None
        #: The forwarded file on the host, by allow-list, and the connection that forwards it.
        self._remote: dict[tuple[str, ...], tuple[asyncssh.SSHClientConnection, EgressRoute]] = {}

    async def socket(self, allow_hosts: tuple[str, ...], remote_directory: str) -> EgressRoute | None:
        """The host's socket file that leads to the proxy for ``allow_hosts`` (started at the first
        call for a list, forwarded again after a reconnect), with the proxy's key; None when the
        server refuses to forward one (the reason is logged)."""
        async with self._lock:
            conn = await self._pool.connection()
            held = self._remote.get(allow_hosts)
            if held is not None and held[0] is conn:
                return held[1]
            remote = f"{remote_directory}/egress-{secrets.token_hex(6)}.sock"
            if not remote.startswith("/") or len(remote) > _SOCKET_PATH_MAX:
                log.warning(
                    "no egress proxy: the socket path %r is no absolute path of at most %d bytes",
                    remote,
                    _SOCKET_PATH_MAX,
                )
                return None
            if self._directory is None:
                self._directory = tempfile.mkdtemp(prefix="dsh-bash-egress-")
            # 0600 in a 0700 directory: only this process's user (asyncssh, forwarding) connects.
            local, key = await self._proxies.in_directory(allow_hosts, self._directory)
            try:
                await conn.forward_remote_path(remote, local)
            except (asyncssh.ChannelListenError, asyncssh.Error, OSError) as exc:
                log.warning(
                    "no egress proxy on %s: the server refused to forward a unix socket (%s; OpenSSH: "
                    "AllowStreamLocalForwarding, DisableForwarding)",
                    self._pool.where,
                    exc,
                )
                return None
            route = EgressRoute(socket=remote, key=key)
            self._remote[allow_hosts] = (conn, route)
            return route

    def close(self) -> None:
        """Remove the local socket files (their listeners end with the executor's helpers)."""
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
