"""One command inside the container: a hijacked exec stream, an exit status from the engine, kills by exec."""

from __future__ import annotations

import io
import logging
import math
import tarfile
from collections.abc import Awaitable, Callable
from typing import Literal
from urllib.parse import quote

import anyio
import anyio.to_thread

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import (
    CommandProcess,
    ExitStatus,
    InfraReason,
    Launch,
)
from dsh_bash.host import (
    ProcEntry,
    signal_marked,
)
from dsh_bash.host import scan_processes as scan
from dsh_bash.remote import (
    CommandStart,
    ExitTrailerFilter,
    boot_failure,
    boot_ok_undecided,
    find_boot_ok,
    kill_args,
)

from ._engine import EngineClient, EngineError, ExecStream
from ._scripts import BOOT_FAIL, KILL

__all__ = ["ContainerMarked", "DockerProcess", "diagnose_refusal", "lost_in_container", "run_script"]

#: How long a kill waits for the engine to run its script before signalling from the host (when
#: the host sees the container's processes).
_ENGINE_ANSWER_BOUND_S = 1.0
#: How long a command whose exec ended without an exit status waits for its container to show
#: whether it is ending (then the command is ``container_gone``, else ``command_lost``).
_GONE_SETTLE_S = 1.0
#: How long a failed start waits for the rest of the boot script's or the engine's report.
_REPORT_BOUND_S = 5.0

log = logging.getLogger("dsh_bash.docker")

StartHelper = Callable[..., None]

#: Our own scripts must never source an rc file the container's environment names.
SCRIPT_ENV = {"BASH_ENV": "", "ENV": ""}
#: Written to stdout first by every script :func:`run_script` runs: without it, bash never ran.
_BEGIN = b"\0dsh-bash-begin\0"
_BEGIN_SCRIPT = "printf '\\0dsh-bash-begin\\0'\n"
#: The exit codes the engine gives an exec whose process the runtime could not start.
_REFUSED_EXIT_CODES = (126, 127)
#: The PATH the engine gives processes of a container whose environment sets none.
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


async def start_script(
    engine: EngineClient, container: str, user: str | None, script: str, *args: str
) -> None:
    """Start a small bash script in the container and return without waiting for its end.

    For clean-up nobody waits on (its exit is never known): two requests on kept-alive connections
    instead of :func:`run_script`'s stream and inspect.
    """
    exec_id = await engine.exec_create(
        container,
        ["bash", "--noprofile", "--norc", "-c", script, "dsh-bash", *args],
        env=SCRIPT_ENV,
        stdin=False,
        user=user,
    )
    await engine.exec_start_detached(exec_id)


async def run_script(
    engine: EngineClient,
    container: str,
    user: str | None,
    script: str,
    *args: str,
    stdin: bytes | None = None,
) -> tuple[int, bytes, bytes]:
    """Run a small bash script in the container to its end: (exit code, stdout, stderr).

    When the engine could not start bash at all (the runtime refused the exec), raises an
    :class:`EngineError` without status and with reason ``start_failed``; :func:`diagnose_refusal`
    tells why.
    """
    exec_id = await engine.exec_create(
        container,
        ["bash", "--noprofile", "--norc", "-c", _BEGIN_SCRIPT + script, "dsh-bash", *args],
        env=SCRIPT_ENV,
        stdin=stdin is not None,
        user=user,
    )
    stream = await engine.exec_start(exec_id)
    out, err = bytearray(), bytearray()
    try:
        if stdin is not None:
            await stream.send_stdin(stdin)
            await stream.close_stdin()
        await stream.pump(out.extend, err.extend)
    finally:
        await stream.aclose()
    code = await engine.exec_exit_code(exec_id)
    began = out.startswith(_BEGIN)
    if code in _REFUSED_EXIT_CODES and not began:
        # The runtime could not start the process at all (no bash, an unknown user, the pids limit).
        detail = bytes(out + err).decode("utf-8", "replace").strip()
        raise EngineError(
            f"cannot start a process in container {container[:12]}: {detail}", reason="start_failed"
        )
    return (-1 if code is None else code), bytes(out[len(_BEGIN) :] if began else out), bytes(err)


async def diagnose_refusal(
    engine: EngineClient, container: str, user: str | None, path: str | None = None
) -> InfraReason:
    """Why the engine could not start bash as ``user`` in ``container``, from the container's files.

    The engine resolves the user first (``name[:group]`` through the container's ``/etc/passwd`` and
    ``/etc/group``; numeric ids need no entry), then looks ``bash`` up on ``path`` (the container's
    PATH when None). So: ``user_unknown`` when a name is in neither file, ``shell_missing`` when no
    directory of the PATH holds a ``bash``, else ``start_failed`` (the pids limit reached, say).
    Works on a created container that never started too.
    """
    try:
        info = await engine.container_inspect(container)
        if user:
            name, _, group = user.partition(":")
            if not await _has_entry(engine, container, "/etc/passwd", name) or (
                group and not await _has_entry(engine, container, "/etc/group", group)
            ):
                return "user_unknown"
        if path is None:
            env = (info.get("Config") or {}).get("Env") or []
            path = next((item[5:] for item in env if item.startswith("PATH=")), _DEFAULT_PATH)
        for directory in path.split(":"):
            where = f"{directory or '.'}/bash"
            if not where.startswith("/"):
                continue  # relative to the process's workdir: not worth guessing
            status, _ = await engine.request_raw(
                "HEAD", f"/containers/{quote(container, safe='')}/archive?path={quote(where, safe='')}"
            )
            if status == 200:
                return "start_failed"
        return "shell_missing"
    except EngineError:  # the container went away meanwhile: nothing to tell from it
        return "start_failed"


async def _has_entry(engine: EngineClient, container: str, file: str, name: str) -> bool:
    """Whether ``name`` is a numeric id or has an entry in the container's ``file`` (passwd, group)."""
    if name.isdigit():
        return True
    status, data = await engine.request_raw(
        "GET", f"/containers/{quote(container, safe='')}/archive?path={quote(file, safe='')}"
    )
    if status == 404:
        return False  # no such file: no name resolves
    if status != 200:
        return True  # cannot tell: not claimed unknown
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            member = next((m for m in archive.getmembers() if m.isfile()), None)
            handle = archive.extractfile(member) if member is not None else None
            if handle is None:
                return True
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except tarfile.TarError:
        return True
    return any(line.split(":", 1)[0] == name for line in lines)


async def lost_in_container(engine: EngineClient, container: str, otherwise: str) -> BashInfrastructureError:
    """Why a command's exec stream ended without its exit status: ``container_gone`` when the
    container shows its end within a bound (one being removed or killed may still show as running
    for a moment after its processes died), ``connection_lost`` when the engine cannot be reached,
    else ``command_lost`` with ``otherwise`` as the message."""
    with anyio.move_on_after(_GONE_SETTLE_S):
        while True:
            try:
                state = (await engine.container_inspect(container)).get("State", {})
            except EngineError as exc:
                reason: InfraReason = exc.reason
                if exc.status == 404:
                    reason = "container_gone"
                elif exc.status is None:
                    reason = "connection_lost"
                return BashInfrastructureError(f"lost the command: {exc}", reason=reason)
            if not state.get("Running") or state.get("Status") in ("removing", "dead"):
                return BashInfrastructureError(
                    f"container {container[:12]} stopped under the command", reason="container_gone"
                )
            await anyio.sleep(0.05)
    return BashInfrastructureError(otherwise, reason="command_lost")


class ContainerMarked:
    """The processes in the container carrying a marker (exactly, or as a prefix), and their groups.

    Found and signalled by a script exec'd in the container. When no process can be started there
    (the pids limit is exhausted), the host's /proc is searched for the marker instead, which works
    when the engine runs on this host; in image mode the container itself is the last resort.

    A kill for one command (``exact``) skips processes that started before the command, unread (an
    environment can be megabytes; issue 15): in the container, by the start its boot script reported
    (:attr:`start`, once known); on the host, by ``host_since`` (:func:`boot_ticks` read here before
    the exec was created: the engine runs on this kernel when the host sees its processes).
    """

    def __init__(
        self,
        engine: EngineClient,
        container: Callable[[], str],
        user: str | None,
        *,
        marker: str,
        exact: bool,
        kill_container: Callable[[], Awaitable[bool]],
        host_sees_processes: Callable[[], bool],
        host_since: int | None = None,
    ):
        self._engine = engine
        self._container = container
        self._user = user
        self._marker = marker
        self._exact = exact
        self._kill_container = kill_container
        self._host_sees_processes = host_sees_processes
        self._host_since = host_since if exact else None
        #: The command's start on the container's clock, from its boot script (None until then).
        self.start: CommandStart | None = None
        #: The container has no such user (found once, it stays so for this command: it never ran).
        self._no_such_user = False

    def _args(self, mode: Literal["signal", "list"], sig: int) -> tuple[str, ...]:
        return kill_args(mode, sig, self._marker, exact=self._exact, start=self.start)

    async def signal_all(self, sig: int) -> None:
        # A saturated engine (a hundred commands ending at once) can take seconds to run one exec:
        # when the host sees the container's processes, the signal then goes out from there instead.
        bound = _ENGINE_ANSWER_BOUND_S if self._host_sees_processes() else math.inf
        try:
            with anyio.fail_after(bound):
                args = self._args("signal", sig)
                await run_script(self._engine, self._container(), self._user, KILL, *args)
        except TimeoutError:
            log.warning(
                "the engine did not run the kill script within %.0f s; signalling %s from the host",
                _ENGINE_ANSWER_BOUND_S,
                self._marker,
            )
            await self._host_signal(sig)
        except EngineError as exc:
            if exc.status in (404, 409):  # the container is gone or stopped: so are its processes
                return
            if exc.status is not None:
                raise
            if await self._user_unknown(exc):
                return
            if self._host_sees_processes():
                log.warning("%s; signalling %s from the host instead", exc, self._marker)
                await self._host_signal(sig)
            elif not await self._kill_container():
                raise

    async def _user_unknown(self, exc: EngineError) -> bool:
        """Whether the kill could not start because its user is not the container's: then no
        process of that user runs there (a command as that user was refused the same way), and
        neither a search of the host nor killing the whole container is called for."""
        if not self._no_such_user:
            self._no_such_user = (
                exc.reason == "start_failed"
                and bool(self._user)
                and await diagnose_refusal(self._engine, self._container(), self._user) == "user_unknown"
            )
        return self._no_such_user

    async def remaining(self) -> list[str]:
        try:
            _, out, _ = await run_script(
                self._engine, self._container(), self._user, KILL, *self._args("list", 0)
            )
        except EngineError as exc:
            if exc.status in (404, 409):
                return []
            if exc.status is not None:
                raise
            if await self._user_unknown(exc):
                return []
            if self._host_sees_processes():
                return [str(entry.pid) for entry in await self._host_entries()]
            if await self._kill_container():
                return []
            raise
        return sorted(set(out.decode().split()))

    async def _host_entries(self) -> list[ProcEntry]:
        try:
            marker, since = self._marker.encode(), self._host_since
            entries = await anyio.to_thread.run_sync(lambda: scan(marker, since=since))
        except OSError:
            return []
        return [
            e
            for e in entries
            if e.alive and e.marker is not None and (not self._exact or e.marker == self._marker)
        ]

    async def _host_signal(self, sig: int) -> None:
        for entry in await self._host_entries():
            await anyio.to_thread.run_sync(signal_marked, entry.pid, self._marker, sig, self._exact)


class DockerProcess(CommandProcess):
    def __init__(
        self,
        *,
        engine: EngineClient,
        container: str,
        exec_id: str,
        stream: ExecStream,
        launch: Launch,
        marked: ContainerMarked,
        start_helper: StartHelper,
        on_release: Callable[[], Awaitable[None]],
        nonce: str,
        wait_writable: Callable[[], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self._container = container
        self._exec_id = exec_id
        self._stream = stream
        self._launch = launch
        self._marked = marked
        self._start_helper = start_helper
        self._on_release = on_release
        self._eof_or_exit = anyio.Event()
        self._stdout = ExitTrailerFilter(nonce, launch.stdout.feed)
        self._pending_out: list[bytes] = []
        self._pending_err: list[bytes] = []
        # Backpressure: the command's spill files (CommandSpills.wait_writable) must catch up
        # before more output is read, or their queues would hold whatever the engine delivers.
        self._wait_writable = wait_writable
        self._fed = False

    async def read_preamble(self, user: str | None) -> None:
        """Wait for the boot script's verdict; raise BashInfrastructureError when the command cannot start.

        ``user``: the exec's, for telling why the engine could not start bash at all.
        """
        head = bytearray()
        early_err: list[bytes] = []
        started = await self._stream.pump_until(
            head.extend, lambda data: early_err.append(bytes(data)), lambda: not boot_ok_undecided(head)
        )
        found = find_boot_ok(head) if started else None
        if found is not None and found[0] == 0:
            _, end, self._marked.start = found
            # Output the command wrote in the same frame belongs to it.
            self._pending_out = [bytes(head[end:])] if len(head) > end else []
            self._pending_err = early_err
            return
        # The whole report: a failure's kind, or the engine's own words when bash never ran (the
        # exec has ended once the engine closes the stream, so its exit code is in).
        with anyio.move_on_after(_REPORT_BOUND_S):
            await self._stream.pump(head.extend, lambda data: early_err.append(bytes(data)))
        where = f"in container {self._container[:12]}"
        if head.startswith(BOOT_FAIL):
            report = bytes(head[len(BOOT_FAIL) :]).split(b"\0", 1)[0].decode("utf-8", "replace")
            raise boot_failure(report, workdir=self._launch.spec.workdir, where=where)
        detail = (bytes(head) + b"".join(early_err)).decode("utf-8", "replace").strip("\0 \n")
        code = await self._engine.exec_exit_code(self._exec_id, within_s=_REPORT_BOUND_S)
        reason: InfraReason = "unclassified"
        if code in _REFUSED_EXIT_CODES:  # bash never ran: the engine could not start it
            reason = await diagnose_refusal(self._engine, self._container, user, self._launch.env.get("PATH"))
        raise BashInfrastructureError(
            f"the command could not start {where}: {detail or 'no output'}", reason=reason
        )

    async def wait(self) -> ExitStatus:
        await self._eof_or_exit.wait()
        if self._stdout.exit_code is not None:
            # The boot wrapper's `$?`: a signal death reads as 128+n (the marker fallback only).
            return ExitStatus(code=self._stdout.exit_code, exit_code_only=True)
        # The stream ended without the boot script's trailer: the container (or the engine) failed.
        raise await lost_in_container(
            self._engine,
            self._container,
            "the command's supervisor in the container died; its exit status is lost",
        )

    def _feed_stdout(self, data: memoryview | bytes) -> None:
        self._fed = True
        self._stdout.feed(data)
        if self._stdout.exit_code is not None:
            self._eof_or_exit.set()

    def _feed_stderr(self, data: memoryview | bytes) -> None:
        self._fed = True
        self._launch.stderr.feed(data)

    def _fed_since_wait(self) -> bool:
        return self._fed

    async def pump_output(self) -> None:
        launch = self._launch
        try:
            async with anyio.create_task_group() as tg:
                stdin = launch.spec.stdin
                if stdin is not None:
                    tg.start_soon(self._write_stdin, stdin.encode() if isinstance(stdin, str) else stdin)
                for data in self._pending_out:
                    self._feed_stdout(data)
                for data in self._pending_err:
                    launch.stderr.feed(data)
                self._pending_out = []
                self._pending_err = []
                # pump_until returns after each read that fed output (True) or at end of stream.
                while await self._stream.pump_until(
                    self._feed_stdout, self._feed_stderr, self._fed_since_wait
                ):
                    self._fed = False
                    await self._wait_writable()
                tg.cancel_scope.cancel()
        finally:
            if self._stream.at_eof:
                self._stdout.flush()
                self._eof_or_exit.set()

    async def _write_stdin(self, data: bytes) -> None:
        try:
            await self._stream.send_stdin(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return
        await self._stream.close_stdin()

    async def signal_all(self, sig: int) -> None:
        await self._marked.signal_all(sig)

    async def remaining(self) -> list[str]:
        return await self._marked.remaining()

    async def release(self) -> None:
        if self._stream.at_eof:
            await self._stream.aclose()
        else:
            # Leftovers still hold the exec's output: keep draining so their writes never block.
            self._start_helper(_discard_until_eof, self._stream)
        await self._on_release()


async def _discard_until_eof(stream: ExecStream) -> None:
    try:
        await stream.pump(lambda _: None, lambda _: None)
    finally:
        await stream.aclose()
