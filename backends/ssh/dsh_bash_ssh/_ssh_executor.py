"""The SSH backend: every command a fresh bash started over a session channel of one connection."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Self

import anyio

from dsh_bash import BashExecutor, BashInfrastructureError
from dsh_bash.backend import (
    MARKER_VAR,
    MAX_INLINE_COMMAND,
    MODEL_FRIENDLY_ENV,
    CommandProcess,
    ConfinementProbe,
    Containment,
    EgressRoute,
    InfraReason,
    Killable,
    Launch,
    SpillFile,
    SupervisedCommand,
    SupervisedLeftovers,
    SupervisorInstall,
    choose_containment,
    dropped_names,
    kill_abandoned_start,
    prepay_spills,
    refuse_other_user,
)
from dsh_bash.remote import (
    CommandSpills,
    ascii_quote,
    spill_file_path,
)
from dsh_bash.supervisor import (
    CONFINE_FROM_SUPERVISOR,
    SUPERVISOR_KEY_SIZE,
    confine_probe_argv,
    confinement_from_probe,
    continue_runs,
)

from ._connection import ChannelPool
from ._detached import DetachedProcess, DetachedSpill, DetachedSupervisors, Follower
from ._egress import RemoteEgress
from ._files import RemoteFiles
from ._framed_channel import FramedSshProcess
from ._hints import INFRA_HINTS
from ._process import CommandSession, RemoteMarked, SshProcess, SupervisorMissing
from ._scripts import SETUP, SETUP_END, SETUP_HOME, boot_line, boot_request, warm_line
from ._spill import SshSpillFile
from ._ssh_config import SshConfig
from ._ssh_kit_hooks import find_open_leftovers, find_remote_processes, kit_notes, plant_in_bashrc
from ._supervisor import install_supervisor
from ._warm import WarmChannel

__all__ = ["SshBashExecutor"]

log = logging.getLogger("dsh_bash.ssh")

_SPILL_FLUSH_BOUND_S = 30.0
#: How long a refused start's reason may trail its exit status on the channel.
_REASON_BOUND_S = 2.0
#: How long a detached task's dsh-supervise may take to detach once BOOT said it runs.
_DETACH_BOUND_S = 30.0
#: Variables of the setup script's own shell, not of the login.
_NOT_AMBIENT = frozenset({"_", "BASH_ENV", "ENV"})


def parse_setup(out: bytes) -> tuple[dict[str, str], str, str, str]:
    """(environment, home, spill directory, machine) from the setup script's output."""
    home_at = out.find(SETUP_HOME)
    end_at = out.find(SETUP_END, home_at + 1)
    if home_at < 0 or end_at < 0:
        raise ValueError("incomplete setup output")
    env: dict[str, str] = {}
    for entry in out[:home_at].split(b"\0"):
        name, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if sep and name not in _NOT_AMBIENT:
            env[name] = value
    home = out[home_at + len(SETUP_HOME) : end_at].rstrip(b"\0\n").decode("utf-8", "surrogateescape")
    spill_part, _, machine = out[end_at + len(SETUP_END) :].partition(b"\0")
    spill_dir = spill_part.strip().decode("utf-8", "surrogateescape")
    return env, home, spill_dir, machine.strip().decode("utf-8", "replace")


class SshBashExecutor(BashExecutor[SshConfig]):
    """Runs each command as ``bash --noprofile --norc -c -- COMMAND`` on an SSH host. asyncio only."""

    config_class = SshConfig
    infra_hints = INFRA_HINTS  # what dsh-bash doctor says to do, by error reason (_hints.py)

    #: Every look at processes is a KILL script over the one reserved kill channel: at aclose, one
    #: kill sequence over all commands' leftovers instead of one per command queued on that channel.
    close_kills_each_command = False

    def __init__(self, config: SshConfig) -> None:
        super().__init__(config)
        self._ssh_config = config
        self._pool = ChannelPool(config)
        self._pool.on_reconnect = self._reconnected
        self._warm = WarmChannel(
            self._pool,
            self._start_helper,
            line=lambda: warm_line(self._supervisor, self._supervisor_check),
            enabled=config.warm_channel,
        )
        self._pool.reclaim = self._warm.reclaim
        #: Commands whose kill could not reach the host, by marker: killed once it is back.
        self._unreached: dict[str, RemoteMarked] = {}
        self._home = "/"
        self._ambient: dict[str, str] = {}
        self._spill_dir = ""
        self._spills = CommandSpills(self._start_helper, _SPILL_FLUSH_BOUND_S)
        self._follower = Follower(self._pool, self._start_helper)
        self._files = RemoteFiles(self._pool)
        self._egress = RemoteEgress(self._pool, self._start_helper)
        #: Whether background tasks run detached: None until the first one asks the server (SFTP).
        self._detach: bool | None = None
        self._detach_lock = anyio.Lock()
        #: Background tasks attached to a channel (the server offers no SFTP), by marker.
        self._attached: set[str] = set()
        #: Detached tasks by marker: their files' base path and their streams' spill files.
        self._detached: dict[str, tuple[str, dict[str, DetachedSpill]]] = {}
        self._supervisor: str | None = None  # dsh-supervise's path on the host
        #: BOOT's look at that file before each exec of it: the host's stat program and the file's
        #: identity at install (issue 30: a command can replace it); None: only that it is there.
        self._supervisor_check: tuple[str, str] | None = None
        self._machine = ""  # the host's `uname -m`
        #: Commands whose supervisor still runs (leftovers included); detached tasks apart, as one.
        self._supervised: set[SupervisedCommand] = set()
        #: Continues of stopped supervisors, one at a time for all commands (one login: one user).
        self._continues = continue_runs(self._pool.continue_supervisors)
        self._detached_supervisors = DetachedSupervisors(self._pool)

    @property
    def containment(self) -> Containment:
        """``subreaper`` when commands (foreground and detached background tasks) run under
        dsh-supervise on the host, else ``marker``."""
        return "subreaper" if self._supervisor is not None else "marker"

    @property
    def home(self) -> str:
        """The login's home directory, learned at connect."""
        return self._home

    @property
    def spill_dir(self) -> str:
        """The private directory on the host holding this executor's spill files."""
        return self._spill_dir

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self._warm.warm()  # the first command's: it logs in while the caller gets ready
        return self

    async def warm_up(self) -> bool:
        """Wait until a channel is logged in for the next command (see ``warm_channel``). One starts
        logging in when the executor opens and whenever a command takes the last one. False when
        there is none to wait for (``warm_channel=False``, or every channel is busy)."""
        self._ensure_open()
        return await self._warm.ready()

    # -- opening and closing ------------------------------------------------------------------------

    async def _open(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise BashInfrastructureError(
                "the SSH backend needs asyncio (asyncssh is asyncio-only); run it under asyncio, not trio"
            ) from None
        # When anything below fails, the base class runs _release: it removes the spill directory
        # SETUP made (once its path is known) and closes the connection.
        code, out, err = await self._pool.run_script(SETUP)
        # SETUP fails (exit 1) only when it cannot make or write the spill directory.
        reason: InfraReason = "spill_unavailable"
        try:
            if code != 0:
                raise ValueError(f"exit status {code}")
            reason = "unclassified"
            self._ambient, self._home, self._spill_dir, machine = parse_setup(out)
            self._pool.helper_keep = self._helper_keep
            self._follower.directory = self._spill_dir
            if not self._spill_dir.startswith("/"):
                reason = "spill_unavailable"
                raise ValueError("no spill directory")
        except ValueError as exc:
            detail = err.decode("utf-8", "replace").strip()
            raise BashInfrastructureError(
                f"setting up on {self._pool.where} failed ({exc}): {detail or 'no error output'}",
                reason=reason,
            ) from None
        self._machine = machine
        await self._install_supervisor(machine)

    async def _install_supervisor(self, machine: str) -> None:
        config = self._ssh_config
        install = SupervisorInstall(None, "containment = 'marker'")
        check = None
        if config.containment != "marker":
            installed = await install_supervisor(self._pool, self._home, machine)
            install, check = installed.install, installed.check
        self._supervisor = choose_containment(
            config.containment, install.path, install.problem, self._pool.where
        )
        self._supervisor_check = check if self._supervisor is not None else None

    async def _release(self) -> None:
        self._warm.close()
        self._follower.close()
        self._files.close()
        self._egress.close()
        if self._spill_dir.startswith("/"):  # a failed open may have parsed no path, or a bad one
            try:
                with anyio.move_on_after(5):
                    await self._pool.run_script('rm -rf -- "$1"', self._spill_dir)
            except (BashInfrastructureError, OSError) as exc:
                log.warning("removing the spill directory %s failed: %s", self._spill_dir, exc)
        await self._pool.aclose()

    # -- hooks ---------------------------------------------------------------------------------------

    def _default_cwd(self) -> str:
        return self._config.cwd or self._home

    def _ambient_env(self) -> Mapping[str, str]:
        return self._ambient

    def _helper_keep(self) -> str:
        """The login's names a helper script keeps under the policy now (space-separated)."""
        config = self._config
        dropped = set(dropped_names(self._ambient, scrub=config.env_scrub, allow=config.env_allow))
        return " ".join(name for name in self._ambient if name not in dropped)

    def _plan(self, launch: Launch, nonce: str, mode: str) -> _Boot:
        """How BOOT gets its arguments and the command's environment, cold or warm.

        On a cold channel only names, the command text and the library's own constant values are
        arguments (its command line shows them); a value from the login's or the caller's
        environment travels in the header on stdin. A warm channel's request is stdin itself: it
        carries the whole environment.
        """
        spec = launch.spec
        env = dict(launch.env)
        marker = env.pop(MARKER_VAR)
        shell_level = env.get("SHLVL", "")
        if shell_level.isdigit():
            # BOOT's `exec` lowers SHLVL by one and the command's bash raises it again: the command
            # sees its parent's level plus one, as a child shell does (a bash at level 1 under sshd
            # would read ~/.bashrc in every nested `bash -c`).
            env["SHLVL"] = str(int(shell_level) + 1)
        ambient = self._ambient
        keep: list[str] = []
        public: list[str] = []
        secret: list[bytes] = []
        for name, value in env.items():
            if ambient.get(name) == value:
                keep.append(name)
            elif MODEL_FRIENDLY_ENV.get(name) == value or (name == "SHLVL" and value.isdigit()):
                public.append(f"{name}={value}")
            else:
                secret.append(f"{name}={value}".encode("utf-8", "surrogateescape"))

        def args(command: str, header: bool) -> tuple[str, ...]:
            return (
                self._spill_dir,
                nonce,
                mode,
                command,
                spec.workdir,
                marker,
                # Input comes (data or open input; only data for a detached task): else /dev/null.
                "0" if spec.stdin is None and not spec.open_stdin else "1",
                "1" if header else "0",
                " ".join(keep),
                "" if launch.confine is None else " ".join(ascii_quote(word) for word in launch.confine),
                *public,
            )

        def header(long_command: str) -> bytes:
            entries = [
                str(len(secret) + 1).encode(),
                long_command.encode("utf-8", "surrogateescape"),
                *secret,
            ]
            return b"".join(entry + b"\0" for entry in entries)

        environment = tuple(f"{name}={value}" for name, value in env.items())
        supervisor, check = self._supervisor, self._supervisor_check
        # Rounded up: the supervisor's SIGKILL never comes before the grace is over.
        grace_ms = math.ceil(self._config.grace_ms)
        inline = args(spec.command, bool(secret))
        line = boot_line(*inline, supervisor=supervisor, grace_ms=grace_ms, check=check)
        # One execve argument is limited to 128 KiB: a cold channel's whole line, and the command
        # text the command's own bash gets.
        if spec.command and len(line.encode("utf-8", "surrogateescape")) <= MAX_INLINE_COMMAND:
            return _Boot(
                args=inline,
                line=line,
                header=header("") if secret else None,
                script=None,
                environment=environment,
                long_command=None,
                supervisor=supervisor,
                grace_ms=grace_ms,
                check=check,
            )
        stored = args("", True)
        return _Boot(
            args=stored,
            line=boot_line(*stored, supervisor=supervisor, grace_ms=grace_ms, check=check),
            header=header(spec.command),
            script=f"{self._spill_dir}/{nonce}.cmd",
            environment=environment,
            long_command=spec.command,
            supervisor=supervisor,
            grace_ms=grace_ms,
            check=check,
        )

    def _supports_open_stdin(self) -> bool:
        # Through the supervisor's 'i' and 'c' frames on the task's channel (an attached task).
        return self._supervisor is not None

    def _supports_terminal(self) -> bool:
        # A pty the supervisor makes on the host and owns (not an SSH pty-req: the channel carries
        # frames); resized by its 'W' frame.
        return self._supervisor is not None

    def _supports_files(self) -> bool:
        # Over SFTP (or the host's sftp-server over an exec channel): see _files.
        return True

    def _confine_prefix(self) -> list[str] | None:
        # Exec'd by the command's supervisor as its own image: a warm channel's sealed copy, or the
        # file BOOT checked, never one a command of the login replaced since.
        return None if self._supervisor is None else list(CONFINE_FROM_SUPERVISOR)

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        if not self._spill_dir.startswith("/"):
            return None
        return await self._egress.socket(allow_hosts, self._spill_dir)

    async def _probe_confinement(self) -> ConfinementProbe:
        if self._supervisor is None:
            return ConfinementProbe()
        code, out, _ = await self._pool.run_script('exec "$@"', *confine_probe_argv(self._supervisor))
        return confinement_from_probe(code, out)

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        refuse_other_user(user, self._login_names(), f"on {self._pool.where}")
        return await self._files.read(path, max_bytes)

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        refuse_other_user(user, self._login_names(), f"on {self._pool.where}")
        await self._files.write(path, data, make_parents=make_parents)

    def _supports_sessions(self) -> bool:
        # The state comes back through the supervisor's capture descriptor ('v' frames on the
        # command's channel); without it the channel carries nothing but the command's output.
        return self._supervisor is not None

    async def _detached_mode(self) -> bool:
        if self._detach is None:
            async with self._detach_lock:
                if self._detach is None:
                    self._detach = await self._follower.probe()
        return self._detach

    async def _spawn(self, launch: Launch) -> CommandProcess:
        refuse_other_user(launch.spec.user, self._login_names(), f"on {self._pool.where}")
        # A task with open input needs a live writer, so a live channel: it runs attached.
        detached = launch.background and not launch.spec.open_stdin and await self._detached_mode()
        if launch.background and not detached:
            # No SFTP at all: the task holds its channel for its whole life. A start that waited
            # for a channel would wait for another task to end: refused instead, and one command
            # slot stays for foreground commands and helpers (spill writers, rm).
            budget = self._ssh_config.max_channels - 2
            if len(self._attached) >= budget:
                raise BashInfrastructureError(
                    f"{self._pool.where} offers no SFTP (subsystem or sftp-server program), so each "
                    f"background task holds an SSH channel while it runs; {len(self._attached)} run "
                    f"already, as many as max_channels={self._ssh_config.max_channels} allows "
                    "(one channel is kept for kills, one for other commands)",
                    reason="task_limit",
                )
            self._attached.add(launch.marker)
        try:
            return await self._spawn_attempts(launch, detached)
        except BaseException:
            self._attached.discard(launch.marker)
            raise

    async def _spawn_attempts(self, launch: Launch, detached: bool) -> CommandProcess:
        try:
            return await self._spawn_once(launch, detached, warm=True)
        except _SpareDied as exc:
            # The warm channel's shell died before its BOOT wrote a word: nothing started.
            log.info("%s; starting the command on a channel of its own", exc)
        except SupervisorMissing as exc:
            # Removed or replaced after open (by a command of the same user, issue 30: BOOT's look
            # at the file right before its exec): put it back once, so one command cannot leave
            # every later one unable to start, and never run the command under what was there.
            log.warning(
                "%s, or not the file installed (%s); installing it again", exc, self._supervisor or "none"
            )
            await self._install_supervisor(self._machine)
        try:
            return await self._spawn_once(launch, detached, warm=False)
        except SupervisorMissing as exc:
            raise SupervisorMissing(
                f"dsh-supervise at {self._supervisor} on {self._pool.where} was removed or replaced "
                "again right after it was installed again (a process of the login keeps replacing it); "
                "the command did not start",
                reason="start_failed",
            ) from exc

    async def _spawn_once(self, launch: Launch, detached: bool, *, warm: bool) -> CommandProcess:
        marker = launch.marker
        nonce = secrets.token_hex(8)
        if detached and self._supervisor is not None:
            # The supervisor writes the task's output files itself, never past this grant, so the
            # spill budget bounds them at every moment (a lost spill's file only passes bytes on).
            grant = prepay_spills([launch.stdout, launch.stderr])
            if not grant:
                raise BashInfrastructureError(
                    "the spill budget (max_spill_total_bytes) has no room left for the output files of "
                    f"one more background task on {self._pool.where}",
                    reason="task_limit",
                )
            try:
                plan = self._plan(launch, nonce, f"bg:{grant}")
                return await self._spawn_detached(launch, nonce, plan, warm=warm, cap=grant)
            except BaseException:
                # Not started: its files hold nothing (a retry grants anew).
                launch.stdout.prepaid_gone()
                launch.stderr.prepaid_gone()
                raise
        size = launch.spec.terminal
        session = "s" if launch.session is not None else ""
        mode = "bg" if detached else f"fg{session}" + ("" if size is None else f"{size.rows}x{size.cols}")
        plan = self._plan(launch, nonce, mode)
        script = plan.script
        if detached:
            return await self._spawn_detached(launch, nonce, plan, warm=warm)

        async def on_release() -> None:
            self._warm.warm()  # the spare this command took, replaced (see _boot)
            self._attached.discard(marker)  # an attached background task's channel is free again
            if script is not None:
                self._start_helper(self._remove_quietly, script)
            await self._spills.wait_complete(marker)

        process, _ = await self._boot(launch, plan, on_release, warm=warm)
        return process

    async def _boot(
        self,
        launch: Launch,
        plan: _Boot,
        on_release: Callable[[], Awaitable[None]],
        *,
        warm: bool,
        key: bytes | None = None,
    ) -> tuple[SshProcess | FramedSshProcess, CommandSession]:
        """Run BOOT on the warm channel (see _warm), if ``warm`` and there is one, or on a channel
        of its own; feed it, wait for its verdict. Under the supervisor (``plan.supervisor``) the
        process exists before the channel: its frames may arrive as soon as the channel opens.

        A start given up half-way (an error, a cancellation, even while the channel opens: the
        server may already run the command) is killed by marker before the error propagates;
        :class:`_SpareDied` when the warm channel died before BOOT started.

        A detached task under the supervisor (``key``): BOOT reads the stdin data's length before
        the data, and the supervisor it becomes reads ``key`` right after it; the channel's output
        after BOOT's verdict can only be the supervisor's complaint (kept in ``stray_stderr``).
        """
        marker = launch.marker
        marked = self._marked(marker)
        backlogged = partial(self._spills.backlogged, marker)
        framed: FramedSshProcess | None = None
        if plan.supervisor is not None and key is None:
            framed = FramedSshProcess(
                pool=self._pool,
                launch=launch,
                marked=marked,
                on_release=on_release,
                wait_writable=partial(self._spills.wait_writable, marker),
                registry=self._supervised,
                continues=self._continues,
            )
        feed = framed.feed if framed is not None else (_discard if key is not None else None)
        session: CommandSession | None = None
        try:
            header = plan.header
            if warm:
                session = await self._take_spare(launch)
            if session is not None:
                self._send_warm_request(session, launch, plan, backlogged, feed)
                header = None  # the request carried it
            else:
                session = await self._pool.open_session(
                    plan.line, partial(CommandSession, launch, backlogged, feed)
                )
            process = self._process_on(session, launch, marked, framed, on_release)
            self._write_input(session, launch, header, framed=framed is not None, key=key)
            await process.read_preamble()
            marked.start = session.command_start
        except BaseException as exc:
            await self._abandon_start(launch, marked, session, framed)
            if isinstance(exc, BashInfrastructureError) and session is not None and session.died_unused:
                raise _SpareDied(f"the warm channel on {self._pool.where} died unused ({exc})") from exc
            raise
        if framed is not None:
            framed.running()
        return process, session

    async def _take_spare(self, launch: Launch) -> CommandSession | None:
        """The warm channel, if one is logged in."""
        session = await self._warm.take()
        if launch.background or not self._warm.spares:
            self._warm.warm()  # the next command's
        # Else once this foreground command ended (on_release): a login shell starting
        # beside a short command slows it down, and a spare is still waiting.
        return session

    def _send_warm_request(
        self,
        session: CommandSession,
        launch: Launch,
        plan: _Boot,
        backlogged: Callable[[], bool],
        feed: Callable[[bytes], None] | None,
    ) -> None:
        session.adopt(launch, backlogged, feed)
        assert session.chan is not None
        try:
            session.chan.write(plan.warm_request())
        except OSError as exc:  # closing already: the request was not sent
            raise _SpareDied(f"the warm channel on {self._pool.where} closed ({exc})") from None

    def _process_on(
        self,
        session: CommandSession,
        launch: Launch,
        marked: RemoteMarked,
        framed: FramedSshProcess | None,
        on_release: Callable[[], Awaitable[None]],
    ) -> SshProcess | FramedSshProcess:
        if framed is not None:
            framed.attach(session)
            return framed
        return SshProcess(
            pool=self._pool,
            session=session,
            launch=launch,
            marked=marked,
            on_release=on_release,
            wait_writable=partial(self._spills.wait_writable, launch.marker),
        )

    @staticmethod
    def _write_input(
        session: CommandSession, launch: Launch, header: bytes | None, *, framed: bool, key: bytes | None
    ) -> None:
        """BOOT's input: the header, then the command's stdin data, or (a detached task under the
        supervisor) its length, the data and ``key``.

        asyncssh buffers writes: all of it is queued at once, sent as the channel's window allows.
        Without stdin data the command's stdin is /dev/null: no EOF. A framed command's stdin goes
        in frames once the supervisor took the channel (FramedSshProcess.pump_output).
        """
        chan = session.chan
        assert chan is not None
        stdin = launch.spec.stdin
        try:
            if header is not None:
                chan.write(header)
            if stdin is not None and not framed:
                data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
                if key is not None:
                    chan.write(b"%d\0" % len(data))
                chan.write(data)
                if key is None:
                    chan.write_eof()
            if key is not None:
                chan.write(key)
                chan.write_eof()
        except OSError as exc:
            # The channel closed before all of it went (asyncssh: "Channel not open for
            # sending"): BOOT ended early, and its verdict (a missing workdir, say) or the
            # channel's end, which the preamble reads, says why; not this write.
            log.debug("start of %s: the channel closed under its input: %s", launch.marker, exc)

    async def _abandon_start(
        self,
        launch: Launch,
        marked: RemoteMarked,
        session: CommandSession | None,
        framed: FramedSshProcess | None = None,
    ) -> None:
        """Close what a start given up half-way opened and kill by marker what it may have started;
        shielded, as the start may be given up because it was cancelled."""
        with anyio.CancelScope(shield=True):
            if framed is not None:
                framed.abandon()
            if session is not None:
                session.stop_feeding()
                session.close()
            try:
                await kill_abandoned_start(marked, self._config.grace_ms / 1000)
            except Exception as exc:  # the connection may be what failed
                log.warning("cleaning up after a failed start of %s failed: %s", launch.marker, exc)

    async def _spawn_detached(
        self, launch: Launch, nonce: str, plan: _Boot, *, warm: bool, cap: int | None = None
    ) -> CommandProcess:
        marker = launch.marker
        base = f"{self._spill_dir}/{nonce}"
        spills: dict[str, DetachedSpill] = {}
        self._detached[marker] = (base, spills)
        # A fresh key per task: only this executor and the task's supervisor can sign its records.
        key = secrets.token_bytes(SUPERVISOR_KEY_SIZE) if plan.supervisor is not None else None
        try:
            _, session = await self._boot(launch, plan, _nothing, warm=warm, key=key)
            if key is not None:
                await self._detached_started(launch, session)
        except BaseException:
            self._detached.pop(marker, None)
            raise
        # BOOT (or the supervisor's foreground process) exited once the task runs: the channel is done.
        session.stop_feeding()
        session.close()
        followed = self._follower.add(base, launch, spills, key, cap)

        async def on_release() -> None:
            self._detached.pop(marker, None)

        marked = self._marked(marker)
        marked.start = session.command_start
        return DetachedProcess(
            pool=self._pool,
            follower=self._follower,
            followed=followed,
            marked=marked,
            spills=spills,
            on_release=on_release,
            registry=self._detached_supervisors,
        )

    async def _detached_started(self, launch: Launch, session: CommandSession) -> None:
        """Wait for a detached task's dsh-supervise to detach: its foreground process exits 0 once
        the task runs (its first record written), or 125 with its reason on stderr. Anything else
        means the task did not start: what may have started is killed by marker."""
        with anyio.move_on_after(_DETACH_BOUND_S):
            await session.ended.wait()
        if session.exit is not None and session.exit.code == 0:
            return
        if session.exit is not None:
            # sshd may send the exit status before the last of stderr (the reason): its EOF comes
            # only after both streams are drained.
            with anyio.move_on_after(_REASON_BOUND_S):
                await session.eof.wait()
        said = bytes(session.stray_stderr).decode("utf-8", "replace").strip()
        reason: InfraReason = "start_failed"
        if session.exit is None:
            what = "lost its channel" if session.closed else f"did not detach within {_DETACH_BOUND_S:g} s"
            if session.lost is not None or not self._pool.connected():
                reason = "connection_lost"
        elif session.exit.signal and not said:
            # Killed before it said the task runs: the task may have run (and killed it), so
            # whether it did is unknown; what it left is killed by marker below.
            what = f"killed by signal {session.exit.signal}"
            reason = "command_lost"
        else:
            what = f"exit status {session.exit.code}"
        await self._abandon_start(launch, self._marked(launch.marker), session)
        raise BashInfrastructureError(
            f"dsh-supervise did not start the background task on {self._pool.where} ({what}): "
            f"{said or 'no output'}",
            reason=reason,
        )

    async def _remove_quietly(self, path: str) -> None:
        try:
            with anyio.move_on_after(10):
                await self._pool.run_script('rm -f -- "$1"', path)
        except (BashInfrastructureError, OSError) as exc:
            log.debug("removing %s failed: %s", path, exc)

    def _open_spill(self, command_marker: str, stream: str) -> SpillFile:
        if not self._spill_dir:
            raise OSError("no spill directory")
        detached = self._detached.get(command_marker)
        if detached is not None:
            base, spills = detached
            spill = spills[stream] = DetachedSpill(f"{base}.{stream}")
            return spill
        return self._spills.add(
            command_marker, SshSpillFile(self._pool, spill_file_path(self._spill_dir, stream))
        )

    def _marked(self, marker: str) -> RemoteMarked:
        return RemoteMarked(self._pool, marker=marker, exact=True, unreached=self._note_unreached)

    def _note_unreached(self, marked: RemoteMarked) -> None:
        self._unreached[marked.marker] = marked

    def _reconnected(self) -> None:
        if self._unreached:
            self._start_helper(self._kill_unreached)

    async def _kill_unreached(self) -> None:
        """Kill what a kill could not reach while the host was unreachable (issue: "remote processes
        the executor can no longer account for are killed once it reconnects")."""
        pending, self._unreached = self._unreached, {}
        for marked in pending.values():
            try:
                await kill_abandoned_start(marked, self._config.grace_ms / 1000)
            except BashInfrastructureError as exc:  # unreachable again: noted again by signal_all
                log.warning("killing the unaccounted processes of %s failed: %s", marked.marker, exc)

    def _login_names(self) -> set[str]:
        """The login every command runs as."""
        return {self._ssh_config.username}

    def _leftovers(self) -> Killable:
        # The supervisors reach every process of their commands; the marker what no supervisor
        # holds (detached tasks, commands whose supervisor was killed).
        return SupervisedLeftovers(
            self._supervised | {self._detached_supervisors},
            RemoteMarked(self._pool, marker=self._token + "-", exact=False),
        )

    # -- conformance kit hooks (dsh_bash.backend.ConformanceHooks) ------------------------------------

    def kit_plant_ambient(self, variables: Mapping[str, str]) -> AbstractContextManager[Mapping[str, Any]]:
        """A managed block at the top of the remote user's ``~/.bashrc``, put back on exit."""
        return plant_in_bashrc(self._ssh_config, variables)

    def kit_find_processes(self, marker: str) -> list[int]:
        """A ``/proc`` scan on the SSH host, over a connection of its own."""
        return find_remote_processes(self._ssh_config, marker)

    def kit_notes(self) -> list[str]:
        return kit_notes(self._ssh_config)

    def kit_failing_open(self) -> Mapping[str, Any] | None:
        """A login name the host does not accept: the open fails at authentication (no configuration
        change makes a later step fail: the setup and the supervisor install need the host's files)."""
        return {"username": "dsh-bash-kit-no-such-user"}

    def kit_open_leftovers(self, executor: Any) -> list[str]:
        """Its connection if still open, and its spill directory on the host if the setup made one."""
        if not isinstance(executor, SshBashExecutor):
            return [f"not a {SshBashExecutor.__name__}: {type(executor).__name__}"]
        return find_open_leftovers(self._ssh_config, executor._pool.connected(), executor._spill_dir)


async def _nothing() -> None:
    pass


def _discard(data: bytes) -> None:
    """A detached task's channel after BOOT's verdict: dsh-supervise --detach writes nothing there."""


@dataclass(frozen=True, slots=True)
class _Boot:
    """What BOOT needs to start one command."""

    #: BOOT's arguments, a cold channel's command line running it with them, the header for its stdin.
    args: tuple[str, ...]
    line: str
    header: bytes | None
    #: The long command's file on the host (None when the command is inline).
    script: str | None
    #: NAME=VALUE of every variable of the command's environment but the marker.
    environment: tuple[str, ...]
    long_command: str | None
    #: dsh-supervise's path on the host, when the command runs under it (the cold line and the
    #: warm request end in the same exec of it: boot_script).
    supervisor: str | None = None
    #: The executor's grace: the supervisor follows a SIGTERM request with SIGKILL by itself.
    grace_ms: int | None = None
    #: BOOT's check of the supervisor's file right before its exec (see _scripts.boot_script).
    check: tuple[str, str] | None = None

    def warm_request(self) -> bytes:
        # No header (the environment is in the arguments) and no kept names: WAITER's bash has an
        # empty environment, so each value comes from here. The policy's step (the tenth) as it is.
        return boot_request(
            (*self.args[:7], "0", "", self.args[9], *self.environment),
            self.long_command,
            self.supervisor,
            self.grace_ms,
            self.check,
        )


class _SpareDied(BashInfrastructureError):
    """The warm channel's shell ended before its BOOT wrote anything: the command did not start."""

    def __init__(self, message: str, *, reason: InfraReason = "start_failed") -> None:
        super().__init__(message, reason=reason)
