"""The base of every backend whose commands are processes of this Linux host.

The local backend is this class with nothing added; a sandboxing backend (bubblewrap, firejail, a
user namespace of its own) subclasses it too and puts its launcher in front of the argv through
:meth:`HostBashExecutor._wrap_command`. Public through :mod:`dsh_bash.backend`.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import shutil
import signal
import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._bash_executor import (
    BashExecutor,
    ConfigT_co,
)
from .._config import BudgetConfig
from .._egress import EgressProxies
from .._errors import BashInfrastructureError
from .._output import SpillFile
from .._policy import ConfinementProbe, EgressRoute
from .._protocol import (
    CommandProcess,
    Containment,
    ContainmentSetting,
    Killable,
    Launch,
    SupervisedLeftovers,
    choose_containment,
    refuse_other_user,
)
from ._files import read_host_file, write_host_file
from ._fork_server import (
    SupervisorServer,
    server_problem,
)
from ._host_process import (
    ChannelPool,
    SupervisedProcess,
    spawn_host_process,
    unknown_leftovers,
)
from ._kit_finders import (
    find_host_processes,
    plant_in_os_environ,
)
from ._proc_scan import (
    ProcScanError,
    ProcScanner,
    signal_marked,
)
from ._spill_dir import HostSpillDir

__all__ = ["Containment", "HostBashExecutor", "HostConfig", "host_support_problem"]

log = logging.getLogger("dsh_bash")

#: How long releasing waits for supervisors to confirm that the kills left nothing (see
#: ``HostBashExecutor._confirm_nothing_left``).
_CONFIRM_BOUND_S = 1.0


class HostConfig(BudgetConfig):
    """The shared budgets, plus where bash and the spill directory live on this host.

    ``cwd`` defaults to the process's working directory when the executor is made.
    """

    #: The bash to run (a name looked up on PATH at open, or a path).
    bash: str = "bash"
    #: Where the executor's private spill directory is created (default: the temporary directory).
    spill_dir: str | None = None
    #: ``auto``: each command under the ``dsh-supervise`` subreaper when its binary is there for this
    #: machine, else the environment marker (with a warning at open); ``subreaper``: refuse to open
    #: without it; ``marker``: never use it.
    containment: ContainmentSetting = "auto"


def host_support_problem() -> str | None:
    """Why commands cannot run as processes of this host, or None when they can (Linux only)."""
    if not sys.platform.startswith("linux"):
        return f"this backend runs on Linux only (it needs /proc, pidfd_open, pipe2), not on {sys.platform}"
    missing = [name for name in ("pidfd_open", "pipe2", "waitid") if not hasattr(os, name)]
    if missing:
        return f"this Python lacks os.{', os.'.join(missing)}, which this backend needs (Linux, Python 3.11+)"
    if not os.path.isdir("/proc/self"):
        return "/proc is not mounted: this backend finds a command's processes there"
    return None


class _MarkedLeftovers:
    """Every live process on this host carrying one of the executor's markers.

    Runs in the event loop (no worker thread: see ``_proc_scan``). A scan that fails (EMFILE, ENOMEM)
    is logged and leaves the set "unknown": :meth:`remaining` says so, never "empty"."""

    def __init__(self, scanner: ProcScanner) -> None:
        self._scanner = scanner

    async def signal_all(self, sig: int) -> None:
        try:
            entries = await self._scanner.entries()
        except ProcScanError as exc:
            log.warning("cannot find the marked leftovers: %s", exc)
            entries = []
        for entry in entries:
            if entry.alive and entry.marker is not None:
                try:
                    signal_marked(entry.pid, self._scanner.prefix, sig, False, self._scanner.reserve)
                except OSError as exc:
                    log.warning("cannot signal leftover %d: %s", entry.pid, exc)
                await anyio.lowlevel.checkpoint()
        self._scanner.invalidate()

    async def remaining(self) -> list[str]:
        try:
            entries = await self._scanner.entries()
        except ProcScanError as exc:
            return [unknown_leftovers(exc)]
        return [str(e.pid) for e in entries if e.alive and e.marker is not None]


class _NoLeftovers:
    """What the marker fallback has to find while every command ran under a supervisor that is still
    there (or ended having said that nothing is left): nothing, so no scan of /proc at all."""

    async def signal_all(self, sig: int) -> None:
        pass

    async def remaining(self) -> list[str]:
        return []


def _find_supervisor() -> tuple[str | None, str]:
    """The ``dsh-supervise`` binary for this machine, or None and why it cannot be used."""
    try:
        from ..supervisor import supervisor_binary, supervisor_problem  # noqa: PLC0415
    except ImportError:
        return None, "this installation has no dsh-supervise module"
    path = supervisor_binary()
    if path is None:
        return None, supervisor_problem() or "dsh-supervise is missing"
    if not os.access(path, os.X_OK):
        return None, f"{path} cannot be executed here"
    return str(path), ""


class HostBashExecutor(BashExecutor[ConfigT_co]):
    """Runs each command as ``bash --noprofile --norc -c -- COMMAND`` in a new session on this host."""

    #: For a sandboxing subclass whose launcher (``_wrap_command``) would hide how the command's bash
    #: ended (bwrap reports a signal death as ``128+n``): with the ``subreaper`` containment, the argv
    #: given to ``_wrap_command`` then starts with ``dsh-supervise --setenv MARKER --status-fd 3 --``
    #: (the binary's host path, :attr:`supervisor_path`, which the sandbox must make executable at
    #: that path) and the launcher gets the status socket as fd 3, which it must pass through. That
    #: inner supervisor reports the command's exact status; the outer one still holds the launcher and
    #: all under it. The marker reaches the shell alone: the launcher's environment lacks it.
    supervise_inside_launcher: ClassVar[bool] = False

    def __init__(self, config: ConfigT_co) -> None:
        if config.cwd is None:
            config = config.model_copy(update={"cwd": os.getcwd()})
        super().__init__(config)
        self._scanner = ProcScanner(self._token)
        self._spill_dir: HostSpillDir | None = None
        self._bash: str | None = None
        self._server: SupervisorServer | None = None
        self._supervisor_path: str | None = None
        #: The binary of the policy's step ("": none here), once a confined command needed it.
        self._confine_binary: str | None = None
        self._supervised: set[SupervisedProcess] = set()
        self._channels = ChannelPool()
        #: network = "allow-list": each list's egress proxy, on an abstract unix socket.
        self._egress = EgressProxies(self._start_helper)
        #: Whether processes may exist that no live supervisor holds (a command ran without one, or a
        #: supervisor died before it said that nothing was left): only then do leftovers need a scan.
        self._unheld = False

    def _lost_supervisor(self) -> None:
        self._unheld = True

    @property
    def supervisor_path(self) -> str | None:
        """The ``dsh-supervise`` binary commands run under (``subreaper`` containment), else None."""
        return self._supervisor_path

    @property
    def containment(self) -> Containment:
        """``subreaper`` when commands run under ``dsh-supervise``, else ``marker`` (see HostConfig)."""
        return "subreaper" if self._server is not None else "marker"

    def _host_config(self) -> HostConfig:
        config = self.config
        if not isinstance(config, HostConfig):
            raise TypeError(f"{type(self).__name__} needs a HostConfig, got {type(config).__name__}")
        return config

    async def _open(self) -> None:
        problem = host_support_problem()
        if problem is not None:
            raise BashInfrastructureError(problem, reason="start_failed")
        config = self._host_config()
        try:
            self._spill_dir = HostSpillDir(config.spill_dir)
        except OSError as exc:
            where = config.spill_dir or "the temporary directory"
            raise BashInfrastructureError(
                f"cannot create the private spill directory in {where}: {exc.strerror or exc}",
                reason="spill_unavailable",
            ) from exc
        self._bash = shutil.which(config.bash)
        self._scanner.prepare()
        path, why = _find_supervisor() if config.containment != "marker" else (None, "")
        server: SupervisorServer | None = None
        if path is not None:
            server = SupervisorServer(path, self._start_helper)
            try:
                server.start()
            except OSError as exc:
                server, path, why = None, None, server_problem(exc)
        # Held before anything can fail: a failed open's _release (run by the base class) stops it.
        self._server = server
        choose_containment(config.containment, path, why, type(self).__name__)
        self._supervisor_path = path if server is not None else None

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        # In this process's network namespace (the host's): the commands' forwarders connect
        # before they leave it, and nothing in a command's own network reaches it: no key.
        return EgressRoute(socket=await self._egress.abstract(allow_hosts), key=None)

    async def _release(self) -> None:
        self._channels.close()
        await self._confirm_nothing_left()
        if self._server is not None:
            await self._server.aclose()
            self._server = None
        if self._spill_dir is not None:
            self._spill_dir.remove()
            self._spill_dir = None
        self._scanner.close()

    async def _confirm_nothing_left(self) -> None:
        """Wait (bounded) until every supervisor said that nothing is left under it.

        aclose's bound can end before they all confirmed (a hundred commands closed at once on a
        busy host): the SIGKILL passes it asked for are then still under way, and closing the fork
        server now would return with processes alive. Milliseconds, normally. What still stands at
        the bound gets one SIGKILL by marker (a scan in the event loop: no thread is needed)."""
        leftovers = self._leftovers()
        with anyio.move_on_after(_CONFIRM_BOUND_S):
            while await leftovers.remaining():  # noqa: ASYNC110 - supervisors report on sockets we poll
                await anyio.sleep(0.01)
            return
        log.warning("%s: supervisors did not confirm their ends; killing by marker", type(self).__name__)
        await _MarkedLeftovers(self._scanner).signal_all(signal.SIGKILL)

    def _default_cwd(self) -> str:
        cwd = self.config.cwd
        assert cwd is not None
        return cwd

    def _ambient_env(self) -> Mapping[str, str]:
        return os.environ

    async def _spawn(self, launch: Launch) -> CommandProcess:
        if launch.spec.user is not None:  # the passwd lookup only for a spec that names a user
            refuse_other_user(launch.spec.user, _this_user(), "on this host")
        if self._bash is None:
            raise BashInfrastructureError(
                f"bash not found: {self._host_config().bash!r} is not on PATH", reason="shell_missing"
            )
        assert self._spill_dir is not None
        process = await spawn_host_process(
            launch,
            bash=self._bash,
            spill_dir=self._spill_dir,
            scanner=self._scanner,
            start_helper=self._start_helper,
            wrap=self._wrap_command,
            supervisor=self._server,
            inner_supervisor=self._supervisor_path if self.supervise_inside_launcher else None,
            channels=self._channels,
        )
        if isinstance(process, SupervisedProcess):
            process.on_lost = self._lost_supervisor
            if not process.ended:
                process.registry = self._supervised
                self._supervised.add(process)
        else:
            self._unheld = True
        return process

    def _wrap_command(self, argv: list[str], launch: Launch) -> tuple[list[str], str]:
        """Hook for subclasses: the argv to exec for ``launch`` and the host directory to start it in.

        ``argv`` starts the command's bash (``bash --noprofile --norc -c -- COMMAND``, or a script
        file in the spill directory for a long command). A sandboxing subclass wraps it in its
        launcher and maps the spec's workdir to the host directory that is checked (an unusable
        one raises BashInfrastructureError) and used as the launcher's working directory. It runs
        in a new session with ``launch.env``, as the command would. Default: ``argv`` and the
        spec's workdir, unchanged.
        """
        return argv, launch.spec.workdir

    @property
    def spill_directory(self) -> str | None:
        """The directory of this executor's spill files (and long-command scripts) while it is open."""
        return None if self._spill_dir is None else self._spill_dir.path

    def _open_spill(self, command_marker: str, stream: str) -> SpillFile:
        if self._spill_dir is None:
            raise OSError("the spill directory is gone")
        return self._spill_dir.new_file(stream)

    def _leftovers(self) -> Killable:
        fallback: Killable = _MarkedLeftovers(self._scanner) if self._unheld else _NoLeftovers()
        return SupervisedLeftovers(self._supervised, fallback)

    def _supports_terminal(self) -> bool:
        # A pty pair of this process's: the command's stdio, and its controlling terminal (taken in
        # Popen's child without dsh-supervise, by the supervisor's spawn with it).
        return True

    def _supports_open_stdin(self) -> bool:
        # The command's stdin is a pipe from this process, with or without a supervisor.
        return True

    def _supports_files(self) -> bool:
        return True

    def _confine_prefix(self) -> list[str] | None:
        # The same binary as the supervisor's (with marker containment too: the step supervises
        # nothing, it only confines the process it runs in before it execs the command). Looked
        # for once: this runs before every confined command.
        if self._confine_binary is None:
            self._confine_binary = self._supervisor_path or _find_supervisor()[0] or ""
        return [self._confine_binary, "--confine"] if self._confine_binary else None

    async def _probe_confinement(self) -> ConfinementProbe:
        prefix = self._confine_prefix()
        if prefix is None:
            return ConfinementProbe()
        from ..supervisor import confinement_from_probe  # noqa: PLC0415

        done = await anyio.run_process([*prefix, "--probe"], check=False)
        return confinement_from_probe(done.returncode, done.stdout)

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        if user is not None:
            refuse_other_user(user, _this_user(), "on this host")
        return await anyio.to_thread.run_sync(read_host_file, path, max_bytes)

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        if user is not None:
            refuse_other_user(user, _this_user(), "on this host")
        await anyio.to_thread.run_sync(
            functools.partial(write_host_file, path, data, make_parents=make_parents)
        )

    def _supports_sessions(self) -> bool:
        # The capture comes back in a file of the spill directory (the fork server hands a command
        # exactly its stdio and status socket).
        return True

    def _session_capture_file(self, command_marker: str) -> str | None:
        if self._spill_dir is None:
            raise OSError("the spill directory is gone")
        return self._spill_dir.new_capture_file()

    # -- the conformance kit's hooks (dsh_bash.backend.ConformanceHooks) ------------------------------

    def kit_plant_ambient(self, variables: Mapping[str, str]) -> AbstractContextManager[Mapping[str, Any]]:
        """Commands inherit this process's environment: the kit plants in ``os.environ``."""
        return plant_in_os_environ(variables)

    def kit_find_processes(self, marker: str) -> list[int]:
        """Commands run on this host: the kit scans its ``/proc``."""
        return find_host_processes(marker)

    def kit_failing_open(self) -> Mapping[str, Any] | None:
        """A spill directory under a parent that does not exist: the open's first step fails (this
        host's open has no later step that a configuration can make fail)."""
        return {"spill_dir": "/nonexistent/dsh-bash-kit-failing-open"}

    def kit_open_leftovers(self, executor: Any) -> list[str]:
        """The spill directory and the fork server that ``executor`` still holds and that still exist."""
        if not isinstance(executor, HostBashExecutor):
            return [f"not a {HostBashExecutor.__name__}: {type(executor).__name__}"]
        left = []
        spill = executor._spill_dir
        if spill is not None and os.path.exists(spill.path):
            left.append(f"the spill directory {spill.path}")
        server = executor._server
        if server is not None and server.running:
            left.append("the fork server (dsh-supervise) still runs")
        return left

    def kit_notes(self) -> list[str]:
        cls = type(self)
        base = HostBashExecutor
        if cls._ambient_env is not base._ambient_env and cls.kit_plant_ambient is base.kit_plant_ambient:
            return [
                f"{cls.__name__} defines no kit_plant_ambient hook of its own although it overrides "
                "_ambient_env: the env-* checks plant in this process's environment (os.environ), which "
                "its commands may not inherit"
            ]
        return []


@functools.cache
def _this_user() -> frozenset[str]:
    """The names this process's commands run as: its effective uid, and that uid's passwd name."""
    uid = os.geteuid()
    try:
        return frozenset({str(uid), pwd.getpwuid(uid).pw_name})
    except KeyError:  # a uid without a passwd entry (a container's arbitrary uid)
        return frozenset({str(uid)})
