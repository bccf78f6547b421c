"""The Docker backend: every command a fresh bash exec'd inside one container."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import secrets
import shutil
from collections.abc import Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import anyio

from dsh_bash import BashExecSpec, BashExecutor, BashInfrastructureError
from dsh_bash.backend import (
    MARKER_VAR,
    MAX_INLINE_COMMAND,
    RC_FILE_VARIABLES,
    SESSION_FD,
    AtMostEvery,
    CoalescedRuns,
    CommandProcess,
    ConfinementProbe,
    Containment,
    EgressProxies,
    EgressRoute,
    InfraReason,
    Killable,
    Launch,
    SpillFile,
    SupervisedLeftovers,
    SupervisorInstall,
    choose_containment,
    dropped_names,
    is_scrubbed,
    kill_abandoned_start,
)
from dsh_bash.host import boot_ticks
from dsh_bash.remote import (
    CommandSpills,
    spill_file_path,
)
from dsh_bash.supervisor import (
    CONFINE_FROM_SUPERVISOR,
    CONTINUE_SUPERVISOR,
    check_file_mode,
    confine_probe_argv,
    confinement_from_probe,
    continue_runs,
    encode_frame,
    file_read_argv,
    file_write_argv,
)

from ._docker_config import DockerConfig, memory_bytes
from ._docker_kit_hooks import find_container_processes, find_open_leftovers, kit_notes, plant_in_environment
from ._engine import Endpoint, EngineClient, EngineError, ExecStream
from ._files import commands_run_as_root, read_container_file, write_container_file
from ._framed_exec import FramedDockerProcess, SidePipes, SupervisorMissing
from ._hints import INFRA_HINTS
from ._process import ContainerMarked, DockerProcess, diagnose_refusal, run_script, start_script
from ._runtime_thaw import continue_stopped_stages, pid_namespace
from ._scripts import BOOT, BOOT_SUPERVISED, SPILL_DIR, SPILL_WRITER
from ._spill import DockerSpillFile
from ._supervisor import INSTALL_DIR, INSTALL_TMPFS, install_supervisor
from ._warm import WarmExecs, spec_payload

__all__ = ["MANAGED_LABEL", "DockerBashExecutor", "sweep_orphaned_containers"]

log = logging.getLogger("dsh_bash.docker")

#: A long command of a spec's own user (who cannot enter the executor's private spill directory): a
#: fresh file of that user's, readable by it alone; its path on stdout.
_USER_SCRIPT_WRITER = 'umask 077; f=$(mktemp) && cat > "$f" && printf %s "$f"'
#: Where a container of the executor's own has the egress proxies' directory (read-only).
EGRESS_MOUNT = "/run/dsh-bash-egress"


#: Label on every container an executor creates; its value is the creating executor's token.
MANAGED_LABEL = "dsh-bash.executor"
#: Label naming the pid of the process that created the container (for sweeping crashed hosts).
OWNER_PID_LABEL = "dsh-bash.owner-pid"

_SPILL_FLUSH_BOUND_S = 30.0
#: How long aclose waits for the engine to remove the spill directory of a container it does not own.
_RELEASE_WAIT_S = 2.0
#: How long a removal of a container waits for the engine's answer. The engine goes on removing one
#: whose request was given up (Docker Engine 20.10: measured here, a DELETE dropped after 20 ms still
#: removed the container); with a hundred execs ending at once its shim stalled the answer 30-60 s.
_REMOVE_WAIT_S = 10.0
#: The least time between two searches of the host for stopped runtime processes of the container.
_THAW_EVERY_S = 1.0


def _creator_gone(pid: str) -> bool:
    return pid.isdigit() and not os.path.exists(f"/proc/{pid}")


async def sweep_orphaned_containers(config: DockerConfig | None = None) -> list[str]:
    """Remove containers made by executors whose creating process is gone; return their ids.

    Only containers labelled by this backend and created on this host (by pid) are considered. The
    engine is ``config``'s (its ``docker_host``, TLS and SSH settings; None: the environment's).
    """
    endpoint = Endpoint.parse(None) if config is None else Endpoint.from_config(config)
    removed = []
    async with EngineClient(endpoint) as engine:
        for container in await engine.containers_labelled(MANAGED_LABEL):
            if _creator_gone((container.get("Labels") or {}).get(OWNER_PID_LABEL, "")):
                await engine.container_remove(container["Id"])
                removed.append(str(container["Id"]))
    return removed


def mounted_at(directory: str, mounts: list[dict[str, Any]], container: str) -> str:
    """The path in a container (its ``Mounts``, as the engine inspects them) of ``directory`` of this
    host: beneath the destination of the mount whose source holds it. ValueError when none does."""
    wanted = os.path.realpath(directory)
    if not os.path.isdir(wanted):
        raise ValueError(f"egress_directory {directory!r} is no directory of this host")
    for mount in mounts:
        source, destination = str(mount.get("Source") or ""), str(mount.get("Destination") or "")
        if source and destination.startswith("/") and (wanted + "/").startswith(source.rstrip("/") + "/"):
            below = os.path.relpath(wanted, source)
            return destination if below == "." else posixpath.join(destination, below)
    raise ValueError(
        f"egress_directory {directory!r} is not mounted in container {container}: start it with "
        f"-v {wanted}:/run/dsh-bash-egress (any path there), or leave egress_directory out"
    )


class DockerBashExecutor(BashExecutor[DockerConfig]):
    """Runs each command as ``bash --noprofile --norc -c -- COMMAND`` exec'd in a container."""

    config_class = DockerConfig
    infra_hints = INFRA_HINTS  # what dsh-bash doctor says to do, by error reason (_hints.py)

    # The leftovers' kill reaches every command's supervisor, and every command's marked processes
    # and their groups.
    close_kills_each_command = False

    def __init__(self, config: DockerConfig) -> None:
        super().__init__(config)
        self._docker_config = config
        self._engine = EngineClient(Endpoint.from_config(config))
        self._container_id = ""
        #: Image mode: this process's connection to its container's stdin (see _start_container).
        self._tether: ExecStream | None = None
        self._cwd = "/"
        #: The container's configured user (its image's, or the one it was made with): a command's
        #: user when neither the config nor the request names one.
        self._image_user = ""
        self._ambient: dict[str, str] = {}
        self._spill_dir = ""
        self._spills = CommandSpills(self._start_helper, _SPILL_FLUSH_BOUND_S)
        self._recreate_lock = anyio.Lock()
        self._host_visible = False
        #: The container's pid namespace, when the host sees its processes (None: it does not).
        self._pid_namespace: str | None = None
        self._thaw_runtime = AtMostEvery(self._thaw_runtime_now, every_s=_THAW_EVERY_S)
        self._side_pipes = SidePipes(False)
        self._warm = WarmExecs(
            self._create_spare, self._spare_key, self._start_helper, depth=config.warm_execs
        )
        self._supervisor: str | None = None  # dsh-supervise's path in the container
        self._supervised: set[FramedDockerProcess] = set()
        #: Per user: the continues of stopped supervisors, one exec at a time for all commands.
        self._continues: dict[str | None, CoalescedRuns] = {}
        #: network = "allow-list" (an engine on this host): each list's egress proxy on a socket file
        #: in this directory, which the container has mounted at _egress_mounted_at (image mode: a
        #: directory of the executor's own, at EGRESS_MOUNT; container mode: the config's
        #: egress_directory, where the container mounted it, and only the files made there removed).
        self._egress = EgressProxies(self._start_helper)
        self._egress_dir: str | None = None
        self._egress_mounted_at = EGRESS_MOUNT
        self._egress_files: set[str] = set()
        #: Image mode on a dialed engine: the dialer's directory of proxies on the engine's host,
        #: mounted at EGRESS_MOUNT (None: the dialer serves none).
        self._dialed_egress_dir: str | None = None

    @property
    def containment(self) -> Containment:
        """``subreaper`` when commands run under dsh-supervise in the container, else ``marker``."""
        return "subreaper" if self._supervisor is not None else "marker"

    @property
    def where(self) -> str | None:
        """The container and its engine (``doctor`` says it), once open."""
        if not self._container_id:
            return None
        return f"container {self._container_id[:12]} on {self._engine.endpoint.describe()}"

    @property
    def container_id(self) -> str:
        """The container commands run in (a new one after image mode recreated it)."""
        return self._container_id

    async def warm_up(self) -> bool:
        """Wait until the warm execs (``warm_execs``) are started and wait for the next commands. They
        start at open and whenever a command takes one. False when there is none (``warm_execs=0``,
        no supervisor in the container, or the engine refused them)."""
        self._ensure_open()
        return await self._warm.ready()

    # -- opening and closing ------------------------------------------------------------------------

    async def _open(self) -> None:
        config = self._docker_config
        await self._engine.request("GET", "/_ping")  # unreachable: an error that names the endpoint
        if config.image is not None:
            withheld = self._withheld_environment()
            if withheld:
                log.warning(
                    "environment entries %s match env_scrub: they are not given to the container "
                    "(no command could see them, and PID 1's environment is readable to every "
                    "command of its user); add them to env_allow to pass them through",
                    ", ".join(sorted(withheld)),
                )
            # Once it is started, a container of its own that cannot serve is removed by _release,
            # which the base class runs when _open fails.
            self._container_id = await self._start_container()
            await self._learn_container()
            return
        assert config.container is not None
        self._container_id = config.container
        await self._learn_container()
        if config.egress_directory is not None:
            self._egress_mounted_at = await self._find_egress_mount(config.egress_directory)
            self._egress_dir = config.egress_directory

    async def _find_egress_mount(self, directory: str) -> str:
        """Where the attached container has ``directory`` of this host (the config's
        ``egress_directory``): the path there, or an error that says what to mount."""
        if not self._engine.endpoint.on_this_host:
            raise BashInfrastructureError(
                f"egress_directory {directory!r}: the engine is on another host, whose directories "
                "its containers mount",
                reason="policy_unenforceable",
            )
        info = await self._engine.container_inspect(self._container_id)
        try:
            return mounted_at(directory, info.get("Mounts") or [], self._container_id[:12])
        except ValueError as exc:
            raise BashInfrastructureError(str(exc), reason="policy_unenforceable") from exc

    async def _start_container(self) -> str:
        """Image mode: create a container, tie it to this process, and start it; a container that
        cannot start is removed.

        The tie is a connection to the container's stdin, which its main process reads until the
        end: when the connection ends (this process died, its engine's connection or the node that
        relayed it was lost) the engine closes the container's stdin (``StdinOnce``), and the
        container ends. Attached before the start, so no moment has the container running untied."""
        container_id = await self._create_container()
        try:
            tether = await self._engine.container_attach_stdin(container_id)
            await self._replace_tether(tether)
            await self._engine.request("POST", f"/containers/{container_id}/start")
        except EngineError as exc:
            with anyio.CancelScope(shield=True):
                reason = exc.reason
                if exc.status is not None:  # the engine refused: tell why from the container's files
                    reason = await diagnose_refusal(self._engine, container_id, self._docker_config.user)
                await self._remove_container(container_id)
            raise BashInfrastructureError(
                f"cannot start a container from {self._docker_config.image!r}: {exc}", reason=reason
            ) from exc
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._remove_container(container_id)
            raise
        return container_id

    async def _replace_tether(self, tether: ExecStream | None) -> None:
        old, self._tether = self._tether, tether
        if old is not None:
            # Cleanup of a connection that may be broken already: whatever its close raises is moot.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await old.aclose()

    def _withheld_environment(self) -> list[str]:
        """Image mode: the ``environment`` names the env policy scrubs (never given to the container)."""
        config = self._docker_config
        return [name for name in config.environment if is_scrubbed(name, config.env_scrub, config.env_allow)]

    def _container_environment(self, image_env: list[str]) -> dict[str, str]:
        """Image mode: ``environment`` without what the scrub matches, plus every scrub-matched
        ``ENV`` of the image set empty. PID 1 (and so every exec, which starts with the container's
        environment) then holds no scrubbed value: no command could see one anyway."""
        config = self._docker_config
        withheld = set(self._withheld_environment())
        environment = {name: value for name, value in config.environment.items() if name not in withheld}
        for item in image_env:
            name, _, value = item.partition("=")
            if value and name not in environment and is_scrubbed(name, config.env_scrub, config.env_allow):
                environment[name] = ""
        return environment

    async def _create_container(self) -> str:
        """Create (not start) a container from the image, pulling it as ``pull`` says."""
        config = self._docker_config
        assert config.image is not None
        try:
            if config.pull == "always":
                await self._engine.image_pull(config.image)
            image = await self._engine.image_inspect(config.image)
            if image is None:
                if config.pull == "never":
                    raise BashInfrastructureError(
                        f"image {config.image!r} is not present locally (pull it, or set pull='missing')",
                        reason="image_missing",
                    )
                await self._engine.image_pull(config.image)
                image = await self._engine.image_inspect(config.image)
                if image is None:
                    raise EngineError(f"the engine pulled {config.image!r} but does not have it", 404)
            image_env = (image.get("Config") or {}).get("Env") or []
            # The supervisor's own tmpfs, owned by a user no command runs as (see _supervisor.py);
            # a read-only root filesystem gets a writable /tmp as well.
            tmpfs = {INSTALL_DIR: INSTALL_TMPFS}
            if config.read_only:
                tmpfs["/tmp"] = "rw,nosuid,nodev,mode=1777"
            binds = list(config.mounts)
            if self._engine.endpoint.on_this_host:
                binds.append(f"{self._egress_directory()}:{EGRESS_MOUNT}:ro")
            elif config.engine_dialer is not None:
                # The engine's host is the dialer's place: its proxies, in its directory, serve there.
                self._dialed_egress_dir = await config.engine_dialer.egress_directory()
                if self._dialed_egress_dir is not None:
                    binds.append(f"{self._dialed_egress_dir}:{EGRESS_MOUNT}:ro")
            host_config: dict[str, Any] = {
                "Init": True,
                "NetworkMode": config.network,
                "PidsLimit": config.pids_limit,
                "ReadonlyRootfs": config.read_only,
                "SecurityOpt": ["no-new-privileges"],
                "CapDrop": ["ALL"],
                "CapAdd": list(config.cap_add) or None,
                "Binds": binds or None,
                "Tmpfs": tmpfs,
            }
            if config.mem_limit is not None:
                host_config["Memory"] = memory_bytes(config.mem_limit)
            if config.cpus:
                host_config["NanoCpus"] = int(config.cpus * 1e9)
            environment = self._container_environment(image_env)
            body: dict[str, Any] = {
                "Image": config.image,
                # Until its stdin ends (_start_container's tie), whatever reaches it.
                "Cmd": [
                    "bash",
                    "--noprofile",
                    "--norc",
                    "-c",
                    "trap 'exit 0' TERM; while read -r _; do :; done",
                ],
                "Entrypoint": [],
                "OpenStdin": True,
                "StdinOnce": True,
                "Env": [f"{name}={value}" for name, value in environment.items()],
                "Labels": {**config.labels, MANAGED_LABEL: self._token, OWNER_PID_LABEL: str(os.getpid())},
                "HostConfig": {name: value for name, value in host_config.items() if value is not None},
            }
            if config.user:
                body["User"] = config.user
            return await self._engine.container_create(body)
        except EngineError as exc:
            # 404 from a pull or a create: no such image.
            reason: InfraReason = "image_missing" if exc.status == 404 else exc.reason
            raise BashInfrastructureError(
                f"cannot create a container from {config.image!r}: {exc}", reason=reason
            ) from exc

    def _egress_directory(self) -> str:
        """The host directory of the egress proxies' socket files (made at the first call)."""
        if self._egress_dir is None:
            self._egress_dir = EgressProxies.mountable_directory()
        return self._egress_dir

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        # Only a container with the directory mounted: the executor's own (image mode, an engine on
        # this host: a remote engine would mount its own host's directory of that name; or a dialed
        # engine, the dialer's directory on its host, its proxies served there), or an attached one
        # that has the config's egress_directory.
        dialer = self._docker_config.engine_dialer
        if self._dialed_egress_dir is not None and dialer is not None:
            path, key = await dialer.egress_socket(allow_hosts)
            return EgressRoute(socket=posixpath.join(EGRESS_MOUNT, posixpath.basename(path)), key=key)
        if self._egress_dir is None:
            return None
        path, key = await self._egress.in_directory(allow_hosts, self._egress_dir, mode=0o666)
        self._egress_files.add(path)
        return EgressRoute(socket=posixpath.join(self._egress_mounted_at, os.path.basename(path)), key=key)

    async def _still_running(self) -> bool:
        """Whether the executor's container runs (False when the engine cannot say)."""
        try:
            info = await self._engine.container_inspect(self._container_id)
        except EngineError:
            return False
        return bool(info.get("State", {}).get("Running"))

    async def _learn_container(self) -> None:
        try:
            info = await self._engine.container_inspect(self._container_id)
        except EngineError as exc:
            if exc.status == 404:
                raise BashInfrastructureError(
                    f"container {self._container_id!r} does not exist", reason="container_missing"
                ) from exc
            raise
        if not info.get("State", {}).get("Running"):
            reason: InfraReason = "container_missing"
            if self._docker_config.image is not None:
                # Its own container, just started, ended at once: its init could not run bash.
                reason = await diagnose_refusal(self._engine, self._container_id, self._docker_config.user)
            raise BashInfrastructureError(f"container {self._container_id!r} is not running", reason=reason)
        self._container_id = str(info["Id"])
        # With a local engine, the container's processes are this host's processes too: the kill
        # path can then find them through /proc when nothing can be exec'd in the container.
        init_pid = info.get("State", {}).get("Pid")
        self._host_visible = (
            self._engine.endpoint.on_this_host
            and bool(init_pid)
            and os.access(f"/proc/{init_pid}/environ", os.R_OK)
        )
        self._pid_namespace = pid_namespace(init_pid) if self._host_visible else None
        # A stalled call about the container may wait on a runtime process a command stopped.
        self._engine.on_stall = self._thaw_runtime if self._pid_namespace is not None else None
        self._side_pipes = SidePipes(self._host_visible and self._docker_config.direct_output)
        container_config = info.get("Config") or {}
        self._cwd = container_config.get("WorkingDir") or "/"
        self._image_user = str(container_config.get("User") or "")
        self._ambient = dict(item.split("=", 1) for item in container_config.get("Env") or [] if "=" in item)
        self._engine.unset_names = self._unset_names
        user = self._docker_config.user
        try:
            code, out, err = await run_script(self._engine, self._container_id, user, SPILL_DIR)
        except EngineError as exc:
            # The engine could not start bash (no bash, an unknown user, a limit), or, in image mode,
            # its own container ended right after its start (its init found no bash): say why.
            refused = exc.reason == "start_failed" or (
                self._docker_config.image is not None and exc.status in (404, 409)
            )
            if not refused and self._docker_config.image is not None and exc.status is not None:
                # Its container ending under the exec may also come back as a 500 (the runtime
                # found no process to join): a container no longer running is the same case.
                refused = not await self._still_running()
            if not refused:
                raise
            reason = await diagnose_refusal(self._engine, self._container_id, user)
            raise BashInfrastructureError(str(exc), reason=reason) from exc
        path = out.decode().strip()
        if code != 0 or not path.startswith("/"):
            raise BashInfrastructureError(
                f"cannot create the spill directory in the container: {err.decode(errors='replace').strip()}",
                reason="spill_unavailable",
            )
        self._spill_dir = path
        await self._install_supervisor()

    async def _install_supervisor(self) -> None:
        config = self._docker_config
        install = SupervisorInstall(None, "containment = 'marker'")
        if config.containment != "marker":
            install = await install_supervisor(
                self._engine, self._container_id, config.user, owned_tmpfs=config.image is not None
            )
        where = f"container {self._container_id[:12]}"
        self._supervisor = choose_containment(config.containment, install.path, install.problem, where)
        if self._supervisor is not None:
            self._warm.warm()

    def _spare_key(self) -> tuple[str, str | None]:
        """What a spare exec was made for: the container and the supervisor there."""
        return (self._container_id, self._supervisor)

    async def _create_spare(self) -> tuple[str, ExecStream]:
        if self._supervisor is None:
            raise BashInfrastructureError("no supervisor in the container", reason="start_failed")
        exec_id = await self._engine.exec_create(
            self._container_id,
            [self._supervisor, "--frame", "--spec"],
            # The boot script reads no rc file (its bash gets these again with the command).
            env={name: "" for name in RC_FILE_VARIABLES},
            stdin=True,
            user=self._docker_config.user,
            # None of the container's values waits in a spare, whatever the policy is or becomes:
            # the command's environment comes whole with its `x` frame.
            unset=[name for name, value in self._ambient.items() if value],
        )
        return exec_id, await self._engine.exec_start(exec_id)

    async def _release(self) -> None:
        try:
            await self._release_container()
        finally:
            await self._engine.aclose()
            if self._egress_dir is not None and self._docker_config.image is not None:
                shutil.rmtree(self._egress_dir, ignore_errors=True)
            else:  # the user's directory: only the files made in it go
                for path in self._egress_files:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            self._egress_dir = None
            self._egress_files.clear()

    async def _release_container(self) -> None:
        config = self._docker_config
        await self._warm.close()
        if config.image is not None:
            if self._container_id:  # empty when opening failed before the container was started
                await self._remove_container(self._container_id)
            await self._replace_tether(None)
        elif self._spill_dir:
            # Started, not waited for: it completes in the container all the same, and waiting would
            # cost aclose a stream and an inspect (on an ``ssh://`` engine a channel each). Bounded:
            # an engine stalled by a burst of ending execs would hold aclose for seconds.
            try:
                with anyio.move_on_after(_RELEASE_WAIT_S) as waited:
                    await start_script(
                        self._engine, self._container_id, config.user, 'rm -rf -- "$1"', self._spill_dir
                    )
                if waited.cancelled_caught:
                    log.warning(
                        "removing the spill directory %s: the engine did not answer within %.0f s",
                        self._spill_dir,
                        _RELEASE_WAIT_S,
                    )
            except (EngineError, OSError) as exc:
                log.warning("removing the spill directory %s failed: %s", self._spill_dir, exc)

    async def _remove_container(self, container_id: str) -> None:
        try:
            with anyio.move_on_after(_REMOVE_WAIT_S) as waited:
                await self._engine.container_remove(container_id)
        except EngineError as exc:
            log.warning("removing container %s failed: %s", container_id[:12], exc)
            return
        if waited.cancelled_caught:
            log.warning(
                "removing container %s: the engine did not answer within %.0f s (its removal goes on)",
                container_id[:12],
                _REMOVE_WAIT_S,
            )

    # -- hooks ---------------------------------------------------------------------------------------

    def _default_cwd(self) -> str:
        return self._config.cwd or self._cwd

    def _ambient_env(self) -> Mapping[str, str]:
        return self._ambient

    def _unset_names(self) -> list[str]:
        """Every exec starts with the container's Env: what the policy (as it is now) drops is
        unset before any process of ours runs (RC file variables are set empty by every exec)."""
        config = self._config
        dropped = dropped_names(self._ambient, scrub=config.env_scrub, allow=config.env_allow)
        return [name for name in dropped if self._ambient[name] and name not in RC_FILE_VARIABLES]

    def _supports_open_stdin(self) -> bool:
        # Through the supervisor's 'i' and 'c' frames on the exec's stream.
        return self._supervisor is not None

    def _supports_terminal(self) -> bool:
        # A pty the supervisor makes in the container and owns (not an engine TTY exec, which would
        # run the frames through a line discipline); resized by its 'W' frame.
        return self._supervisor is not None

    def _supports_files(self) -> bool:
        # As root through the engine's archive API (see _files); as another user through the
        # supervisor's file mode, exec'd as that user (refused per call without the supervisor).
        return True

    def _confine_prefix(self) -> list[str] | None:
        # Exec'd by the command's supervisor as its own image (root in an attached container can write
        # /.dsh-bash). Without the supervisor (containment = marker): no step.
        return None if self._supervisor is None else list(CONFINE_FROM_SUPERVISOR)

    async def _probe_confinement(self) -> ConfinementProbe:
        if self._supervisor is None:
            return ConfinementProbe()
        argv = confine_probe_argv(self._supervisor)
        code, out, _ = await run_script(
            self._engine, self._container_id, self.config.user, 'exec "$@"', *argv
        )
        return confinement_from_probe(code, out)

    def _file_mode_user(self, user: str | None) -> str | None:
        """None when a command of ``user`` runs as root (the archive API moves its files); else the exec
        user that moves them through the supervisor's file mode, which takes that user's permissions."""
        who = user if user is not None else self.config.user
        if commands_run_as_root(who, self._image_user):
            return None
        if self._supervisor is None:
            raise BashInfrastructureError(
                f"{type(self).__name__} moves files of a user other than root through dsh-supervise, "
                "which this container does not run (containment = marker); the engine's archive API "
                "would read and write as root, past that user's permissions; nothing was read or written",
                reason="files_unsupported",
            )
        return who or ""

    async def _in_file_mode(
        self, user: str, argv: list[str], path: str, doing: str, data: bytes | None
    ) -> bytes:
        # Bounded: a command of the same user may stop (SIGSTOP) the helper, which must not hang the
        # harness; a stopped helper is left to the container (it ends with it).
        bound_s = self.config.timeout_ms / 1000
        with anyio.move_on_after(bound_s):
            code, out, err = await run_script(
                self._engine, self._container_id, user or None, 'exec "$@"', *argv, stdin=data
            )
            check_file_mode(code, err, path, doing)
            return out
        raise BashInfrastructureError(
            f"could not {doing} {path}: dsh-supervise's file mode did not finish within timeout_ms "
            f"({bound_s:g} s; a command of the same user may have stopped it)",
            reason="unclassified",
        )

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        as_user = self._file_mode_user(user)
        if as_user is None:
            return await read_container_file(self._engine, self._container_id, path, max_bytes)
        assert self._supervisor is not None  # _file_mode_user said so
        argv = file_read_argv(self._supervisor, path, max_bytes)
        return await self._in_file_mode(as_user, argv, path, "read", None)

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        as_user = self._file_mode_user(user)
        if as_user is None:
            await write_container_file(
                self._engine, self._container_id, path, data, make_parents=make_parents
            )
            return
        assert self._supervisor is not None
        argv = file_write_argv(self._supervisor, path, len(data), make_parents=make_parents)
        await self._in_file_mode(as_user, argv, path, "write", data)

    def _supports_sessions(self) -> bool:
        # The state comes back through the supervisor's capture descriptor ('v' frames); without it
        # the exec's stream carries nothing but the command's output.
        return self._supervisor is not None

    async def _spawn(self, launch: Launch) -> CommandProcess:
        try:
            return await self._spawn_in_with_supervisor(launch)
        except EngineError as exc:
            if exc.status not in (404, 409):
                raise
            if self._docker_config.image is None:
                refusal = await self._find_container_again()
                if refusal is None:
                    return await self._spawn_in(self._container_id, launch)
                # The state comes from the fresh inspect: the call that failed may have been on an
                # exec the engine dropped when the container stopped (404 "no such exec"), which
                # says nothing of whether the container still exists.
                raise BashInfrastructureError(
                    f"{refusal}; the executor never starts or recreates a container it does not own",
                    reason="container_missing",
                ) from exc
        # Image mode: the container is gone or stopped; make a fresh one and try once more.
        await self._recreate()
        return await self._spawn_in(self._container_id, launch)

    async def _spawn_in_with_supervisor(self, launch: Launch) -> CommandProcess:
        try:
            return await self._spawn_in(self._container_id, launch)
        except SupervisorMissing as exc:
            # Removed after open (a command of root may remove anything in the container): put it
            # back once, so one command cannot leave every later one unable to start.
            log.warning("%s; installing it again", exc)
            await self._install_supervisor()
            return await self._spawn_in(self._container_id, launch)

    async def _find_container_again(self) -> BashInfrastructureError | None:
        """Container mode: look the configured name up afresh; None when it now runs, else why not.

        The container may have been removed and made again under the same name (a new id, a new
        filesystem): then commands run in the new one, with a new spill directory.
        """
        config = self._docker_config
        assert config.container is not None
        async with self._recreate_lock:
            previous = self._container_id
            self._container_id = config.container
            try:
                await self._learn_container()
            except BashInfrastructureError as refusal:
                self._container_id = previous
                return refusal
            if self._container_id != previous:
                log.warning(
                    "container %r is another container now: %s", config.container, self._container_id[:12]
                )
            return None

    async def _recreate(self) -> None:
        async with self._recreate_lock:
            if await self._still_running():
                return  # another command recreated it already
            old = self._container_id
            log.warning(
                "container %s is gone or stopped; creating a fresh one from %s", old[:12], self.config.image
            )
            await self._remove_container(old)
            self._container_id = await self._start_container()
            await self._learn_container()

    async def _spawn_in(self, container: str, launch: Launch) -> CommandProcess:
        spec = launch.spec
        supervisor = self._supervisor
        env, nonce = self._boot_env(launch)
        # The command's user: the spec's, else the configured one (the engine switches per exec).
        user = spec.user if spec.user is not None else self.config.user
        script_path = ""
        if len(spec.command.encode("utf-8", "surrogateescape")) > MAX_INLINE_COMMAND:
            script_path = await self._store_long_command(container, user, spec)
        env["DSH_BASH_COMMAND"] = "" if script_path else spec.command
        marker = env["DSH_BASH_MARK_FOR"]

        async def on_release() -> None:
            await self._spills.wait_complete(marker)
            if script_path:
                with contextlib.suppress(EngineError, OSError):
                    await run_script(self._engine, container, user, 'rm -f -- "$1"', script_path)

        marked = ContainerMarked(
            self._engine,
            lambda: container,
            user,  # one that may signal the command's processes
            marker=launch.marker,
            exact=True,
            kill_container=self._kill_own_container,
            host_sees_processes=self._host_sees_processes,
            # Before the exec exists: every process of the command starts later.
            host_since=boot_ticks(),
        )
        boot = ["bash", "--noprofile", "--norc", "-c", BOOT_SUPERVISED if supervisor else BOOT]
        boot += ["dsh-bash", spec.workdir, script_path]
        if launch.confine is not None:
            # The policy's step before the boot script, which then execs the command's bash: the
            # script only looks (the directory, the pids limit) before it, so it may run confined.
            boot = [*launch.confine, *boot]
        exec_id, stream = await self._start_exec(
            container, user, boot, env, spec, capture=launch.session is not None
        )
        # What both kinds of process need: the exec, its stream, and the marker kill as the last resort.
        parts: dict[str, Any] = {
            "engine": self._engine,
            "container": container,
            "exec_id": exec_id,
            "stream": stream,
            "launch": launch,
            "marked": marked,
            "start_helper": self._start_helper,
            "on_release": on_release,
            "wait_writable": lambda: self._spills.wait_writable(marker),
        }
        process: DockerProcess | FramedDockerProcess
        if supervisor is not None:
            process = FramedDockerProcess(
                **parts,
                registry=self._supervised,
                supervisor=supervisor,
                side_pipes=self._side_pipes,
                continues=self._continues_of(user),
            )
        else:
            process = DockerProcess(**parts, nonce=nonce)
        try:
            await process.read_preamble(user)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
                try:
                    await kill_abandoned_start(marked, self._config.grace_ms / 1000)
                except Exception as exc:  # the container may be what failed
                    log.warning("cleaning up after a failed start of %s failed: %s", launch.marker, exc)
            raise
        if isinstance(process, FramedDockerProcess):
            process.start_reading()
        return process

    def _continues_of(self, user: str | None) -> CoalescedRuns:
        """The runs of CONTINUE_SUPERVISOR as ``user``, shared by all of that user's commands: at
        ``aclose`` a hundred kills each ask for one, and one exec at a time serves them all."""
        runs = self._continues.get(user)
        if runs is None:
            runs = self._continues[user] = continue_runs(partial(self._continue_supervisors, user))
        return runs

    async def _continue_supervisors(self, user: str | None) -> None:
        """SIGCONT, as ``user``, to every stopped supervisor in the container: a command may have
        stopped its own, or a warm spare, which would leave every request unheard."""
        try:
            await run_script(self._engine, self._container_id, user, CONTINUE_SUPERVISOR)
        except EngineError as exc:
            if exc.status not in (404, 409):  # a container gone or stopped holds nothing to continue
                log.warning("continuing stopped supervisors in the container failed: %s", exc)

    async def _thaw_runtime_now(self) -> None:
        """Continue, from the host, the runtime's processes entering the container that a command
        stopped (see ``_runtime_thaw``): the engine holds every call about the container while one is
        stopped. Through ``self._thaw_runtime``: at most once a second."""
        namespace = self._pid_namespace
        if namespace is None:
            return
        try:
            continued = await anyio.to_thread.run_sync(continue_stopped_stages, namespace)
        except OSError as exc:
            log.warning("searching the host for stopped runtime processes failed: %s", exc)
            return
        if continued:
            log.warning(
                "container %s: continued %d stopped runtime process(es) entering it (a command "
                "stopped them; the engine held every call about the container)",
                self._container_id[:12],
                continued,
            )

    def _boot_env(self, launch: Launch) -> tuple[dict[str, str], str]:
        """The exec's environment for BOOT (all but the command's text) and the trailer's nonce ("" under
        the supervisor, whose frames need none)."""
        env = dict(launch.env)
        marker = env.pop(MARKER_VAR)
        # The boot script itself must not read an rc file: explicit values travel under other names.
        for name in RC_FILE_VARIABLES:
            if name in env:
                env[f"DSH_BASH_RC_{name}"] = env[name]
            env[name] = ""
        unset = {name for name in self._ambient if name not in launch.env} | (
            RC_FILE_VARIABLES - set(launch.env)
        )
        env["DSH_BASH_UNSET"] = " ".join(sorted(unset))
        env["DSH_BASH_MARK_FOR"] = marker
        spec = launch.spec
        if spec.stdin is None and not spec.open_stdin:
            env["DSH_BASH_STDIN"] = "none"  # /dev/null, not the supervisor's pipe
        # Without the supervisor, the exit status travels as a trailer carrying this nonce.
        nonce = "" if self._supervisor is not None else secrets.token_hex(8)
        if self._supervisor is None:
            env["DSH_BASH_NONCE"] = nonce
        return env, nonce

    async def _store_long_command(self, container: str, user: str | None, spec: BashExecSpec) -> str:
        """Write a command too long for an exec's environment into a file BOOT runs; its path."""
        if spec.user is None:
            writer: tuple[str, ...] = (SPILL_WRITER, spill_file_path(self._spill_dir, "sh"))
        else:
            # Another user cannot enter the private spill directory: a file of its own.
            writer = (_USER_SCRIPT_WRITER,)
        try:
            code, out, err = await run_script(
                self._engine,
                container,
                user,
                *writer,  # SPILL_WRITER refuses any existing path, planted links included
                stdin=spec.command.encode("utf-8", "surrogateescape"),
            )
        except EngineError as exc:
            if exc.status is not None or exc.reason != "start_failed":
                raise
            # The engine could not start bash as the spec's user at all: tell why.
            raise BashInfrastructureError(
                f"cannot start a command as {user!r}: {exc}",
                reason=await diagnose_refusal(self._engine, container, user),
            ) from None
        if code != 0:
            raise BashInfrastructureError(
                "cannot store the long command: the writer exited with "
                + ("no status the engine recorded" if code == -1 else f"status {code}")
                + f": {err.decode(errors='replace').strip() or 'no message'}",
                reason="start_failed",
            )
        return writer[1] if spec.user is None else out.decode("utf-8", "surrogateescape").strip()

    async def _start_exec(
        self,
        container: str,
        user: str | None,
        boot: list[str],
        env: dict[str, str],
        spec: BashExecSpec,
        *,
        capture: bool,
    ) -> tuple[str, ExecStream]:
        """The exec that runs ``boot``: a warm one taken, else a fresh one started. ``capture``: a
        session command, which gets the supervisor's capture descriptor."""
        supervisor = self._supervisor
        terminal = None if spec.terminal is None else (spec.terminal.rows, spec.terminal.cols)
        capture_fd = SESSION_FD if capture else None
        if supervisor is not None and (
            taken := await self._take_spare(container, user, boot, env, terminal, capture_fd=capture_fd)
        ):
            return taken
        tty = [] if terminal is None else ["--tty", f"{terminal[0]}x{terminal[1]}"]
        if capture_fd is not None:
            tty += ["--capture-fd", str(capture_fd)]
        argv = [supervisor, "--frame", *tty, "--", *boot] if supervisor is not None else boot
        exec_id = await self._engine.exec_create(
            container, argv, env=env, stdin=supervisor is not None or spec.stdin is not None, user=user
        )
        return exec_id, await self._engine.exec_start(exec_id)

    async def _take_spare(
        self,
        container: str,
        user: str | None,
        boot: list[str],
        env: dict[str, str],
        terminal: tuple[int, int] | None,
        *,
        capture_fd: int | None,
    ) -> tuple[str, ExecStream] | None:
        """A warm exec of the configured user in ``container``, told to run ``boot`` with ``env``;
        None when there is none (or the command cannot go by one): then a fresh exec."""
        if user != self._docker_config.user or container != self._container_id:
            return None
        payload = spec_payload(boot, env, terminal, capture_fd)
        if payload is None:
            return None
        spare = await self._warm.take()
        if spare is None or spare.stream is None:
            return None
        try:
            await spare.stream.send_stdin(encode_frame(b"x", payload))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await spare.discard()  # it never had the whole command: nothing of it runs
            return None
        except BaseException:
            await spare.discard()  # cancelled mid-frame: it ends at EOF, unless it started it all
            raise
        log.debug("command %s: in warm exec %s", env.get("DSH_BASH_MARK_FOR", "?"), spare.exec_id[:12])
        return spare.exec_id, spare.stream

    def _open_spill(self, command_marker: str, stream: str) -> SpillFile:
        if not self._spill_dir:
            raise OSError("no spill directory")
        return self._spills.add(
            command_marker,
            DockerSpillFile(
                self._engine,
                self._container_id,
                self.config.user,
                spill_file_path(self._spill_dir, stream),
            ),
        )

    def _leftovers(self) -> Killable:
        return SupervisedLeftovers(self._supervised, self._marked_leftovers())

    def _marked_leftovers(self) -> ContainerMarked:
        return ContainerMarked(
            self._engine,
            lambda: self._container_id,
            self.config.user,
            marker=self._token + "-",
            exact=False,
            kill_container=self._kill_own_container,
            host_sees_processes=self._host_sees_processes,
        )

    def _host_sees_processes(self) -> bool:
        """True when this host's /proc shows the container's processes with their environments."""
        return self._host_visible

    async def _kill_own_container(self) -> bool:
        """Last resort when nothing can be exec'd: kill the container, if the executor owns it."""
        if self._docker_config.image is None:
            return False
        short = self._container_id[:12]
        log.warning("killing container %s: no process can start in it to kill its commands", short)
        try:
            await self._engine.request("POST", f"/containers/{self._container_id}/kill")
        except EngineError as exc:
            log.warning("killing container %s failed: %s", short, exc)
            return False
        return True

    # -- conformance kit hooks (dsh_bash.backend.ConformanceHooks) ------------------------------------

    def kit_plant_ambient(self, variables: Mapping[str, str]) -> AbstractContextManager[Mapping[str, Any]]:
        """Image mode: through ``environment``; container mode cannot plant (see :meth:`kit_notes`)."""
        return plant_in_environment(self._docker_config, variables)

    def kit_find_processes(self, marker: str) -> list[int]:
        """A ``/proc`` scan exec'd in the container (image mode: in every one this process created)."""
        labels = {MANAGED_LABEL: None, OWNER_PID_LABEL: str(os.getpid())}
        return find_container_processes(self._docker_config, labels, marker)

    def kit_notes(self) -> list[str]:
        return kit_notes(self._docker_config)

    def kit_failing_open(self) -> Mapping[str, Any] | None:
        """A user the container does not know: image mode creates its container, whose start then
        fails; container mode fails at its first exec (before it made anything)."""
        return {"user": "dsh-bash-kit-no-such-user"}

    def kit_open_leftovers(self, executor: Any) -> list[str]:
        """Image mode: containers labelled with the executor's token; container mode: its spill directory."""
        if not isinstance(executor, DockerBashExecutor):
            return [f"not a {DockerBashExecutor.__name__}: {type(executor).__name__}"]
        return find_open_leftovers(
            executor._docker_config, (MANAGED_LABEL, executor._token), executor._spill_dir
        )
