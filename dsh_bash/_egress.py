"""The egress proxy of ``network = "allow-list"`` (``docs/design/policy.md``): an HTTP proxy behind an
abstract unix socket, which the confinement step connects to before it makes the command's own
network; its forwarder there (on ``127.0.0.1:``:data:`PROXY_PORT`, named by ``HTTP(S)_PROXY``) hands
each connection it accepts over that one connection. Or (a remote host's commands) behind a unix
socket file, to which an SSH server forwards each connection that the forwarder relays. It lets
``CONNECT host:port`` and absolute-form ``http://`` requests through to the policy's
``allow_hosts`` only; anything else gets a status and a line the model can read. One proxy serves
one allow-list; the executor runs it in its task group (:meth:`EgressProxy.serve`,
:meth:`EgressProxy.serve_clients`). Behind a socket file it has a key: a connection must begin with
it and a newline (the step's relays send it, taken from ``--proxy-key-env``), so that a confined
command that learns another list's file name cannot use that list (``docs/design/policy.md``)."""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import tempfile
from collections.abc import Callable
from urllib.parse import urlsplit

import anyio
import anyio.abc

from ._policy import host_allowed
from ._sockets import CancelSafeUnixStream

__all__ = ["PROXY_PORT", "EgressProxies", "EgressProxy"]

log = logging.getLogger("dsh_bash.egress")

#: Where the command's forwarder listens in its own network (the step sets the proxy variables to it).
PROXY_PORT = 3128
#: How many connections one proxy (one allow-list of one executor) serves at once.
MAX_CONNECTIONS = 256
#: The longest request head the proxy reads before it refuses (431), and how long it waits for it.
_HEAD_LIMIT = 16 * 1024
_HEAD_TIMEOUT_S = 30.0
_CONNECT_TIMEOUT_S = 30.0
_CHUNK = 64 * 1024


class _Refused(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class EgressProxy:
    """An HTTP proxy for the hosts of ``allow_hosts`` (:func:`dsh_bash._policy.host_allowed`'s rule).

    A name that resolves to a loopback or link-local address (this machine, a cloud's metadata
    service) is refused unless the allow-list names that address itself: an allowed name must not
    lead back into the harness's own network."""

    def __init__(
        self,
        allow_hosts: tuple[str, ...],
        *,
        max_connections: int = MAX_CONNECTIONS,
        key: str | None = None,
    ) -> None:
        self.allow_hosts = allow_hosts
        #: What a client's connection must begin with (and a newline) to be served (hex; see
        #: :func:`new_key`), or None: every connection is served (an abstract socket's forwarder,
        #: which only the command's own step could reach).
        self.key = key
        #: Connections served at once (each holds descriptors and a task of the harness's): past it a
        #: new one gets 503 at once, so that a command that opens thousands cannot exhaust the
        #: harness's descriptors for every other command.
        self.max_connections = max_connections
        self._serving = 0

    def allows(self, host: str, port: int) -> bool:
        """Whether ``host:port`` may be reached (the allow-list's rule)."""
        return host_allowed(self.allow_hosts, host, port)

    @staticmethod
    async def listen() -> tuple[anyio.abc.Listener[anyio.abc.SocketStream], str]:
        """A listener on a fresh abstract unix socket, and its name for the step's ``--proxy``
        (``@NAME``). Abstract: it exists in this network namespace only, so a command in its own
        network cannot reach it but through the forwarder the step connects before it makes that
        network; a connection from another user is refused."""
        name = f"dsh-egress-{secrets.token_hex(12)}"
        listener = await anyio.create_unix_listener(f"\0{name}")
        return listener, f"@{name}"

    @staticmethod
    async def listen_at(
        directory: str, *, mode: int = 0o600
    ) -> tuple[anyio.abc.Listener[anyio.abc.SocketStream], str]:
        """A listener on a fresh unix socket file in ``directory``, and its path, for
        :meth:`serve_clients`: where connections come one per client (an SSH server forwards a
        remote socket's connections to it; a container reaches it through a mount; the step's
        ``--proxy PATH`` relays each of the command's). Who may connect is the file's ``mode`` and
        its directory's: the proxy itself asks no peer who it is (a container's processes may be
        any user)."""
        path = os.path.join(directory, f"egress-{secrets.token_hex(8)}.sock")
        listener = await anyio.create_unix_listener(path, mode=mode)
        return listener, path

    async def serve(self, listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
        """Serve every command's forwarder that connects to ``listener`` (from :meth:`listen`)
        until cancelled (the listener is closed then)."""
        async with listener:
            await listener.serve(self._forwarder)

    async def serve_clients(self, listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
        """Serve each connection to ``listener`` (from :meth:`listen_at`) as one client's request,
        until cancelled (the listener is closed then)."""
        async with listener:
            await listener.serve(self._handle)

    async def _forwarder(self, control: anyio.abc.SocketStream) -> None:
        """One command's forwarder: each connection it accepted comes as a descriptor (SCM_RIGHTS).
        Whatever one sends, the proxy of the others goes on."""
        try:
            await self._forwarded(control)
        except Exception:
            log.exception("egress proxy: a forwarder's connection failed")

    async def _forwarded(self, control: anyio.abc.SocketStream) -> None:
        if not (isinstance(control, anyio.abc.UNIXSocketStream) and _from_this_user(control)):
            await control.aclose()
            return
        async with CancelSafeUnixStream(control) as handing, anyio.create_task_group() as tg:
            while True:
                try:
                    message, fds = await handing.receive_fds(1, 1)
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    break
                if not message and not fds:
                    break
                for fd in fds:
                    try:  # a forwarder hands over TCP sockets; anything else is closed
                        handed = socket.socket(fileno=fd)
                    except OSError:
                        os.close(fd)
                        continue
                    try:
                        stream = await anyio.abc.SocketStream.from_socket(handed)
                    except (OSError, ValueError):
                        handed.close()
                        continue
                    tg.start_soon(self._handle, stream)

    async def _handle(self, client: anyio.abc.ByteStream) -> None:
        if isinstance(client, anyio.abc.UNIXSocketStream):
            client = CancelSafeUnixStream(client)
        async with client:
            if self._serving >= self.max_connections:
                reason = f"more than {self.max_connections} connections through it at once; close some first"
                await _answer(client, "503 Service Unavailable", reason)
                return
            self._serving += 1
            try:
                await self._proxy(client)
            except _Refused as refused:
                await _answer(client, refused.status, refused.reason)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the client or the host went away (a timed-out head is an OSError: TimeoutError)
            except Exception:  # one connection's bug must not end the proxy of every command
                log.exception("egress proxy: a connection failed")
            finally:
                self._serving -= 1

    async def _proxy(self, client: anyio.abc.ByteStream) -> None:
        with anyio.fail_after(_HEAD_TIMEOUT_S):
            rest = await self._check_key(client)
            head, extra = await _read_head(client, rest)
        first, _, headers = head.partition(b"\r\n")
        words = first.decode("latin-1").split(" ")
        if len(words) != 3 or not words[2].startswith("HTTP/"):
            raise _Refused("400 Bad Request", "not an HTTP proxy request")
        method, target, version = words
        if method == "CONNECT":
            host, _, port_text = target.rpartition(":")
            host = host.strip("[]")
            forward = b""
        else:
            url = urlsplit(target)
            if url.scheme != "http" or not url.hostname:
                raise _Refused(
                    "400 Bad Request", "only CONNECT and absolute http:// URLs go through this proxy"
                )
            try:
                port_text = str(url.port or 80)
            except ValueError:
                port_text = ""
            host = url.hostname
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            kept = b"".join(
                line + b"\r\n"
                for line in headers.split(b"\r\n")
                if line and not line.lower().startswith(b"proxy-")
            )
            forward = f"{method} {path} {version}\r\n".encode("latin-1") + kept + b"\r\n" + extra
            extra = b""
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise _Refused("400 Bad Request", f"no port in {target!r}")
        port = int(port_text)
        if not self.allows(host, port):
            raise _Refused(
                "403 Forbidden",
                f"{host}:{port} is not in the sandbox policy's network allow-list "
                f"({', '.join(self.allow_hosts) or 'empty'}); nothing in the command can change that",
            )
        upstream = await self._connect(host, port)
        async with upstream:
            if method == "CONNECT":
                await client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if forward or extra:
                await upstream.send(forward or extra)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_copy, client, upstream)
                tg.start_soon(_copy, upstream, client)

    async def _check_key(self, client: anyio.abc.ByteStream) -> bytes:
        """Read the key line a keyed proxy's client must begin with; what came after it in the same
        reads is returned. A connection without the key is refused (403): whoever it is, it is no
        relay of a command that this list serves."""
        if self.key is None:
            return b""
        expected = self.key.encode("ascii") + b"\n"
        buffer = b""
        while len(buffer) < len(expected):
            buffer += await client.receive(_CHUNK)
        if not hmac.compare_digest(buffer[: len(expected)], expected):
            raise _Refused(
                "403 Forbidden",
                "this connection is not from a command whose sandbox policy allows this list of hosts",
            )
        return buffer[len(expected) :]

    async def _connect(self, host: str, port: int) -> anyio.abc.SocketStream:
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        try:
            found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _Refused("502 Bad Gateway", f"cannot resolve {host}: {exc}") from None
        addresses = [str(info[4][0]) for info in found]
        if literal is None:
            inward = [a for a in addresses if (ip := ipaddress.ip_address(a)).is_loopback or ip.is_link_local]
            if inward:
                raise _Refused(
                    "403 Forbidden",
                    f"{host} resolves to {inward[0]}, this machine's own or link-local network",
                )
        last: OSError | None = None
        for address in addresses:
            try:
                with anyio.fail_after(_CONNECT_TIMEOUT_S):
                    return await anyio.connect_tcp(address, port)
            except (OSError, TimeoutError) as exc:
                last = (
                    exc if isinstance(exc, OSError) else OSError(f"timed out after {_CONNECT_TIMEOUT_S:g} s")
                )
        raise _Refused("502 Bad Gateway", f"cannot reach {host}:{port}: {last}")


def new_key() -> str:
    """A fresh key for a proxy behind a socket file (32 hex digits: the step's ``--proxy-key-env``
    takes 16 to 128)."""
    return secrets.token_hex(16)


class EgressProxies:
    """An executor's egress proxies: one per allow-list, each started at the first call for its
    list (as a helper of the executor, by ``start_helper``) and the same after."""

    def __init__(self, start_helper: Callable[..., None]) -> None:
        self._start_helper = start_helper
        self._lock = anyio.Lock()
        self._started: dict[tuple[tuple[str, ...], str | None], tuple[str, str | None]] = {}

    @staticmethod
    def mountable_directory() -> str:
        """A new directory for socket files that a container mounts (:meth:`in_directory` with mode
        0o666): 0711, so that the container's processes, of whatever user, reach a file whose name
        they know (the step's ``--proxy``), and no one lists them. A user of this host who learns a
        name reaches the allowed hosts through the proxy, as it can without it. The caller removes
        it."""
        directory = tempfile.mkdtemp(prefix="dsh-bash-egress-")
        os.chmod(directory, 0o711)
        return directory

    async def abstract(self, allow_hosts: tuple[str, ...]) -> str:
        """The ``@NAME`` of the list's proxy on an abstract unix socket (:meth:`EgressProxy.listen`)."""
        where, _ = await self._proxy(allow_hosts, None, 0)
        return where

    async def in_directory(
        self, allow_hosts: tuple[str, ...], directory: str, *, mode: int = 0o600
    ) -> tuple[str, str]:
        """The path of the list's proxy's socket file in ``directory`` (:meth:`EgressProxy.listen_at`)
        and the proxy's key (:attr:`EgressProxy.key`), for ``EgressRoute.key``."""
        where, key = await self._proxy(allow_hosts, directory, mode)
        assert key is not None
        return where, key

    async def _proxy(
        self, allow_hosts: tuple[str, ...], directory: str | None, mode: int
    ) -> tuple[str, str | None]:
        async with self._lock:
            started = self._started.get((allow_hosts, directory))
            if started is None:
                if directory is None:
                    proxy = EgressProxy(allow_hosts)
                    listener, where = await EgressProxy.listen()
                    self._start_helper(proxy.serve, listener)
                else:
                    proxy = EgressProxy(allow_hosts, key=new_key())
                    listener, where = await EgressProxy.listen_at(directory, mode=mode)
                    self._start_helper(proxy.serve_clients, listener)
                started = self._started[allow_hosts, directory] = (where, proxy.key)
            return started


def _from_this_user(stream: anyio.abc.SocketStream) -> bool:
    """Whether the unix socket's peer runs as this process's user (``SO_PEERCRED``)."""
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    uid: int = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    return uid == os.geteuid()


async def _read_head(stream: anyio.abc.ByteStream, buffer: bytes = b"") -> tuple[bytes, bytes]:
    """The request head (to its blank line, exclusive) and what came after it in the same reads;
    ``buffer``: what was read of it already."""
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > _HEAD_LIMIT:
            raise _Refused("431 Request Header Fields Too Large", f"a request head over {_HEAD_LIMIT} bytes")
        buffer += await stream.receive(_CHUNK)
    head, _, extra = buffer.partition(b"\r\n\r\n")
    return head + b"\r\n", extra


async def _copy(source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
    """Bytes from ``source`` to ``sink`` until ``source`` ends; then ``sink`` is told (half-close)."""
    try:
        while True:
            await sink.send(await source.receive(_CHUNK))
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    try:
        await sink.send_eof()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await sink.aclose()


async def _answer(client: anyio.abc.ByteStream, status: str, reason: str) -> None:
    body = f"dsh-bash sandbox policy: {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await client.send(head + body)
