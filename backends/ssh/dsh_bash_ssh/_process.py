"""One command on the SSH host: a session channel, an in-band exit trailer, kills over a reserved channel."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import anyio
import asyncssh

from dsh_bash import BashInfrastructureError, CommandProcess, ExitStatus, Launch, signal_name
from dsh_bash._remote_bash import ExitTrailerFilter

from ._connection import Channel, ChannelPool
from ._scripts import BOOT_FAIL, BOOT_OK, KILL, STDERR_OK

__all__ = ["RemoteMarked", "SshProcess"]

log = logging.getLogger("dsh_bash.ssh")

StartHelper = Callable[..., None]

_CHUNK = 256 * 1024
_WORKDIR_REASONS = ("does not exist", "is not a directory", "cannot be entered")
#: rc-file noise kept while looking for the boot verdict (only its tail can hold a marker).
_MAX_NOISE = 64 * 1024


class RemoteMarked:
    """The processes on the host carrying a marker (exactly, or as a prefix), and their groups.

    Found and signalled by the shared KILL script, run over the pool's reserved kill channel (the
    connection is re-established first when it dropped: a command outlives its connection).
    """

    def __init__(self, pool: ChannelPool, *, marker: str, exact: bool) -> None:
        self._pool = pool
        self._marker = marker
        self._exact = exact

    def _args(self, mode: str, sig: int) -> tuple[str, ...]:
        return (mode, signal_name(sig) if sig else "0", self._marker, "1" if self._exact else "0")

    async def signal_all(self, sig: int) -> None:
        await self._pool.run_script(KILL, *self._args("signal", sig), kill=True)

    async def remaining(self) -> list[str]:
        _, out, _ = await self._pool.run_script(KILL, *self._args("list", 0), kill=True)
        return sorted(set(out.decode(errors="replace").split()))


class SshProcess(CommandProcess):
    def __init__(
        self,
        *,
        pool: ChannelPool,
        channel: Channel,
        launch: Launch,
        marked: RemoteMarked,
        start_helper: StartHelper,
        on_release: Callable[[], Awaitable[None]],
        nonce: str,
    ) -> None:
        self._pool = pool
        self._channel = channel
        self._launch = launch
        self._marked = marked
        self._start_helper = start_helper
        self._on_release = on_release
        self._stdout = ExitTrailerFilter(nonce, launch.stdout.feed)
        self._ended = anyio.Event()
        self._out_done = False
        self._err_done = anyio.Event()
        self._err_started = False
        self._err_held = b""
        self._pending_out = b""
        self._failure: str | None = None

    async def read_preamble(self) -> None:
        """Wait for the boot script's verdict, skipping rc-file noise; raise when the command cannot start."""
        process = self._channel.process
        buf = bytearray()
        while True:
            ok = buf.find(BOOT_OK)
            if ok >= 0:
                self._pending_out = bytes(buf[ok + len(BOOT_OK) :])
                return
            fail = buf.find(BOOT_FAIL)
            if fail >= 0:
                end = buf.find(b"\0", fail + len(BOOT_FAIL))
                if end >= 0:
                    reason = bytes(buf[fail + len(BOOT_FAIL) : end]).decode("utf-8", "replace")
                    if reason in _WORKDIR_REASONS:
                        raise BashInfrastructureError(f"workdir {self._launch.spec.workdir!r} {reason}")
                    raise BashInfrastructureError(
                        f"the command could not start on {self._pool.where}: {reason}"
                    )
            try:
                chunk = await process.stdout.read(_CHUNK)
            except (asyncssh.Error, OSError) as exc:
                raise BashInfrastructureError(
                    f"the connection to {self._pool.where} failed while starting the command: {exc}"
                ) from None
            if not chunk:
                detail = b""
                with anyio.move_on_after(1):
                    with contextlib.suppress(asyncssh.Error, OSError):
                        detail = await process.stderr.read(_CHUNK)
                text = (bytes(buf) + detail).decode("utf-8", "replace").strip("\0 \n")
                raise BashInfrastructureError(
                    f"the command could not start on {self._pool.where} "
                    f"(exit status {process.exit_status}): {text or 'no output'}"
                )
            buf += chunk
            if len(buf) > _MAX_NOISE:
                del buf[: len(buf) - _MAX_NOISE // 2]

    async def wait(self) -> ExitStatus:
        await self._ended.wait()
        if self._stdout.exit_code is not None:
            return ExitStatus(code=self._stdout.exit_code)
        if self._failure is not None or not self._pool.connected():
            raise BashInfrastructureError(
                f"lost the command: the SSH connection to {self._pool.where} failed"
                + (f" ({self._failure})" if self._failure else "")
            )
        raise BashInfrastructureError(
            f"the command's supervisor on {self._pool.where} ended without reporting an exit status "
            f"(channel exit status {self._channel.process.exit_status})"
        )

    def _feed_stdout(self, data: bytes) -> None:
        self._stdout.feed(data)
        if self._stdout.exit_code is not None:
            self._ended.set()

    def _feed_stderr(self, data: bytes) -> None:
        if not self._err_started:
            held = self._err_held + data
            index = held.find(STDERR_OK)
            if index < 0:
                # Everything before the marker is rc-file noise of the login shell.
                self._err_held = held[-(len(STDERR_OK) - 1) :]
                return
            self._err_started = True
            self._err_held = b""
            data = held[index + len(STDERR_OK) :]
            if not data:
                return
        self._launch.stderr.feed(data)

    async def _pump_stderr(self) -> None:
        try:
            while chunk := await self._channel.process.stderr.read(_CHUNK):
                self._feed_stderr(chunk)
        except (asyncssh.Error, OSError) as exc:
            self._failure = self._failure or str(exc) or type(exc).__name__
        finally:
            self._err_done.set()

    async def pump_output(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump_stderr)
                if self._pending_out:
                    self._feed_stdout(self._pending_out)
                    self._pending_out = b""
                try:
                    while chunk := await self._channel.process.stdout.read(_CHUNK):
                        self._feed_stdout(chunk)
                except (asyncssh.Error, OSError) as exc:
                    self._failure = self._failure or str(exc) or type(exc).__name__
                else:
                    self._stdout.flush()
                self._out_done = True
                await self._err_done.wait()
        finally:
            self._ended.set()

    async def signal_all(self, sig: int) -> None:
        await self._marked.signal_all(sig)

    async def remaining(self) -> list[str]:
        return await self._marked.remaining()

    async def release(self) -> None:
        if self._out_done and self._err_done.is_set():
            await self._channel.close()
        else:
            # Leftovers still hold the command's output: keep draining so their writes never block.
            self._start_helper(_discard_until_eof, self._channel)
        await self._on_release()


async def _discard_until_eof(channel: Channel) -> None:
    async def discard(reader: asyncssh.SSHReader[bytes]) -> None:
        try:
            while await reader.read(_CHUNK):
                pass
        except (asyncssh.Error, OSError):
            pass

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(discard, channel.process.stderr)
            await discard(channel.process.stdout)
    finally:
        with anyio.CancelScope(shield=True):
            await channel.close()
