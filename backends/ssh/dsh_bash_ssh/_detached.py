"""Background tasks detached on the host, followed through one SFTP channel per executor.

When dsh-supervise is installed, a detached task runs under ``dsh-supervise --detach`` (BOOT execs
it, see ``_scripts._DETACH_SUPERVISED``): its output goes to ``BASE.stdout``/``BASE.stderr`` in the
private spill directory, its status records to ``BASE.status``, each signed with a key only the
executor and the supervisor know (:class:`~dsh_bash.supervisor.SignedRecords`). The task's outcome is
the verified ``exit``/``signal`` record (a self-kill is a signal), the end of its output the verified
``empty``; files or lines the task writes itself mean nothing. Kills go to the supervisor (SIGUSR1,
SIGUSR2), which reaches every process of the task however it hides; a supervisor killed by the task
(same user) leaves the marker as the last hint, and the task ``command_lost`` unless its exit was in.

Without the supervisor the task runs under a bash script started with ``setsid -f`` (see
``_scripts.SUPERVISOR``), its end told by ``BASE.exit-STATUS`` and ``BASE.eof``, files the task
could write as well. No channel is held while it runs. One :class:`Follower`
per executor lists the spill directory each tick (one ``readdir`` gives every file's size) and
reads only the files that grew, from their offsets, through files it keeps open: a tick costs
one round trip plus the new bytes, whatever the total output. Ticks are fast right after activity
and slow down when idle. When the connection drops, the follower reconnects and goes on at the
same offsets (the tasks keep running on the host).

Every file is opened by path only where the listing showed a regular file, and read-write (never
written): SFTP has neither O_NOFOLLOW nor O_NONBLOCK, and a FIFO swapped in after the listing would
hold a read-only open (and the single-threaded SFTP server with it) until a writer came, while Linux
opens a FIFO read-write at once. The opened file itself (fstat) must then be a regular file of the
login's, else it is refused: a status file so replaced (or removed) before the follower holds it
makes its task end ``command_lost``; an output file, its stream gets nothing more. A file the
follower holds is read through its handle, whatever the path now names.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import asyncssh

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    CommandProcess,
    ExitStatus,
    InfraReason,
    Launch,
    OutputStream,
)
from dsh_bash.supervisor import (
    SignedRecords,
    SupervisorRecords,
)

from ._connection import ChannelPool, RequestRefused
from ._process import RemoteMarked
from ._scripts import SIGNAL_SUPERVISORS

__all__ = ["DetachedProcess", "DetachedSpill", "DetachedSupervisors", "Follower"]

log = logging.getLogger("dsh_bash.ssh")

_FAST_TICK_S = 0.02
_SLOW_TICK_S = 0.2
#: Reads per request; asyncssh splits larger ones itself.
_READ_CHUNK = 1 << 20
#: How long the follower keeps trying to reach the host again before it gives its tasks up.
_RECONNECT_BOUND_S = 30.0
#: How long an idle follower keeps its channel before it releases it.
_IDLE_LINGER_S = 1.0
STREAMS = ("stdout", "stderr")
#: Stands in for bytes that are counted but never read (see Follower._read).
_PLACEHOLDER = bytes(1 << 20)
#: A lost spill's file gets its read part freed each time this many more bytes were read (a capped
#: file: a quarter of its cap, so that its writer, which stops at the cap, never waits long).
_PUNCH_STEP = 64 << 20
#: Listings in a row that show a task's eof file but no exit file before the task counts as lost.
_EOF_WITHOUT_EXIT_TICKS = 5
#: How long a release waits to remove a given-up spill file itself before leaving it to the loop.
_REMOVE_NOW_BOUND_S = 5.0
#: How often the follower looks whether a task's supervisor still lives (one read of its
#: /proc/PID/stat): a supervisor the task killed writes no record, so only this tells it is gone.
_LIVENESS_S = 0.5
#: Bytes of a status file read per tick: its records are short; more is junk a task appended.
_STATUS_CHUNK = 1 << 20
#: How long a kill waits for the follower to read the supervisor's pid from a task just started.
_SUPERVISOR_PID_BOUND_S = 2.0
#: How long one signal to tasks' supervisors (a script over the kill channel) may take.
_SIGNAL_BOUND_S = 10.0
#: Supervisors one script signals at most (its arguments stay far below the host's ARG_MAX).
_SIGNAL_BATCH = 500
#: SFTP errors that say the channel is gone, not that a file refused what was asked of it.
_CHANNEL_ERRORS = (asyncssh.SFTPNoConnection, asyncssh.SFTPConnectionLost, asyncssh.SFTPBadMessage)


class DetachedSpill:
    """The spill file of a detached task's stream: the task's own output file, which already holds
    the whole stream. ``write`` and ``close`` have nothing to do; ``delete`` marks it for removal
    once the task is done (the follower still reads it until then)."""

    #: The task writes the file itself: nothing is sent to it, so nothing can fail behind the scenes.
    #: Its supervisor made it before the task's first byte.
    lost = False
    pending = False

    def __init__(self, path: str) -> None:
        self._path = path
        self.deleted = False
        #: From :meth:`delete`: called once the file was removed (the stream's budget is free).
        self.gone: Callable[[], None] | None = None

    @property
    def path(self) -> str:
        return self._path

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def close(self) -> None:
        pass

    def delete(self, gone: Callable[[], None]) -> None:
        # The task still writes the file: its bytes are gone only once it is removed, at release.
        self.deleted = True
        self.gone = gone


class _Followed:
    """What the follower knows about one task."""

    def __init__(
        self,
        base: str,
        launch: Launch,
        spills: dict[str, DetachedSpill],
        key: bytes | None = None,
        cap: int | None = None,
    ) -> None:
        self.base = base
        self.spills = spills
        #: Under dsh-supervise --cap-bytes: the caps its writer knows of (stdout's, stderr's), raised
        #: through BASE.cap as the streams' grants grow (None: no cap, the marker fallback).
        self.caps = None if cap is None else (cap, cap)
        self.writing_caps = False
        #: Per stream, how far the file's start was freed (punched) and whether a punch runs.
        self.punched = {stream: 0 for stream in STREAMS}
        self.punching: set[str] = set()
        self.name = base.rsplit("/", 1)[-1]
        self.launch = launch
        self.offsets = {stream: 0 for stream in STREAMS}
        self.files: dict[str, Any] = {}
        self.exit = anyio.Event()
        self.status: ExitStatus | None = None
        #: Under dsh-supervise --detach: the status file's verifier (None without the supervisor)
        #: and what its verified records said.
        self.signed = SignedRecords(key) if key is not None else None
        self.records = SupervisorRecords()
        #: Set once the supervisor's pid is known (its first record), or the task ended.
        self.supervisor_known = anyio.Event()
        #: The supervisor ended without its last record (killed): the marker finds what it left.
        self.supervisor_gone = False
        self.next_check = 0.0
        self.warned_forged = False
        self.eof = anyio.Event()
        self.failure: str | None = None
        self.failure_reason: InfraReason = "unclassified"
        self.feeding = True
        self.unexplained_eofs = 0
        #: Its status file was not the supervisor's when the follower opened it (see _SignedEnding).
        self.tampered = False
        #: Streams whose file was refused at its opening: nothing more is read from them.
        self.refused: set[str] = set()

    def fail(self, message: str, reason: InfraReason) -> None:
        self.failure = message
        self.failure_reason = reason
        self.exit.set()
        self.eof.set()
        self.supervisor_known.set()

    @property
    def supervised(self) -> bool:
        return self.signed is not None


class Follower:
    """Reads every detached task's files through one SFTP channel, as long as tasks exist."""

    def __init__(self, pool: ChannelPool, start_helper: Callable[..., None]) -> None:
        self._pool = pool
        self._start_helper = start_helper
        self._tasks: dict[str, _Followed] = {}
        self._to_remove: list[str] = []
        #: Called once the path was removed (a given-up spill's budget is free only then).
        self._on_removed: dict[str, Callable[[], None]] = {}
        self._running = False
        self._wake = anyio.Event()
        self._sftp: asyncssh.SFTPClient | None = None
        self._closed = False
        self._punch_works = True
        self._markers = _FileEnding()
        self._signed = _SignedEnding(pool.where)
        #: The spill directory's owner (the login's uid), which every followed file must have.
        self._owner: int | None = None
        self._owner_read = False
        self.directory = ""

    async def probe(self) -> bool:
        """Whether the server offers SFTP (opens the follower's channel when it does)."""
        try:
            await self._ensure_sftp()
        except _NoSftp as exc:
            log.warning(
                "%s offers no SFTP subsystem (%s): background tasks stay attached to a channel",
                self._pool.where,
                exc,
            )
            return False
        self._ensure_running()
        return True

    def add(
        self,
        base: str,
        launch: Launch,
        spills: dict[str, DetachedSpill],
        key: bytes | None = None,
        cap: int | None = None,
    ) -> _Followed:
        """Follow the task at ``base``; ``key``: its supervisor's (under dsh-supervise --detach);
        ``cap``: what each of its output files may hold on disk (dsh-supervise --cap-bytes)."""
        followed = _Followed(base, launch, spills, key, cap)
        self._tasks[followed.name] = followed
        self._ensure_running()
        self._wake.set()
        return followed

    def forget(
        self, followed: _Followed, remove: list[str], on_removed: dict[str, Callable[[], None]]
    ) -> None:
        """Stop following ``followed``; remove ``remove`` (paths) on the host; ``on_removed[path]``
        is called once ``path`` is confirmed removed."""
        self._on_removed.update(on_removed)
        followed.feeding = False
        self._tasks.pop(followed.name, None)
        self._to_remove.extend(remove)
        files, followed.files = followed.files, {}
        for handle in files.values():
            self._start_helper(_close_quietly, handle)
        self._ensure_running()
        self._wake.set()

    async def remove_now(self, paths: list[str], on_removed: dict[str, Callable[[], None]]) -> None:
        """Remove ``paths`` before returning (a spill file given up must be gone once its task is
        reported done); what cannot be removed now is left to the loop. ``on_removed[path]`` is
        called once ``path`` is confirmed removed."""
        self._on_removed.update(on_removed)
        paths = list(paths)
        try:
            with anyio.move_on_after(_REMOVE_NOW_BOUND_S):
                await self._remove(await self._ensure_sftp(), paths)
        except (asyncssh.Error, OSError, BashInfrastructureError, _NoSftp) as exc:
            log.debug("removing %s now failed (%s): left to the follower", paths, exc)
        if paths:
            self._to_remove.extend(paths)
            self._ensure_running()
            self._wake.set()

    def _removed(self, path: str) -> None:
        callback = self._on_removed.pop(path, None)
        if callback is not None:
            callback()

    def close(self) -> None:
        self._closed = True
        for followed in list(self._tasks.values()):
            followed.fail("the executor closed", "closed")
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if not self._running and not self._closed and (self._tasks or self._to_remove):
            self._running = True
            self._start_helper(self._run)

    async def _ensure_sftp(self) -> asyncssh.SFTPClient:
        if self._sftp is not None:
            return self._sftp
        try:
            self._sftp = await self._pool.open_sftp()
        except RequestRefused as exc:
            raise _NoSftp(str(exc)) from None
        return self._sftp

    async def _drop_sftp(self) -> None:
        sftp, self._sftp = self._sftp, None
        for followed in self._tasks.values():
            followed.files.clear()  # handles die with their channel
        if sftp is not None:
            try:
                sftp.exit()
                with anyio.move_on_after(2):
                    await sftp.wait_closed()
            except Exception as exc:  # a dead connection: nothing left to close
                log.debug("closing the SFTP channel: %r", exc)

    async def _run(self) -> None:
        delay = _FAST_TICK_S
        lost_since: float | None = None
        idle_since: float | None = None
        try:
            while not self._closed:
                if not self._tasks and not self._to_remove:
                    now = anyio.current_time()
                    idle_since = idle_since if idle_since is not None else now
                    if now - idle_since >= _IDLE_LINGER_S:
                        break
                else:
                    idle_since = None
                try:
                    sftp = await self._ensure_sftp()
                    active = await self._tick(sftp)
                    lost_since = None
                except (asyncssh.Error, OSError, BashInfrastructureError, _NoSftp) as exc:
                    await self._drop_sftp()
                    now = anyio.current_time()
                    lost_since = lost_since if lost_since is not None else now
                    if now - lost_since > _RECONNECT_BOUND_S or isinstance(exc, _NoSftp):
                        reason: InfraReason = (
                            "unclassified" if isinstance(exc, _NoSftp) else "connection_lost"
                        )
                        for followed in list(self._tasks.values()):
                            followed.fail(
                                f"cannot follow the task's output on {self._pool.where}: {exc}", reason
                            )
                        self._tasks.clear()
                        break
                    log.warning(
                        "following background tasks on %s failed (%s); retrying", self._pool.where, exc
                    )
                    active = False
                    delay = _SLOW_TICK_S
                delay = _FAST_TICK_S if active else min(delay * 2, _SLOW_TICK_S)
                with anyio.move_on_after(delay):
                    await self._wake.wait()
                self._wake = anyio.Event()
        finally:
            self._running = False
            with anyio.CancelScope(shield=True):
                await self._drop_sftp()
            if (self._tasks or self._to_remove) and not self._closed:
                self._ensure_running()

    async def _tick(self, sftp: asyncssh.SFTPClient) -> bool:
        """One pass: list the directory, read what grew, report ends. True if anything happened."""
        active = False
        if self._to_remove:
            paths, self._to_remove = self._to_remove, []
            try:
                await self._remove(sftp, paths)
            finally:
                # What an error left (a lost connection) is tried again on the next pass.
                self._to_remove[:0] = paths
            active = True
        if not self._tasks:
            return active
        # Only the tasks added before the listing began: the files of one added since may be
        # missing from it, which would read as removed.
        tasks = dict(self._tasks)
        listing = await self._list(sftp, tasks)
        for followed in tasks.values():
            if self._tasks.get(followed.name) is followed and await self._follow(sftp, followed, listing):
                active = True
        return active

    async def _remove(self, sftp: asyncssh.SFTPClient, paths: list[str]) -> None:
        """Remove ``paths`` in turn, each taken off the list once gone: on an error of the channel,
        the list holds what is left to remove. A path the server refuses to remove (a task put a
        directory there) is left to the spill directory's removal at ``aclose``."""
        while paths:
            try:
                with contextlib.suppress(asyncssh.SFTPNoSuchFile):
                    await sftp.remove(paths[0])
            except _CHANNEL_ERRORS:
                raise
            except asyncssh.SFTPError as exc:
                log.warning("cannot remove %s on %s (%s): left until aclose", paths[0], self._pool.where, exc)
            else:
                self._removed(paths[0])
            del paths[0]

    async def _list(self, sftp: asyncssh.SFTPClient, tasks: dict[str, _Followed]) -> _Listing:
        if not self._owner_read:
            self._owner = (await sftp.stat(self.directory)).uid
            self._owner_read = True
        listing = _Listing(owner=self._owner)
        for entry in await sftp.readdir(self.directory):
            filename = entry.filename
            assert isinstance(filename, str)
            name, _, suffix = filename.partition(".")
            if name not in tasks:
                continue
            if suffix in STREAMS or suffix == "status":
                listing.sizes[filename] = entry.attrs.size or 0
                if not _regular(entry.attrs):  # the server's lstat: a link shows as one
                    listing.irregular.add(filename)
            elif suffix.startswith("exit-") and suffix[5:].isdigit():
                listing.exits[name] = int(suffix[5:])
            elif suffix == "eof":
                listing.eofs.add(name)
        return listing

    async def _follow(self, sftp: asyncssh.SFTPClient, followed: _Followed, listing: _Listing) -> bool:
        """One task: how far it got (its ending's look), the output it wrote, its exit status, and
        its end once its output is complete. True if anything happened."""
        ending = self._signed if followed.supervised else self._markers
        progress = await ending.look(sftp, followed, listing)
        active = progress.active
        if ending.status_first and self._publish(followed, progress.status):
            active = True
        for stream in STREAMS:
            name = f"{followed.name}.{stream}"
            size = listing.sizes.get(name, 0)
            # A file held whose path names another file (or none) now: it tells its own size.
            swapped = stream in followed.files and (
                name not in listing.sizes or name in listing.irregular or size < followed.offsets[stream]
            )
            grew = size > followed.offsets[stream] or progress.at_eof or swapped
            to_end = progress.at_eof or swapped
            if grew and await self._read(sftp, followed, stream, size, listing, to_end=to_end):
                active = True
            if followed.caps is not None:
                self._maybe_punch(followed, stream)
        self._raise_caps(followed)
        if not ending.status_first and self._publish(followed, progress.status):
            active = True
        if progress.at_eof:
            ending.ended(followed)
            followed.eof.set()
            self._tasks.pop(followed.name, None)
            active = True
        return active

    @staticmethod
    def _publish(followed: _Followed, status: ExitStatus | None) -> bool:
        if status is None or followed.exit.is_set():
            return False
        followed.status = status
        followed.exit.set()
        return True

    async def _read(
        self,
        sftp: asyncssh.SFTPClient,
        followed: _Followed,
        stream: str,
        size: int,
        listing: _Listing,
        *,
        to_end: bool,
    ) -> bool:
        """Feed what the file gained. Only the last ``max_output_bytes`` of the gain are read: the
        stream keeps no more than that, and the file itself is the spill, so earlier bytes are
        only counted. A tick's cost is bounded, however fast the task writes."""
        handle = followed.files.get(stream)
        if handle is None:
            if stream in followed.refused:
                return False
            try:
                handle, attrs = await _open_checked(sftp, followed, stream, listing)
                if (attrs.size or 0) < followed.offsets[stream]:
                    await _close_quietly(handle)
                    raise _Refused("is shorter than what was read from it")
            except _Refused as exc:
                followed.refused.add(stream)
                log.warning(
                    "background task %s on %s: its %s file %s; its output from there on is lost",
                    followed.launch.marker,
                    self._pool.where,
                    stream,
                    exc,
                )
                return False
            followed.files[stream] = handle
        if to_end:
            size = (await handle.stat()).size or 0  # the listing's size may predate the eof file
        offset = followed.offsets[stream]
        if size <= offset:
            return False
        target = followed.launch.stdout if stream == "stdout" else followed.launch.stderr
        # What the kept tail would drop is not fetched, unless a tap takes every byte (R-output-tap).
        skip = 0 if target.tapped else max(0, size - offset - target.max_bytes)
        data = bytearray()
        while offset + skip + len(data) < size:
            chunk = await handle.read(
                min(_READ_CHUNK, size - offset - skip - len(data)), offset + skip + len(data)
            )
            if not chunk:
                break
            assert isinstance(chunk, bytes)  # opened in binary mode
            data += chunk
        followed.offsets[stream] = offset + skip + len(data)
        if followed.feeding:
            # Synchronous from here: no reader sees the placeholder bytes, which the real tail
            # fed right after pushes out (and counts as dropped, as they were).
            while skip:
                step = min(skip, len(_PLACEHOLDER))
                target.feed(memoryview(_PLACEHOLDER)[:step])
                skip -= step
            target.feed(data)
        self._maybe_punch(followed, stream)
        self._raise_caps(followed)
        return True

    def _maybe_punch(self, followed: _Followed, stream: str) -> None:
        """No spill file kept (refused or lost past max_spill_bytes): the bytes read are needed
        nowhere any more, free them. Checked after each read, and each tick for a capped task (its
        writer may wait for exactly this while nothing else moves)."""
        target = followed.launch.stdout if stream == "stdout" else followed.launch.stderr
        if (
            followed.feeding
            and target.total_bytes > target.max_bytes
            and target.spill_path is None
            and self._punch_works
            and stream not in followed.punching
            and followed.offsets[stream] - followed.punched[stream] >= self._punch_step(followed, target)
        ):
            followed.punching.add(stream)
            self._start_helper(self._punch, followed, stream, followed.offsets[stream])

    def _raise_caps(self, followed: _Followed) -> None:
        """Start telling the supervisor of grants that grew (checked after each read and each tick:
        a writer waiting at its old cap must learn of the new one even when nothing else moves)."""
        if followed.caps is not None and not followed.writing_caps and followed.feeding:
            launch = followed.launch
            if (launch.stdout.prepaid, launch.stderr.prepaid) != followed.caps:
                followed.writing_caps = True
                self._start_helper(self._write_caps, followed)

    @staticmethod
    def _punch_step(followed: _Followed, target: OutputStream) -> int:
        # A capped file's writer stops at its grant: free a quarter of it at a time, so that it never
        # waits long. An uncapped one (the marker fallback) is freed in larger steps.
        if followed.caps is None:
            return _PUNCH_STEP
        return max(4096, min(_PUNCH_STEP, target.prepaid // 4))

    async def _write_caps(self, followed: _Followed) -> None:
        """Tell the task's supervisor its streams' grants grew: BASE.cap, replaced whole by a rename
        (created O_EXCL under a fresh name first: never written through a planted link)."""
        launch = followed.launch
        caps = (launch.stdout.prepaid, launch.stderr.prepaid)
        temporary = f"{followed.base}.cap-{secrets.token_hex(8)}"
        try:
            sftp = await self._ensure_sftp()
            handle = await sftp.open(temporary, "xb", asyncssh.SFTPAttrs(permissions=0o600))
            try:
                await handle.write(b"%d %d\n" % caps)
            finally:
                await handle.close()
            await sftp.posix_rename(temporary, f"{followed.base}.cap")
            followed.caps = caps
        except (asyncssh.Error, OSError, BashInfrastructureError, _NoSftp) as exc:
            log.debug("raising the output caps of %s failed (%s): tried again next tick", followed.base, exc)
            self._to_remove.append(temporary)
        finally:
            followed.writing_caps = False
        self._wake.set()

    async def _punch(self, followed: _Followed, stream: str, upto: int) -> None:
        """Free the disk blocks of a lost spill's bytes already read: the file keeps its size and
        offsets (a hole reads as zeros), so following goes on, and the disk does not fill up
        with output nobody keeps. Only a regular file is punched, opened once (read-write, which
        never blocks on a FIFO) and checked through its descriptor: fallocate's own open by path
        would follow a link or wait on a FIFO for a reader, holding a channel for ever."""
        length = upto - upto % 4096
        done = True
        try:
            code, _, err = await self._pool.run_script(
                '[[ -f $1 && ! -L $1 ]] && exec 3<>"$1" && [[ -f /dev/fd/3 ]] || exit 3\n'
                'exec fallocate --punch-hole --offset 0 --length "$2" /dev/fd/3',
                f"{followed.base}.{stream}",
                str(length),
            )
            if code == 0:
                followed.punched[stream] = length
            elif code == 3 and followed.feeding:
                # The path names no regular file now (a process of the login replaced it): never
                # punched again (the stream stays in ``punching``); its capped writer waits at its
                # cap until the task is killed.
                done = False
                log.warning(
                    "background task %s on %s: its %s file is no regular file any more; its read "
                    "output is not freed",
                    followed.launch.marker,
                    self._pool.where,
                    stream,
                )
            elif not followed.feeding:
                pass  # released meanwhile: its file is gone, which says nothing about fallocate
            elif self._punch_works:
                self._punch_works = False
                log.warning(
                    "cannot free the disk space of lost output on %s (fallocate --punch-hole: %s); "
                    "a detached task's output file keeps growing until the task ends",
                    self._pool.where,
                    err.decode("utf-8", "replace").strip() or f"exit status {code}",
                )
        except (BashInfrastructureError, OSError) as exc:
            log.debug("punching %s.%s failed: %s", followed.base, stream, exc)
        finally:
            if done:
                followed.punching.discard(stream)
            self._wake.set()  # a capped writer may go on now: look soon


@dataclass(slots=True)
class _Listing:
    """One listing of the spill directory, for the followed tasks' files."""

    #: The directory's owner (the login's uid; None: the server did not say).
    owner: int | None = None
    #: Sizes of the output and status files, by file name.
    sizes: dict[str, int] = field(default_factory=dict)
    #: Those of them that are no regular file (as the server's lstat tells: a link is one).
    irregular: set[str] = field(default_factory=set)
    #: The marker fallback's end files, by task name: the status in BASE.exit-STATUS's name, and the
    #: tasks that have a BASE.eof.
    exits: dict[str, int] = field(default_factory=dict)
    eofs: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Progress:
    """How far a task got, as its ending told at one tick."""

    #: Something was read (the tick that follows comes fast).
    active: bool
    #: Its output is complete: read each file to its end, then the task is done.
    at_eof: bool
    status: ExitStatus | None


class _Ending(Protocol):
    """How the follower learns a task's exit status and the end of its output."""

    #: Whether the status is published before the tick's output is read, or after it. Each mode
    #: keeps the order it always had, which is not indifferent: when that read fails and the host
    #: stays out of reach until the follower gives up, a status published first is what the task
    #: reports; else the task reports the lost connection.
    status_first: bool

    async def look(self, sftp: asyncssh.SFTPClient, followed: _Followed, listing: _Listing) -> _Progress: ...

    def ended(self, followed: _Followed) -> None:
        """The output is complete: explain an end without status."""


class _FileEnding:
    """The marker fallback: BASE.exit-STATUS and BASE.eof, written by the task script (or by the
    task itself: nothing tells them apart)."""

    status_first = False

    async def look(self, sftp: asyncssh.SFTPClient, followed: _Followed, listing: _Listing) -> _Progress:
        code = listing.exits.get(followed.name)
        at_eof = followed.name in listing.eofs
        if at_eof and not followed.exit.is_set() and code is None:
            # A listing spanning several requests may show a file created during it (the eof
            # file) and miss an older one (the exit file): look again next tick.
            followed.unexplained_eofs += 1
            if followed.unexplained_eofs < _EOF_WITHOUT_EXIT_TICKS:
                at_eof = False
        # The task script's `$?`: a signal reads as 128+n.
        status = None if code is None else ExitStatus(code=code, exit_code_only=True)
        return _Progress(active=False, at_eof=at_eof, status=status)

    def ended(self, followed: _Followed) -> None:
        if not followed.exit.is_set():  # an eof file without exit file: never written so
            followed.fail("the task's supervisor ended without an exit status", "command_lost")


class _SignedEnding:
    """Under dsh-supervise --detach: the verified records of BASE.status (the task can create any
    file in the directory, so nothing else counts), and whether the supervisor still lives (one the
    task killed writes no last record).

    The status file is opened by path when it is first read and again after a reconnect; whatever
    a process of the login put at that path then (a FIFO, a link, a directory, another file, or
    nothing) is refused (see :func:`_open_checked`), and so is a file that does not start with the
    supervisor's first record (it was written before the task's start returned) or is shorter than
    what was read already: the task ends ``command_lost`` (its processes are killed through its
    supervisor when its pid is known, else by marker). A file the follower holds is read through its
    handle: replacing the path then changes nothing.
    """

    status_first = True

    def __init__(self, where: str) -> None:
        self._where = where

    async def look(self, sftp: asyncssh.SFTPClient, followed: _Followed, listing: _Listing) -> _Progress:
        records = followed.records
        signed = followed.signed
        assert signed is not None
        gone = False
        now = anyio.current_time()
        if records.supervisor_pid is not None and not records.empty and now >= followed.next_check:
            followed.next_check = now + _LIVENESS_S
            # Looked at before the status file is read: a supervisor that exited wrote its last
            # record before, so a file read after this shows it.
            gone = not await _supervisor_alive(sftp, records)
        name = f"{followed.name}.status"
        size = listing.sizes.get(name)
        if (
            size is None
            or size < signed.fed
            or name in listing.irregular
            or gone
            or "status" not in followed.files
        ):
            # Opened now, read to its end, or the path names another file (or none) now: the
            # file's own size (fstat), which for one held is the supervisor's file, wherever it is.
            size = None
        complete = True
        active = False
        if size is None or size > signed.fed:
            fed = signed.fed
            try:
                complete = await self._read_status(sftp, followed, size, listing)
            except _Refused as exc:
                self._refused(followed, str(exc))
                return _Progress(active=True, at_eof=True, status=None)
            # Not merely looked at (a held file whose path was replaced is looked at every tick).
            active = gone or signed.fed > fed
        if records.supervisor_pid is not None:
            followed.supervisor_known.set()
        return _Progress(
            active=active, at_eof=records.empty or (gone and complete), status=records.command_exit
        )

    async def _read_status(
        self, sftp: asyncssh.SFTPClient, followed: _Followed, size: int | None, listing: _Listing
    ) -> bool:
        """Feed what the status file gained to its verifier (at most _STATUS_CHUNK a tick); True when
        everything up to ``size`` (None: the file's size now) was read. Raises :class:`_Refused`
        when the file at the path is not the supervisor's."""
        signed = followed.signed
        assert signed is not None
        handle = followed.files.get("status")
        first = signed.fed == 0
        if handle is None:
            handle, attrs = await _open_checked(sftp, followed, "status", listing)
            size = attrs.size or 0
            if size < signed.fed or size == 0:
                await _close_quietly(handle)
                raise _Refused("is shorter than what was read from it" if signed.fed else "is empty")
            followed.files["status"] = handle
        elif size is None:
            size = (await handle.stat()).size or 0
        want = min(size - signed.fed, _STATUS_CHUNK)
        if want > 0:
            data = await handle.read(want, signed.fed)
            assert isinstance(data, bytes)  # opened in binary mode
            forged = signed.forged
            for record in signed.feed(data):
                followed.records.apply(record)
            if first and signed.next_seq == 0:
                # The supervisor wrote its first record before the task's start returned.
                raise _Refused("does not start with its supervisor's first record")
            if signed.forged > forged and not followed.warned_forged:
                followed.warned_forged = True
                log.warning(
                    "background task %s on %s: its status file holds lines that do not verify "
                    "(written by the task?); they are ignored",
                    followed.launch.marker,
                    self._where,
                )
        return signed.fed >= size

    def _refused(self, followed: _Followed, why: str) -> None:
        log.warning(
            "background task %s on %s: its status file %s (replaced by a process of the login?); "
            "the task is lost",
            followed.launch.marker,
            self._where,
            why,
        )
        followed.tampered = True
        followed.fail(
            f"the status file of the background task on {self._where} {why} (replaced by a process of "
            "the login?): its exit status is lost",
            "command_lost",
        )

    def ended(self, followed: _Followed) -> None:
        if followed.tampered:
            # Its supervisor may well live on: it is still the way to kill the task (when its pid
            # was read), and its records go on into the file the path no longer names.
            followed.supervisor_known.set()
            return
        if not followed.records.empty:
            followed.supervisor_gone = True
            log.warning(
                "the supervisor of background task %s on %s ended without its last record "
                "(killed by the task itself?)",
                followed.launch.marker,
                self._where,
            )
            if not followed.exit.is_set():
                followed.fail(
                    f"the background task's supervisor on {self._where} ended before it "
                    "reported how the command ended (killed by the task itself?); "
                    "its exit status is lost",
                    "command_lost",
                )
        followed.supervisor_known.set()


class _Refused(Exception):
    """A followed file at its path is not the one its task's supervisor (or script) made."""


def _regular(attrs: asyncssh.SFTPAttrs) -> bool:
    """A regular file, as far as the server tells (a server that sends no mode is believed)."""
    return attrs.permissions is None or stat.S_ISREG(attrs.permissions)


async def _open_checked(
    sftp: asyncssh.SFTPClient, followed: _Followed, suffix: str, listing: _Listing
) -> tuple[Any, asyncssh.SFTPAttrs]:
    """Open ``BASE.suffix`` for reading, never blocking and never reading anything but a regular
    file of the login's; raises :class:`_Refused` otherwise.

    The listing (the server's lstat) must show a regular file there: no link is followed, no FIFO
    or device opened, unless one was swapped in since. The open asks for reading and writing (the
    file is never written): that is what keeps a FIFO swapped in from blocking the open (Linux opens
    a FIFO for both at once; for reading alone it waits for a writer, and the SFTP server, which
    serves one request at a time, with it). Then the opened file itself (fstat on the handle, so
    nothing swapped in later counts) must be a regular file owned by the spill directory's owner.
    """
    filename = f"{followed.name}.{suffix}"
    if filename not in listing.sizes:
        raise _Refused("is gone")
    if filename in listing.irregular:
        raise _Refused("is no regular file (a link, a FIFO, a directory, ...)")
    try:
        handle = await sftp.open(f"{followed.base}.{suffix}", "r+b")
    except _CHANNEL_ERRORS:
        raise
    except asyncssh.SFTPError as exc:
        raise _Refused(f"cannot be opened ({exc.reason})") from None
    try:
        attrs = await handle.stat()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _close_quietly(handle)
        raise
    if not _regular(attrs) or (listing.owner is not None and attrs.uid not in (None, listing.owner)):
        await _close_quietly(handle)
        raise _Refused("is no regular file of the login's")
    return handle, attrs


class _NoSftp(Exception):
    pass


async def _supervisor_alive(sftp: asyncssh.SFTPClient, records: SupervisorRecords) -> bool:
    """Whether the supervisor of ``records`` still runs: its pid shows the start time it recorded
    (another start time: the pid was reused) and is no zombie."""
    try:
        handle = await sftp.open(f"/proc/{records.supervisor_pid}/stat", "rb")
        try:
            data = await handle.read(4096, 0)
        finally:
            await handle.close()
    except asyncssh.SFTPNoSuchFile:
        return False
    except asyncssh.SFTPError as exc:
        # /proc out of the SFTP server's reach (a chroot): nothing tells the supervisor is gone.
        log.debug("reading the stat of supervisor %s: %s", records.supervisor_pid, exc)
        return True
    assert isinstance(data, bytes)
    return _stat_matches(data, records.supervisor_start_time)


def _stat_matches(stat: bytes, start_time: int | None) -> bool:
    # The command name (field 2) is in parentheses and may hold anything: fields after the last ')'.
    fields = stat.rpartition(b")")[2].split()
    try:
        return fields[0] not in (b"Z", b"X") and int(fields[19]) == start_time
    except (IndexError, ValueError):
        return False


async def _close_quietly(handle: Any) -> None:
    try:
        with anyio.move_on_after(2):
            await handle.close()
    except Exception as exc:
        log.debug("closing an SFTP file: %r", exc)


class DetachedProcess(CommandProcess):
    """A background task detached on the host: its output and end come from the follower.

    Under dsh-supervise (``followed.supervised``) it is in the executor's :class:`DetachedSupervisors`
    (``registry``) until its supervisor said that no process is left or is gone, so that the
    leftovers' kill at ``aclose`` reaches it.
    """

    def __init__(
        self,
        *,
        pool: ChannelPool,
        follower: Follower,
        followed: _Followed,
        marked: RemoteMarked,
        spills: dict[str, DetachedSpill],
        on_release: Callable[[], Awaitable[None]],
        registry: DetachedSupervisors | None = None,
    ) -> None:
        self._pool = pool
        self._follower = follower
        self._followed = followed
        self._marked = marked
        self._spills = spills
        self._on_release = on_release
        self._registry = registry
        if registry is not None and followed.supervised:
            registry.add(self)

    async def wait(self) -> ExitStatus:
        followed = self._followed
        await followed.exit.wait()
        if followed.status is not None:
            return followed.status
        if followed.failure is not None:
            raise BashInfrastructureError(followed.failure, reason=followed.failure_reason)
        raise BashInfrastructureError(
            f"lost the background task on {self._pool.where}", reason="command_lost"
        )

    async def pump_output(self) -> None:
        try:
            await self._followed.eof.wait()
        finally:
            self._followed.feeding = False

    @property
    def ended(self) -> bool:
        """True once the supervisor said no process is left, or is gone (the marker then reaches
        what it left: the fallback of the executor's leftovers)."""
        followed = self._followed
        return followed.records.empty or followed.supervisor_gone or followed.failure is not None

    async def _supervisor(self, request: str) -> bool:
        """Send ``request`` (USR1, USR2, or 0: look only) to the task's supervisor; False when it is
        gone (or its pid is not known: it never wrote its first record)."""
        followed = self._followed
        if followed.records.supervisor_pid is None and not followed.supervisor_known.is_set():
            # Just started: the follower reads its first record at its next tick.
            with anyio.move_on_after(_SUPERVISOR_PID_BOUND_S):
                await followed.supervisor_known.wait()
        if not self._reachable:
            return False
        return (await _ask_supervisors(self._pool, [self], request)) == [True]

    @property
    def _reachable(self) -> bool:
        """Its supervisor's pid is known, and it was not seen gone."""
        followed = self._followed
        return followed.records.supervisor_pid is not None and not followed.supervisor_gone

    async def signal_all(self, sig: int) -> None:
        followed = self._followed
        if followed.supervised:
            if followed.records.empty:
                return
            try:
                if await self._supervisor("USR2" if sig == signal.SIGKILL else "USR1"):
                    return
            except BashInfrastructureError as exc:
                log.debug("signalling the supervisor of %s failed: %s", followed.name, exc)
        await self._marked.signal_all(sig)

    async def remaining(self) -> list[str]:
        followed = self._followed
        if followed.supervised:
            if followed.records.empty:
                return []
            if await self._supervisor("0"):
                return [f"processes under dsh-supervise of background task {followed.name}"]
            if not followed.supervisor_known.is_set():
                return [f"the supervisor of {followed.name}"]
            # Gone: it just wrote its last record (the follower reads it soon) or it was killed.
            return await self._marked.remaining()
        found = await self._marked.remaining()
        if not found and not followed.exit.is_set() and followed.failure is None:
            # The supervisor may not have started the command yet (start returns once the
            # supervisor runs): the task counts as alive until its exit status is in.
            return [f"the supervisor of {followed.name}"]
        return found

    async def release(self) -> None:
        base = self._followed.base
        remove = [f"{base}.cmd", f"{base}.in"]
        if self._followed.supervised:
            remove.append(f"{base}.status")
            if self._followed.caps is not None:
                remove.append(f"{base}.cap")
        else:
            remove.append(f"{base}.eof")
            status = self._followed.status
            if status is not None and status.code is not None:
                remove.append(f"{base}.exit-{status.code}")
        given_up: dict[str, Callable[[], None]] = {}
        removed: dict[str, Callable[[], None]] = {}
        launch = self._followed.launch
        for stream in STREAMS:
            spill = self._spills.get(stream)
            path = f"{base}.{stream}"
            if spill is None:
                remove.append(path)
                # Never the spill: a grant (prepay_spills) comes back once the file is gone.
                removed[path] = (launch.stdout if stream == "stdout" else launch.stderr).prepaid_gone
            elif spill.deleted:
                given_up[path] = spill.gone or (lambda: None)
        self._follower.forget(self._followed, remove, removed)
        if given_up:
            # A read named this file while it was the spill: it must not outlive the task's end.
            await self._follower.remove_now(list(given_up), given_up)
        if self._registry is not None and self.ended:
            self._registry.discard(self)
        await self._on_release()


async def _ask_supervisors(pool: ChannelPool, tasks: list[DetachedProcess], request: str) -> list[bool]:
    """Send ``request`` (USR1, USR2, or 0: look only) to the supervisors of ``tasks`` (each
    ``_reachable``), a script per :data:`_SIGNAL_BATCH` of them; True for each that is alive."""
    alive: list[bool] = []
    for first in range(0, len(tasks), _SIGNAL_BATCH):
        batch = tasks[first : first + _SIGNAL_BATCH]
        pairs: list[str] = []
        for task in batch:
            records = task._followed.records
            pairs += [str(records.supervisor_pid), str(records.supervisor_start_time)]
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SIGNAL_BOUND_S) as scope:
            _, out, _ = await pool.run_script(SIGNAL_SUPERVISORS, request, *pairs, kill=True)
        await anyio.lowlevel.checkpoint()
        if scope.cancelled_caught:
            raise BashInfrastructureError(
                f"signalling the supervisors of background tasks on {pool.where} took too long",
                reason="connection_lost",
            )
        words = out.split()
        if len(words) != len(batch):
            raise BashInfrastructureError(
                f"signalling the supervisors of background tasks on {pool.where}: {len(words)} answers "
                f"for {len(batch)} tasks",
                reason="unclassified",
            )
        alive += [word == b"alive" for word in words]
    return alive


class DetachedSupervisors:
    """The executor's detached tasks under dsh-supervise, as one :class:`~dsh_bash.backend.Killable`.

    One script signals (or looks at) every supervisor: one per task, each a round trip over the kill
    channel, made a hundred tasks outlast ``aclose``'s bound, and the SIGKILL it ends with then
    reached tasks that never had their SIGTERM. A task leaves once it ``ended``. What a gone
    supervisor left is the executor's marker fallback's.
    """

    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool
        self.tasks: set[DetachedProcess] = set()

    @property
    def ended(self) -> bool:
        """No task is left (others may come: the executor's leftovers take this set anew each time)."""
        return not self.tasks

    def add(self, task: DetachedProcess) -> None:
        self.tasks.add(task)

    def discard(self, task: DetachedProcess) -> None:
        self.tasks.discard(task)

    async def _ask(self, request: str) -> tuple[list[DetachedProcess], list[DetachedProcess]]:
        """(alive, not known yet): ``request`` sent to every supervisor whose pid is known."""
        live = [task for task in self.tasks if not task.ended]
        reachable = [task for task in live if task._reachable]
        unknown = [task for task in live if not task._followed.supervisor_known.is_set()]
        if not reachable:
            return [], unknown
        answers = await _ask_supervisors(self._pool, reachable, request)
        return [task for task, alive in zip(reachable, answers, strict=True) if alive], unknown

    async def signal_all(self, sig: int) -> None:
        request = "USR2" if sig == signal.SIGKILL else "USR1"
        try:
            _, unknown = await self._ask(request)
            if not unknown:
                return
            # Just started: the follower reads their first records at its next tick. One bounded
            # wait for them all, one script for those it brought: a wait and a script per task made
            # a hundred tasks' close outlast its bound on a loaded host.
            with anyio.move_on_after(_SUPERVISOR_PID_BOUND_S):
                for task in unknown:
                    await task._followed.supervisor_known.wait()
            known = [task for task in unknown if task._reachable]
            if known:
                await _ask_supervisors(self._pool, known, request)
        except BashInfrastructureError as exc:
            log.debug("signalling the supervisors of background tasks failed: %s", exc)
        # What is still unknown (or unreached) is the executor's marker fallback's, which comes next.

    async def remaining(self) -> list[str]:
        alive, unknown = await self._ask("0")
        for task in list(self.tasks):
            if task.ended and task not in alive:
                self.tasks.discard(task)
        found = [f"processes under dsh-supervise of background task {t._followed.name}" for t in alive]
        return found + [f"the supervisor of {task._followed.name}" for task in unknown if task not in alive]
