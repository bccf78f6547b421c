"""The open stdin of a background task: what ``write_input`` queued, handed to the backend in order.

The executor refuses and routes (owner, end, terminal: ``BashExecutor._input_of``); this module holds
one task's input from there on: the bounded queue, the close, the pump that feeds the backend's
:class:`~dsh_bash.backend.CommandProcess` one chunk at a time, and the watch that tells whether a
process of the task waits for input (``waiting_for_input``).
"""

from __future__ import annotations

import logging
from typing import Literal

import anyio

from ._errors import TaskInputError
from ._protocol import CommandProcess
from ._types import _encodable

__all__ = ["MAX_INPUT_BYTES", "MAX_PENDING_INPUT", "TaskInput", "input_bytes"]

log = logging.getLogger("dsh_bash")

#: The most one ``write_input`` takes (bytes, after encoding).
MAX_INPUT_BYTES = 1_048_576
#: The most input that may wait for a task's command to read it: what the executor queued plus what
#: the backend holds (``CommandProcess.input_pending``). A write beyond it is refused (``input_full``):
#: a command that never reads its stdin must not make the harness, or a supervisor, hold without bound.
MAX_PENDING_INPUT = 1_048_576
#: Input goes to the backend in pieces of at most this, so that a close or a kill never waits behind
#: one large write.
_INPUT_CHUNK = 65_536
#: How often a task with open input is looked at for a process blocked reading it.
_WAIT_SAMPLE_S = 0.2
InputState = Literal["open", "closing", "closed", "broken"]


def input_bytes(data: object) -> bytes:
    """What ``write_input`` was given, as bytes; ``ValueError`` past :data:`MAX_INPUT_BYTES` or for text
    without a UTF-8 form, ``TypeError`` for neither text nor bytes."""
    if isinstance(data, str):
        _encodable(data, "input")  # refuses a lone surrogate, naming it
        payload = data.encode("utf-8")
    elif isinstance(data, bytes | bytearray | memoryview):
        payload = bytes(data)
    else:
        raise TypeError(f"input must be str or bytes, got {type(data).__name__}")
    if len(payload) > MAX_INPUT_BYTES:
        raise ValueError(
            f"input of {len(payload)} bytes is more than one write takes ({MAX_INPUT_BYTES}); split it"
        )
    return payload


class TaskInput:
    """The open stdin of one background task: queued bytes, their order, and whether more may come."""

    __slots__ = ("in_flight", "queue", "scope", "state", "waiting", "wake", "writes")

    def __init__(self, first: bytes) -> None:
        self.queue = bytearray(first)
        #: How many writes were queued: a wait seen before the latest write is not reported.
        self.writes = 0
        #: The latest verdict of the waiting-for-input watch (None: the backend cannot tell).
        self.waiting: bool | None = False
        self.in_flight = 0
        self.state: InputState = "open"
        self.wake = anyio.Event()
        #: The pump's scope: the executor cancels it (:meth:`end`) before the backend releases the command.
        self.scope = anyio.CancelScope()

    def write(self, payload: bytes, process: CommandProcess, task: str) -> None:
        """Queue ``payload`` behind what is queued; :class:`TaskInputError` (nothing queued) when the
        input is closed or broken, or when it would pass :data:`MAX_PENDING_INPUT`."""
        if self.state in {"closing", "closed"}:
            raise TaskInputError(f"the input of task {task} was closed", reason="input_closed")
        if self.state == "broken":
            raise TaskInputError(f"task {task} closed its input", reason="input_broken")
        pending = len(self.queue) + self.in_flight + process.input_pending()
        if pending + len(payload) > MAX_PENDING_INPUT:
            raise TaskInputError(
                f"task {task} has {pending} bytes of input it has not read yet; {len(payload)} more "
                f"would pass the {MAX_PENDING_INPUT} bytes that may wait (nothing was sent)",
                reason="input_full",
            )
        self.queue += payload
        self.writes += 1
        self.waiting = False  # it has something to read now
        self.wake.set()

    def close(self) -> bool:
        """Close once the queue is written; False when it was closed already (or broken)."""
        if self.state != "open":
            return False
        self.state = "closing"
        self.wake.set()
        return True

    def broken(self) -> None:
        self.state = "broken"
        self.queue.clear()

    def end(self) -> None:
        """The task ended: no input hook may run any more (the backend releases the command next)."""
        self.scope.cancel()
        if self.state != "broken":
            self.state = "closed"
        self.queue.clear()

    async def pump(self, process: CommandProcess, name: str) -> None:
        """Hand the queue to ``process``, in order, then the close, and watch meanwhile for a process
        waiting for input; ends with the task (:meth:`end` cancels :attr:`scope`)."""
        with self.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_waiting, process, name)
                await self._feed(process, name)
                tg.cancel_scope.cancel()  # closed or broken: nobody can wait for it any more

    async def _watch_waiting(self, process: CommandProcess, name: str) -> None:
        #: ``writes`` when the previous look saw a process waiting; None when it saw none.
        previous: int | None = None
        while True:
            if self.queue or self.in_flight or process.input_pending():
                previous, self.waiting = None, False  # there is input on its way
            else:
                writes = self.writes
                try:
                    seen = await process.sample_input_waiting()
                except Exception:
                    log.exception("looking for a reader of command %s's input failed", name)
                    seen = None
                if seen is None:
                    # Cannot tell (yet: a supervisor's first report may still be on its way).
                    previous, self.waiting = None, None
                elif seen:
                    self.waiting = previous is not None and previous == writes == self.writes
                    previous = writes
                else:
                    previous, self.waiting = None, False
            await anyio.sleep(_WAIT_SAMPLE_S)

    async def _feed(self, process: CommandProcess, name: str) -> None:
        """The queue, in order, then the close; returns once closed or broken."""
        try:
            while True:
                if self.queue:
                    chunk = bytes(self.queue[:_INPUT_CHUNK])
                    del self.queue[:_INPUT_CHUNK]
                    self.in_flight = len(chunk)
                    try:
                        await process.send_input(chunk)
                    finally:
                        self.in_flight = 0
                elif self.state == "closing":
                    await process.end_input()
                    self.state = "closed"
                    return
                else:
                    self.wake = anyio.Event()
                    await self.wake.wait()
        except BrokenPipeError:
            self.broken()
        except Exception:
            log.exception("writing the input of command %s failed", name)
            self.broken()
