"""The Ray backend's direct channel between harness and node host (``dsh_bash_ray._channel``), on
real sockets in this process: both ends prove the key, nothing but plain values is unpickled, a
failure says whether the request may have reached the node host. The node host's use of it is
held to the whole kit by ``test_conformance_ray.py``."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
from typing import Any

import anyio
import pytest
from dsh_bash_ray._channel import (
    ChannelAddress,
    ChannelBroken,
    ChannelClient,
    ChannelServer,
    dumps,
    loads,
)
from dsh_bash_ray._node_host import StartRequest

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the node host's end is asyncio's (Ray's actors run in it)


class _Odd(Exception):
    pass


class _Service:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.release = asyncio.Event()
        self.hanging = asyncio.Event()

    async def dispatch(self, method: str, args: tuple[Any, ...]) -> Any:
        self.calls.append((method, args))
        if method == "echo":
            return args
        if method == "missing":
            raise FileNotFoundError("no such file: /x")
        if method == "odd":
            raise _Odd("k")
        if method == "hang":
            self.hanging.set()
            await self.release.wait()
            return "released"
        raise AssertionError(method)


async def _served(service: _Service) -> tuple[ChannelServer, ChannelAddress]:
    server = ChannelServer(service.dispatch, {"echo", "missing", "odd", "hang"})
    return server, await server.start("127.0.0.1")


def test_plain_values_and_start_requests_cross_and_nothing_else_is_made() -> None:
    request = StartRequest(
        owner="o", supervisor_args=["--frame"], argv=["bash"], env={"A": "b"}, cwd="/", terminal=(24, 80)
    )
    value = (1, 2.5, "é\udcff", b"\x00\xff", [None, True], {"k": (1,)}, request)
    assert loads(dumps(value)) == value
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system is not carried"):
        loads(dumps(os.system))
    with pytest.raises(pickle.UnpicklingError, match="not carried"):
        loads(pickle.dumps(ValueError("x")))


async def test_calls_their_errors_and_methods_not_served() -> None:
    service = _Service()
    _, address = await _served(service)
    client = ChannelClient(address)
    try:
        assert await client.call("echo", (1, b"x")) == (1, b"x")
        with pytest.raises(FileNotFoundError, match="no such file"):
            await client.call("missing", ())
        with pytest.raises(RuntimeError, match="_Odd on the node host: k"):
            await client.call("odd", ())
        with pytest.raises(ValueError, match="'describe' is not served"):
            await client.call("describe", ())
        assert [method for method, _ in service.calls] == ["echo", "missing", "odd"]
        # Overlapping calls each take a connection; they are kept for the next ones.
        results = await asyncio.gather(*(client.call("echo", (n,)) for n in range(12)))
        assert results == [(n,) for n in range(12)]
        assert 1 <= len(client._idle) <= 4
    finally:
        client.close()
    assert client._idle == []
    with pytest.raises(ChannelBroken) as broken:
        await client.call("echo", ())
    assert not broken.value.sent


async def test_a_harness_that_does_not_know_the_key_calls_nothing() -> None:
    service = _Service()
    _, address = await _served(service)
    client = ChannelClient(ChannelAddress(address.host, address.port, b"wrong" * 8))
    with pytest.raises(ChannelBroken, match="does not know the key") as broken:
        await client.call("echo", ())
    assert not broken.value.sent
    assert client.reached  # the address is right: a later lease tries again

    def skip_the_proof() -> bytes:
        with socket.create_connection((address.host, address.port), timeout=5) as sock:
            sock.sendall(os.urandom(16))
            sock.recv(16 + 32)
            sock.sendall(b"\x00" * 32)
            request = dumps(("echo", ("forged",)))
            sock.sendall(len(request).to_bytes(4, "big") + request)
            return sock.recv(1)

    # A raw connection that skips the proof is closed, its request never read.
    assert await anyio.to_thread.run_sync(skip_the_proof) == b""
    assert service.calls == []


async def test_a_listener_that_does_not_know_the_key_is_not_the_node_host() -> None:
    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(16)
        writer.write(os.urandom(16 + 32))  # a nonce and a proof it cannot make
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = ChannelClient(ChannelAddress("127.0.0.1", port, b"k" * 32))
        with pytest.raises(ChannelBroken, match="does not know the key") as broken:
            await client.call("echo", ())
        assert not broken.value.sent


async def test_connections_that_never_prove_themselves_are_bounded() -> None:
    service = _Service()
    _, address = await _served(service)
    idle = [socket.create_connection((address.host, address.port)) for _ in range(32)]
    try:
        await anyio.sleep(0.2)  # all taken in
        with pytest.raises(ChannelBroken, match="cannot connect") as broken:
            await ChannelClient(address).call("echo", ())
        assert not broken.value.sent
    finally:
        for sock in idle:
            sock.close()
    await anyio.sleep(0.2)
    client = ChannelClient(address)
    assert await client.call("echo", (1,)) == (1,)
    client.close()


async def test_a_node_host_gone_mid_call_is_told_apart_from_one_never_reached() -> None:
    service = _Service()
    server, address = await _served(service)
    client = ChannelClient(address)
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            with pytest.raises(ChannelBroken) as broken:
                await client.call("hang", ())
            assert broken.value.sent

        tg.start_soon(call)
        await service.hanging.wait()
        assert server._server is not None
        server._server.close()
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__.startswith("ChannelServer._serve"):  # type: ignore[union-attr]
                task.cancel()
    with pytest.raises(ChannelBroken) as broken:
        await client.call("echo", ())
    assert not broken.value.sent


async def test_a_cancelled_call_leaves_no_connection_for_the_next() -> None:
    service = _Service()
    _, address = await _served(service)
    client = ChannelClient(address)
    with anyio.move_on_after(0.2):
        await client.call("hang", ())
    assert client._idle == []  # its reply would have been the next call's
    service.release.set()
    assert await client.call("echo", (2,)) == (2,)
    client.close()


async def test_an_address_nothing_listens_on_is_told_apart() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]  # bound, not listening: refused
        client = ChannelClient(ChannelAddress("127.0.0.1", port, b"k" * 32))
        with pytest.raises(ChannelBroken, match="cannot connect") as broken:
            await client.call("echo", ())
    assert not broken.value.sent and not client.reached
