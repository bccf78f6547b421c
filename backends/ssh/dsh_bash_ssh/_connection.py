"""One asyncssh connection, reconnected on demand, and the bounded channels opened on it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import anyio
import anyio.to_thread
import asyncssh
from asyncssh.constants import OPEN_REQUEST_SESSION_FAILED
from asyncssh.sftp import MIN_SFTP_VERSION
from asyncssh.sftp import start_sftp_client as _start_sftp_client

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import AtMostEvery, InfraReason, while_watching
from dsh_bash.supervisor import CONTINUE_SUPERVISOR

from ._host_keys import Hop, HostKeyPlan, jump_hops, plan_host_keys
from ._scripts import SCRIPT_BEGIN, SFTP_SERVER, cmdline
from ._ssh_config import SshConfig

__all__ = ["Channel", "ChannelPool", "RequestRefused", "ScriptResult", "SlotSession"]

log = logging.getLogger("dsh_bash.ssh")


#: The ciphers offered, in order: asyncssh's defaults with AES-GCM first. Its chacha20-poly1305 makes
#: five cipher contexts per packet in Python, AES-GCM one call (hardware AES on x86-64 and arm64):
#: the harness's CPU is what bounds an SSH command's output rate. (``use_user_ssh_config``: the
#: config's ``Ciphers`` decide.)
CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes256-ctr",
    "aes192-ctr",
    "aes128-ctr",
)


class RequestRefused(BashInfrastructureError):
    """The server opened the channel but refused what it was for (a subsystem it does not offer)."""


class SlotSession(asyncssh.SSHClientSession[bytes]):
    """A session that holds one slot of the pool until its channel is closed (by either side).

    Subclasses override the asyncssh callbacks and call ``super().connection_lost``.
    """

    def __init__(self) -> None:
        self._slot: anyio.Semaphore | None = None
        self.lost_channel = False
        self.chan: asyncssh.SSHClientChannel[bytes] | None = None

    def _hold(self, slot: anyio.Semaphore) -> None:
        self._slot = slot

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:
        self.chan = chan

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_channel = True
        self.free_slot()

    def free_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


SessionT = TypeVar("SessionT", bound=SlotSession)
T = TypeVar("T")
#: How long a refused channel open is retried while the connection itself is fine.
_REFUSED_RETRY_S = 2.0

#: A helper script that has not ended after this long may be held by a stopped server: the login's
#: own ``sshd`` session process (``sshd: USER@notty``) runs as the login user, so a command can stop
#: it (``kill -STOP -1``), and then no channel of the connection moves any more.
_STALL_S = 1.0
#: The least time between two thaws.
_THAW_EVERY_S = 1.0
#: The most a thaw (a new connection, one script) may take.
_THAW_BOUND_S = 10.0
#: The most a run of CONTINUE_SUPERVISOR may take (a kill script's bound).
_CONTINUE_BOUND_S = 10.0

#: Run on a fresh connection when the executor's own stalls: SIGCONT to every stopped process of the
#: login that is an ``sshd`` session process, a ``dsh-supervise``, a channel's process (a child of
#: one of the login's ``sshd`` processes: a warm channel's shell, say), or a child of a channel's
#: process in that process's own group (the ``stat`` a warm channel's shell checks the supervisor
#: with before it execs it). None of them is ever meant to be stopped: a user's own stopped jobs are
#: in process groups of their own (job control), or under a supervisor; processes of other users
#: cannot be signalled anyway. Prints how many it continued.
THAW = r"""
declare -A name=() parent=() group=()
stopped=()
for dir in /proc/[0-9]*; do
    read -r stat 2>/dev/null < "$dir/stat" || continue
    pid=${dir#/proc/}
    comm=${stat#*(}
    name[$pid]=${comm%%)*}
    fld=(${stat##*) })
    parent[$pid]=${fld[1]}
    group[$pid]=${fld[2]}
    [ "${fld[0]}" = T ] && stopped+=("$pid")
done
n=0
for pid in "${stopped[@]}"; do
    up=${parent[$pid]}
    case ${name[$pid]}/${name[$up]-} in
    sshd*|dsh-supervise*|*/sshd*) ;;
    */|*/dsh-supervise*) continue ;;
    *)
        [ "${group[$pid]}" = "${group[$up]}" ] || continue
        case ${name[${parent[$up]}]-} in sshd*) ;; *) continue ;; esac
        ;;
    esac
    kill -CONT "$pid" 2>/dev/null && n=$((n+1))
done
echo "$n"
"""
#: How deep ProxyJump hops of ~/.ssh/config may nest (a jump host's own first hop, and so on).
_MAX_JUMP_DEPTH = 8


class Channel:
    """An SSH session channel running one process, holding one slot of the pool until released."""

    def __init__(self, process: asyncssh.SSHClientProcess[bytes], slot: anyio.Semaphore) -> None:
        self.process = process
        self._slot: anyio.Semaphore | None = slot

    async def close(self, wait_s: float = 2.0) -> None:
        """Close the channel (if still open) and free its slot. Idempotent."""
        try:
            self.process.close()
            with anyio.move_on_after(wait_s):
                await self.process.wait_closed()
        except Exception as exc:  # a dead connection: nothing left to close
            log.debug("closing a channel: %r", exc)
        finally:
            slot, self._slot = self._slot, None
            if slot is not None:
                slot.release()


ScriptResult = tuple[int, bytes, bytes]


class ChannelPool:
    """The executor's connection and its channel budget.

    ``max_channels - 1`` slots serve commands, spill writers and helper scripts; one more is kept
    for kills, so a kill never waits behind running commands.
    """

    def __init__(self, config: SshConfig) -> None:
        self._config = config
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lock = anyio.Lock()
        self._slots = anyio.Semaphore(config.max_channels - 1)
        self._kill_slot = anyio.Semaphore(1)
        self._closed = False
        self.where = f"{config.username}@{config.host}:{config.port}"
        #: Called after every reconnection (not the first connect).
        self.on_reconnect: Callable[[], None] | None = None
        #: Called when a slot is wanted and none is free: closes an idle warm channel, if any.
        self.reclaim: Callable[[], None] | None = None
        #: The server offers no SFTP subsystem: SFTP goes over an exec channel (see open_sftp).
        self.sftp_over_exec = False
        #: The login's variable names helper scripts keep (space-separated), under the executor's
        #: policy as it is now (``reconfigure`` may change it); set once SETUP told the login's
        #: environment: from then on every helper starts with the scrubbed environment.
        self.helper_keep: Callable[[], str] | None = None
        #: The warnings about ~/.ssh/config's host-key settings said already (once per pool).
        self._said: set[str] = set()
        #: Continues the login's stopped processes from a second connection, at most once a second.
        self.thaw = AtMostEvery(self._thaw_now, every_s=_THAW_EVERY_S)

    # -- the connection ---------------------------------------------------------------------------

    def _options(self) -> dict[str, Any]:
        """The target's options but for host keys and the tunnel (see :meth:`_connect_one`)."""
        config = self._config
        options: dict[str, Any] = {
            "port": config.port,
            "username": config.username,
            "connect_timeout": config.connect_timeout_ms / 1000,
            "keepalive_interval": config.keepalive_interval_ms / 1000,
            "keepalive_count_max": 3,
        }
        if not config.use_user_ssh_config:
            options["config"] = None
            options["encryption_algs"] = list(CIPHERS)
            options["agent_path"] = config.agent_path
            options["client_keys"] = list(config.client_keys) if config.client_keys else ()
        else:
            if config.agent_path is not None:
                options["agent_path"] = config.agent_path
            if config.client_keys:
                options["client_keys"] = list(config.client_keys)
        return options

    def _hop_options(self, hop: Hop) -> dict[str, Any]:
        """A jump host's options: what ``~/.ssh/config`` says for it (as asyncssh's own ProxyJump
        would), with this config's timeouts; host keys and the tunnel as for the target."""
        config = self._config
        options: dict[str, Any] = {
            "connect_timeout": config.connect_timeout_ms / 1000,
            "keepalive_interval": config.keepalive_interval_ms / 1000,
            "keepalive_count_max": 3,
        }
        if hop.port is not None:
            options["port"] = hop.port
        if hop.username is not None:
            options["username"] = hop.username
        return options

    def _say(self, plan: HostKeyPlan) -> None:
        """Warn (once per pool) of each ``~/.ssh/config`` setting about host keys not honoured."""
        for ignored in plan.ignored:
            message = f"{ignored}; {plan.address}'s host key is verified against {plan.against}"
            if message not in self._said:
                self._said.add(message)
                log.warning("%s", message)

    async def _connect(self) -> asyncssh.SSHClientConnection:
        config = self._config
        if config.insecure_skip_host_key_check:
            log.warning(
                "connecting to %s WITHOUT verifying its host key (insecure_skip_host_key_check=True)",
                self.where,
            )
        return await self._reach(Hop(config.host, config.port, config.username), None, True, 0)

    async def _reach(
        self, hop: Hop, via: asyncssh.SSHClientConnection | None, follow_jump: bool, depth: int
    ) -> asyncssh.SSHClientConnection:
        """Connect to ``hop`` (the target at depth 0), through ``via`` or, with ``follow_jump``,
        through the ProxyJump hops ``~/.ssh/config`` gives it: each verified as the target is
        (asyncssh's own ProxyJump would open them with ``~/.ssh/config`` alone)."""
        config = self._config
        target = depth == 0
        try:
            plan = await anyio.to_thread.run_sync(
                functools.partial(
                    plan_host_keys,
                    hop,
                    known_hosts=config.known_hosts,
                    insecure=config.insecure_skip_host_key_check,
                    use_user_ssh_config=config.use_user_ssh_config,
                )
            )
            hops = jump_hops(plan.jump) if follow_jump and plan.jump is not None else []
        except (ValueError, OSError) as exc:  # an unreadable ~/.ssh/config or ProxyJump
            subject = self.where if target else f"jump host {hop}"
            raise BashInfrastructureError(f"SSH connection to {subject} not attempted: {exc}") from None
        self._say(plan)
        if hops and depth >= _MAX_JUMP_DEPTH:
            raise BashInfrastructureError(
                f"SSH connection to {self.where} not attempted: ProxyJump in ~/.ssh/config goes more "
                f"than {_MAX_JUMP_DEPTH} jump hosts deep (a loop?)"
            )
        tunnel = via
        opened: asyncssh.SSHClientConnection | None = None
        try:
            for index, jump in enumerate(hops):
                conn = await self._reach(jump, opened, index == 0, depth + 1)
                if opened is not None:
                    conn.set_tunnel(opened)  # closed with it
                opened = tunnel = conn
            conn = await self._connect_one(hop, plan, tunnel, target)
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        if opened is not None:
            conn.set_tunnel(opened)
        return conn

    async def _connect_one(
        self, hop: Hop, plan: HostKeyPlan, tunnel: asyncssh.SSHClientConnection | None, target: bool
    ) -> asyncssh.SSHClientConnection:
        config = self._config
        options = self._options() if target else self._hop_options(hop)
        # Always given, never left to ~/.ssh/config (whose ``UserKnownHostsFile none`` would mean
        # no checking at all), and the tunnel too (asyncssh opens a config's ProxyJump with the
        # config alone).
        options["known_hosts"] = plan.known_hosts
        options["tunnel"] = tunnel
        if not (config.use_user_ssh_config and config.known_hosts is None):
            # No X.509 trust anchors from ~/.ssh/ca-bundle.crt or ~/.ssh/crt beside known_hosts.
            options["x509_trusted_certs"] = []
            options["x509_trusted_cert_paths"] = []
        target_at = f"{config.host}:{config.port}"
        if target:
            host_port, where, reach = target_at, self.where, f"SSH host {target_at}"
        else:
            alias = "" if plan.address.startswith(f"{hop.host}:") else f" ({hop.host})"
            host_port = f"jump host {plan.address}{alias} on the way to {target_at}"
            where = reach = host_port
        try:
            return await asyncssh.connect(hop.host, **options)
        except asyncssh.HostKeyNotVerifiable as exc:
            ignored = "".join(f"; not honoured: {item}" for item in plan.ignored)
            raise BashInfrastructureError(
                f"host key verification failed for {host_port}: {exc.reason} "
                f"(known_hosts: {plan.against}{ignored})",
                reason="host_key_rejected",
            ) from None
        except asyncssh.PermissionDenied as exc:
            raise BashInfrastructureError(
                f"authentication failed for {where}: {exc.reason}", reason="auth_failed"
            ) from None
        except asyncssh.ConnectionLost as exc:
            raise BashInfrastructureError(
                f"SSH connection to {where} failed: {exc.reason}", reason="connection_lost"
            ) from None
        except asyncssh.DisconnectError as exc:
            raise BashInfrastructureError(f"SSH connection to {where} failed: {exc.reason}") from None
        except TimeoutError:
            # asyncssh's connect_timeout covers the TCP connect, the handshake and the login; its
            # own message is empty.
            seconds = config.connect_timeout_ms / 1000
            raise BashInfrastructureError(
                f"no SSH session with {host_port} within {seconds:g} s "
                f"(connect_timeout_ms={config.connect_timeout_ms:g}): the host accepted no connection "
                "or the server never finished the SSH handshake and login (packets dropped, a stuck or "
                "overloaded sshd); raise connect_timeout_ms for a slow link",
                reason="host_unreachable",
            ) from None
        except OSError as exc:  # DNS, refused, unreachable
            raise BashInfrastructureError(
                f"cannot reach {reach}: {type(exc).__name__}: {exc}",
                reason="host_unreachable",
            ) from None
        except asyncssh.Error as exc:
            raise BashInfrastructureError(f"cannot reach {reach}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # unreadable keys or known_hosts
            raise BashInfrastructureError(f"SSH connection to {where} not attempted: {exc}") from None

    async def connection(self) -> asyncssh.SSHClientConnection:
        """The live connection; connects (again, after a drop) when there is none."""
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        async with self._lock:
            if self._closed:
                raise BashInfrastructureError(f"the connection to {self.where} is closed", reason="closed")
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            reconnecting = self._conn is not None
            if reconnecting:
                log.warning("the SSH connection to %s was lost; reconnecting", self.where)
            self._conn = await self._connect()
            if reconnecting and self.on_reconnect is not None:
                self.on_reconnect()
            return self._conn

    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            with anyio.move_on_after(2):
                await conn.wait_closed()

    # -- channels -------------------------------------------------------------------------------------

    async def _create(self, create: Callable[[asyncssh.SSHClientConnection], Awaitable[T]]) -> T:
        """Open a channel with ``create``: reconnect once if the connection dropped under us, and retry
        briefly when the server refuses while the connection is fine: sshd frees a closed session
        only after the packets that arrived with its close (the next open among them) are handled.
        """
        reconnected = False
        deadline = anyio.current_time() + _REFUSED_RETRY_S
        delay = 0.005
        while True:
            conn = await self.connection()
            try:
                return await create(conn)
            except (
                asyncssh.ChannelOpenError,
                asyncssh.ConnectionLost,
                asyncssh.DisconnectError,
                OSError,
            ) as exc:
                if conn.is_closed():
                    if not reconnected:
                        reconnected = True
                        continue
                elif (
                    isinstance(exc, asyncssh.ChannelOpenError)
                    and exc.code == asyncssh.OPEN_CONNECT_FAILED
                    and anyio.current_time() < deadline
                ):
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.1)
                    continue
                reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
                if (
                    isinstance(exc, asyncssh.ChannelOpenError)
                    and exc.code == OPEN_REQUEST_SESSION_FAILED
                    and not conn.is_closed()
                ):
                    raise RequestRefused(
                        f"{self.where} refused the session request: {reason}", reason="start_failed"
                    ) from None
                # The connection is up and refused the channel, or it dropped (again).
                refused = isinstance(exc, asyncssh.ChannelOpenError) and not conn.is_closed()
                raise BashInfrastructureError(
                    f"cannot open an SSH channel on {self.where}: {reason}",
                    reason="start_failed" if refused else "connection_lost",
                ) from None

    def try_reserve(self) -> bool:
        """Take a command slot if one is free right now (for :meth:`open_session` ``reserved``)."""
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            return False
        return True

    async def _acquire(self, slot: anyio.Semaphore) -> None:
        if slot is self._slots and slot.value == 0 and self.reclaim is not None:
            self.reclaim()  # its slot comes back once the warm channel closed
        await slot.acquire()

    async def open(self, command_line: str, *, kill: bool = False) -> Channel:
        """Open a channel running ``command_line`` (through the login shell); waits for a free slot."""
        slot = self._kill_slot if kill else self._slots
        await self._acquire(slot)
        try:
            process = await self._create(lambda conn: conn.create_process(command_line, encoding=None))
        except BaseException:
            slot.release()
            raise
        return Channel(process, slot)

    async def open_session(
        self, command_line: str, factory: Callable[[], SessionT], *, reserved: bool = False
    ) -> SessionT:
        """Open a channel running ``command_line`` with a session object taking its data as it comes.

        The session holds a slot until the channel closes (its ``connection_lost``); ``reserved``:
        the caller took it already (:meth:`try_reserve`).
        """
        if not reserved:
            await self._acquire(self._slots)
        try:
            _, opened = await self._create(
                lambda conn: conn.create_session(factory, command_line, encoding=None)
            )
        except BaseException:
            self._slots.release()
            raise
        session = cast(SessionT, opened)  # the factory's own object
        session._hold(self._slots)
        if session.lost_channel:
            session.free_slot()  # closed before the slot was handed over
        return session

    async def open_sftp(self) -> asyncssh.SFTPClient:
        """The SFTP channel following detached tasks. It takes no slot: a slot held for as long
        as background tasks run would leave none to start another with ``max_channels=2``. So the
        connection has at most ``max_channels + 1`` sessions, within the server's ``MaxSessions``
        when ``max_channels`` is below it, as advised.

        A server that offers no SFTP subsystem refuses it (:class:`RequestRefused`); then, with
        ``exec_sftp_server``, the host's sftp-server program runs over an exec channel instead
        (remembered for later opens). :class:`RequestRefused` when neither works.
        """
        if not self.sftp_over_exec:
            try:
                return await self._create(lambda conn: conn.start_sftp_client())
            except RequestRefused as exc:
                if not self._config.exec_sftp_server:
                    raise
                log.warning(
                    "%s offers no SFTP subsystem (%s): running its sftp-server over an exec channel",
                    self.where,
                    exc,
                )
                self.sftp_over_exec = True
        return await self._create(self._exec_sftp)

    async def _exec_sftp(self, conn: asyncssh.SSHClientConnection) -> asyncssh.SFTPClient:
        """An SFTP client over an exec channel running the host's sftp-server (see SFTP_SERVER)."""
        writer, reader, errors = await conn.open_session(
            self.helper_line(SFTP_SERVER, begin_marker=False), encoding=None
        )
        try:
            with anyio.fail_after(self._config.connect_timeout_ms / 1000):
                await reader.readuntil(SCRIPT_BEGIN)  # rc noise before it is not SFTP
        except (asyncssh.Error, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            detail = ""
            with contextlib.suppress(Exception), anyio.move_on_after(1):
                detail = (await errors.read(4096)).decode("utf-8", "replace").strip()
            writer.close()
            raise RequestRefused(
                f"{self.where} offers no SFTP subsystem, and running its sftp-server failed: "
                f"{detail or type(exc).__name__}",
                reason="start_failed",
            ) from None
        # asyncssh starts its SFTP client on any pair of streams; its public entry point only
        # opens the subsystem. Its own loop and decoding settings, as start_sftp_client passes them.
        return await _start_sftp_client(
            conn,
            conn._loop,
            conn._utf8_decode_errors,
            reader,
            writer,
            "utf-8",
            "strict",
            MIN_SFTP_VERSION,
        )

    def helper_line(self, script: str, *args: str, begin_marker: bool = True) -> str:
        """The command line of a helper script, with the scrubbed environment once it is known."""
        keep = None if self.helper_keep is None else self.helper_keep()
        return cmdline(script, *args, begin_marker=begin_marker, keep=keep)

    async def run_script(
        self, script: str, *args: str, stdin: bytes | None = None, kill: bool = False
    ) -> ScriptResult:
        """Run a helper script to its end: (exit status, its stdout after the begin marker, stderr).

        A script that has not ended after ``_STALL_S`` may wait on a stopped server process of the
        connection: meanwhile :meth:`thaw` continues it from a fresh connection."""

        async def thaw_if_stalled() -> None:
            await anyio.sleep(_STALL_S)
            await self.thaw()

        return await while_watching(
            lambda: self._run_script(script, *args, stdin=stdin, kill=kill), thaw_if_stalled
        )

    async def continue_supervisors(self) -> None:
        """Run :data:`CONTINUE_SUPERVISOR` over the kill channel: every stopped supervisor of the
        login is continued (a command may have stopped its own, or a warm channel's, which would
        leave every request unheard). Shielded: a script cancelled half-way keeps its server
        session until it exits; bounded like a kill."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CONTINUE_BOUND_S):
            await self.run_script(CONTINUE_SUPERVISOR, kill=True)

    async def _thaw_now(self) -> None:
        """Continue the login's stopped ``sshd`` session processes and supervisors from a fresh
        connection (the executor's own may be the one stopped). Through ``self.thaw``: at most once a
        second. Bounded; failures are logged: the caller's own deadline decides what it gives up."""
        if self._closed:
            return
        conn: asyncssh.SSHClientConnection | None = None
        try:
            with anyio.move_on_after(_THAW_BOUND_S):
                conn = await self._connect()
                done = await conn.run(self.helper_line(THAW), check=False, encoding=None)
                stdout = done.stdout if isinstance(done.stdout, bytes) else b""
                continued = stdout.rpartition(SCRIPT_BEGIN)[2].decode("ascii", "replace").strip()
                if continued not in ("", "0"):
                    log.warning(
                        "%s: %s stopped process(es) of the login (sshd sessions, supervisors, "
                        "channels) continued from a second connection",
                        self.where,
                        continued,
                    )
        except Exception as exc:
            log.warning(
                "%s: continuing stopped processes from a second connection failed: %s", self.where, exc
            )
        finally:
            if conn is not None:
                conn.close()
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await conn.wait_closed()

    async def _run_script(
        self, script: str, *args: str, stdin: bytes | None = None, kill: bool = False
    ) -> ScriptResult:
        channel = await self.open(self.helper_line(script, *args), kill=kill)
        try:
            process = channel.process
            if stdin is not None:
                process.stdin.write(stdin)
            process.stdin.write_eof()
            out, err = bytearray(), bytearray()

            async def drain(reader: asyncssh.SSHReader[bytes], into: bytearray) -> None:
                while chunk := await reader.read(1 << 16):
                    into += chunk

            try:
                # Helper scripts write little to stderr: reading it after stdout cannot stall the channel.
                await drain(process.stdout, out)
                await drain(process.stderr, err)
                await process.wait_closed()
            except (asyncssh.Error, OSError) as exc:
                raise BashInfrastructureError(
                    f"the connection to {self.where} failed: {exc}", reason="connection_lost"
                ) from None
            status = process.exit_status
            begin = out.find(SCRIPT_BEGIN)
            if begin < 0:
                detail = bytes(err).decode("utf-8", "replace").strip()
                reason: InfraReason = "unclassified"
                if status == 127:  # the login shell found no bash to run the script with
                    reason = "shell_missing"
                elif status is None and not self.connected():
                    reason = "connection_lost"
                raise BashInfrastructureError(
                    f"a helper script did not start on {self.where} (exit {status}): {detail or 'no output'}",
                    reason=reason,
                )
            return (status if status is not None else -1), bytes(out[begin + len(SCRIPT_BEGIN) :]), bytes(err)
        finally:
            with anyio.CancelScope(shield=True):
                await channel.close()
