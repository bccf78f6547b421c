"""A direct connection between the harness and its node host, beside Ray, for the calls of a
command's path: its start, its stream's reads and writes, an inner engine's bytes.

An actor call costs 1.5-2.5 ms here (Ray's own floor, measured by ``bench/cluster.py``); a request
on a connection kept open costs about 0.2 ms. Ray stays what places the node host, bounds its life
and tells of its death: the channel's address and key come in the lease's reply (over Ray), and a
channel that breaks is left for Ray's path, which says whether the node host is gone.

Both ends prove that they know the key before anything else is read (each sends a nonce, each
answers the other's with an HMAC), so that a command on the node can neither call the node host
nor, should the node host die and a command take its port, answer the harness. A message is a
length and a pickle read by an unpickler that makes no object but plain values and
:class:`~dsh_bash_ray._node_host.StartRequest` (and a signal's number).

The harness's end keeps a few idle connections per lease and opens another for each call that
overlaps (a long poll holds one); the node host serves each connection's requests in turn.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import hmac
import io
import logging
import os
import pickle
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Collection
from typing import Any, NamedTuple

import anyio

__all__ = ["ChannelAddress", "ChannelBroken", "ChannelClient", "ChannelServer", "dumps", "loads"]

log = logging.getLogger("dsh_bash.ray")

_NONCE = 16
_MAC = hashlib.sha256().digest_size
#: The largest message either end takes (a write of an inner engine's upload is one message).
MAX_MESSAGE = 64 * 1024 * 1024
#: How long a connection may take to prove itself before the node host drops it, and how many
#: may be at it at once (a command on the node can connect; it cannot hold the node host's fds).
_AUTH_BOUND_S = 5.0
_UNPROVEN_MAX = 32
#: How long the harness waits for a connection to be made and proven.
_CONNECT_BOUND_S = 5.0
#: Idle connections kept per lease (more are opened while calls overlap, and closed after).
_IDLE_KEPT = 4
_HEADER = struct.Struct("!I")
#: The classes a message may carry beyond plain values.
_CLASSES = {("dsh_bash_ray._node_host", "StartRequest"), ("signal", "Signals")}


class ChannelAddress(NamedTuple):
    host: str
    port: int
    key: bytes

    def __repr__(self) -> str:  # the key is not for logs
        return f"ChannelAddress({self.host!r}, {self.port})"


class ChannelBroken(Exception):
    """The connection failed; ``sent``: the request (or part of it) may have reached the node host."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not carried by the node host's channel")


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


def _mac(key: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, side + first + second, hashlib.sha256).digest()


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def raise_remote(name: str, message: str) -> None:
    """The node host's exception, as this side can make it: a builtin one as itself (an ``OSError``
    stays one), any other as a RuntimeError naming it."""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(message)
    raise RuntimeError(f"{name} on the node host: {message}")


# -- the node host's end (asyncio: it runs in the actor's event loop) ---------------------------------


class ChannelServer:
    """Serves ``dispatch(method, args)`` for ``methods`` to connections that prove the key."""

    def __init__(
        self, dispatch: Callable[[str, tuple[Any, ...]], Awaitable[Any]], methods: Collection[str]
    ) -> None:
        self._dispatch = dispatch
        self._methods = frozenset(methods)
        self._key = secrets.token_bytes(32)
        self._unproven = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> ChannelAddress:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return ChannelAddress(host, port, self._key)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._unproven >= _UNPROVEN_MAX:
                return
            self._unproven += 1
            try:
                proven = await asyncio.wait_for(self._prove(reader, writer), _AUTH_BOUND_S)
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                proven = False
            finally:
                self._unproven -= 1
            if proven:
                await self._requests(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _prove(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        theirs = await reader.readexactly(_NONCE)
        ours = os.urandom(_NONCE)
        writer.write(ours + _mac(self._key, b"node host", theirs, ours))
        await writer.drain()
        answer = await reader.readexactly(_MAC)
        return hmac.compare_digest(answer, _mac(self._key, b"harness", ours, theirs))

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            except asyncio.IncompleteReadError:
                return  # the harness closed it
            if size > MAX_MESSAGE:
                log.warning("a channel request of %d bytes: the connection is dropped", size)
                return
            reply: tuple[bool, Any]
            try:
                method, args = loads(await reader.readexactly(size))
                if method not in self._methods:
                    raise ValueError(f"{method!r} is not served on the channel")
                reply = True, await self._dispatch(method, tuple(args))
            except (asyncio.IncompleteReadError, ConnectionError):
                raise
            except Exception as exc:
                reply = False, _error(exc)
            try:
                data = dumps(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                data = dumps((False, _error(exc)))
            writer.write(_HEADER.pack(len(data)) + data)
            await writer.drain()


# -- the harness's end (anyio, plain sockets: a lease closes them without awaiting) -------------------


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await anyio.wait_writable(sock)


async def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        try:
            count = sock.recv_into(view[got:])
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if count == 0:
            raise ConnectionError("the node host closed the connection")
        got += count
    return bytes(buffer)


def _keepalive(sock: socket.socket) -> None:
    """A node that vanishes (no reset) is noticed in about 10 s, not after TCP's two hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class ChannelClient:
    """The harness's connections to one node host."""

    def __init__(self, address: ChannelAddress) -> None:
        self.address = address
        self._idle: list[socket.socket] = []
        self._closed = False
        #: A connection to the address was ever made (a proof that failed is not the address's
        #: fault: a command on the node may hold the node host's unproven connections).
        self.reached = False

    async def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """``method(*args)`` on the node host; its exception raised here (:func:`raise_remote`);
        :class:`ChannelBroken` when the connection failed."""
        if self._closed:
            raise ChannelBroken("the channel was closed", sent=False)
        request = dumps((method, args))  # before a connection is taken: a failure here holds none
        sock = self._idle.pop() if self._idle else await self._connect()
        try:
            await _send_all(sock, _HEADER.pack(len(request)) + request)
            (size,) = _HEADER.unpack(await _receive_exactly(sock, _HEADER.size))
            if size > MAX_MESSAGE:
                raise ConnectionError(f"a reply of {size} bytes")
            ok, value = loads(await _receive_exactly(sock, size))
        except (OSError, pickle.UnpicklingError, ValueError, TypeError) as exc:
            sock.close()
            # Whatever part of the request went, the node host may have taken it.
            raise ChannelBroken(f"{method}: {exc}", sent=True) from exc
        except BaseException:
            sock.close()  # cancelled mid-call: what is left on it is not the next call's
            raise
        if self._closed or len(self._idle) >= _IDLE_KEPT:
            sock.close()
        else:
            self._idle.append(sock)
        if not ok:
            raise_remote(*value)
        return value

    async def _connect(self) -> socket.socket:
        host, port, key = self.address
        try:
            infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
        except (OSError, IndexError) as exc:
            raise ChannelBroken(f"cannot resolve {host}: {exc}", sent=False) from exc
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
            with anyio.fail_after(_CONNECT_BOUND_S):
                with contextlib.suppress(BlockingIOError):
                    sock.connect(sockaddr)
                await anyio.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error))
                self.reached = True
                ours = os.urandom(_NONCE)
                await _send_all(sock, ours)
                reply = await _receive_exactly(sock, _NONCE + _MAC)
                theirs, proof = reply[:_NONCE], reply[_NONCE:]
                if not hmac.compare_digest(proof, _mac(key, b"node host", ours, theirs)):
                    raise OSError(f"{host}:{port} is not the node host (it does not know the key)")
                await _send_all(sock, _mac(key, b"harness", theirs, ours))
        except (OSError, TimeoutError) as exc:
            sock.close()
            message = f"cannot connect to the node host at {host}:{port}: {exc}"
            raise ChannelBroken(message, sent=False) from exc
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
