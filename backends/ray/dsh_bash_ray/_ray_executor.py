"""``RayBashExecutor``: an executor whose commands run on one node of a Ray cluster."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, TypeVar

from dsh_bash import BashExecutor, BashInfrastructureError, ConfigError, FileOperationError
from dsh_bash.backend import (
    MAX_INLINE_COMMAND,
    SESSION_FD,
    CommandProcess,
    ConfinementProbe,
    EgressRoute,
    Killable,
    Launch,
    SpillFile,
    StreamName,
    SupervisedLeftovers,
    refuse_other_user,
    run_in_fresh_loop,
)
from dsh_bash.remote import CommandSpills, spill_file_path
from dsh_bash.supervisor import (
    confine_probe_argv,
    confinement_from_probe,
    continue_runs,
)

from ._dialer import docker_on_a_node
from ._node import Node, NodeLease, lease_every_node, lease_node
from ._node_host import NodeInfo, StartRequest
from ._process import START_WAIT_S, NodeMarked, NodeSpillFile, RayFramedProcess
from ._ray_config import RayConfig

__all__ = ["RayBashExecutor", "ray_executor"]

log = logging.getLogger("dsh_bash.ray")

T = TypeVar("T")


class RayBashExecutor(BashExecutor[RayConfig]):
    """Runs every command on one node of a Ray cluster, chosen at open, under that node's
    ``dsh-supervise``; see the package README."""

    config_class = RayConfig

    def __init__(self, config: RayConfig) -> None:
        if config.inner != "local":
            raise ConfigError(
                f"inner: RayBashExecutor runs inner = 'local'; inner = {config.inner!r} is the Docker "
                "backend's executor on a node: dsh_bash_ray.ray_executor(...) or load_executor makes it"
            )
        super().__init__(config)
        self._lease: NodeLease | None = None
        self._spill_dir = ""
        self._supervised: set[Any] = set()
        self._spills = CommandSpills(self._start_helper)
        self._continues = continue_runs(self._continue_supervisors)

    # -- what the caller may ask -------------------------------------------------------------------

    @property
    def containment(self) -> str | None:
        return "subreaper"

    @property
    def where(self) -> str | None:
        if self._lease is None:
            return None
        info = self._lease.node.info
        return f"Ray node {info.node_id} ({info.address}, host {info.hostname}), node host pid {info.pid}"

    @property
    def node(self) -> NodeInfo:
        """The node the commands run on (known once open)."""
        return self._node.info

    @property
    def _node(self) -> Node:
        if self._lease is None:
            raise RuntimeError("the executor is not open")
        return self._lease.node

    # -- open and release -----------------------------------------------------------------------------

    async def _open(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise BashInfrastructureError(
                "the Ray backend needs asyncio (Ray's object refs are asyncio futures); run it under "
                "asyncio, not trio"
            ) from None
        self._lease = await lease_node(self._config)
        node = self._lease.node
        info = node.info
        if info.supervisor is None:
            raise BashInfrastructureError(
                f"dsh-supervise cannot run on {node.where}: {info.supervisor_problem} (install dsh-bash "
                "there as it is installed here, with its native helper)",
                reason="start_failed",
            )
        if info.bash is None:
            raise BashInfrastructureError(f"no bash on PATH on {node.where}", reason="shell_missing")
        try:
            self._spill_dir = await node.call("make_directory", "dsh-bash-ray-", self._config.spill_parent)
        except OSError as exc:
            raise BashInfrastructureError(
                f"cannot make the spill directory on {node.where}: {exc}", reason="spill_unavailable"
            ) from exc

    async def _release(self) -> None:
        lease = self._lease
        if lease is None:
            return
        node = lease.node
        try:
            if node.lost is None:
                await node.call("release_owner", self._token)
                if self._spill_dir:
                    await node.call("remove_directory", self._spill_dir)
        except BashInfrastructureError as exc:
            log.warning("releasing the executor on %s: %s", node.where, exc)
        finally:
            lease.release()

    # -- what commands get --------------------------------------------------------------------------------

    def _default_cwd(self) -> str:
        return self._config.cwd or self._node.info.home

    def _ambient_env(self) -> Mapping[str, str]:
        return self._node.info.environment

    def _supports_open_stdin(self) -> bool:
        return True

    def _supports_terminal(self) -> bool:
        return True

    def _supports_sessions(self) -> bool:
        return True

    def _supports_files(self) -> bool:
        return True

    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        node = self._node
        refuse_other_user(user, node.info.user, f"on {node.where}")
        data, reason, message = await node.call("read_file", path, max_bytes)
        if reason:
            raise FileOperationError(message, reason=reason)
        return data  # type: ignore[no-any-return]

    async def _write_file(self, path: str, data: bytes, *, user: str | None, make_parents: bool) -> None:
        node = self._node
        refuse_other_user(user, node.info.user, f"on {node.where}")
        reason, message = await node.call("write_file", path, data, make_parents)
        if reason:
            raise FileOperationError(message, reason=reason)

    def _confine_prefix(self) -> list[str] | None:
        supervisor = self._node.info.supervisor
        return None if supervisor is None else [supervisor, "--confine"]

    async def _egress_socket(self, allow_hosts: tuple[str, ...]) -> EgressRoute | None:
        # The proxy runs in the node host (connections leave from the node the command runs on),
        # on a socket file in the executor's spill directory there.
        socket, key = await self._node.call("egress_socket", self._token, list(allow_hosts), self._spill_dir)
        return EgressRoute(socket=socket, key=key)

    async def _probe_confinement(self) -> ConfinementProbe:
        supervisor = self._node.info.supervisor
        if supervisor is None:
            return ConfinementProbe()
        code, out, _ = await self._node.call("run", confine_probe_argv(supervisor), b"", {})
        return confinement_from_probe(code, out)

    # -- commands ----------------------------------------------------------------------------------------

    async def _spawn(self, launch: Launch) -> CommandProcess:
        node = self._node
        info = node.info
        refuse_other_user(launch.spec.user, info.user, f"on {node.where}")
        assert info.bash is not None and info.supervisor is not None
        encoded = launch.spec.command.encode("utf-8", "surrogateescape")
        argv = [info.bash, "--noprofile", "--norc"]
        script: bytes | None = None
        if len(encoded) <= MAX_INLINE_COMMAND:
            argv += ["-c", "--", launch.spec.command]
        else:
            script = encoded  # execve refuses one argument that long: the node host writes a file
        if launch.confine is not None:
            argv = [*launch.confine, *argv]
        size = launch.spec.terminal
        marker = launch.marker
        # A command given no input reads /dev/null (the contract), not an empty pipe.
        no_input = launch.spec.stdin is None and not launch.spec.open_stdin and size is None
        stdin_null = ["--stdin-null"] if no_input else []
        process = RayFramedProcess(
            node=node,
            launch=launch,
            marked=NodeMarked(node, marker, exact=True),
            registry=self._supervised,
            continues=self._continues,
            wait_writable=partial(self._spills.wait_writable, marker),
            on_release=partial(self._spills.wait_complete, marker),
        )
        process.stdin_null = no_input
        request = StartRequest(
            owner=self._token,
            supervisor_args=[info.supervisor, "--frame", "--spec", *stdin_null],
            argv=argv,
            env=launch.env,
            cwd=launch.spec.workdir,
            terminal=None if size is None else (size.rows, size.cols),
            capture_fd=SESSION_FD if launch.session is not None else None,
            script=script,
            script_dir=self._spill_dir,
        )
        try:
            reason, message, data, ended, stderr = await node.call("start", marker, request, START_WAIT_S)
            if reason:
                raise BashInfrastructureError(f"{message} on {node.where}", reason=reason)
            if not process.first(data, ended, stderr):
                self._start_helper(process.follow)
            await process.read_preamble()
        except BaseException:
            # Also when the start's reply never came (a cancellation): the node host closes the
            # supervisor's input whenever it started it, before or after this.
            process.abandon()
            raise
        process.running()
        return process

    async def _continue_supervisors(self) -> None:
        await self._node.call("continue_supervisors")

    def _open_spill(self, command_marker: str, stream: StreamName) -> SpillFile:
        if not self._spill_dir:
            raise OSError("no spill directory")
        return self._spills.add(
            command_marker, NodeSpillFile(self._node, spill_file_path(self._spill_dir, stream))
        )

    def _leftovers(self) -> Killable:
        return SupervisedLeftovers(self._supervised, NodeMarked(self._node, f"{self._token}-", exact=False))

    # -- the conformance kit's view of the node (dsh_bash.backend.ConformanceHooks) -----------------------

    def kit_plant_ambient(self, variables: Mapping[str, str]) -> AbstractContextManager[Mapping[str, Any]]:
        return _planted_on_nodes(self._config, dict(variables))

    def kit_find_processes(self, marker: str) -> list[int]:
        async def find(node: Node) -> list[int]:
            found: list[int] = await node.call("find_in_command_lines", marker)
            return found

        return sorted({pid for pids in _on_every_node(self._config, find) for pid in pids})

    def kit_failing_open(self) -> Mapping[str, Any] | None:
        """A ``spill_parent`` no node has: the open fails after it leased its node host."""
        return {"spill_parent": "/proc/dsh-bash-kit-no-such-directory"}

    def kit_open_leftovers(self, executor: Any) -> list[str]:
        """Its lease of the node host, if not given back, and its spill directory, if still there."""
        if not isinstance(executor, RayBashExecutor):
            return [f"not a {RayBashExecutor.__name__}: {type(executor).__name__}"]
        lease = executor._lease
        if lease is not None and not lease.released:
            return [f"the lease of the node host on {lease.node.where}"]
        directory = executor._spill_dir
        if not directory:
            return []

        async def look(node: Node) -> bool:
            there: bool = await node.call("exists", directory)
            return there

        return [directory] if any(_on_every_node(self._config, look)) else []

    def kit_notes(self) -> list[str]:
        return [
            "commands run on a node chosen at each executor's open: the kit's hooks find processes and "
            "plant variables on every node that fits the config"
        ]


def _on_every_node(config: RayConfig, action: Callable[[Node], Awaitable[T]]) -> list[T]:
    """``action`` on the node host of every node an executor of ``config`` may get (synchronous:
    the kit's hooks are)."""

    async def run() -> list[T]:
        leases = await lease_every_node(config)
        try:
            return [await action(lease.node) for lease in leases]
        finally:
            for lease in leases:
                lease.release()

    return run_in_fresh_loop(run)


@contextmanager
def _planted_on_nodes(config: RayConfig, variables: dict[str, str]) -> Iterator[Mapping[str, Any]]:
    """``variables`` in the ambient environment of every node an executor of ``config`` may get,
    their node hosts leased for the block (a node host ends with its last lease, and what was
    planted with it)."""

    async def plant() -> list[tuple[NodeLease, dict[str, str | None]]]:
        leases = await lease_every_node(config)
        planted = []
        try:
            for lease in leases:
                planted.append((lease, await lease.node.call("plant", variables)))
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        return planted

    planted = run_in_fresh_loop(plant)
    try:
        yield {}
    finally:

        async def restore() -> None:
            for lease, before in planted:
                try:
                    await lease.node.call("restore", before)
                finally:
                    lease.release()

        run_in_fresh_loop(restore)


def ray_executor(**fields: Any) -> BashExecutor[Any]:
    """The ``ray`` backend's factory (its entry point): with ``inner = "local"`` (the default) a
    :class:`RayBashExecutor`; with ``inner = "docker"`` the Docker backend's executor, its engine the
    chosen node's, reached through that node (``_dialer.py``)."""
    if fields.get("inner") == "docker":
        return docker_on_a_node(dict(fields))
    return RayBashExecutor.from_fields(**fields)
