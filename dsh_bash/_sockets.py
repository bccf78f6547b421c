"""A unix socket stream whose cancelled reads and writes are safe on asyncio.

anyio 4.16's asyncio ``UNIXSocketStream`` waits for a readable socket with
``loop.add_reader(sock, future.set_result, None)`` and removes that reader only from the future's
done callback, which asyncio runs one loop pass later. When a read is cancelled (a bound runs out,
a task group ends) in the same pass in which the socket turns readable, the reader sets the result
of the cancelled future: ``InvalidStateError`` in a loop callback, which anyio's pytest runner
raises in the test (seen in whole runs, on the Docker engine's socket under load). asyncio's own
``loop.sock_recv`` and ``loop.sock_sendall`` check the future before they touch it, so this stream
reads and writes through them on asyncio and leaves trio (whose waits have no such race) to anyio.
"""

from __future__ import annotations

import array
import asyncio
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import sniffio

__all__ = ["CancelSafeUnixStream"]

_T = TypeVar("_T")
#: Loop passes ``aclose`` waits for cancelled operations to leave their waits before it closes.
_CLOSE_PASSES = 64


class CancelSafeUnixStream(anyio.abc.ByteStream):
    """An anyio ``UNIXSocketStream`` whose cancelled reads and writes leave nothing behind on asyncio.

    ``aclose`` first ends the reads and writes under way (they raise ``ClosedResourceError``, as
    anyio's do) and lets them leave their waits, so no reader is left on a closed descriptor whose
    number a new socket may take.
    """

    def __init__(self, stream: anyio.abc.UNIXSocketStream) -> None:
        self._stream = stream
        self._socket: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        self._under_way: set[anyio.CancelScope] = set()
        self._closed = False

    @classmethod
    async def connect(cls, path: str) -> CancelSafeUnixStream:
        return cls(await anyio.connect_unix(path))

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if sniffio.current_async_library() != "asyncio":
            return await self._stream.receive(max_bytes)
        data = await self._on_loop(lambda loop: loop.sock_recv(self._socket, max_bytes))
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        if sniffio.current_async_library() != "asyncio":
            await self._stream.send(item)
            return
        await self._on_loop(lambda loop: loop.sock_sendall(self._socket, item))

    async def _on_loop(self, operation: Callable[[asyncio.AbstractEventLoop], Awaitable[_T]]) -> _T:
        if self._closed:
            raise anyio.ClosedResourceError
        await anyio.lowlevel.checkpoint()
        with anyio.CancelScope() as scope:
            self._under_way.add(scope)
            try:
                return await operation(asyncio.get_running_loop())
            except OSError as exc:
                if self._closed:
                    raise anyio.ClosedResourceError from None
                raise anyio.BrokenResourceError from exc
            finally:
                self._under_way.discard(scope)
        # Only aclose cancels this scope.
        raise anyio.ClosedResourceError

    async def receive_fds(self, msglen: int, maxfds: int) -> tuple[bytes, list[int]]:
        """A message of at most ``msglen`` bytes and the descriptors (SCM_RIGHTS, at most
        ``maxfds``) that came with it; ``EndOfStream`` at the end."""
        if sniffio.current_async_library() != "asyncio":
            return await self._stream.receive_fds(msglen, maxfds)
        fds = array.array("i")
        ancillary_size = socket.CMSG_LEN(maxfds * fds.itemsize)

        async def recvmsg(loop: asyncio.AbstractEventLoop) -> tuple[bytes, list[Any]]:
            while True:
                try:
                    message, ancillary, _flags, _address = self._socket.recvmsg(msglen, ancillary_size)
                except BlockingIOError:
                    await _until_readable(loop, self._socket.fileno())
                else:
                    return message, ancillary

        message, ancillary = await self._on_loop(recvmsg)
        if not message and not ancillary:
            raise anyio.EndOfStream
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        return message, list(fds)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        self._closed = True
        if self._under_way:
            for scope in self._under_way:
                scope.cancel()
            # A cancelled sock_recv removes its reader in a done callback that runs before the
            # cancelled task resumes: once the operations have left, nothing waits on the socket.
            with anyio.CancelScope(shield=True):
                for _ in range(_CLOSE_PASSES):
                    if not self._under_way:
                        break
                    await anyio.lowlevel.checkpoint()
        await self._stream.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self._stream.extra_attributes


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _until_readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    waiter: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _wake, waiter)
    try:
        await waiter
    finally:
        loop.remove_reader(fd)
