"""A bubblewrap-confined local backend: the local backend's mechanics, each command inside ``bwrap``.

Every command runs as::

    env --ignore-signal=TERM bwrap --ro-bind / / --dev /dev --proc /proc \\
        --bind SANDBOX/tmp /tmp --bind-try CWD CWD [--bind-try PATH PATH ...] \\
        --ro-bind SANDBOX/cmd SANDBOX/cmd [--ro-bind SUPERVISOR SUPERVISOR] \\
        --ro-bind SPILL_DIR SPILL_DIR --unshare-pid [--unshare-net] [--die-with-parent] \\
        --chdir WORKDIR -- env --default-signal=TERM setsid \\
        [SUPERVISOR --status-fd 3 --] bash --noprofile --norc SANDBOX/cmd/SCRIPT

itself under a ``dsh-supervise`` forked by the executor's fork server (the ``subreaper`` containment).

Pipes, stdin, timeouts, the kill sequence, finding escapees by their marker in ``/proc`` and spill
files are all :class:`dsh_bash.host.HostBashExecutor`'s (the base the local backend is built on
too), unchanged: this class wraps the argv through its ``_wrap_command`` hook and waits, in
``_spawn``, until the sandboxed shell runs. It imports nothing but the public ``dsh_bash`` and
``dsh_bash.backend`` APIs. Why each piece is there:

- The launcher (``bwrap``, and the init process it runs as pid 1 of the new PID namespace) ignores
  SIGTERM, so the kill sequence's SIGTERM reaches the command's processes (by their marker) while
  the launcher stays until the shell ended. ``env --default-signal=TERM`` undoes the ignore for the
  shell, which could not trap SIGTERM otherwise.
- The launcher's own status says ``128+n`` when the shell died of signal ``n``: with the
  ``subreaper`` containment, a second ``dsh-supervise`` runs inside the sandbox in front of the
  shell (``supervise_inside_launcher``; its binary bound read-only at its host path) and reports the
  shell's exact status on the status socket, which the launcher passes through as fd 3. The one in
  front of the launcher still holds the launcher and everything under it, and kills it all.
- Because a SIGTERM sent while the sandbox is still being set up would be ignored, ``_spawn``
  returns only once the shell's process runs with SIGTERM restored (it has called ``setsid``).
- ``setsid`` makes the shell lead a session of its own as the PID namespace sees it (pid = pgrp =
  sid). It is not a group leader there, so ``setsid`` does not fork.
- The command text is in a script file, not on the command line: bwrap's init lives as long as
  any process of the sandbox does, and its command line would show the command (and mislead anyone
  who looks for the command's processes by what it says) long after the command's shell exited.
- The private ``/tmp`` is one host directory per executor, kept across its commands (a file one
  command writes there, the next one reads) and removed at ``aclose``. Paths under ``/tmp`` are
  mapped to it on the host, to check a workdir before starting.
- The spill directory is bound read-only at its own path, so a spill file's path works in the next
  command.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import shutil
import tempfile

import anyio
import anyio.to_thread
from pydantic import field_validator

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    MARKER_VAR,
    CommandProcess,
    ExitStatus,
    Launch,
)
from dsh_bash.host import (
    HostBashExecutor,
    HostConfig,
    read_proc_stat,
)

__all__ = ["BwrapBashExecutor", "BwrapConfig"]

#: How long ``_spawn`` waits for the sandboxed shell to run before giving up on the launcher.
_START_BOUND_S = 10.0
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class BwrapConfig(HostConfig):
    """The host backends' fields (``bash``, ``spill_dir``), plus the sandbox's.

    ``cwd`` (default: the current directory) is bound writable, unless it is ``/``.
    """

    #: The bubblewrap binary (a name on PATH or a path).
    bwrap: str = "bwrap"
    #: More host directories bound writable at the same path (missing ones are skipped).
    writable: tuple[str, ...] = ()
    #: False: ``--unshare-net``, no network but a loopback interface.
    network: bool = True
    #: ``--die-with-parent``: the sandbox is SIGKILLed when its launcher's parent dies. The launcher
    #: exits when the command's shell exits, so this also kills whatever the command left running
    #: (a ``server &``) at that moment, which the contract forbids for a background task (``bounded-drain``,
    #: ``aclose-kills-leftovers`` and ``kill-reaches-group-after-leader-exit`` fail): off by default.
    die_with_parent: bool = False

    @field_validator("writable")
    @classmethod
    def _below_root(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for path in paths:
            if not posixpath.isabs(path) or posixpath.normpath(path) == "/":
                raise ValueError(f"{path!r} is not an absolute path below / (the host stays read-only)")
        return paths


class _SandboxedProcess(CommandProcess):
    """The local process of the launcher, plus the command's script file, deleted at release."""

    def __init__(self, inner: CommandProcess, script: str) -> None:
        self._inner = inner
        self._script = script

    async def wait(self) -> ExitStatus:
        return await self._inner.wait()

    async def pump_output(self) -> None:
        await self._inner.pump_output()

    async def signal_all(self, sig: int) -> None:
        await self._inner.signal_all(sig)

    async def remaining(self) -> list[str]:
        return await self._inner.remaining()

    async def release(self) -> None:
        try:
            await self._inner.release()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._script)


def _shell_runs(marker: str) -> bool:
    """Whether the sandboxed shell of the command ``marker`` has started its own session.

    It descends from this process through the launcher and the namespace's init (and the
    ``dsh-supervise`` subreaper in front of the launcher, when commands run under it), leads its
    own session, carries the marker in its environment, and lives in the sandbox's PID namespace:
    the supervisor and the launcher lead sessions with the marker too (each is started in a session
    of its own), and a kill sent while only they run would be lost (the launcher ignores SIGTERM).
    """
    own = os.getpid()
    try:
        own_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        own_namespace = ""
    parents: dict[int, tuple[int, int]] = {}  # pid -> (ppid, session)
    for name in os.listdir("/proc"):
        stat = read_proc_stat(name) if name.isdigit() else None
        if stat is not None:
            parents[stat.pid] = (stat.ppid, stat.session)
    needle = f"\0{MARKER_VAR}={marker}\0".encode()
    for pid, (ppid, session) in parents.items():
        if session != pid or not _descends_from(own, ppid, parents, depth=6):
            continue
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == own_namespace:
                continue
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = b"\0" + handle.read()
        except OSError:
            continue
        if needle in environ:
            return True
    return False


def _descends_from(ancestor: int, pid: int, parents: dict[int, tuple[int, int]], depth: int) -> bool:
    """Whether ``ancestor`` is ``pid`` or one of its first ``depth`` ancestors."""
    for _ in range(depth):
        if pid == ancestor:
            return True
        entry = parents.get(pid)
        if entry is None:
            return False
        pid = entry[0]
    return pid == ancestor


class BwrapBashExecutor(HostBashExecutor[BwrapConfig]):
    """Runs each command in a fresh bubblewrap sandbox: host read-only, private /tmp, own PID namespace."""

    # The launcher reports a signal death of the shell as exit status 128+n: a supervisor inside the
    # sandbox reports the shell's exact status instead (the outer one still holds the launcher).
    supervise_inside_launcher = True

    config_class = BwrapConfig

    def __init__(self, config: BwrapConfig | None = None) -> None:
        super().__init__(config if config is not None else BwrapConfig())
        self._sandbox_dir: str | None = None
        self._prefix: list[str] = []
        self._inner: list[str] = []
        self._scripts: dict[str, str] = {}  # command marker -> its script file

    # -- opening and closing ------------------------------------------------------------------------

    async def _open(self) -> None:
        await super()._open()
        # A failure below gets _release from the base class (the sandbox directory included).
        names = (self.config.bwrap, "env", "setsid")
        tools = [shutil.which(name) for name in names]
        missing = [name for name, path in zip(names, tools, strict=True) if path is None]
        if missing:
            raise BashInfrastructureError(
                f"not found on PATH: {', '.join(missing)} (bubblewrap: apt-get install bubblewrap)"
            )
        bwrap, env, setsid = (str(path) for path in tools)
        self._prefix = [env, "--ignore-signal=TERM", bwrap]
        self._inner = [env, "--default-signal=TERM", setsid]
        # SANDBOX/tmp is the private /tmp, SANDBOX/cmd holds the command scripts (read-only inside).
        self._sandbox_dir = tempfile.mkdtemp(prefix="dsh-bash-bwrap-")
        os.mkdir(f"{self._sandbox_dir}/tmp", 0o700)
        os.mkdir(f"{self._sandbox_dir}/cmd", 0o700)
        await self._probe()

    async def _probe(self) -> None:
        """Fail at open, in bwrap's own words, where no sandbox can be made."""
        argv = self._sandbox_argv(["true"], "/")
        with anyio.fail_after(_START_BOUND_S):
            result = await anyio.run_process(argv, check=False)
        if result.returncode != 0:
            said = " ".join(result.stderr.decode(errors="replace").split()) or f"exit {result.returncode}"
            raise BashInfrastructureError(f"bubblewrap cannot make a sandbox here: {said}")

    async def _release(self) -> None:
        try:
            await super()._release()
        finally:
            sandbox_dir, self._sandbox_dir = self._sandbox_dir, None
            if sandbox_dir is not None:
                await anyio.to_thread.run_sync(shutil.rmtree, sandbox_dir, True)

    # -- the sandbox ----------------------------------------------------------------------------------

    def _writable(self) -> list[str]:
        """Host directories bound writable at the same path (the workdir first)."""
        paths = (posixpath.normpath(path) for path in [self._default_cwd(), *self.config.writable])
        return [path for path in paths if path != "/"]

    def _host_path(self, path: str) -> str:
        """Where a path inside the sandbox is on the host (only the private /tmp differs)."""
        path = posixpath.normpath(path)
        for bound in self._writable():
            if path == bound or path.startswith(bound + "/"):
                return path
        if self._sandbox_dir is not None and (path == "/tmp" or path.startswith("/tmp/")):
            return f"{self._sandbox_dir}/tmp{path[len('/tmp') :]}"
        return path

    def _sandbox_argv(self, argv: list[str], workdir: str, capture_file: str | None = None) -> list[str]:
        if self._sandbox_dir is None or not self._prefix:
            raise BashInfrastructureError("the bwrap sandbox is not set up (executor not open)")
        config = self.config
        sandbox = [*self._prefix, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        sandbox += ["--bind", f"{self._sandbox_dir}/tmp", "/tmp"]
        for path in self._writable():
            sandbox += ["--bind-try", path, path]
        sandbox += ["--ro-bind", f"{self._sandbox_dir}/cmd", f"{self._sandbox_dir}/cmd"]
        supervisor = self.supervisor_path
        if supervisor is not None:
            # The supervisor inside runs from its host path (under a private /tmp it would be gone).
            sandbox += ["--ro-bind", supervisor, supervisor]
        spill_dir = self.spill_directory
        if spill_dir is not None:
            sandbox += ["--ro-bind", spill_dir, spill_dir]
        if capture_file is not None:
            # A session command writes its state there: that one file, writable, inside the view.
            sandbox += ["--bind", capture_file, capture_file]
        sandbox.append("--unshare-pid")
        if not config.network:
            sandbox.append("--unshare-net")
        if config.die_with_parent:
            sandbox.append("--die-with-parent")
        return [*sandbox, "--chdir", workdir, "--", *self._inner, *argv]

    def _wrap_command(self, argv: list[str], launch: Launch) -> tuple[list[str], str]:
        script = self._scripts.get(launch.marker)
        if script is not None and len(argv) >= 3 and argv[-3:-1] == ["-c", "--"]:
            argv = [*argv[:-3], script]  # bash --noprofile --norc SCRIPT
        workdir = launch.spec.workdir
        capture_file = None if launch.session is None else launch.session.file
        return self._sandbox_argv(argv, workdir, capture_file), self._host_path(workdir)

    def _write_script(self, command: str) -> str:
        assert self._sandbox_dir is not None
        path = f"{self._sandbox_dir}/cmd/{secrets.token_hex(12)}.sh"
        fd = os.open(path, _CREATE_FLAGS, 0o600)
        try:
            data = memoryview(command.encode("utf-8", "surrogateescape"))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        return path

    def _supports_open_stdin(self) -> bool:
        # bwrap's own process keeps the stdin pipe it passes to the shell: a command that closed its
        # stdin would never be seen to (writes would pile up, not fail as the contract says).
        return False

    def _supports_files(self) -> bool:
        # Its commands see a sandbox (a private /tmp, a read-only root but for `writable`): the host's
        # files are not theirs. Files through the sandbox's view wait for the sandbox policy (issue 33).
        return False

    def _supports_terminal(self) -> bool:
        # A terminal's input is open input, refused above.
        return False

    def _confine_prefix(self) -> list[str] | None:
        # Its sandbox is its own (bwrap's view of the host): the project's policy, which names the
        # host's paths, is not applied inside it (an active one is refused: policy_unenforceable).
        return None

    async def _spawn(self, launch: Launch) -> CommandProcess:
        if self._sandbox_dir is None:
            raise BashInfrastructureError("the bwrap sandbox is gone (executor closing)")
        script = self._write_script(launch.spec.command)
        self._scripts[launch.marker] = script
        try:
            process = _SandboxedProcess(await super()._spawn(launch), script)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(script)
            raise
        finally:
            del self._scripts[launch.marker]
        # Started: the executor now owns the process, so a cancellation must wait until it knows it.
        with anyio.CancelScope(shield=True):
            await self._until_shell_runs(launch.marker, process)
        return process

    async def _until_shell_runs(self, marker: str, process: CommandProcess) -> None:
        """Return once the sandboxed shell runs, or the launcher exited, or the bound passed."""
        async with anyio.create_task_group() as tg:

            async def launcher_exited() -> None:
                await process.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(launcher_exited)
            with anyio.move_on_after(_START_BOUND_S):
                delay = 0.0005
                while not await anyio.to_thread.run_sync(_shell_runs, marker):
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.02)
            tg.cancel_scope.cancel()
