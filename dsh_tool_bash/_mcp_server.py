"""``dsh-bash mcp``: the toolset's three tools over the Model Context Protocol (official ``mcp`` SDK, 2.x).

One executor serves every client. Each MCP connection (the stdio client, or one streamable-HTTP session) is
its own owner with its own :class:`BashToolset`: it sees only its own background tasks, is told on the
connection when one of them finishes (a ``notifications/message`` log entry), and when the connection ends
its running tasks are killed. Stopping the server (SIGTERM, SIGINT, stdin closed) closes the executor, which
kills everything it started.

The server speaks the session-based (``initialize`` handshake) protocol versions only: background tasks,
owners and announcements need a session, which the stateless 2026-07-28 protocol has not. It answers
``server/discover`` with "method not found", so a 2.x client in its default ``auto`` mode falls back to
the handshake, and refuses tool calls that arrive without a session.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import socket
import stat
import sys
import warnings
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar, Final, NoReturn, cast

import anyio
import anyio.abc
import h11
import mcp_types as types
import uvicorn
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.runner import serve_loop
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsh_bash import BashExecutor, BashTask, OwnerToken, load_executor

from ._toolset import BashToolset, ToolResult, too_deep

__all__ = [
    "TOKEN_ENV",
    "BashMcpServer",
    "parse_http_address",
    "read_token_file",
    "run_server",
    "token_from_environment",
]

log = logging.getLogger("dsh_tool_bash.mcp")

SERVER_NAME: Final = "dsh-bash"
#: ``_meta`` key of a tool result (and of a completion notice) carrying ``ToolResult.data``.
DATA_META_KEY: Final = "dsh-bash/data"
#: The ``logger`` of completion notices.
NOTICE_LOGGER: Final = "dsh-bash"
_STATE_KEY: Final = "dsh_tool_bash.session"
_LEVELS: Final = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
_NOTICE_LEVEL: Final = "info"
_NOTIFY_BOUND_S: Final = 5.0
#: ``_meta`` key by which the stdio reader marks a request it rewrote because it was nested too deeply.
REFUSED_META_KEY: Final = "dsh-bash/refused"
#: The method a too-deep request other than ``tools/call`` is rewritten to: answered with an error.
_REFUSED_METHOD: Final = "dsh-bash/refused"
#: Messages nested deeper than this are refused by the stdio reader (the SDK's JSON parser refuses them
#: at about 200 and drops the line unanswered, leaving the client waiting).
_MAX_LINE_DEPTH: Final = 128
#: A JSON string or a bracket: what the depth scan of a line looks at.
_JSON_TOKENS: Final = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
#: Idle streamable-HTTP sessions (no request in flight, no open stream) end after this long.
DEFAULT_SESSION_IDLE_TIMEOUT_S: Final = 1800.0
#: Live streamable-HTTP sessions at most; one more is refused (HTTP 503).
DEFAULT_MAX_SESSIONS: Final = 16
#: Open HTTP connections at most. When all are open, a new one pushes out the oldest connection still
#: waiting for a request's headers, or, when none is, is refused (HTTP 503).
DEFAULT_MAX_CONNECTIONS: Final = 256
#: A connection must have delivered a request's headers this long after it was accepted (kept alive
#: after an answer: after the first byte of its next request); else it is closed.
DEFAULT_HEADER_TIMEOUT_S: Final = 5.0
#: A request's body must have arrived this long after its headers; else the connection is closed.
DEFAULT_BODY_TIMEOUT_S: Final = 30.0
#: How many connections asyncio accepts in one turn of its loop before the guard sees them (uvicorn's
#: ``backlog``): the descriptors in use peak at the cap plus this.
_ACCEPT_BATCH: Final = 128
#: The listening socket's queue, set once uvicorn has started (it listens with ``backlog``): connections
#: waiting there hold no descriptor of the server, and a burst does not overflow it into SYN retries.
_LISTEN_QUEUE: Final = 1024
#: Reports of connections pushed out or refused at the cap: at most one log line in this long.
_GUARD_REPORT_INTERVAL_S: Final = 60.0
#: ``max_running_total`` when not given: this many times ``max_running``.
DEFAULT_TOTAL_FACTOR: Final = 4
#: The environment variable holding the HTTP bearer token (read and removed from the environment). Not
#: ``DSH_BASH_*``: those are the backend's configuration fields.
TOKEN_ENV: Final = "DSH_MCP_TOKEN"
#: Beyond the executor's kill bound, what a session's DELETE waits for its teardown to begin.
_DELETE_MARGIN_S: Final = 1.0

_INSTRUCTIONS: Final = (
    "Shell access. Run commands with the bash tool: each call is a fresh non-interactive bash (use its "
    "workdir argument instead of cd)."
)
_SESSION_INSTRUCTIONS: Final = (
    "Shell access. Run commands with the bash tool: each call is a new non-interactive bash that starts "
    "where the last one left off (directory, exported variables, functions, aliases, options), as in one "
    "terminal for this session; its restart argument starts from a fresh shell."
)
_BACKGROUND_INSTRUCTIONS: Final = (
    " Long-running commands (servers, watchers) go to the background with run_in_background, or after "
    "yield_ms milliseconds when they have not ended by then; read their "
    "output with bash_output and stop them with bash_kill; answer a program that asks for input (started "
    "with open_stdin) with bash_input. Background tasks belong to this session and are killed when it ends."
)


def _package_version() -> str:
    try:
        return version("dsh-bash")
    except PackageNotFoundError:
        return "0"


@dataclass(eq=False)
class _Session:
    """What one MCP connection owns."""

    connection: Connection
    toolset: BashToolset
    log_level: str | None = None
    unsubscribe: Callable[[], None] = field(default=lambda: None)
    #: Set once the session's end has sent its tasks the kill (``killed`` are those tasks).
    ending: anyio.Event = field(default_factory=anyio.Event)
    killed: list[BashTask] = field(default_factory=list)


def _connection_of(ctx: ServerRequestContext[Any, Any]) -> Connection:
    # The SDK hands handlers a per-request ServerSession; the per-connection object (its ``state`` and
    # ``exit_stack`` are public) is reachable only through this attribute. Tests pin it.
    connection = getattr(ctx.session, "_connection", None)
    if not isinstance(connection, Connection):
        raise RuntimeError("this version of the mcp SDK does not expose the connection of a request")
    return connection


class BashMcpServer:
    """The MCP server over one open executor. Serve it with :meth:`serve_stdio` or :meth:`serve_http`."""

    def __init__(
        self,
        executor: BashExecutor,
        *,
        background: bool = True,
        max_running: int = 10,
        max_running_total: int | None = None,
    ) -> None:
        self._executor = executor
        self._background = background
        self._max_running = max_running
        self._max_running_total = max_running_total
        self._template = BashToolset(
            executor, background=background, max_running=max_running, max_running_total=max_running_total
        )
        self._tg: anyio.abc.TaskGroup | None = None
        #: Sessions with a toolset, by HTTP session id (a DELETE waits for its session's end).
        self._by_session_id: dict[str, _Session] = {}
        with warnings.catch_warnings():
            # logging/setLevel is deprecated from 2026-07-28 on; the handshake versions this server speaks
            # still use it, and it is what declares the logging capability the notices need.
            warnings.simplefilter("ignore", MCPDeprecationWarning)
            self._server: Server[Any] = Server(
                SERVER_NAME,
                version=_package_version(),
                instructions=(_SESSION_INSTRUCTIONS if self._template.sessions else _INSTRUCTIONS)
                + (_BACKGROUND_INSTRUCTIONS if background else ""),
                on_list_tools=self._list_tools,
                on_call_tool=self._call_tool,
                on_set_logging_level=self._set_logging_level,
            )
        self._server.add_request_handler("server/discover", types.RequestParams, self._refuse_discover)
        self._server.add_request_handler(_REFUSED_METHOD, types.RequestParams, self._refuse_too_deep)

    @property
    def server(self) -> Server[Any]:
        """The SDK's low-level server (to mount it elsewhere)."""
        return self._server

    # -- handlers -------------------------------------------------------------------------------------

    async def _refuse_discover(
        self, ctx: ServerRequestContext[Any, Any], params: types.RequestParams
    ) -> NoReturn:
        raise MCPError(
            code=types.METHOD_NOT_FOUND,
            message="server/discover: this server speaks the session-based protocol; use initialize",
        )

    async def _refuse_too_deep(
        self, ctx: ServerRequestContext[Any, Any], params: types.RequestParams
    ) -> NoReturn:
        problem = (params.meta or {}).get(REFUSED_META_KEY)
        raise MCPError(code=types.INVALID_REQUEST, message=str(problem or "the request was refused"))

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=tool.name, description=tool.description, input_schema=tool.input_schema)
                for tool in self._template.definitions()
            ]
        )

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            result = ToolResult(
                text=(
                    f"{SERVER_NAME} keeps background tasks per session and needs a session-based MCP "
                    "connection (the initialize handshake); this request came without one"
                ),
                is_error=True,
                data={"tool": params.name, "error": "no_session"},
            )
        elif params.meta and REFUSED_META_KEY in params.meta:  # rewritten by the stdio reader: too deep
            result = ToolResult(
                text=f"invalid arguments for {params.name}: {too_deep()}",
                is_error=True,
                data={"tool": params.name, "error": "invalid_arguments"},
            )
        else:
            session = self._session(ctx)
            result = await session.toolset.call(params.name, params.arguments or {})
        return types.CallToolResult(
            content=[types.TextContent(text=result.text)],
            is_error=result.is_error,
            _meta={DATA_META_KEY: result.data},
        )

    async def _set_logging_level(
        self, ctx: ServerRequestContext[Any, Any], params: types.SetLevelRequestParams
    ) -> types.EmptyResult:
        connection = _connection_of(ctx)
        connection.state[f"{_STATE_KEY}.log_level"] = params.level
        session = connection.state.get(_STATE_KEY)
        if isinstance(session, _Session):
            session.log_level = params.level
        return types.EmptyResult()

    # -- sessions -------------------------------------------------------------------------------------

    def _session(self, ctx: ServerRequestContext[Any, Any]) -> _Session:
        connection = _connection_of(ctx)
        session = connection.state.get(_STATE_KEY)
        if isinstance(session, _Session):
            return session
        owner = OwnerToken(f"mcp-{secrets.token_hex(8)}")
        toolset = BashToolset(
            self._executor,
            owner=owner,
            background=self._background,
            max_running=self._max_running,
            max_running_total=self._max_running_total,
        )
        session = _Session(connection, toolset, log_level=connection.state.get(f"{_STATE_KEY}.log_level"))
        session.unsubscribe = toolset.on_completion(lambda text, task: self._announce(session, text, task))
        connection.state[_STATE_KEY] = session
        if connection.session_id is not None:
            self._by_session_id[connection.session_id] = session
        connection.exit_stack.push_async_callback(self._end_session, session)
        log.debug("session %s: owner %s", connection.session_id or "stdio", owner)
        return session

    async def _end_session(self, session: _Session) -> None:
        """The connection ended: stop announcing, kill its running tasks (a DELETE then waits for them)."""
        session.unsubscribe()
        session.toolset.end_session()
        session.killed = session.toolset.running_tasks()
        try:
            killed = await session.toolset.kill_all()
        finally:
            session.ending.set()
            session_id = session.connection.session_id
            if session_id is not None and self._by_session_id.get(session_id) is session:
                del self._by_session_id[session_id]
        if killed:
            log.info("connection ended: killed %s", ", ".join(killed))

    def _kill_bound_s(self) -> float:
        """The executor's bound on a kill: ``2 x grace + 0.5 s``."""
        grace_ms = getattr(self._executor.config, "grace_ms", 3000)
        return 2 * float(grace_ms) / 1000 + 0.5

    async def _await_session_end(self, session: _Session) -> None:
        """Until the session's tasks have ended (bounded by the kill bound plus a margin)."""
        with anyio.move_on_after(self._kill_bound_s() + _DELETE_MARGIN_S) as scope:
            await session.ending.wait()
            for task in session.killed:
                await task.wait()
        if scope.cancelled_caught:
            left = [task.id for task in session.killed if task.status == "running"]
            log.warning(
                "session %s: tasks still running after its end: %s", session.connection.session_id, left
            )

    def _announce(self, session: _Session, text: str, task: BashTask) -> None:
        level = session.log_level
        if level in _LEVELS and _LEVELS.index(_NOTICE_LEVEL) < _LEVELS.index(level):
            return
        if self._tg is None:
            return
        params: dict[str, Any] = {
            "level": _NOTICE_LEVEL,
            "logger": NOTICE_LOGGER,
            "data": text,
            "_meta": {
                DATA_META_KEY: {
                    "task_id": task.id,
                    "status": task.status,
                    "exit_code": task.exit_code,
                    "signal": task.signal,
                    "end_cause": task.end_cause,
                }
            },
        }
        self._tg.start_soon(self._notify, session.connection, params)

    async def _notify(self, connection: Connection, params: dict[str, Any]) -> None:
        with anyio.move_on_after(_NOTIFY_BOUND_S):
            await connection.notify("notifications/message", params)

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                yield
            finally:
                self._tg = None
                tg.cancel_scope.cancel()

    # -- transports -----------------------------------------------------------------------------------

    async def serve_stdio(self, *, stop: anyio.Event | None = None) -> None:
        """Serve one client on this process's stdin/stdout until stdin closes or ``stop`` is set."""
        reader = _FdLines.for_stdin()
        async with self._running(), anyio.create_task_group() as tg:
            if stop is not None:
                tg.start_soon(_cancel_when, stop, tg.cancel_scope)
            async with (
                stdio_server(stdin=cast(Any, reader)) as (read_stream, write_stream),
                self._server.lifespan(self._server) as state,
            ):
                await serve_loop(self._server, read_stream, write_stream, lifespan_state=state)
            tg.cancel_scope.cancel()

    async def serve_http(
        self,
        sock: socket.socket,
        *,
        stop: anyio.Event | None = None,
        path: str = "/mcp",
        token: str | None = None,
        max_sessions: int | None = DEFAULT_MAX_SESSIONS,
        session_idle_timeout: float | None = DEFAULT_SESSION_IDLE_TIMEOUT_S,
        shutdown_grace_s: int = 1,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        """Serve streamable HTTP on a bound, listening socket until ``stop`` is set.

        With ``token``, every request must carry ``Authorization: Bearer TOKEN`` (else 401, before
        anything else happens); without one the socket must be on a loopback address (``ValueError``
        otherwise). At most ``max_sessions`` sessions live at once (one more gets HTTP 503). A session's
        DELETE is answered once its background tasks have ended (bounded by the executor's kill bound
        plus 1 s). On a loopback address, DNS-rebinding protection admits only loopback ``Host`` and
        ``Origin`` headers. At the stop, open streams get ``shutdown_grace_s`` to end before they are
        cancelled; then every session ends (its tasks are killed).

        At most ``max_connections`` connections are open at once (a new one pushes out the one waiting
        longest for a request's headers, or gets 503 when none waits); a connection must deliver a
        request's headers within ``header_timeout_s`` of being accepted (of the request's first byte, on
        a connection kept alive) and its body within ``body_timeout_s`` of the headers, else it is
        closed (:class:`_GuardedH11`). A request without the token is answered 401 as soon as its
        headers are in, and its connection closed.
        """
        if max_connections < 1 or header_timeout_s <= 0 or body_timeout_s <= 0:
            raise ValueError("max_connections, header_timeout_s and body_timeout_s must be positive")
        host = sock.getsockname()[0]
        if token is None and not _is_loopback(host):
            raise ValueError(_TOKEN_REQUIRED.format(host=host))
        if token is not None:
            _check_token(token, "the token")
        security = None
        if _is_loopback(host):
            shown = f"[{host}]" if ":" in host else host
            hosts = sorted({"127.0.0.1", "localhost", "[::1]", shown})
            security = TransportSecuritySettings(
                enable_dns_rebinding_protection=True,
                allowed_hosts=[f"{name}:*" for name in hosts],
                allowed_origins=[f"http://{name}:*" for name in hosts],
            )
        app = self._server.streamable_http_app(
            streamable_http_path=path,
            session_idle_timeout=session_idle_timeout,
            max_sessions=max_sessions,
            transport_security=security,
            host=host,
        )
        guard = _ConnectionGuard(max_connections, header_timeout_s, body_timeout_s)
        config = uvicorn.Config(
            _Gate(app, token, self, max_sessions),
            http=type("GuardedH11Protocol", (_GuardedH11,), {"guard": guard}),
            ws="none",  # not served (the gate ignores websockets); an upgrade would leave the guard
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=shutdown_grace_s,
            backlog=_ACCEPT_BATCH,
        )
        server = _Uvicorn(config)
        quiet = _QuietShutdown()
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(quiet)
        try:
            async with self._running(), anyio.create_task_group() as tg:
                if stop is not None:

                    async def stop_server() -> None:
                        await stop.wait()
                        quiet.stopping = True
                        server.should_exit = True

                    tg.start_soon(stop_server)
                await server.serve(sockets=[sock])
                tg.cancel_scope.cancel()
        finally:
            uvicorn_log.removeFilter(quiet)


_TOKEN_REQUIRED: Final = (
    "--http {host}: not a loopback address, and no token: give one with --token-file PATH or the "
    f"{TOKEN_ENV} environment variable (every request must then carry 'Authorization: Bearer TOKEN')"
)
_MCP_SESSION_HEADER: Final = b"mcp-session-id"
_UNAUTHORIZED_BODY: Final = (
    b'{"jsonrpc":"2.0","id":null,"error":{"code":-32001,'
    b'"message":"unauthorized: this server needs Authorization: Bearer TOKEN"}}'
)


class _Gate:
    """In front of the SDK's app: the bearer token, then a DELETE answered once its session's tasks ended.

    The token is checked (in constant time) before the request reaches anything else: a request without
    it gets 401 as soon as its headers are in (its body is not read, its connection closed) and creates
    no session and no executor work. The SDK's refusal of a session beyond ``max_sessions`` (503) is
    reworded to name the cap.
    """

    def __init__(
        self, app: ASGIApp, token: str | None, server: BashMcpServer, max_sessions: int | None
    ) -> None:
        self._app = app
        self._token = token.encode() if token is not None else None
        self._server = server
        self._max_sessions = max_sessions

    async def _opening(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request without a session id (one that may open a session): name the cap in a 503."""
        refused = False

        async def reword(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 503:
                refused = True
                text = f"too many open sessions: at most {self._max_sessions} (dsh-bash mcp --max-sessions)"
                error = {"code": types.INTERNAL_ERROR, "message": text}
                body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**message, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            if not refused:
                await send(message)

        await self._app(scope, receive, reword)

    def _authorized(self, scope: Scope) -> bool:
        if self._token is None:
            return True
        values = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, given = values[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(given.strip(), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._app(scope, receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served
        if not self._authorized(scope):
            body = _UNAUTHORIZED_BODY
            challenge = b'Bearer realm="dsh-bash"'
            if any(name == b"authorization" for name, _ in scope.get("headers", ())):
                challenge += b', error="invalid_token"'
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", challenge),
                        # Closed after the answer: the body is never read, and the connection
                        # cannot be kept to try again.
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        session_id = next(
            (
                value.decode("latin-1")
                for name, value in scope.get("headers", ())
                if name == _MCP_SESSION_HEADER
            ),
            None,
        )
        if session_id is None and self._max_sessions is not None:
            await self._opening(scope, receive, send)
            return
        if scope.get("method") != "DELETE":
            await self._app(scope, receive, send)
            return
        session = self._server._by_session_id.get(session_id) if session_id is not None else None
        if session is None:
            await self._app(scope, receive, send)
            return
        # Hold the answer until the session's tasks are gone: a client that saw its DELETE answered
        # knows nothing of its session runs on.
        held: list[Message] = []

        async def hold(message: Message) -> None:
            held.append(message)

        await self._app(scope, receive, hold)
        status = next((m["status"] for m in held if m["type"] == "http.response.start"), None)
        if status is not None and 200 <= status < 300:
            await self._server._await_session_end(session)
        for message in held:
            await send(message)


_BUSY_RESPONSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: 26\r\n\r\ntoo many open connections\n"
)


class _ConnectionGuard:
    """The bounds every HTTP connection of one server is held to (by :class:`_GuardedH11`).

    ``open`` are the connections admitted; ``waiting`` those of them waiting for a request's headers,
    the longest waiting first: the ones a new connection may push out when ``max_connections`` are open.
    """

    def __init__(self, max_connections: int, header_timeout_s: float, body_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.open: set[_GuardedH11] = set()
        self.waiting: dict[_GuardedH11, None] = {}
        self._dropped = self._refused = 0
        self._reported = -_GUARD_REPORT_INTERVAL_S

    def admit(self, connection: _GuardedH11) -> bool:
        """Make room for ``connection`` (pushing out the longest waiting one if need be); False if none."""
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                self._refused += 1
                self._report()
                return False
            self._dropped += 1
            next(iter(self.waiting)).drop()
            self._report()
        self.open.add(connection)
        return True

    def _report(self) -> None:
        """A warning at the first event, then at most one a minute with the counts since the last."""
        now = asyncio.get_running_loop().time()
        if now - self._reported < _GUARD_REPORT_INTERVAL_S:
            return
        log.warning(
            "%d HTTP connections open (the cap): closed %d waiting for their headers, refused %d",
            self.max_connections,
            self._dropped,
            self._refused,
        )
        self._reported, self._dropped, self._refused = now, 0, 0


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with deadlines and a cap (uvicorn has neither a header nor a body timeout).

    A connection is admitted by its ``guard`` when it is accepted, or answered 503 and closed. Once in,
    it is in one of three phases, read from h11's state of the client's side after each batch of data:
    waiting for a request's headers (``IDLE``), waiting for the body (``SEND_BODY``), or neither (the
    request is in; the answer may stream for as long as the tool runs). The first two have a deadline,
    ``header_timeout_s`` and ``body_timeout_s``, after which the connection is aborted. The header
    deadline runs from the accept for a connection's first request; on a connection kept alive after an
    answer, from the first byte of the next request (until then uvicorn's keep-alive timeout closes it,
    as before). A connection waiting for headers is also the one pushed out first when the cap is
    reached. Only the hooks ``connection_made``, ``data_received``, ``handle_events`` and
    ``connection_lost`` are extended; uvicorn's own code runs unchanged.
    """

    guard: ClassVar[_ConnectionGuard]
    _phase: str | None = None
    _deadline: asyncio.TimerHandle | None = None
    _kept_alive = False  # a request has come in on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(_BUSY_RESPONSE)
            transport.close()
            return
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._phase == "headers" and self._deadline is None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.guard.header_timeout_s, self.drop)

    def handle_events(self) -> None:
        super().handle_events()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def drop(self) -> None:
        """Close at once (a deadline passed, or pushed out), without waiting for a write to drain."""
        self._forget()
        self.transport.abort()

    def _forget(self) -> None:
        self._enter(None)
        self.guard.open.discard(self)

    def _track(self) -> None:
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._kept_alive = True
        self._enter("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        self._phase = phase
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.guard.waiting.pop(self, None)
        if phase == "headers":
            self.guard.waiting[self] = None
            if not self._kept_alive:
                self._deadline = self.loop.call_later(self.guard.header_timeout_s, self.drop)
        elif phase == "body":
            self._deadline = self.loop.call_later(self.guard.body_timeout_s, self.drop)


class _QuietShutdown(logging.Filter):
    """Once stopping, drop uvicorn's reports of the streams it cancels: they are the stop, not errors."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping:
            return True
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        return not str(record.msg).startswith("Cancel ")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the caller decides when to stop (``should_exit``).

    Its sockets listen with a longer queue than ``backlog`` (:data:`_LISTEN_QUEUE`), which asyncio
    also takes as the most connections to accept in one turn.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        for sock in sockets or ():
            sock.listen(_LISTEN_QUEUE)


async def _cancel_when(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class _FdLines:
    """Lines of a pollable descriptor (pipe, socket, terminal), read without a worker thread.

    The SDK reads stdin in a worker thread, which a cancellation cannot interrupt: a server told to stop
    by a signal would wait for the client's next line. Polling the descriptor keeps the stop immediate.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._lines: collections.deque[str] = collections.deque()
        self._partial: list[str] = []  # the start of a line whose newline has not arrived (linear cost)
        self._eof = False

    @classmethod
    def for_stdin(cls) -> _FdLines | None:
        """A reader of fd 0 if it can be polled; None (the SDK's own reader) for files and devices."""
        try:
            mode = os.fstat(0).st_mode
        except OSError:
            return None
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(0):
            return cls(0)
        return None

    def __aiter__(self) -> _FdLines:
        return self

    def _feed(self, text: str) -> None:
        *complete, rest = text.split("\n")
        for part in complete:
            self._lines.append("".join([*self._partial, part, "\n"]))
            self._partial.clear()
        if rest:
            self._partial.append(rest)

    async def __anext__(self) -> str:
        while not self._lines:
            if self._eof:
                if self._partial:
                    line = "".join(self._partial)
                    self._partial.clear()
                    return line
                raise StopAsyncIteration
            await anyio.wait_readable(self._fd)
            try:
                chunk = os.read(self._fd, 65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if chunk:
                self._feed(self._decoder.decode(chunk))
            else:
                self._eof = True
                self._feed(self._decoder.decode(b"", final=True))
        return _screen(self._lines.popleft())


def _screen(line: str) -> str:
    """``line``, or, when it is a request nested too deeply for the SDK's parser (which would drop it
    unanswered), a small request with the same id that the server answers with an error: a ``tools/call``
    keeps its tool name and gets ``invalid_arguments``, anything else a JSON-RPC error."""
    if line.count("[") + line.count("{") <= _MAX_LINE_DEPTH:
        return line  # cannot nest deeper: the usual case, at C speed
    pieces: list[str] = []
    depth = kept = 0
    cut: int | None = None
    for match in _JSON_TOKENS.finditer(line):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth == _MAX_LINE_DEPTH + 1:
                cut = match.start()
        elif token in ("]", "}"):
            if depth == _MAX_LINE_DEPTH + 1 and cut is not None:
                pieces += [line[kept:cut], "0"]
                kept, cut = match.end(), None
            depth -= 1
    if not pieces or cut is not None:
        return line  # not too deep, or not JSON: the SDK's to judge
    try:
        message = json.loads("".join([*pieces, line[kept:]]))
    except (ValueError, RecursionError):
        return line
    if not isinstance(message, dict):
        return line
    number, method, params = message.get("id"), message.get("method"), message.get("params")
    if isinstance(number, bool) or not isinstance(number, int | str) or not isinstance(method, str):
        return line  # a notification or a response: nobody waits for an answer
    name = params.get("name") if isinstance(params, dict) else None
    if method == "tools/call" and isinstance(name, str):
        replaced = {"name": name, "arguments": {}, "_meta": {REFUSED_META_KEY: too_deep()}}
        rewritten = {"jsonrpc": "2.0", "id": number, "method": method, "params": replaced}
    else:
        problem = f"{method}: the request is nested too deeply (at most {_MAX_LINE_DEPTH} levels)"
        rewritten = {
            "jsonrpc": "2.0",
            "id": number,
            "method": _REFUSED_METHOD,
            "params": {"_meta": {REFUSED_META_KEY: problem}},
        }
    log.warning("refused request %r (%s): nested too deeply", number, method)
    return json.dumps(rewritten) + "\n"


# -- the command line's entry point ---------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_http_address(text: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[IPV6]:PORT`` → (host, port); the host defaults to ``127.0.0.1``."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        host = "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--http {text!r}: expected [HOST:]PORT") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--http {text!r}: port must be 0-65535")
    return host, port


_MIN_TOKEN_LENGTH: Final = 16


def _check_token(token: str, what: str) -> None:
    """A token is visible ASCII (what an ``Authorization`` header carries), not empty."""
    if not token:
        raise ValueError(f"{what} is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(f"{what}: only visible ASCII characters (no spaces) can be sent as a bearer token")


def _warn_short(token: str) -> None:
    if len(token) < _MIN_TOKEN_LENGTH:
        _say(
            f"WARNING: the token has {len(token)} characters; use a long random one "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The bearer token in the first line of ``path`` (stripped).

    Refused (``ValueError``) when the file is readable or writable by its group or others, empty, or
    holds characters a header cannot carry.
    """
    shown = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            mode = os.fstat(file.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"--token-file {shown}: not a regular file")
            if mode & 0o077:
                raise ValueError(
                    f"--token-file {shown}: its mode {stat.S_IMODE(mode):04o} lets its group or others read "
                    f"or change it: chmod 600 {shown}"
                )
            first = file.readline().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {shown}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--token-file {shown}: not UTF-8 text") from None
    _check_token(first, f"--token-file {shown}: the first line")
    return first


def token_from_environment() -> str | None:
    """The token in ``DSH_MCP_TOKEN`` (stripped), removed from the environment so no command inherits it."""
    raw = os.environ.pop(TOKEN_ENV, None)
    if raw is None:
        return None
    token = raw.strip()
    _check_token(token, f"the {TOKEN_ENV} environment variable")
    return token


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc}") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(_LISTEN_QUEUE)
    except OSError:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket, path: str) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"dsh-bash mcp: {message}\n")
        sys.stderr.flush()


async def _serve(
    config: str,
    *,
    http: tuple[str, int] | None,
    background: bool,
    max_running: int,
    max_running_total: int | None,
    max_sessions: int | None,
    token: str | None,
    idle_timeout: float | None,
    received: list[int],
) -> None:
    executor = load_executor(config)
    sock = _bind(*http) if http is not None else None
    if sock is not None and token is None and not _is_loopback(sock.getsockname()[0]):
        sock.close()
        assert http is not None
        raise ValueError(_TOKEN_REQUIRED.format(host=http[0]))
    stop = anyio.Event()

    async def watch(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            received.append(signum)
            stop.set()

    try:
        # Signals are received (not acted on by default handlers) until the executor is closed: a second
        # SIGTERM during the close must not kill the process and orphan what the close is still killing.
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with executor, anyio.create_task_group() as tg:
                tg.start_soon(watch, signals)
                server = BashMcpServer(
                    executor,
                    background=background,
                    max_running=max_running,
                    max_running_total=max_running_total,
                )
                if sock is None:
                    await server.serve_stdio(stop=stop)
                else:
                    if token is None:
                        _say(
                            "WARNING: no token (--token-file or "
                            f"{TOKEN_ENV}): any local user can reach this port and run commands"
                        )
                    else:
                        _warn_short(token)
                    _say(f"serving {_url(sock, '/mcp')}")
                    await server.serve_http(
                        sock,
                        stop=stop,
                        token=token,
                        max_sessions=max_sessions,
                        session_idle_timeout=idle_timeout,
                    )
                tg.cancel_scope.cancel()
    finally:
        if sock is not None:
            sock.close()


def run_server(
    config: str,
    *,
    http: str | None = None,
    background: bool = True,
    max_running: int = 10,
    max_running_total: int | None = None,
    max_sessions: int | None = DEFAULT_MAX_SESSIONS,
    token: str | None = None,
    session_idle_timeout: float | None = DEFAULT_SESSION_IDLE_TIMEOUT_S,
) -> int:
    """Serve until stopped; return the exit status (0, or 130 after SIGINT). Errors propagate.

    ``max_running_total`` defaults to ``4 x max_running``. With ``http``, ``token`` is the bearer token
    every request must carry; it is required unless ``http`` is a loopback address.
    """
    address = parse_http_address(http) if http is not None else None
    if max_running_total is None:
        max_running_total = DEFAULT_TOTAL_FACTOR * max_running
    received: list[int] = []
    try:
        main = functools.partial(
            _serve,
            config,
            http=address,
            background=background,
            max_running=max_running,
            max_running_total=max_running_total,
            max_sessions=max_sessions,
            token=token,
            idle_timeout=session_idle_timeout,
            received=received,
        )
        anyio.run(main, backend="asyncio")
    except BaseExceptionGroup as group:
        raise _sole(group) from None
    return 130 if signal.SIGINT in received else 0


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside nested single-member groups, or the group itself."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
        inner = inner.exceptions[0]
    return inner
