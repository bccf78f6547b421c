"""Warm execs: supervisors started ahead of the next commands, waiting for them on stdin.

Most of a command's latency on Docker is the engine creating and starting its exec (runc entering
the container): about 50-60 ms here, against a few for the command. So the executor keeps up to
``warm_execs`` spares: execs of ``dsh-supervise --frame --spec`` that wait, holding no value of any
command's environment, for an ``x`` frame naming the command (the boot script, its arguments, and
the command's environment as ``--setenv`` entries). The next command of the configured user takes
one and sends that frame; from there it is the same framed supervisor as a fresh exec's, with every
promise of it. Taking a spare starts the next one.

A spare that died unused (a command of the same user killed it, the container stopped) is found
dead when taken (the engine closed its stream) and dropped; the command then has a fresh exec. A
spare of another container (image mode made a new one) is dropped too. A spare's exec unsets every
name of the container's Env that holds a value before the supervisor starts, so no value waits in
it whatever the environment policy is or becomes; the command's whole environment comes with its
frame. ``close`` ends every spare: its supervisor reads end of file and exits at once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio

from dsh_bash import BashInfrastructureError
from dsh_bash.supervisor import command_payload

from ._engine import ExecStream

__all__ = ["Spare", "WarmExecs", "spec_payload"]

log = logging.getLogger("dsh_bash.docker")

#: The largest ``x`` frame the supervisor takes (its REQUEST_MAX).
_MAX_SPEC = 1 << 20


def spec_payload(
    argv: list[str],
    env: dict[str, str],
    terminal: tuple[int, int] | None = None,
    capture_fd: int | None = None,
) -> bytes | None:
    """The ``x`` frame's payload for ``dsh-supervise --spec``; None when it cannot carry them (a NUL
    in a string, or over the supervisor's frame limit): the command then takes a fresh exec.
    ``capture_fd``: the fd the command gets the capture pipe at (protocol 8), in the field a
    ``--fork-server`` request names the status fd in."""
    if any("\0" in text for text in argv) or any("\0" in name + value for name, value in env.items()):
        return None
    payload = command_payload(
        argv, env, ".", status_in_program=-1 if capture_fd is None else capture_fd, terminal=terminal
    )
    return payload if len(payload) <= _MAX_SPEC else None


class Spare:
    """One waiting exec: its id and stream once started."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.exec_id = ""
        self.stream: ExecStream | None = None
        #: Set once the exec started (``stream`` is then set) or failed to.
        self.opened = anyio.Event()
        self.discarded = False

    async def discard(self) -> None:
        self.discarded = True
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with anyio.CancelScope(shield=True):
                await stream.aclose()  # the supervisor reads EOF and exits


class WarmExecs:
    """Up to ``depth`` spare execs for the commands of the configured user.

    ``create`` starts one (an exec of the supervisor with ``--spec``) and returns its id and stream;
    ``key`` says what a spare must have been made for to serve now (the container, the supervisor
    there): a spare made under another key is dropped.
    """

    def __init__(
        self,
        create: Callable[[], Awaitable[tuple[str, ExecStream]]],
        key: Callable[[], Hashable],
        start_helper: Callable[[Callable[..., Awaitable[Any]], Any], None],
        *,
        depth: int,
    ) -> None:
        self._create = create
        self._key = key
        self._start_helper = start_helper
        self._depth = depth
        #: Oldest first: the one most likely started already.
        self._spares: deque[Spare] = deque()
        self._closed = depth <= 0

    @property
    def spares(self) -> int:
        """How many spares there are (started or starting)."""
        return len(self._spares)

    def warm(self) -> None:
        """Start spares up to the depth."""
        while not self._closed and len(self._spares) < self._depth:
            spare = Spare(self._key())
            self._spares.append(spare)
            self._start_helper(self._open, spare)

    async def _open(self, spare: Spare) -> None:
        try:
            spare.exec_id, stream = await self._create()
        except (BashInfrastructureError, OSError) as exc:
            log.debug("a warm exec did not start: %s", exc)
            if spare in self._spares:
                self._spares.remove(spare)
            spare.discarded = True
            return
        finally:
            spare.opened.set()
        spare.stream = stream
        if spare.discarded:
            await spare.discard()

    async def ready(self) -> bool:
        """Start spares up to the depth and wait until each started (or failed); False when none did."""
        self.warm()
        for spare in list(self._spares):
            await spare.opened.wait()
        return any(spare.stream is not None for spare in self._spares)

    async def take(self) -> Spare | None:
        """A started spare made for the current key, alive; None when there is none."""
        key = self._key()
        while self._spares:
            spare = next((each for each in self._spares if each.stream is not None), self._spares[0])
            self._spares.remove(spare)
            try:
                await spare.opened.wait()
            except BaseException:
                # Cancelled while it started: left for the next command.
                if not self._closed:
                    self._spares.appendleft(spare)
                else:
                    await spare.discard()
                raise
            stream = spare.stream
            if stream is None or spare.key != key or stream.closed_by_engine():
                await spare.discard()
                continue
            self.warm()
            return spare
        self.warm()
        return None

    async def close(self) -> None:
        self._closed = True
        while self._spares:
            await self._spares.pop().discard()
