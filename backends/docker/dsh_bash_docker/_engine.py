"""An async client for the Docker Engine API calls this backend makes.

HTTP is httpcore2's (a pooled, kept-alive connection per call; the ``101`` of an exec's start hands
over the connection, which then carries the exec's multiplexed output and its stdin); it runs on
asyncio and trio. Where the engine is and how to reach it (a unix socket, TCP, TLS, SSH) is
``_transport``'s. docker-py is not used: it is synchronous (a thread per call and per stream) and
reaches ``ssh://`` engines only through paramiko or an ``ssh`` process per connection.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import anyio
import anyio.lowlevel
import httpcore2

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import InfraReason, while_watching

from ._transport import Endpoint, EngineNetwork, EngineStream

__all__ = ["Endpoint", "EngineClient", "EngineError", "ExecStream"]

API_VERSION = "v1.41"
_READ_SIZE = 256 * 1024
#: How long :meth:`EngineClient.exec_exit_code` waits for the engine to record an ended exec's exit.
EXIT_CODE_WAIT_S = 5.0
_FRAME = struct.Struct(">BxxxI")
#: How long a call about a container, or an exec's first read, waits before
#: :attr:`EngineClient.on_stall` runs (and again after each further ``STALL_S`` of waiting).
STALL_S = 1.0
#: The calls about one container or exec: the engine holds them while the runtime cannot enter it.
_WATCHED_PATHS = ("/containers/", "/exec/")

_T = TypeVar("_T")


class EngineError(BashInfrastructureError):
    """The engine answered with an error status (``status``), or could not be reached (None)."""

    def __init__(
        self, message: str, status: int | None = None, *, reason: InfraReason = "unclassified"
    ) -> None:
        super().__init__(message, reason=reason)
        self.status = status


_CONNECTION_ERRORS = (
    httpcore2.NetworkError,
    httpcore2.ProtocolError,
    httpcore2.TimeoutException,
    ssl.SSLError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


def _lost(endpoint: Endpoint, exc: BaseException) -> EngineError:
    # Only a dialer's connections carry another backend's reason.
    cause: BaseException | None = exc if endpoint.dialer is not None else None
    while cause is not None and not isinstance(cause, BashInfrastructureError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        # A dialer's own reason (the Ray node that relays the engine is gone: node_lost).
        return EngineError(f"Docker engine at {endpoint.describe()}: {cause}", reason=cause.reason)
    if isinstance(exc, httpcore2.ConnectError):
        return EngineError(
            f"Docker engine at {endpoint.describe()} is unreachable: {exc}", reason="engine_unreachable"
        )
    return EngineError(
        f"lost the connection to the Docker engine at {endpoint.describe()}: {type(exc).__name__}: {exc}",
        reason="connection_lost",
    )


def _body(body: Any | None) -> tuple[bytes | list[bytes], int, bytes]:
    """(payload, its length, content type): ``bytes`` go as they are (a tar archive), and so does a
    list of ``bytes`` (the parts of one archive, sent one after the other: a large file is never
    copied into one buffer); anything else as JSON."""
    if isinstance(body, bytes):
        return body, len(body), b"application/x-tar"
    if isinstance(body, list):
        return body, sum(len(part) for part in body), b"application/x-tar"
    payload = b"" if body is None else json.dumps(body).encode()
    return payload, len(payload), b"application/json"


async def _one_by_one(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body).get("message", "")
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    return f"Docker engine error {status}: {message.strip()}"


class ExecStream:
    """The upgraded connection of a started exec: a multiplexed stdout/stderr stream, and stdin."""

    def __init__(
        self,
        stream: httpcore2.AsyncNetworkStream,
        response: httpcore2.Response,
        watch: Callable[[Callable[[], Awaitable[bytes]]], Awaitable[bytes]] | None = None,
    ) -> None:
        # Reads go through httpcore2's wrapper (it holds any bytes that came with the response's
        # head); the half-close and the readiness test need the connection itself.
        self._stream = stream
        engine_stream = stream.get_extra_info("dsh_bash.engine_stream")
        assert isinstance(engine_stream, EngineStream)
        self._connection = engine_stream
        self._response = response
        self.buffer = bytearray()
        self.eof = False
        #: Watches the first read (until the exec's process said anything, or ended): an exec whose
        #: process the runtime could not start yet shows nothing but this wait.
        self._watch_first = watch

    async def send_stdin(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except httpcore2.WriteError as exc:
            raise anyio.BrokenResourceError(str(exc)) from exc

    async def close_stdin(self) -> None:
        await self._connection.write_eof()

    @property
    def at_eof(self) -> bool:
        return self.eof

    def closed_by_engine(self) -> bool:
        """For a stream nothing was read from yet: True when the engine closed it (its process
        ended) or sent anything at all, without waiting and without taking the bytes."""
        return self.eof or bool(self.buffer) or bool(self._connection.get_extra_info("is_readable"))

    async def fill(self) -> bool:
        """Read what the engine sent next into ``buffer``; False at the end of the stream."""
        if self.eof:
            return False
        watch, self._watch_first = self._watch_first, None
        try:
            if watch is None:
                data = await self._stream.read(_READ_SIZE)
            else:
                data = await watch(lambda: self._stream.read(_READ_SIZE))
        except (httpcore2.ReadError, httpcore2.TimeoutException):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    def _parse(
        self, on_stdout: Callable[[memoryview], None], on_stderr: Callable[[memoryview], None]
    ) -> None:
        """Hand every complete frame in the buffer to its stream's callback, without copying payloads."""
        buffer = self.buffer
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
            if not await self.fill():
                return False
            await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            # The pool forgets the connection (an upgraded one is never reused).
            await self._response.aclose()


# $0: names to unset (space-separated identifiers), then the process to become. No rc file is read:
# every exec sets BASH_ENV and ENV (empty for the executor's own scripts).
_UNSET_AND_EXEC = 'unset -v $0; exec "$@"'


class EngineClient:
    """The engine's API over a pool of kept-alive connections; an async context manager (closing
    it closes every connection, an exec's too, and an ``ssh://`` engine's SSH connection)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._network = EngineNetwork(endpoint)
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=endpoint.ssl_context(),
            max_connections=None,  # every running command holds one (its exec's stream)
            max_keepalive_connections=8,
            keepalive_expiry=30.0,
            network_backend=self._network,
        )
        #: Names of the container's environment that the env policy drops (as it is now:
        #: ``reconfigure`` may change it) and that hold a value: the engine gives every exec the
        #: container's environment, and an exec cannot take a name out of it, so each exec then
        #: starts as a bash that unsets them and `exec`s the real process (see :meth:`exec_create`).
        #: Set by the executor once it read the container's Env.
        self.unset_names: Callable[[], Sequence[str]] = tuple
        #: Run when a call about a container or an exec, or an exec's first read, has waited
        #: ``STALL_S``, and after each further ``STALL_S`` while it still waits: a command may have
        #: stopped (SIGSTOP) the runtime's process that enters the container, and the engine then
        #: holds every call about it. Set by the executor when it can help; None: nothing watches.
        self.on_stall: Callable[[], Awaitable[None]] | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._pool.aclose()
            finally:
                await self._network.aclose()

    async def _watched(self, body: Callable[[], Awaitable[_T]]) -> _T:
        """``await body()``, running :attr:`on_stall` while it waits past ``STALL_S``."""
        remedy = self.on_stall
        if remedy is None:
            return await body()

        async def watch() -> None:
            while True:
                await anyio.sleep(STALL_S)
                await remedy()

        return await while_watching(body, watch)

    def _request(
        self, method: str, path: str, body: Any | None, extra: list[tuple[bytes, bytes]]
    ) -> httpcore2.Request:
        payload, length, kind = _body(body)
        headers = [
            (b"Host", b"docker"),
            (b"Content-Type", kind),
            (b"Content-Length", str(length).encode()),
        ]
        return httpcore2.Request(
            method.encode(),
            self.endpoint.url(f"/{API_VERSION}{path}"),
            headers=headers + extra,
            content=payload if isinstance(payload, bytes) else _one_by_one(payload),
        )

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
        status, _, data = await self.request_with_headers(method, path, body)
        return status, data

    async def request_with_headers(
        self, method: str, path: str, body: Any | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body) of one call, whatever the status."""
        status, headers, parts = await self.request_parts(method, path, body)
        return status, headers, b"".join(parts)

    async def request_parts(
        self, method: str, path: str, body: Any | None = None
    ) -> tuple[int, dict[str, str], list[bytes]]:
        """As :meth:`request_with_headers`, the body left in the parts it came in: a caller that
        wants a slice of a large body (a file in an archive) joins only that, once."""

        async def call() -> tuple[int, dict[str, str], list[bytes]]:
            response = await self._pool.handle_async_request(self._request(method, path, body, []))
            try:
                parts = [part async for part in response.aiter_stream()]
                headers = {
                    name.decode("latin-1").lower(): value.decode("latin-1")
                    for name, value in response.headers
                }
                return response.status, headers, parts
            finally:
                await response.aclose()

        try:
            return await (self._watched(call) if path.startswith(_WATCHED_PATHS) else call())
        except _CONNECTION_ERRORS as exc:
            raise _lost(self.endpoint, exc) from exc

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
        return await self._upgraded(f"/exec/{exec_id}/start", {"Detach": False, "Tty": False}, "the exec's")

    async def container_attach_stdin(self, container: str) -> ExecStream:
        """A connection attached to the container's stdin alone. A container created with
        ``OpenStdin`` and ``StdinOnce`` keeps its stdin open while this connection is, and the
        engine closes it when the connection ends, however it ends."""
        path = f"/containers/{quote(container, safe='')}/attach?stream=1&stdin=1"
        return await self._upgraded(path, None, "the container's")

    async def _upgraded(self, path: str, body: Any | None, whose: str) -> ExecStream:
        """A ``POST`` the engine answers by handing over the connection (101), as a stream."""
        request = self._request("POST", path, body, [(b"Connection", b"Upgrade"), (b"Upgrade", b"tcp")])
        try:
            response = await self._watched(lambda: self._pool.handle_async_request(request))
        except _CONNECTION_ERRORS as exc:
            raise _lost(self.endpoint, exc) from exc
        if response.status == 101:
            watch = None if self.on_stall is None else self._watched
            return ExecStream(response.extensions["network_stream"], response, watch)
        try:
            data = await response.aread()
        except _CONNECTION_ERRORS as exc:
            raise _lost(self.endpoint, exc) from exc
        finally:
            await response.aclose()
        if response.status >= 400:
            raise EngineError(_error_text(response.status, data), response.status)
        raise EngineError(f"the Docker engine did not hand over {whose} stream (status {response.status})")

    async def exec_start_detached(self, exec_id: str) -> None:
        """Start the exec and return at once: no stream is handed over (on an ``ssh://`` engine no
        new channel is opened for it), nothing it writes is read."""
        await self.request("POST", f"/exec/{exec_id}/start", {"Detach": True, "Tty": False})

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/exec/{exec_id}/json")
        return result

    async def exec_exit_code(self, exec_id: str, *, within_s: float = EXIT_CODE_WAIT_S) -> int | None:
        """The exit code of an exec whose stream ended; None when the engine has not recorded one
        within ``within_s``.

        The engine ends an exec's stream when the process's output ends, and records the exit
        when containerd's exit event reaches it, later: on a loaded engine an inspect right after
        the stream ended can still read ``Running`` and no ``ExitCode``. So it asks again, with
        growing pauses, until the exit is in.
        """
        pause = 0.01
        with anyio.move_on_after(within_s):
            while True:
                info = await self.exec_inspect(exec_id)
                code = info.get("ExitCode")
                if not info.get("Running") and isinstance(code, int):
                    return code
                await anyio.sleep(pause)
                pause = min(pause * 2, 0.2)
        return None

    async def container_inspect(self, container: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/containers/{quote(container, safe='')}/json")
        return result

    async def image_inspect(self, image: str) -> dict[str, Any] | None:
        """The image's description, None when the engine has no such image."""
        try:
            result: dict[str, Any] = await self.request("GET", f"/images/{quote(image, safe='')}/json")
        except EngineError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    async def image_pull(self, image: str) -> None:
        """Pull ``image`` (``name[:tag]`` or ``name@digest``); the engine's error as an EngineError."""
        name, tag = image, ""
        if "@" not in image:
            last = image.rsplit("/", 1)[-1]
            if ":" in last:
                name, tag = image.rsplit(":", 1)
        query = f"fromImage={quote(name, safe='')}" + (
            f"&tag={quote(tag, safe='')}" if tag else "&tag=latest"
        )
        status, data = await self.request_raw("POST", f"/images/create?{query}")
        if status >= 400:
            raise EngineError(_error_text(status, data), status)
        # Progress is a stream of JSON lines; a failure is a line with "error" (the status is 200).
        for line in data.splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                error = json.loads(line).get("error")
                if error:
                    raise EngineError(f"pulling {image!r}: {error}", 404 if "not found" in error else None)

    async def container_create(self, body: dict[str, Any]) -> str:
        result = await self.request("POST", "/containers/create", body)
        return str(result["Id"])

    async def container_remove(self, container: str) -> None:
        """Remove the container, running or not; one already gone is not an error."""
        try:
            await self.request("DELETE", f"/containers/{quote(container, safe='')}?force=1&v=1")
        except EngineError as exc:
            if exc.status != 404:
                raise

    async def containers_labelled(self, label: str) -> list[dict[str, Any]]:
        """Every container (running or not) that has ``label``."""
        filters = quote(json.dumps({"label": [label]}), safe="")
        result: list[dict[str, Any]] = await self.request("GET", f"/containers/json?all=1&filters={filters}")
        return result
