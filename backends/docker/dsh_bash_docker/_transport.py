"""Where the engine is and how to reach it: one parser of ``DOCKER_HOST``, and httpcore2's network seam.

httpcore2 speaks HTTP/1.1 (keep-alive, chunked bodies, the ``101`` of an exec's start); this module
only dials. Unix sockets and plain TCP are anyio socket streams (a unix one wrapped so that its
cancelled reads are safe on asyncio: ``dsh_bash.remote.CancelSafeUnixStream``); TLS is an
``ssl.SSLObject`` over one, because an exec's stdin must be half-closed (TLS ``close_notify``, as
the docker CLI's ``CloseWrite`` does) while its output is still read, which anyio's ``TLSStream``
does not offer;
``ssh://`` is one SSH connection per client, with a channel running ``docker system dial-stdio``
per HTTP connection (the docker CLI starts a new ``ssh`` process for each).
"""

# ruff: noqa: ASYNC109 - httpcore2's network interface takes a timeout on every call
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import select
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import unquote, urlsplit

import anyio
import anyio.abc
import httpcore2
import sniffio

from dsh_bash import BashInfrastructureError, ConfigError
from dsh_bash.backend import Dialer
from dsh_bash.remote import CancelSafeUnixStream

if TYPE_CHECKING:
    import asyncssh

    from ._docker_config import DockerConfig

__all__ = ["Endpoint", "EngineNetwork", "EngineStream", "TlsFiles"]

_READ_SIZE = 256 * 1024
#: An SSH channel's unread bytes above which the channel stops reading (SSH window backpressure).
_SSH_HIGH_WATER = 1024 * 1024
_DIAL_STDIO = "docker system dial-stdio"
#: How long the end of a channel's output waits for its exit status.
_SSH_CLOSE_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """TLS to a ``tcp://`` engine: the CA (None: the system's trust store), client certificate and key."""

    ca_cert: str | None
    client_cert: str | None
    client_key: str | None

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca_cert)
            if self.client_cert and self.client_key:
                context.load_cert_chain(self.client_cert, self.client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"docker_host: cannot load the TLS certificates ({self}): {exc}") from exc
        return context


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The engine's address, resolved from the config and (for what the config leaves out) the environment."""

    scheme: Literal["unix", "tcp", "ssh", "dialed"]
    path: str = ""
    host: str = ""
    port: int = 0
    user: str | None = None
    tls: TlsFiles | None = None
    ssh_client_keys: tuple[str, ...] | None = None
    ssh_known_hosts: str | None = None
    #: ``dialed``: the connections another backend makes (the config's ``engine_dialer``).
    dialer: Dialer | None = None

    @classmethod
    def parse(cls, docker_host: str | None) -> Endpoint:
        """From a ``DOCKER_HOST``-style URL alone (None: the environment, as the docker CLI reads it)."""
        return cls._resolve(docker_host)

    @classmethod
    def from_config(cls, config: DockerConfig) -> Endpoint:
        if config.engine_dialer is not None:
            return cls("dialed", dialer=config.engine_dialer)
        return cls._resolve(
            config.docker_host,
            ca_cert=config.tls_ca_cert,
            client_cert=config.tls_client_cert,
            client_key=config.tls_client_key,
            ssh_keys=config.ssh_client_keys,
            known_hosts=config.ssh_known_hosts,
        )

    @classmethod
    def _resolve(
        cls,
        docker_host: str | None,
        *,
        ca_cert: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        ssh_keys: list[str] | None = None,
        known_hosts: str | None = None,
    ) -> Endpoint:
        from_environment = docker_host is None
        url = os.environ.get("DOCKER_HOST", "") if docker_host is None else docker_host
        tls: TlsFiles | None = None
        if ca_cert or client_cert or client_key:
            tls = TlsFiles(ca_cert, client_cert, client_key)
        elif from_environment and os.environ.get("DOCKER_TLS_VERIFY", "") not in ("", "0"):
            # The docker CLI's convention: ca.pem, cert.pem and key.pem in DOCKER_CERT_PATH (~/.docker).
            cert_path = os.environ.get("DOCKER_CERT_PATH") or os.path.expanduser("~/.docker")
            tls = TlsFiles(*(os.path.join(cert_path, name) for name in ("ca.pem", "cert.pem", "key.pem")))
        if not url:
            if tls is not None:
                raise ConfigError("docker_host: TLS settings need a tcp:// docker_host")
            return cls("unix", path="/var/run/docker.sock")
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"docker_host: bad port in {url!r}") from None
        if parts.scheme == "unix":
            if tls is not None:
                raise ConfigError(f"docker_host: TLS settings need a tcp:// engine, not {url!r}")
            return cls("unix", path=parts.path or "/var/run/docker.sock")
        if not parts.hostname:
            raise ConfigError(f"docker_host: no host in {url!r}")
        if parts.scheme in ("tcp", "http", "https"):
            if parts.scheme == "https" and tls is None:
                tls = TlsFiles(None, None, None)
            return cls("tcp", host=parts.hostname, port=port or (2376 if tls else 2375), tls=tls)
        if parts.scheme == "ssh":
            if tls is not None:
                raise ConfigError(f"docker_host: TLS settings need a tcp:// engine, not {url!r}")
            if parts.path not in ("", "/"):
                raise ConfigError(f"docker_host: an ssh:// engine takes no path: {url!r}")
            return cls(
                "ssh",
                host=parts.hostname,
                port=port or 22,
                user=unquote(parts.username) if parts.username else None,
                ssh_client_keys=None if ssh_keys is None else tuple(ssh_keys),
                ssh_known_hosts=known_hosts,
            )
        raise ConfigError(
            f"docker_host: unsupported {url!r} (use unix:///path, tcp://host:port or ssh://user@host[:port])"
        )

    @property
    def on_this_host(self) -> bool:
        """Whether the engine's processes are in this host's ``/proc`` (only a unix socket says so).

        A TCP engine on a loopback address could be local too, but could equally be a tunnel: the
        host's ``/proc`` is never trusted for one.
        """
        return self.scheme == "unix"

    async def every_place(self) -> list[Endpoint]:
        """Each engine this endpoint may lead to (the conformance kit looks in all): a dialer placed
        by another backend may reach several; any other endpoint is one engine."""
        if self.dialer is None:
            return [self]
        return [Endpoint("dialed", dialer=each) for each in await self.dialer.every_place()]

    def describe(self) -> str:
        if self.dialer is not None:
            return self.dialer.describe()
        if self.scheme == "unix":
            return f"unix://{self.path}"
        if self.scheme == "ssh":
            return f"ssh://{self.user + '@' if self.user else ''}{self.host}:{self.port}"
        return f"tcp://{self.host}:{self.port}{' (TLS)' if self.tls else ''}"

    def url(self, target: str) -> httpcore2.URL:
        if self.scheme == "tcp":
            scheme = b"https" if self.tls else b"http"
            return httpcore2.URL(
                scheme=scheme, host=self.host.encode(), port=self.port, target=target.encode()
            )
        return httpcore2.URL(scheme=b"http", host=b"docker", port=None, target=target.encode())

    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.context() if self.tls is not None else None


class EngineStream(httpcore2.AsyncNetworkStream):
    """A connection to the engine: what httpcore2 needs, and a half-close for an exec's stdin."""

    async def write_eof(self) -> None:
        raise NotImplementedError

    def get_extra_info(self, info: str) -> Any:
        # httpcore2 wraps an upgraded connection; the exec's stream reaches this one through it.
        return self if info == "dsh_bash.engine_stream" else None


def _read_error(exc: BaseException) -> httpcore2.ReadError:
    error = httpcore2.ReadError(str(exc) or type(exc).__name__)
    error.__cause__ = exc
    return error


def _write_error(exc: BaseException) -> httpcore2.WriteError:
    error = httpcore2.WriteError(str(exc) or type(exc).__name__)
    error.__cause__ = exc
    return error


def _readable(sock: Any) -> bool:
    """Whether a read would not wait: bytes, the peer's close, or an error (a poll that does not wait).

    ``sock`` is a socket or asyncio's ``TransportSocket`` (anyio's TCP streams on asyncio): its fd.
    """
    fd = sock.fileno() if sock is not None else -1
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


class _SocketStream(EngineStream):
    #: What a failed read or write may raise (then an httpcore2 error with it as the cause).
    _ERRORS: tuple[type[BaseException], ...] = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            with anyio.fail_after(timeout):
                return await self._stream.receive(max_bytes)
        except anyio.EndOfStream:
            return b""
        except self._ERRORS as exc:
            raise _read_error(exc) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            with anyio.fail_after(timeout):
                await self._stream.send(buffer)
        except self._ERRORS as exc:
            raise _write_error(exc) from exc

    async def write_eof(self) -> None:
        with contextlib.suppress(*self._ERRORS):
            await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.AsyncNetworkStream:
        with anyio.fail_after(timeout):
            return await _TlsStream.wrap(
                cast(anyio.abc.SocketStream, self._stream), ssl_context, server_hostname
            )

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return _readable(self._stream.extra(anyio.abc.SocketAttribute.raw_socket, None))
        if info == "socket":
            return self._stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        return super().get_extra_info(info)


class _TlsStream(EngineStream):
    """TLS over a socket stream by memory BIOs; ``write_eof`` sends ``close_notify`` and reads on."""

    def __init__(
        self,
        transport: anyio.abc.SocketStream,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self._transport = transport
        self._tls = tls
        self._incoming = incoming
        self._outgoing = outgoing
        self._send_lock = anyio.Lock()
        self._eof_sent = False

    @classmethod
    async def wrap(
        cls, transport: anyio.abc.SocketStream, context: ssl.SSLContext, hostname: str | None
    ) -> _TlsStream:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_hostname=hostname)
        stream = cls(transport, tls, incoming, outgoing)
        try:
            await stream._call(tls.do_handshake)
        except BaseException:
            await anyio.aclose_forcefully(transport)
            raise
        return stream

    async def _flush(self) -> None:
        async with self._send_lock:
            data = self._outgoing.read()
            if data:
                await self._transport.send(data)

    async def _call(self, method: Any, *args: Any) -> Any:
        """One SSLObject call, fed from the socket until it need not wait; None at a clean end."""
        while True:
            try:
                result = method(*args)
            except ssl.SSLWantReadError:
                await self._flush()
                try:
                    data = await self._transport.receive(_READ_SIZE)
                except anyio.EndOfStream:
                    self._incoming.write_eof()
                else:
                    self._incoming.write(data)
            except ssl.SSLZeroReturnError:
                return None
            else:
                await self._flush()
                return result

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            with anyio.fail_after(timeout):
                data = await self._call(self._tls.read, max_bytes)
        except (ssl.SSLError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            # SSLEOFError: the engine closed the socket without close_notify, as Go's server may.
            if isinstance(exc, ssl.SSLEOFError):
                return b""
            raise _read_error(exc) from exc
        return b"" if data is None else bytes(data)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            with anyio.fail_after(timeout):
                await self._call(self._tls.write, buffer)
        except (ssl.SSLError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise _write_error(exc) from exc

    async def write_eof(self) -> None:
        if self._eof_sent:
            return
        self._eof_sent = True
        # One SSL_shutdown: our close_notify goes out and reading goes on (OpenSSL allows it); the
        # engine reads it as the end of stdin.
        with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLError):
            self._tls.unwrap()
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._flush()

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.AsyncNetworkStream:
        raise RuntimeError("TLS is already on")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return (
                self._tls.pending() > 0
                or self._incoming.pending > 0
                or _readable(self._transport.extra(anyio.abc.SocketAttribute.raw_socket, None))
            )
        if info == "ssl_object":
            return self._tls
        return super().get_extra_info(info)


def _same(session: _DialStdioSession) -> _DialStdioSession:
    return session


@dataclass(slots=True)
class _SshLink:
    """One SSH connection to the engine's host and how many dial-stdio channels it carries."""

    connection: asyncssh.SSHClientConnection
    channels: int = 0
    #: OpenSSH's MaxSessions is 10 by default; lowered when the server refuses a channel.
    limit: int = 8

    def release(self) -> None:
        self.channels -= 1


class _DialStdioSession:
    """The client side of one ``docker system dial-stdio`` channel (an asyncssh session)."""

    def __init__(self, on_closed: Callable[[], None]) -> None:
        self._on_closed: Callable[[], None] | None = on_closed
        self.channel: asyncssh.SSHClientChannel[bytes] | None = None
        self.buffer = bytearray()
        self.stderr = bytearray()
        self.ended = False
        self.exit_status: int | None = None
        self.closed = asyncio.Event()
        self.readable = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()

    # -- asyncssh's session callbacks -------------------------------------------------------------

    def connection_made(self, channel: asyncssh.SSHClientChannel[bytes]) -> None:
        self.channel = channel

    def connection_lost(self, exc: Exception | None) -> None:
        on_closed, self._on_closed = self._on_closed, None
        if on_closed is not None:
            on_closed()
        self.ended = True
        self.closed.set()
        self.readable.set()
        self.writable.set()

    def session_started(self) -> None:
        pass

    def data_received(self, data: bytes, datatype: int | None) -> None:
        if datatype:  # stderr: kept (its end) to say why the channel ended
            self.stderr += data
            del self.stderr[:-4096]
            return
        self.buffer += data
        self.readable.set()
        if len(self.buffer) > _SSH_HIGH_WATER and self.channel is not None:
            self.channel.pause_reading()

    def eof_received(self) -> bool:
        self.ended = True
        self.readable.set()
        return False

    def exit_status_received(self, status: int) -> None:
        self.exit_status = status

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        pass

    def xon_xoff_requested(self, client_can_restart: bool) -> None:
        pass

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


class _DialedStream(_SocketStream):
    """A connection another backend made (:class:`dsh_bash.backend.Dialer`): any anyio byte stream,
    whose failures may carry that backend's reason (a Ray node lost); no socket of this host."""

    _ERRORS = (*_SocketStream._ERRORS, BashInfrastructureError)

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.AsyncNetworkStream:
        raise RuntimeError("a dialed engine takes no TLS")

    def get_extra_info(self, info: str) -> Any:
        return EngineStream.get_extra_info(self, info)


class _SshStream(EngineStream):
    def __init__(self, session: _DialStdioSession, where: str) -> None:
        self._session = session
        self._where = where

    def _ended_error(self) -> httpcore2.ReadError:
        said = self._session.stderr.decode("utf-8", "replace").strip()
        status = self._session.exit_status
        return httpcore2.ReadError(
            f"`{_DIAL_STDIO}` on {self._where} ended"
            + ("" if status is None else f" (exit {status})")
            + (f": {said}" if said else " without a word")
        )

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        session = self._session
        with anyio.fail_after(timeout):
            while not session.buffer and not session.ended:
                session.readable.clear()
                await session.readable.wait()
        if not session.buffer:
            # The end: a failed dial-stdio (no engine there, no access to it) says why on stderr,
            # and its exit status follows the end of its output.
            with anyio.move_on_after(_SSH_CLOSE_WAIT_S):
                await session.closed.wait()
            if session.exit_status not in (None, 0):
                raise self._ended_error()
            return b""
        data = bytes(session.buffer[:max_bytes])
        del session.buffer[:max_bytes]
        if len(session.buffer) <= _SSH_HIGH_WATER // 2 and session.channel is not None:
            session.channel.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        session = self._session
        if session.channel is None or session.ended:
            raise httpcore2.WriteError(str(self._ended_error()))
        with anyio.fail_after(timeout):
            await session.writable.wait()
        try:
            session.channel.write(buffer)
        except OSError as exc:
            raise _write_error(exc) from exc

    async def write_eof(self) -> None:
        if self._session.channel is not None and not self._session.ended:
            with contextlib.suppress(OSError):
                self._session.channel.write_eof()

    async def aclose(self) -> None:
        channel = self._session.channel
        if channel is not None:
            channel.close()
            with anyio.move_on_after(2), contextlib.suppress(Exception):
                await channel.wait_closed()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.AsyncNetworkStream:
        raise RuntimeError("an ssh:// engine takes no TLS")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return bool(self._session.buffer) or self._session.ended
        return super().get_extra_info(info)


class EngineNetwork(httpcore2.AsyncNetworkBackend):
    """httpcore2's dialer for one engine, whatever host and port a request's URL names."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        #: A dialer's hold, given back at :meth:`aclose` (Dialer.hold).
        self._let_go = endpoint.dialer.hold() if endpoint.dialer is not None else None
        self._ssh_links: list[_SshLink] = []
        self._ssh_lock: asyncio.Lock | None = None

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore2.AsyncNetworkStream:
        return await self.dial(timeout)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore2.AsyncNetworkStream:
        return await self.dial(timeout)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    async def dial(self, timeout: float | None = None) -> EngineStream:
        """A new connection; httpcore2.ConnectError (naming the engine and the cause) when there is none."""
        try:
            return await self._dial(timeout)
        except ConfigError:
            raise
        # OSError, asyncssh's errors (a refused login, an unknown host key), a dialer's own
        # BashInfrastructureError (kept as the cause: its reason is the engine error's)
        except Exception as exc:
            raise httpcore2.ConnectError(f"{type(exc).__name__}: {exc}") from exc

    async def _dial(self, timeout: float | None) -> EngineStream:
        endpoint = self.endpoint
        with anyio.fail_after(timeout):
            if endpoint.scheme == "unix":
                return _SocketStream(await CancelSafeUnixStream.connect(endpoint.path))
            if endpoint.scheme == "tcp":
                stream = await anyio.connect_tcp(endpoint.host, endpoint.port)
                with contextlib.suppress(OSError):
                    stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(
                        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                    )
                return _SocketStream(stream)
            if endpoint.dialer is not None:
                return _DialedStream(await endpoint.dialer.dial())
            return await self._dial_ssh()

    async def _dial_ssh(self) -> EngineStream:
        if sniffio.current_async_library() != "asyncio":
            raise ConfigError(
                "docker_host: an ssh:// engine needs asyncio (asyncssh is asyncio-only), not trio"
            )
        import asyncssh  # noqa: PLC0415 - present: _ssh_link imported it

        while True:
            link = await self._ssh_link()
            session = _DialStdioSession(link.release)
            try:
                # A duck-typed session: asyncssh is imported only for ssh:// engines.
                factory: Any = functools.partial(_same, session)
                await link.connection.create_session(factory, _DIAL_STDIO, encoding=None)
            except asyncssh.ChannelOpenError:
                link.channels -= 1
                if link.channels == 0:
                    raise  # not one channel on a connection of its own: not a session limit
                # The server allows fewer sessions per connection (MaxSessions) than we assumed.
                link.limit = link.channels
                continue
            except BaseException:
                link.channels -= 1
                raise
            return _SshStream(session, self.endpoint.describe())

    async def _ssh_link(self) -> _SshLink:
        """A connection with room for one more channel (reserved), a new one when none has."""
        try:
            import asyncssh  # noqa: PLC0415 - only ssh:// engines need it
        except ImportError:
            raise ConfigError(
                "docker_host: an ssh:// engine needs asyncssh: pip install 'dsh-bash[docker,ssh]'"
            ) from None
        if self._ssh_lock is None:
            self._ssh_lock = asyncio.Lock()
        async with self._ssh_lock:
            self._ssh_links = [link for link in self._ssh_links if not link.connection.is_closed()]
            for link in self._ssh_links:
                if link.channels < link.limit:
                    link.channels += 1
                    return link
            endpoint = self.endpoint
            options: dict[str, Any] = {"port": endpoint.port, "username": endpoint.user}
            if endpoint.ssh_client_keys is not None:
                options["client_keys"] = list(endpoint.ssh_client_keys)
            if endpoint.ssh_known_hosts is not None:
                options["known_hosts"] = endpoint.ssh_known_hosts
            link = _SshLink(await asyncssh.connect(endpoint.host, **options))
            self._ssh_links.append(link)
            link.channels += 1
            return link

    async def aclose(self) -> None:
        let_go, self._let_go = self._let_go, None
        if let_go is not None:
            let_go()
        links, self._ssh_links = self._ssh_links, []
        for link in links:
            link.connection.close()
        for link in links:
            with anyio.move_on_after(2), contextlib.suppress(Exception):
                await link.connection.wait_closed()
