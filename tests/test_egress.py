"""The egress proxy of network = "allow-list" (dsh_bash._egress), on real sockets: its abstract unix
listener as the executor runs it, connections handed over as descriptors as the step's forwarder
does, a TCP server on this host as the allowed host. The whole way (the step's
forwarder in the command's own network, the proxy variables, the executor serving the proxy) is the
kit's policy-network-allow-list check; the forwarder alone is in test_supervise_confine.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

from dsh_bash.backend import EgressProxies, EgressProxy

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def _world(allow: tuple[str, ...] = ()) -> AsyncIterator[tuple[str, int, list[bytes]]]:
    """A proxy for ``allow`` (``{port}`` in an entry: the server's), and a server on 127.0.0.1 that
    greets, then echoes; what it received, per connection. Yields the proxy's name (``@NAME``)."""
    received: list[bytes] = []

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(b"hello\n")
            got = b""
            try:
                while True:
                    chunk = await stream.receive()
                    got += chunk
                    await stream.send(chunk)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
            received.append(got)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as server:
        port = server.extra(anyio.abc.SocketAttribute.local_port)
        proxy = EgressProxy(tuple(entry.format(port=port) for entry in allow))
        listener, name = await EgressProxy.listen()
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, serve)
            tg.start_soon(proxy.serve, listener)
            yield name, port, received
            tg.cancel_scope.cancel()


async def _ask(name: str, request: bytes, then: bytes = b"") -> bytes:
    """As a command's forwarder does: one end of a socket pair handed to the proxy ``name``, the
    other sends ``request``, then ``then``; everything until the proxy or the host closes."""
    async with await anyio.connect_unix(f"\0{name[1:]}") as control:
        mine, theirs = socket.socketpair()
        await control.send_fds(b"c", [theirs.fileno()])
        theirs.close()
        async with await anyio.abc.SocketStream.from_socket(mine) as stream:
            return await _exchange(stream, request, then)


async def _exchange(stream: anyio.abc.SocketStream, request: bytes, then: bytes = b"") -> bytes:
    """Send ``request``, then ``then``, then EOF; everything until the other end closes."""
    await stream.send(request)
    if then:
        await anyio.sleep(0.05)
        await stream.send(then)
    await stream.send_eof()
    got = b""
    with anyio.fail_after(10):
        try:
            while True:
                got += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return got


async def test_connect_to_an_allowed_host_is_a_tunnel_both_ways() -> None:
    async with _world(("127.0.0.1:{port}",)) as (socket, port, received):
        got = await _ask(socket, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode(), b"ping")
        assert got == b"HTTP/1.1 200 Connection established\r\n\r\nhello\nping"
    assert received == [b"ping"]


async def test_a_host_the_list_lacks_gets_403_and_a_line_the_model_can_read() -> None:
    async with _world(("127.0.0.1:{port}", "*.example.com")) as (socket, port, received):
        got = await _ask(
            socket, f"CONNECT 127.0.0.1:{port + 1 if port < 65535 else 1} HTTP/1.1\r\n\r\n".encode()
        )
        assert got.startswith(b"HTTP/1.1 403 Forbidden\r\n"), got
        assert b"is not in the sandbox policy's network allow-list (127.0.0.1:" in got
        assert b"*.example.com); nothing in the command can change that\n" in got
        denied = await _ask(socket, b"CONNECT example.com:443 HTTP/1.1\r\n\r\n")  # *. is subdomains only
        assert denied.startswith(b"HTTP/1.1 403 Forbidden\r\n"), denied
    assert received == []


async def test_an_absolute_http_url_is_sent_on_in_origin_form_without_proxy_headers() -> None:
    async with _world(("127.0.0.1:{port}",)) as (socket, port, received):
        request = (
            f"GET http://127.0.0.1:{port}/path?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Proxy-Authorization: secret\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n"
        ).encode()
        got = await _ask(socket, request)
    assert got.startswith(b"hello\n")
    assert received == [f"GET /path?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: */*\r\n\r\n".encode()]


async def test_a_name_that_leads_back_to_this_machine_is_refused() -> None:
    """Allowed by name, ``localhost`` resolves to loopback: the harness's own network is not egress."""
    async with _world(("localhost:{port}",)) as (socket, port, received):
        got = await _ask(socket, f"CONNECT localhost:{port} HTTP/1.1\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 403 Forbidden\r\n") and b"this machine's own" in got, got
    assert received == []


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"hello there\r\n\r\n", b"400 Bad Request"),
        (b"GET /relative HTTP/1.1\r\n\r\n", b"400 Bad Request"),
        (b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n", b"400 Bad Request"),
        (b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nX: " + b"y" * 20000, b"431 Request Header Fields Too Large"),
    ],
)
async def test_what_is_not_a_proxy_request_is_answered_not_followed(
    request_bytes: bytes, status: bytes
) -> None:
    async with _world(("127.0.0.1:{port}",)) as (socket, _port, received):
        got = await _ask(socket, request_bytes)
    assert got.startswith(b"HTTP/1.1 " + status + b"\r\n"), got
    assert received == []


async def test_an_allowed_host_that_does_not_answer_is_502() -> None:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as closed:
        port = closed.extra(anyio.abc.SocketAttribute.local_port)
    async with _world((f"127.0.0.1:{port}",)) as (socket, _port, _received):
        got = await _ask(socket, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 502 Bad Gateway\r\n") and b"cannot reach" in got, got


async def test_what_a_forwarder_should_not_hand_over_is_closed_and_the_proxy_goes_on() -> None:
    """A descriptor that is no stream socket (a pipe, a datagram socket) is closed; the next
    connection is served as before."""
    async with _world(("127.0.0.1:{port}",)) as (name, port, _received):
        async with await anyio.connect_unix(f"\0{name[1:]}") as control:
            reading, writing = os.pipe()
            datagram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            await control.send_fds(b"c", [reading])
            await control.send_fds(b"c", [datagram.fileno()])
            os.close(reading)
            os.close(writing)
            datagram.close()
        got = await _ask(name, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nhello\n"), got


async def _ask_file(path: str, request: bytes, then: bytes = b"") -> bytes:
    """As an SSH server forwards a host's connection: one connection to the socket file per client."""
    async with await anyio.connect_unix(path) as stream:
        return await _exchange(stream, request, then)


async def test_a_proxy_behind_a_socket_file_serves_each_connection_as_a_client() -> None:
    """listen_at and serve_clients (an SSH host's or a container's commands): an allowed host is a
    tunnel, another is refused; who may connect is the file's mode (0600 by default: another user is
    refused by the kernel; 0666, as for a container's other users, answered like anyone)."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as server:
        port = server.extra(anyio.abc.SocketAttribute.local_port)

        async def greet(stream: anyio.abc.SocketStream) -> None:
            async with stream:
                await stream.send(b"hello\n")

        directory = tempfile.mkdtemp(dir="/tmp")  # pytest's tmp_path is beneath a 0700 directory
        os.chmod(directory, 0o711)
        proxy = EgressProxy((f"127.0.0.1:{port}",))
        private, private_path = await EgressProxy.listen_at(directory)
        shared, shared_path = await EgressProxy.listen_at(directory, mode=0o666)
        modes = [stat.S_IMODE(os.stat(each).st_mode) for each in (private_path, shared_path)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, greet)
            tg.start_soon(proxy.serve_clients, private)
            tg.start_soon(proxy.serve_clients, shared)
            allowed = await _ask_file(private_path, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            refused = await _ask_file(private_path, b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n")
            as_nobody = []
            if os.geteuid() == 0:
                for path in (private_path, shared_path):
                    done = await anyio.run_process(
                        [*_AS_NOBODY, sys.executable, "-c", _ASK_AS_OTHER, path], check=False
                    )
                    as_nobody.append(done.stdout.decode().splitlines()[-1:])
            tg.cancel_scope.cancel()
        shutil.rmtree(directory)
    assert modes == [0o600, 0o666] and all(
        os.path.dirname(p) == directory for p in (private_path, shared_path)
    )
    assert allowed == b"HTTP/1.1 200 Connection established\r\n\r\nhello\n", allowed
    assert refused.startswith(b"HTTP/1.1 403 Forbidden\r\n"), refused
    if os.geteuid() == 0:
        assert as_nobody == [["refused PermissionError"], ["answered HTTP/1.1 403 Forbidden"]], as_nobody


_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
_ASK_AS_OTHER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", type(exc).__name__)
    sys.exit()
s.sendall(b"CONNECT 127.0.0.1:1 HTTP/1.1\\r\\n\\r\\n")
s.settimeout(10)
print("answered", s.recv(100).decode().splitlines()[0])
"""


async def test_past_its_connections_at_once_a_proxy_answers_503_until_one_ends() -> None:
    """A command that opens connection after connection cannot take the harness's descriptors: past
    ``max_connections`` held at once, a new one gets 503 and a line; once one ends, one is served."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as server:
        port = server.extra(anyio.abc.SocketAttribute.local_port)

        async def hold(stream: anyio.abc.SocketStream) -> None:
            async with stream:
                await stream.send(b"hello\n")
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    await stream.receive()

        directory = tempfile.mkdtemp()
        try:
            listener, path = await EgressProxy.listen_at(directory)
            proxy = EgressProxy((f"127.0.0.1:{port}",), max_connections=2)
            request = f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode()
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, hold)
                tg.start_soon(proxy.serve_clients, listener)
                held = []
                for _ in range(2):
                    stream = await anyio.connect_unix(path)
                    await stream.send(request)
                    assert (await stream.receive()).startswith(b"HTTP/1.1 200 ")
                    held.append(stream)
                turned_away = await _ask_file(path, request)
                await held.pop().aclose()
                await anyio.sleep(0.1)  # the proxy sees the end
                served = await _ask_file(path, request)
                for stream in held:
                    await stream.aclose()
                tg.cancel_scope.cancel()
        finally:
            shutil.rmtree(directory)
    assert turned_away.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), turned_away
    assert b"more than 2 connections through it at once" in turned_away, turned_away
    assert served.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nhello\n"), served


async def test_a_keyed_proxy_serves_only_connections_that_begin_with_its_key() -> None:
    """Behind a socket file (a name any of the user's processes may learn) a proxy has a key: the
    step's relays send it and a newline first; a connection without it, or with another key, gets
    403 and is not tunnelled, however its bytes are split; the request after a right key is served
    even when it came in the key's own read."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as server:
        port = server.extra(anyio.abc.SocketAttribute.local_port)

        async def greet(stream: anyio.abc.SocketStream) -> None:
            async with stream:
                await stream.send(b"hello\n")

        directory = tempfile.mkdtemp()
        try:
            request = f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode()
            async with anyio.create_task_group() as tg:
                proxies = EgressProxies(tg.start_soon)
                tg.start_soon(server.serve, greet)
                path, key = await proxies.in_directory((f"127.0.0.1:{port}",), directory)
                again = await proxies.in_directory((f"127.0.0.1:{port}",), directory)
                other = await proxies.in_directory(("127.0.0.1:1",), directory)
                line = key.encode() + b"\n"
                keyless = await _ask_file(path, request)
                wrong = await _ask_file(path, other[1].encode() + b"\n" + request)
                together = await _ask_file(path, line + request)
                split = await _ask_file(path, line[:5], line[5:] + request)
                tg.cancel_scope.cancel()
        finally:
            shutil.rmtree(directory)
    assert again == (path, key) and other[0] != path and other[1] != key
    assert len(key) == 32 and set(key) <= set("0123456789abcdef")
    for refused in (keyless, wrong):
        assert refused.startswith(b"HTTP/1.1 403 Forbidden\r\n"), refused
        assert b"not from a command whose sandbox policy allows this list" in refused, refused
        assert b"hello" not in refused
    for served in (together, split):
        assert served == b"HTTP/1.1 200 Connection established\r\n\r\nhello\n", served
