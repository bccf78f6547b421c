"""The node host: one Ray actor per node and per harness process, on that node, doing what a backend
does where its commands run: start ``dsh-supervise --frame --spec`` processes and relay their
streams, signal and find processes by marker, keep spill files, run helper commands.

Every truth about a command (its outcome, its output's accounting, its kill sequence) stays in the
harness's executor; this side only moves bytes and signals. Its methods are what the harness calls
over Ray; they take and return plain values (no exception crosses for a refusal the harness must
tell apart: a start that cannot happen returns why).

The stream of a command is read by the harness with a long poll: :meth:`NodeHost.read` returns as
soon as bytes are there, always from an offset the harness names, so a call repeated after a lost
reply neither loses nor doubles a byte. The host holds at most ``_HELD`` bytes of a stream and
stops reading the supervisor's pipe meanwhile: back-pressure reaches the supervisor, which then
holds the command as it does on a slow channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import pwd
import shutil
import signal
import socket
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dsh_bash import FileOperationError
from dsh_bash.backend import EgressProxies
from dsh_bash.host import read_host_file, scan_processes, signal_marked, workdir_problem, write_host_file
from dsh_bash.supervisor import command_payload, encode_frame, supervisor_binary, supervisor_problem

from ._channel import ChannelAddress, ChannelServer

__all__ = ["CHANNEL_METHODS", "NodeHost", "NodeInfo", "StartRequest", "ray_worker_variable"]

#: What the harness may call over the channel (``_channel``) as well as over Ray: all but the
#: node host's life (its lease and idle wait) and the kit's planting.
CHANNEL_METHODS = frozenset(
    {
        "start",
        "read",
        "write",
        "close_input",
        "release_owner",
        "connect",
        "write_eof",
        "disconnect",
        "egress_socket",
        "egress_directory",
        "continue_supervisors",
        "find_marked",
        "signal_marked",
        "find_in_command_lines",
        "run",
        "make_directory",
        "remove_directory",
        "spill_create",
        "spill_write",
        "spill_close",
        "spill_remove",
        "read_file",
        "write_file",
        "exists",
    }
)

#: What a node host holds of one stream before it stops reading the supervisor's pipe.
_HELD = 256 * 1024
#: The most one read returns.
_READ_MAX = 256 * 1024
#: The parent of one supervisor: it starts it with its own stdin (an asynchronous command's stdin
#: would be /dev/null), lets go of the three pipes, and waits for it.
_KEEPER = '"$@" 0<&0 & exec 0<&- 1>&- 2>&-; wait $!'
#: How long a read waits for the rest of a burst of the supervisor's (see ``NodeHost._linger``).
_LINGER_S = 0.0005
_LINGER_MAX_S = 0.003
_LINGER = (_LINGER_S, _LINGER_MAX_S)
#: Supervisors kept started ahead for each of the last ``_SPARE_KEYS`` (options, directory) pairs.
_SPARES = 2
_SPARE_KEYS = 4
#: How long a start waits for the rest of what the supervisor says (its start's records and, for a
#: short command, its end), between bursts and at most: the same, so that a command that ends within
#: 10 ms is one call (a 2.5 ms gap let bash's start split `true` into two: 6.05 -> 5.2 ms added in
#: bench/cluster.py); a longer command's start is said 10 ms late.
_START_LINGER_S = 0.010
_START_LINGER_MAX_S = 0.010
#: What is kept of a supervisor's own stderr (its usage errors; the command's go in frames).
_STDERR_KEPT = 4096
#: How long a helper command may run at most.
_HELPER_BOUND_S = 60.0


def ray_worker_variable(name: str) -> bool:
    """Whether ``name`` is one Ray puts in the environment of its worker processes (not the node's):
    a command must not inherit the worker's view of the cluster."""
    return (
        name.startswith(("RAY_", "RAYLET_", "OMP_NUM_THREADS"))
        or name in {"PYTHONPATH", "CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "NEURON_RT_VISIBLE_CORES"}
        or name.startswith("__RAY")
    )


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (``/proc/PID/task/PID/children``; none when it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            return [int(word) for word in fh.read().split()]
    except (OSError, ValueError):
        return []


def _home() -> str:
    """The user's home from the password database (``HOME`` is the environment's to say)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir or "/"
    except KeyError:
        return "/"


@dataclass(frozen=True)
class NodeInfo:
    """What the harness learns of the node when it opens an executor there."""

    node_id: str
    hostname: str
    address: str
    pid: int
    machine: str
    #: The ``dsh-supervise`` of the package installed on the node, or None (``supervisor_problem``).
    supervisor: str | None
    supervisor_problem: str
    bash: str | None
    #: The user the node host, and so every command, runs as: (name, uid).
    user: tuple[str, str]
    home: str
    cwd: str
    #: The node host's environment less what Ray put there for its worker.
    environment: dict[str, str]


@dataclass(frozen=True)
class StartRequest:
    """One command for a supervisor on the node: what goes in its ``x`` frame, and its script."""

    owner: str
    supervisor_args: list[str]
    argv: list[str]
    env: dict[str, str]
    cwd: str
    terminal: tuple[int, int] | None = None
    capture_fd: int | None = None
    #: A command too long for one argument: written to a file in ``script_dir`` on the node, whose
    #: path is appended to ``argv``; removed once the supervisor is gone.
    script: bytes | None = None
    script_dir: str | None = None


@dataclass
class _Stream:
    """A supervisor's stream (``process`` set: its stdout and stdin), or a connection to a socket on
    the node (an engine's, relayed for an inner backend)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    owner: str
    process: asyncio.subprocess.Process | None = None
    held: bytearray = field(default_factory=bytearray)
    #: The offset of ``held[0]`` in the stream.
    base: int = 0
    ended: bool = False
    stderr: bytearray = field(default_factory=bytearray)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    script: str | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class NodeHost:
    """The actor class (made remote by the harness, placed on one node; async, so every call is a
    coroutine in one event loop and many long polls wait at once)."""

    def __init__(self) -> None:
        #: Streams by the name the harness gave them (the command's marker).
        self._streams: dict[str, _Stream] = {}
        #: Streams closed before their start was taken (calls may be taken out of order): the
        #: start then refuses.
        self._closed_early: set[str] = set()
        #: Each executor's egress proxies (``network = "allow-list"``), served from here: the
        #: command's connections leave from its own node, and its step reaches them by a file here.
        self._egress: dict[str, EgressProxies] = {}
        self._egress_dirs: dict[str, str] = {}
        self._owner_tasks: dict[str, list[asyncio.Task[Any]]] = {}
        # Each supervisor is started by a bash of its own that waits for it (``_KEEPER``), so that
        # it is not this worker's child: a Ray worker that exits (its raylet died, the node went
        # away) SIGKILLs its children first, and a supervisor killed so could not kill its
        # command. Orphaned by its keeper's death, it sees its input close instead, and kills
        # everything of its command. Not orphaned at the start (``setsid --fork``): a command may
        # stop every process that shares its supervisor's parent (the spares), and init's children
        # are the whole machine's daemons.
        self._spares: dict[tuple[tuple[str, ...], str], list[asyncio.subprocess.Process]] = {}
        self._refilling: set[tuple[tuple[str, ...], str]] = set()
        self._spare_tasks: set[asyncio.Task[None]] = set()
        bash = shutil.which("bash")
        self._detach = (
            [] if bash is None else [bash, "--noprofile", "--norc", "-c", _KEEPER, "dsh-bash-keeper"]
        )
        self._spills: dict[str, int] = {}
        #: The harness's count of its busy and idle turns with this node host, as far as seen: an
        #: idle wait ends when a later turn began (the calls of one turn may come out of order).
        self._epoch = 0
        self._idle_wait: asyncio.Task[None] | None = None
        #: Set once an idle wait ran out: a lease then gets None, and the harness starts another.
        self._ending = False
        self._channel = ChannelServer(self._dispatch, CHANNEL_METHODS)

    # -- the node ------------------------------------------------------------------------------------

    async def describe(self) -> NodeInfo:
        import ray  # noqa: PLC0415

        context = ray.get_runtime_context()
        machine = platform.machine()
        supervisor = supervisor_binary(machine)
        return NodeInfo(
            node_id=context.get_node_id(),
            hostname=socket.gethostname(),
            address=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            pid=os.getpid(),
            machine=machine,
            supervisor=None if supervisor is None else str(supervisor),
            supervisor_problem="" if supervisor is not None else (supervisor_problem(machine) or "unknown"),
            bash=shutil.which("bash"),
            user=(_user_name(), str(os.getuid())),
            home=_home(),
            cwd=os.getcwd(),
            environment={name: value for name, value in os.environ.items() if not ray_worker_variable(name)},
        )

    async def lease(self, epoch: int) -> tuple[NodeInfo, ChannelAddress] | None:
        """:meth:`describe` and the channel's address, for an executor's lease in the harness's turn
        ``epoch`` (which ends an idle wait of an earlier turn); None once an idle wait ran out and
        this node host is ending."""
        if self._ending:
            return None
        if epoch > self._epoch:
            self._epoch = epoch
            if self._idle_wait is not None:
                self._idle_wait.cancel()
                self._idle_wait = None
        info = await self.describe()
        return info, await self._channel.start(info.address)

    async def _dispatch(self, method: str, args: tuple[Any, ...]) -> Any:
        return await getattr(self, method)(*args)

    async def idle(self, epoch: int, linger_s: float) -> None:
        """The harness's last executor here closed (its turn ``epoch``): end this node host after
        ``linger_s`` unless a lease of a later turn comes first. It ends itself, so that no thread
        of the harness waits for it."""
        if epoch <= self._epoch:
            return  # a lease of a later turn came first
        self._epoch = epoch
        if self._idle_wait is not None:
            self._idle_wait.cancel()

        async def wait_then_end() -> None:
            await asyncio.sleep(linger_s)
            self._ending = True
            for directory in self._egress_dirs.values():  # of owners never released (a harness gone)
                shutil.rmtree(directory, ignore_errors=True)
            import ray  # noqa: PLC0415

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

        self._idle_wait = asyncio.ensure_future(wait_then_end())

    async def plant(self, variables: dict[str, str]) -> dict[str, str | None]:
        """The conformance kit's planting: ``variables`` become part of this node's ambient
        environment (what a later :meth:`describe` reports); what they replaced is returned, for
        :meth:`restore`."""
        before = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        return before

    async def restore(self, before: dict[str, str | None]) -> None:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    # -- commands under a supervisor ----------------------------------------------------------------

    async def start(
        self, stream_id: str, request: StartRequest, wait_s: float
    ) -> tuple[str, str, bytes, bool, bytes]:
        """Start one supervisor as the stream ``stream_id``, send it the command, and return what it
        said first (:meth:`read` from offset 0 within ``wait_s``: its start's records, most often,
        so that a command's start costs one call): ("", "", bytes, ended, stderr). (reason,
        message, ...) when nothing could start (the reason one of the contract's)."""
        reason, message = await self._start(stream_id, request)
        if reason:
            return reason, message, b"", True, b""
        return ("", "", *await self.read(stream_id, 0, wait_s, (_START_LINGER_S, _START_LINGER_MAX_S)))

    async def _start(self, stream_id: str, request: StartRequest) -> tuple[str, str]:
        if stream_id in self._closed_early or stream_id in self._streams:
            self._closed_early.discard(stream_id)
            return "start_failed", "the start was given up (its stream was closed before it)"
        problem = workdir_problem(request.cwd)
        if problem is not None:
            what, reason = problem
            return reason, f"workdir {request.cwd!r} {what}"
        argv = list(request.argv)
        script: str | None = None
        if request.script is not None:
            fd, script = tempfile.mkstemp(prefix="cmd-", suffix=".sh", dir=request.script_dir)
            with os.fdopen(fd, "wb") as fh:
                fh.write(request.script)
            argv.append(script)
        payload = command_payload(
            argv,
            request.env,
            ".",  # --spec runs the command where the supervisor starts: request.cwd
            status_in_program=-1 if request.capture_fd is None else request.capture_fd,
            terminal=request.terminal,
        )
        key = (tuple(request.supervisor_args), request.cwd)
        try:
            process = self._take_spare(key) or await self._spawn(key)
        except OSError as exc:
            if script is not None:
                with contextlib.suppress(OSError):
                    os.unlink(script)
            return "start_failed", f"cannot start {request.supervisor_args[0]}: {exc}"
        assert process.stdout is not None and process.stdin is not None
        stream = _Stream(process.stdout, process.stdin, request.owner, process=process, script=script)
        stream.room.set()
        self._streams[stream_id] = stream
        assert process.stdin is not None
        if stream_id in self._closed_early:
            # Closed while it started: its input ends before the command came, and it exits.
            self._closed_early.discard(stream_id)
            process.stdin.close()
        else:
            process.stdin.write(encode_frame(b"x", payload))
        stream.tasks.append(asyncio.ensure_future(self._pump(stream)))
        stream.tasks.append(asyncio.ensure_future(self._pump_stderr(stream)))
        self._refill(key)
        return "", ""

    # -- spares: supervisors started ahead ------------------------------------------------------------

    async def _spawn(self, key: tuple[tuple[str, ...], str]) -> asyncio.subprocess.Process:
        """A supervisor waiting for its command (``--spec``: it holds nothing of any command yet)."""
        argv, cwd = key
        return await asyncio.create_subprocess_exec(
            *self._detach,
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            cwd=cwd,
            env={},
        )

    def _take_spare(self, key: tuple[tuple[str, ...], str]) -> asyncio.subprocess.Process | None:
        spares = self._spares.get(key, [])
        while spares:
            spare = spares.pop(0)
            assert spare.stdout is not None and spare.stdin is not None
            if not spare.stdout.at_eof() and not spare.stdin.is_closing():
                return spare
            spare.stdin.close()  # it died waiting (a command of the same user may kill it)
        return None

    def _refill(self, key: tuple[tuple[str, ...], str]) -> None:
        """Keep ``_SPARES`` supervisors ready for the next commands of ``key`` (the directory and the
        supervisor's options: a command of another starts the usual way), for the ``_SPARE_KEYS``
        keys used last."""
        self._spares[key] = self._spares.pop(key, [])  # the last used goes last
        while len(self._spares) > _SPARE_KEYS:
            for spare in self._spares.pop(next(iter(self._spares))):
                if spare.stdin is not None:
                    spare.stdin.close()  # EOF before its command: it exits at once
        if key in self._refilling:
            return
        self._refilling.add(key)

        async def refill() -> None:
            try:
                while key in self._spares and len(self._spares[key]) < _SPARES:
                    spare = await self._spawn(key)
                    if key in self._spares:
                        self._spares[key].append(spare)
                    elif spare.stdin is not None:
                        spare.stdin.close()
            except OSError:
                pass  # the next start makes its own, and says what fails
            finally:
                self._refilling.discard(key)

        self._spare_tasks.add(task := asyncio.ensure_future(refill()))
        task.add_done_callback(self._spare_tasks.discard)

    async def _pump(self, stream: _Stream) -> None:
        reader = stream.reader
        try:
            while True:
                if len(stream.held) >= _HELD:
                    stream.room.clear()
                    await stream.room.wait()
                    continue
                try:
                    data = await reader.read(64 * 1024)
                except OSError:  # a connection reset: its end, as for a pipe
                    break
                if not data:
                    break
                stream.held += data
                stream.changed.set()
        finally:
            if stream.process is not None:
                with contextlib.suppress(Exception):
                    await stream.process.wait()
            if stream.script is not None:
                with contextlib.suppress(OSError):
                    os.unlink(stream.script)
            stream.ended = True
            stream.changed.set()

    async def _pump_stderr(self, stream: _Stream) -> None:
        assert stream.process is not None
        reader = stream.process.stderr
        assert reader is not None
        while data := await reader.read(4096):
            if len(stream.stderr) < _STDERR_KEPT:
                stream.stderr += data[: _STDERR_KEPT - len(stream.stderr)]

    async def read(
        self,
        stream_id: str,
        offset: int,
        wait_s: float,
        linger: tuple[float, float] = (_LINGER_S, _LINGER_MAX_S),
    ) -> tuple[bytes, bool, bytes]:
        """The stream's bytes from ``offset`` (everything before it is acknowledged and dropped),
        waiting up to ``wait_s`` for some. (bytes, ended, the supervisor's stderr once ended):
        ``ended`` once nothing follows the bytes returned."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return b"", True, b"the node host holds no such stream (it was released)"
        if offset > stream.base:
            del stream.held[: offset - stream.base]
            stream.base = offset
            stream.room.set()
        if not stream.held and not stream.ended and wait_s > 0:
            stream.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stream.changed.wait(), wait_s)
        await self._linger(stream, *linger)
        start = max(0, offset - stream.base)
        data = bytes(stream.held[start : start + _READ_MAX])
        ended = stream.ended and start + len(data) >= len(stream.held)
        if ended:
            self._streams.pop(stream_id, None)
            return data, True, bytes(stream.stderr)
        return data, False, b""

    @staticmethod
    async def _linger(stream: _Stream, gap_s: float, most_s: float) -> None:
        """A supervisor writes in bursts (a command's start: two records; its end: its exit, both
        ends of file, ``empty``, then its own end): one reply for a burst, not one a record. Waits
        while bytes keep coming within ``gap_s`` of each other, ``most_s`` at most."""
        if not stream.held:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + most_s
        while not stream.ended and len(stream.held) < _READ_MAX:
            left = until - loop.time()
            if left <= 0:
                return
            stream.changed.clear()
            try:
                await asyncio.wait_for(stream.changed.wait(), min(left, gap_s))
            except TimeoutError:
                return

    async def write(self, stream_id: str, data: bytes) -> bool:
        """Send whole frames to the supervisor (written before the first await, so that the frames
        of calls taken in order are in order); False once its input is gone."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.writer.is_closing():
            return False
        try:
            stream.writer.write(data)
            await stream.writer.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            return False
        return True

    async def close_input(self, stream_id: str) -> None:
        """End the supervisor's input: it kills everything of its command and exits. Before its
        start was taken: that start refuses."""
        stream = self._streams.get(stream_id)
        if stream is None:
            self._closed_early.add(stream_id)
        else:
            stream.writer.close()

    async def release_owner(self, owner: str) -> int:
        """Close the input of every supervisor an executor started (its close, or its harness gone):
        each kills what it holds; end its proxies. How many supervisors were still there."""
        self._egress.pop(owner, None)
        directory = self._egress_dirs.pop(owner, None)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        for task in self._owner_tasks.pop(owner, []):
            task.cancel()
        self._closed_early = {name for name in self._closed_early if not name.startswith(owner + "-")}
        count = 0
        for stream in self._streams.values():
            if stream.owner == owner:
                stream.writer.close()
                count += stream.process is not None
        return count

    # -- connections to a socket on the node (an inner backend's engine) ----------------------------

    async def connect(self, stream_id: str, owner: str, path: str) -> str:
        """Open a connection to the unix socket ``path`` on this node as the stream ``stream_id``
        (read with :meth:`read`, written with :meth:`write`); why not, or "" once open."""
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=_READ_MAX)
        except OSError as exc:
            return f"cannot connect to {path} on {socket.gethostname()}: {exc.strerror or exc}"
        stream = _Stream(reader, writer, owner)
        stream.room.set()
        self._streams[stream_id] = stream
        stream.tasks.append(asyncio.ensure_future(self._pump(stream)))
        return ""

    async def write_eof(self, stream_id: str) -> None:
        """Half-close a connection after what was written (an exec's stdin ends; its output goes on)."""
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.writer.is_closing() and stream.writer.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                await stream.writer.drain()
                stream.writer.write_eof()

    async def disconnect(self, stream_id: str) -> None:
        """Close a connection and forget it (what was not read of it is dropped)."""
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.writer.close()
            for task in stream.tasks:
                task.cancel()
            stream.ended = True
            stream.changed.set()  # a read waiting on it returns

    async def egress_socket(
        self, owner: str, allow_hosts: list[str], directory: str, mode: int = 0o600
    ) -> tuple[str, str]:
        """The socket file (in ``directory``, of ``mode``) of ``owner``'s proxy for ``allow_hosts``,
        and its key."""
        proxies = self._egress.get(owner)
        if proxies is None:
            proxies = self._egress[owner] = EgressProxies(partial(self._owner_helper, owner))
        return await proxies.in_directory(tuple(allow_hosts), directory, mode=mode)

    async def egress_directory(self, owner: str) -> str:
        """A directory (0711) for ``owner``'s proxies' socket files that others mount (a container
        on this node's engine); removed with ``owner``'s release."""
        directory = self._egress_dirs.get(owner)
        if directory is None:
            directory = self._egress_dirs[owner] = EgressProxies.mountable_directory()
        return directory

    def _owner_helper(self, owner: str, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self._owner_tasks.setdefault(owner, []).append(asyncio.ensure_future(func(*args)))

    async def continue_supervisors(self) -> None:
        """SIGCONT to every supervisor this node host started (its streams' and its spares') and
        their keepers: a command may stop its own supervisor (same user), which then hears no
        request. Only these: a script that continued every stopped supervisor of the user would, as
        root, rescue other harnesses' on the machine (and did, in a test run, for a backend meant
        to be caught leaving them stopped)."""
        keepers = [stream.process.pid for stream in self._streams.values() if stream.process is not None]
        keepers += [spare.pid for spares in self._spares.values() for spare in spares]
        for keeper in keepers:
            for pid in (keeper, *_children(keeper)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)

    # -- processes by marker -------------------------------------------------------------------------

    async def find_marked(self, marker: str, exact: bool) -> list[int]:
        """Live processes on this node carrying ``marker`` (exactly, or as a prefix)."""
        entries = scan_processes(marker.encode())
        return [
            entry.pid
            for entry in entries
            if entry.alive and entry.marker is not None and (not exact or entry.marker == marker)
        ]

    async def signal_marked(self, marker: str, exact: bool, sig: int) -> list[str]:
        """Signal every live process on this node carrying ``marker``; the failures, said."""
        failures: list[str] = []
        for pid in await self.find_marked(marker, exact):
            try:
                signal_marked(pid, marker, sig, exact)
            except OSError as exc:
                failures.append(f"pid {pid}: {exc}")
        return failures

    async def find_in_command_lines(self, needle: str) -> list[int]:
        """The conformance kit's view: live processes whose command line contains ``needle``."""
        from dsh_bash.host import find_host_processes  # noqa: PLC0415

        return find_host_processes(needle)

    # -- helper commands -----------------------------------------------------------------------------

    async def run(self, argv: list[str], stdin: bytes, env: dict[str, str]) -> tuple[int, bytes, bytes]:
        """Run a helper (a probe, a continue script, a file move) to its end, bounded."""
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=env,
            )
        except OSError as exc:
            return 127, b"", str(exc).encode()
        try:
            out, err = await asyncio.wait_for(process.communicate(stdin), _HELPER_BOUND_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            return 124, b"", b"the helper did not finish in time"
        return process.returncode if process.returncode is not None else 127, out, err

    # -- spill files and the executor's directory ----------------------------------------------------

    async def make_directory(self, prefix: str, parent: str | None) -> str:
        """A fresh private directory (0700) on the node, in ``parent`` (None: the temp directory)."""
        return tempfile.mkdtemp(prefix=prefix, dir=parent)

    async def remove_directory(self, path: str) -> None:
        for name in list(self._spills):
            if name.startswith(path + "/"):
                with contextlib.suppress(OSError):
                    os.close(self._spills.pop(name))
        shutil.rmtree(path, ignore_errors=True)

    async def spill_create(self, path: str) -> None:
        """Create the spill file ``path`` (never an existing one); OSError otherwise."""
        self._spills[path] = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )

    async def spill_write(self, path: str, data: bytes) -> None:
        fd = self._spills[path]
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    async def spill_close(self, path: str) -> None:
        fd = self._spills.pop(path, None)
        if fd is not None:
            os.close(fd)

    async def spill_remove(self, path: str) -> None:
        await self.spill_close(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # -- files (R-file-*) -------------------------------------------------------------------------------

    async def read_file(self, path: str, max_bytes: int) -> tuple[bytes, str, str]:
        """(bytes, "", "") or (b"", refusal reason, message): a refusal is a value, not an
        exception, so that its reason crosses Ray as it is."""
        try:
            return await asyncio.to_thread(read_host_file, path, max_bytes), "", ""
        except FileOperationError as exc:
            return b"", exc.reason, str(exc)

    async def write_file(self, path: str, data: bytes, make_parents: bool) -> tuple[str, str]:
        try:
            await asyncio.to_thread(write_host_file, path, data, make_parents=make_parents)
        except FileOperationError as exc:
            return exc.reason, str(exc)
        return "", ""

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(os.path.lexists, path)
