"""One command on the node: a supervisor there, its stream relayed by the node host's long poll.

The supervisor (``dsh-supervise --frame --spec``, started by the node host) holds the command: its
output and status records come as frames (nothing the command writes can forge its outcome), a kill
request reaches every process it started however it hides, and when its input closes (the node
host released it, or died with its node, or the harness went away) it kills everything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import CoalescedRuns, Launch
from dsh_bash.remote import QueuedSpillFile, SpillWriter
from dsh_bash.supervisor import FramedCommand

from ._node import Node

__all__ = ["START_WAIT_S", "NodeMarked", "NodeSpillFile", "RayFramedProcess"]

log = logging.getLogger("dsh_bash.ray")

#: How long the start's call waits for the supervisor's first words (its start's records).
START_WAIT_S = 2.0
#: How long one read of the stream waits on the node for bytes before it returns empty (a long
#: poll: it returns as soon as there are some).
_POLL_WAIT_S = 5.0
#: How long one signal delivery by marker may take even after its caller gave up.
_SIGNAL_BOUND_S = 10.0


class NodeMarked:
    """The processes on the node carrying a marker (exactly, or as a prefix): what is left to find
    once a supervisor is gone (killed by its own command: same user)."""

    def __init__(self, node: Node, marker: str, *, exact: bool) -> None:
        self._node = node
        self._marker = marker
        self._exact = exact

    async def signal_all(self, sig: int) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SIGNAL_BOUND_S):
            try:
                failures = await self._node.call("signal_marked", self._marker, self._exact, sig)
            except BashInfrastructureError as exc:
                log.warning("cannot signal the processes of %s: %s", self._marker, exc)
                return
            for failure in failures:
                log.warning(
                    "cannot signal a process of %s on %s: %s", self._marker, self._node.where, failure
                )

    async def remaining(self) -> list[str]:
        try:
            pids = await self._node.call("find_marked", self._marker, self._exact, idempotent=True)
        except BashInfrastructureError:
            if self._node.lost is not None:
                return []  # the node host died with its node: nothing of it runs there any more
            raise
        return [f"pid {pid} on {self._node.where}" for pid in pids]


class _NodeSpillWriter:
    def __init__(self, node: Node, path: str) -> None:
        self._node = node
        self._path = path

    async def send(self, data: bytes) -> None:
        try:
            await self._node.call("spill_write", self._path, data)
        except BashInfrastructureError as exc:
            raise OSError(str(exc)) from exc

    async def finish(self) -> None:
        try:
            await self._node.call("spill_close", self._path)
        except BashInfrastructureError as exc:
            raise OSError(str(exc)) from exc

    async def aclose(self) -> None:
        pass


class NodeSpillFile(QueuedSpillFile):
    """A spill file on the node, written by the node host in order."""

    def __init__(self, node: Node, path: str) -> None:
        super().__init__(path)
        self._node = node

    async def _open_writer(self) -> SpillWriter:
        try:
            await self._node.call("spill_create", self.path)
        except BashInfrastructureError as exc:
            raise OSError(str(exc)) from exc
        return _NodeSpillWriter(self._node, self.path)

    async def _remove(self) -> None:
        try:
            await self._node.call("spill_remove", self.path)
        except BashInfrastructureError as exc:
            raise OSError(str(exc)) from exc


class RayFramedProcess(FramedCommand):
    """A command whose supervisor runs on the node; its stream read by :meth:`follow`, a helper task
    the executor starts once the node host started the supervisor."""

    def __init__(
        self,
        *,
        node: Node,
        launch: Launch,
        marked: NodeMarked,
        registry: set[Any],
        continues: CoalescedRuns,
        wait_writable: Callable[[], Awaitable[None]],
        on_release: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(
            launch, fallback=marked, registry=registry, where=f"on {node.where}", continues=continues
        )
        self._node = node
        #: The stream's name on the node host: the command's marker.
        self._stream_id = launch.marker
        self._wait_writable = wait_writable
        self._on_release = on_release
        self._stderr = b""
        self._send_lock = anyio.Lock()
        #: Where :meth:`follow` goes on reading (after what the start returned).
        self._offset = 0
        #: The supervisor was told that the command's stdin is /dev/null: no ``c`` frame is due.
        self.stdin_null = False

    def first(self, data: bytes, ended: bool, stderr: bytes) -> bool:
        """What the node host's start returned of the stream; True when that was all of it."""
        self._offset = len(data)
        if data:
            self.feed(data)
        if ended:
            self._stderr = stderr
            self.stream_ended()
        return ended

    async def follow(self) -> None:
        """Read the supervisor's stream to its end (helper task: the stream is read, and its output
        dropped once released, until the supervisor exits: leftovers may hold it until ``aclose``)."""
        offset = self._offset
        if not self._discard:
            await self._wait_writable()
        try:
            while True:
                try:
                    data, ended, stderr = await self._node.call(
                        "read", self._stream_id, offset, _POLL_WAIT_S, idempotent=True
                    )
                except BashInfrastructureError as exc:
                    log.warning("command %s: reading its stream failed: %s", self._launch.marker, exc)
                    return
                if data:
                    offset += len(data)
                    self.feed(data)
                    if not self._discard:
                        await self._wait_writable()
                if ended:
                    self._stderr = stderr
                    return
        finally:
            self.stream_ended()

    # -- FramedCommand's hooks -----------------------------------------------------------------------

    async def _send_frame(self, frame: bytes, *, urgent: bool) -> bool:
        if self.ended:
            return False
        try:
            if urgent:
                sent: bool = await self._node.call("write", self._stream_id, frame)
                return sent
            # One at a time: the node host writes each call's frames before its first await, and
            # calls that overlap may be taken in any order.
            async with self._send_lock:
                sent = await self._node.call("write", self._stream_id, frame)
                return sent
        except BashInfrastructureError:
            return False

    async def _lost(self) -> BashInfrastructureError:
        if self._node.lost is not None:
            from ._node import node_lost_error  # noqa: PLC0415

            return node_lost_error(self._node.where, self._node.lost)
        said = self._stderr.decode("utf-8", "replace").strip()
        return BashInfrastructureError(
            f"the command's supervisor {self._where} ended before it reported how the command ended "
            f"(killed by the command itself?); its exit status is lost{f' ({said})' if said else ''}",
            reason="command_lost",
        )

    def _stream_broken(self) -> None:
        self._close_input()

    # -- start -------------------------------------------------------------------------------------------

    async def read_preamble(self) -> None:
        """Wait until the supervisor started the command; raise BashInfrastructureError when it did not."""
        if await self.wait_started():
            return
        if self._node.lost is not None:
            raise await self._lost()
        said = self._stderr.decode("utf-8", "replace").strip()
        raise BashInfrastructureError(
            f"dsh-supervise did not start the command {self._where}: {self._broken or said or 'no output'}",
            reason="start_failed",
        )

    def abandon(self) -> None:
        super().abandon()
        self._close_input()

    def _close_input(self) -> None:
        if self._node.lost is None:
            # Fire and forget: the supervisor kills everything once its input is closed.
            self._node.actor.close_input.remote(self._stream_id)

    # -- the process protocol ----------------------------------------------------------------------------

    async def pump_output(self) -> None:
        try:
            if self._launch.spec.stdin is None:
                if not self.stdin_null:  # with /dev/null as stdin there is nothing to close
                    await self.send_stdin()
                await self._output_done.wait()
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.send_stdin)
                await self._output_done.wait()
                tg.cancel_scope.cancel()
        finally:
            self._discard = True

    async def release(self) -> None:
        self._discard = True
        await self._on_release()
