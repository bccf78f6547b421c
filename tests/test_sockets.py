"""``dsh_bash.remote.CancelSafeUnixStream``: the unix socket stream of the Docker engine client and of
the egress proxies, on real socket pairs. Its reason to exist is a race of anyio 4.16's asyncio
unix streams (``dsh_bash/_sockets.py``); the first test makes that race happen on purpose."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio
import anyio.abc
import pytest

from dsh_bash.remote import CancelSafeUnixStream

pytestmark = pytest.mark.anyio


async def _pair() -> tuple[CancelSafeUnixStream, socket.socket]:
    ours, peer = socket.socketpair(socket.AF_UNIX)
    return CancelSafeUnixStream(await anyio.abc.UNIXSocketStream.from_socket(ours)), peer


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_read_cancelled_as_bytes_arrive_leaves_no_callback_error(anyio_backend: str) -> None:
    # The peer's bytes are sent, then this task yields once: in the next loop pass the selector
    # reports the socket readable after this task's step is queued, and that step cancels the read.
    # anyio's own stream then sets the result of the cancelled future from its reader.
    loop = asyncio.get_running_loop()
    callback_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: callback_errors.append(context))
    stream, peer = await _pair()
    try:
        for _ in range(20):
            scope = anyio.CancelScope()

            async def read(scope: anyio.CancelScope = scope) -> None:
                with scope:
                    await stream.receive()

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(0.01)
                peer.send(b"x")
                await asyncio.sleep(0)
                scope.cancel()
            await anyio.sleep(0.01)
            assert await stream.receive() == b"x"  # the byte is not lost either
    finally:
        await stream.aclose()
        peer.close()
    assert callback_errors == []


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_aclose_ends_a_read_under_way_and_the_stream_stays_closed(anyio_backend: str) -> None:
    stream, peer = await _pair()
    outcome: list[BaseException] = []

    async def read() -> None:
        try:
            await stream.receive()
        except anyio.ClosedResourceError as exc:
            outcome.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.05)
            await stream.aclose()
    assert [type(exc) for exc in outcome] == [anyio.ClosedResourceError]
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"after")
    peer.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_bytes_both_ways_then_the_ends(anyio_backend: str) -> None:
    stream, peer = await _pair()
    peer.setblocking(False)
    big = bytes(range(256)) * 8192  # 2 MiB: more than the socket buffers, so the send must wait
    received = bytearray()

    async def drain_peer() -> None:
        while len(received) < len(big):
            await anyio.wait_readable(peer)
            received.extend(peer.recv(1 << 20))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain_peer)
            await stream.send(big)
        assert bytes(received) == big
        await stream.send_eof()
        assert peer.recv(1) == b""
        peer.send(b"reply")
        peer.shutdown(socket.SHUT_WR)
        assert await stream.receive() == b"reply"
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()
    assert stream.extra(anyio.abc.SocketAttribute.raw_socket).fileno() >= 0
    await stream.aclose()
    peer.close()
