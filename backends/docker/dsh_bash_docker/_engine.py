"""A minimal async client for the few Docker Engine API calls on every command's path.

docker-py is synchronous; calling it from worker threads for every command would cost a thread hop
per call and a thread per streaming command. Exec create, start (a hijacked connection carrying the
multiplexed stream) and inspect are plain HTTP/1.1 over the daemon's socket, spoken here over anyio
streams, so they run on asyncio and trio alike. Container lifecycle (create, pull, remove) stays
with docker-py, off the hot path.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import anyio
import anyio.abc
import anyio.lowlevel

from dsh_bash import BashInfrastructureError, ConfigError
from dsh_bash.backend import InfraReason

__all__ = ["Endpoint", "EngineClient", "EngineError", "ExecStream"]

API_VERSION = "v1.41"
_MAX_HEADER = 64 * 1024
_FRAME = struct.Struct(">BxxxI")


class EngineError(BashInfrastructureError):
    """The engine answered with an error status (``status``), or could not be reached (None)."""

    def __init__(
        self, message: str, status: int | None = None, *, reason: InfraReason = "unclassified"
    ) -> None:
        super().__init__(message, reason=reason)
        self.status = status


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the engine listens: a unix socket path, or a plain TCP host and port."""

    unix_path: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, docker_host: str | None) -> Endpoint:
        """From a ``DOCKER_HOST``-style URL; ``None`` reads the environment as ``docker.from_env()`` does."""
        url = docker_host if docker_host is not None else os.environ.get("DOCKER_HOST", "")
        if not url:
            return cls(unix_path="/var/run/docker.sock")
        if os.environ.get("DOCKER_TLS_VERIFY") and docker_host is None:
            raise ConfigError("docker_host: TLS-protected engines (DOCKER_TLS_VERIFY) are not supported yet")
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return cls(unix_path=parts.path or "/var/run/docker.sock")
        if parts.scheme in ("tcp", "http"):
            if not parts.hostname:
                raise ConfigError(f"docker_host: no host in {url!r}")
            return cls(host=parts.hostname, port=parts.port or 2375)
        raise ConfigError(f"docker_host: unsupported {url!r} (use unix:///path or tcp://host:port)")

    def describe(self) -> str:
        return f"unix://{self.unix_path}" if self.unix_path else f"tcp://{self.host}:{self.port}"

    async def connect(self) -> anyio.abc.SocketStream:
        try:
            if self.unix_path is not None:
                return await anyio.connect_unix(self.unix_path)
            assert self.host is not None and self.port is not None
            return await anyio.connect_tcp(self.host, self.port)
        except OSError as exc:
            raise EngineError(
                f"Docker engine at {self.describe()} is unreachable: {exc}", reason="engine_unreachable"
            ) from exc


def _cut_short() -> EngineError:
    return EngineError("the Docker engine closed the connection mid-response", reason="connection_lost")


class _Reader:
    """Buffered reads over a byte stream: HTTP heads, exact sizes, chunked bodies."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        try:
            data = await self.stream.receive(256 * 1024)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.eof = True
            return False
        self.buffer += data
        return True

    async def read_until(self, separator: bytes, limit: int = _MAX_HEADER) -> bytes:
        while (index := self.buffer.find(separator)) < 0:
            if len(self.buffer) > limit or not await self.fill():
                raise _cut_short()
        data = bytes(self.buffer[: index + len(separator)])
        del self.buffer[: index + len(separator)]
        return data

    async def read_exact(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not await self.fill():
                raise _cut_short()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def read_all(self) -> bytes:
        while await self.fill():
            pass
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


async def _read_head(reader: _Reader) -> tuple[int, dict[str, str]]:
    head = (await reader.read_until(b"\r\n\r\n")).decode("latin-1")
    status_line, *header_lines = head.split("\r\n")
    try:
        status = int(status_line.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise EngineError(f"malformed response from the Docker engine: {status_line!r}") from None
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: _Reader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.read_until(b"\r\n")).strip().split(b";")[0], 16)
            if size == 0:
                await reader.read_until(b"\r\n")
                return bytes(body)
            body += await reader.read_exact(size)
            await reader.read_exact(2)
    if "content-length" in headers:
        return await reader.read_exact(int(headers["content-length"]))
    return await reader.read_all()


def _request_bytes(method: str, path: str, body: Any | None, extra: str = "") -> bytes:
    """One request: a ``bytes`` body goes as it is (a tar archive), anything else as JSON."""
    if isinstance(body, bytes):
        payload, kind = body, "application/x-tar"
    else:
        payload, kind = (b"" if body is None else json.dumps(body).encode()), "application/json"
    head = (
        f"{method} /{API_VERSION}{path} HTTP/1.1\r\nHost: docker\r\n"
        f"Content-Type: {kind}\r\nContent-Length: {len(payload)}\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + payload


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body).get("message", "")
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    return f"Docker engine error {status}: {message.strip()}"


class ExecStream:
    """The hijacked connection of a started exec: a multiplexed stdout/stderr stream, and stdin."""

    def __init__(self, stream: anyio.abc.SocketStream, reader: _Reader) -> None:
        self._stream = stream
        self._reader = reader

    async def send_stdin(self, data: bytes) -> None:
        await self._stream.send(data)

    async def close_stdin(self) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._stream.send_eof()

    @property
    def at_eof(self) -> bool:
        return self._reader.eof

    def closed_by_engine(self) -> bool:
        """For a stream nothing was read from yet: True when the engine closed it (its process
        ended) or sent anything at all, without waiting and without taking the bytes."""
        if self._reader.eof or self._reader.buffer:
            return True
        raw = self._stream.extra(anyio.abc.SocketAttribute.raw_socket)
        try:
            raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def _parse(
        self, on_stdout: Callable[[memoryview], None], on_stderr: Callable[[memoryview], None]
    ) -> None:
        """Hand every complete frame in the buffer to its stream's callback, without copying payloads."""
        buffer = self._reader.buffer
        offset = 0
        view = memoryview(buffer)
        try:
            while len(buffer) - offset >= 8:
                kind, size = _FRAME.unpack_from(buffer, offset)
                if len(buffer) - offset - 8 < size:
                    break
                with view[offset + 8 : offset + 8 + size] as payload:
                    if kind == 2:
                        on_stderr(payload)
                    else:
                        on_stdout(payload)
                offset += 8 + size
        finally:
            view.release()
        if offset:
            del buffer[:offset]

    async def pump(
        self, on_stdout: Callable[[memoryview], None], on_stderr: Callable[[memoryview], None]
    ) -> None:
        """Demultiplex frames until the engine closes the stream."""
        await self.pump_until(on_stdout, on_stderr, lambda: False)

    async def pump_until(
        self,
        on_stdout: Callable[[memoryview], None],
        on_stderr: Callable[[memoryview], None],
        done: Callable[[], bool],
    ) -> bool:
        """Demultiplex until ``done()`` holds (True) or the stream ends (False)."""
        while True:
            self._parse(on_stdout, on_stderr)
            if done():
                return True
            if not await self._reader.fill():
                return False
            await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await self._stream.aclose()


# $0: names to unset (space-separated identifiers), then the process to become. No rc file is read:
# every exec sets BASH_ENV and ENV (empty for the executor's own scripts).
_UNSET_AND_EXEC = 'unset -v $0; exec "$@"'


class EngineClient:
    """One short-lived connection per call; the engine's HTTP/1.1 keep-alive is not relied upon."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        #: Names of the container's environment that the env policy drops (as it is now:
        #: ``reconfigure`` may change it) and that hold a value: the engine gives every exec the
        #: container's environment, and an exec cannot take a name out of it, so each exec then
        #: starts as a bash that unsets them and `exec`s the real process (see :meth:`exec_create`).
        #: Set by the executor once it read the container's Env.
        self.unset_names: Callable[[], Sequence[str]] = tuple

    async def request(self, method: str, path: str, body: Any | None = None) -> Any:
        status, data = await self.request_raw(method, path, body)
        if status >= 400:
            raise EngineError(_error_text(status, data), status)
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError:
            return data.decode("utf-8", "replace")

    async def request_raw(self, method: str, path: str, body: Any | None = None) -> tuple[int, bytes]:
        """(status, body) of one call, whatever the status; a HEAD request's body is empty."""
        stream = await self.endpoint.connect()
        async with stream:
            reader = _Reader(stream)
            try:
                await stream.send(_request_bytes(method, path, body, "Connection: close\r\n"))
                status, headers = await _read_head(reader)
                data = b"" if method == "HEAD" else await _read_body(reader, headers)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise EngineError(
                    f"lost the connection to the Docker engine: {exc}", reason="connection_lost"
                ) from exc
        return status, data

    async def exec_create(
        self,
        container: str,
        cmd: list[str],
        *,
        env: dict[str, str],
        stdin: bool,
        user: str | None,
        workdir: str | None = None,
        unset: Sequence[str] | None = None,
    ) -> str:
        # /proc/PID/environ shows the environment a process was started with for its whole life:
        # a process the exec starts (a spill writer's cat, a boot wrapper, a supervisor, a kill
        # script) would show the container's secrets to every command of its user. The wrapper bash
        # holds them only until its `exec` (the same process, a new environment). A name the exec
        # sets itself (an explicit value of the command's) is the exec's, not the container's.
        # ``unset``: other names than the policy's (a warm exec holds none of the container's values).
        names = [name for name in (self.unset_names() if unset is None else unset) if name not in env]
        if names:
            cmd = ["bash", "--noprofile", "--norc", "-c", _UNSET_AND_EXEC, " ".join(names), *cmd]
        body: dict[str, Any] = {
            "AttachStdin": stdin,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
            "Cmd": cmd,
            "Env": [f"{name}={value}" for name, value in env.items()],
        }
        if user:
            body["User"] = user
        if workdir:
            body["WorkingDir"] = workdir
        result = await self.request("POST", f"/containers/{quote(container, safe='')}/exec", body)
        return str(result["Id"])

    async def exec_start(self, exec_id: str) -> ExecStream:
        stream = await self.endpoint.connect()
        try:
            await stream.send(
                _request_bytes(
                    "POST",
                    f"/exec/{exec_id}/start",
                    {"Detach": False, "Tty": False},
                    "Connection: Upgrade\r\nUpgrade: tcp\r\n",
                )
            )
            reader = _Reader(stream)
            status, headers = await _read_head(reader)
            if status >= 400:
                raise EngineError(_error_text(status, await _read_body(reader, headers)), status)
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise
        return ExecStream(stream, reader)

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/exec/{exec_id}/json")
        return result

    async def container_inspect(self, container: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/containers/{quote(container, safe='')}/json")
        return result
