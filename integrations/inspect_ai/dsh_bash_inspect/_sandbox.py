"""The ``dsh-bash`` sandbox type: inspect_ai's ``SandboxEnvironment`` over any dsh-bash executor.

Lifecycle: one executor per sample. ``sample_init`` loads the config file with
``dsh_bash.load_executor`` (the code path of ``dsh-bash run --config``), opens it, and makes a private
working directory for the sample where commands run; ``sample_cleanup`` removes that directory and
closes the executor, which kills everything the sample's commands left behind and releases what the
backend holds (an image-mode container, an SSH connection, the spill files). Samples therefore never
see each other's files or processes, and a cancelled sample leaves nothing: inspect runs
``sample_cleanup`` shielded from the cancellation, and ``task_cleanup`` closes any executor a sample
did not get to close.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import os
import posixpath
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, ClassVar, Literal, TypeVar, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from inspect_ai.util import (
    concurrency as inspect_concurrency,
)

from dsh_bash import BashExecutor, BashInfrastructureError, BashRunResult, FileOperationError, load_executor

from ._commands import (
    BROKEN,
    IS_DIRECTORY,
    NO_PERMISSION,
    NOT_FOUND,
    PROBE_SCRIPT,
    argv_to_command,
    as_user,
    not_executable_script,
    read_chunk_script,
    read_start_script,
    returncode_of,
    write_script,
)

__all__ = ["SANDBOX_TYPE", "DshBashSandboxEnvironment"]

SANDBOX_TYPE = "dsh-bash"

#: read_file moves files in chunks of whole blocks, base64-encoded, each well inside the output limit.
_BLOCK = 12_288  # a multiple of 3 (no base64 padding inside a file) and of 4096
_MAX_CHUNK = 3 * 1024 * 1024 // _BLOCK * _BLOCK

#: How long the provider's own short commands (probe, file checks, cleanup) may take.
_HOUSEKEEPING_MS = 120_000.0

#: Infrastructure reasons that say something about the request rather than the sandbox.
_WORKDIR_ERRORS: dict[str, tuple[type[OSError], int]] = {
    "workdir_missing": (FileNotFoundError, errno.ENOENT),
    "workdir_not_directory": (NotADirectoryError, errno.ENOTDIR),
    "workdir_not_accessible": (PermissionError, errno.EACCES),
}


_T = TypeVar("_T")


class _Holder:
    """Keeps an executor open in a task of its own, from ``open`` until ``close``.

    An executor is an async context manager whose block holds a task group, and a task group must be
    left in the task, and at the nesting of cancel scopes, where it was entered. inspect opens a
    sandbox in ``sample_init`` and closes it in ``sample_cleanup``, with its own scopes entered and
    left in between, so the provider cannot hold the block in inspect's task: it holds it in a task
    spawned outside inspect's scopes (an asyncio task, or a trio system task). If the event loop
    ends first (an eval interrupted hard), the loop cancels that task and the block closes the
    executor on the way out.
    """

    _tasks: ClassVar[set[Any]] = set()  # asyncio keeps only weak references to its tasks

    def __init__(self, executor: BashExecutor[Any]) -> None:
        self.executor = executor
        self._ready = anyio.Event()
        self._stop = anyio.Event()
        self._done = anyio.Event()
        self._error: Exception | None = None

    async def _hold(self) -> None:
        try:
            async with self.executor:
                self._ready.set()
                await self._stop.wait()
        except Exception as exc:  # opening failed: open() raises it in the caller's task
            self._error = exc
        finally:
            self._ready.set()
            self._done.set()

    async def open(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio: inspect's other event loop is trio's
            import trio  # noqa: PLC0415 - only under trio

            trio.lowlevel.spawn_system_task(self._hold)
        else:
            task = loop.create_task(self._hold())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await self._ready.wait()
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """Close the executor (kills what is left, releases the backend) and wait for it."""
        self._stop.set()
        with anyio.CancelScope(shield=True):
            await self._done.wait()


def _translate_infra(exc: BashInfrastructureError, workdir: str | None) -> Exception:
    """inspect's exception for an executor's infrastructure error, chosen by ``reason`` (never the text)."""
    mapped = _WORKDIR_ERRORS.get(exc.reason)
    if mapped is not None and workdir is not None:
        kind, number = mapped
        return kind(number, os.strerror(number), workdir)
    translated: Exception
    if exc.reason == "user_unknown":
        translated = SandboxUserUnsupportedError(str(exc))
    else:
        # Everything else (closed, an engine, container, host or connection that is gone, no bash, a
        # start the backend refused, a lost command) means the sandbox cannot run the request.
        translated = SandboxUnavailableError(f"dsh-bash ({exc.reason}): {exc}")
    return translated


@sandboxenv(name=SANDBOX_TYPE)
class DshBashSandboxEnvironment(SandboxEnvironment):
    """A sample's sandbox: one open dsh-bash executor and the sample's working directory."""

    #: Executors opened per task and not yet closed: task_cleanup's last chance.
    _open: ClassVar[dict[str, set[DshBashSandboxEnvironment]]] = {}

    def __init__(
        self,
        holder: _Holder,
        *,
        task_name: str,
        uid: int,
        user_name: str,
        workdir: str,
        runuser: str | None,
    ) -> None:
        super().__init__()
        self._holder = holder
        self.executor = holder.executor
        self.task_name = task_name
        self.uid = uid
        self.user_name = user_name
        #: The sample's private working directory: relative paths and cwds resolve against it.
        self.workdir = workdir
        self.runuser = runuser
        #: Whether the backend runs a command as another user (the request's ``user``): assumed
        #: until it refuses one (``user_unsupported``: local and SSH), then runuser as root.
        self.switches_users = True
        self._entered_by_others = False
        #: The backend moves no files without a shell (``files_unsupported``): commands move them.
        self._files_unsupported = False

    # -- lifecycle ---------------------------------------------------------------------------------

    @classmethod
    def _load(cls, config: SandboxEnvironmentConfigType | None) -> BashExecutor[Any]:
        if config is None:
            # As `dsh-bash run` without --config: the local backend with default settings.
            return load_executor({"backend": "local"})
        if isinstance(config, str):
            return load_executor(config)
        raise TypeError(
            f"sandbox {SANDBOX_TYPE!r}: the config is the path of a dsh-bash config file "
            f"(TOML or YAML), not {type(config).__name__}"
        )

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        # A config file that does not load fails the task before any sample starts (ConfigError names
        # the file, the field and the problem). Loading makes an unopened executor: no I/O but the read.
        cls._load(config)

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        executor = cls._load(config)
        holder = _Holder(executor)
        try:
            await holder.open()
        except BashInfrastructureError as exc:
            raise _translate_infra(exc, None) from exc
        try:
            # inspect's callers get up to its exec output limit per stream and truncate for the model
            # themselves, so the executor keeps that much (the tail beyond it, as inspect allows).
            executor.reconfigure(
                max_output_bytes=max(
                    SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE, executor.config.max_output_bytes
                )
            )
            probe = await executor.exec(PROBE_SCRIPT, timeout_ms=_HOUSEKEEPING_MS)
            lines = probe.stdout.text.split("\n")
            if probe.exit_code != 0 or len(lines) < 4 or not lines[0].isdigit():
                raise SandboxUnavailableError(
                    f"dsh-bash: the sandbox's first command failed (exit {probe.exit_code}): "
                    f"{probe.stderr.text.strip()}"
                )
        except BaseException as exc:
            await holder.close()
            if isinstance(exc, BashInfrastructureError):
                raise _translate_infra(exc, None) from exc
            raise
        env = cls(
            holder,
            task_name=task_name,
            uid=int(lines[0]),
            user_name=lines[1],
            workdir=lines[2],
            runuser=lines[3] or None,
        )
        cls._open.setdefault(task_name, set()).add(env)
        return {"default": env}

    async def _close(self) -> None:
        """Remove the sample's directory, then close the executor (kills what is left, releases)."""
        self._open.get(self.task_name, set()).discard(self)
        # Closed or lost: closing below releases what is left.
        with contextlib.suppress(BashInfrastructureError):
            await self.executor.exec(
                f"rm -rf -- {argv_to_command([self.workdir])}", timeout_ms=_HOUSEKEEPING_MS
            )
        await self._holder.close()

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for env in environments.values():
            if isinstance(env, DshBashSandboxEnvironment):
                await env._close()

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        for env in list(cls._open.pop(task_name, set())):
            await env._holder.close()

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        # `inspect sandbox cleanup dsh-bash`: containers of image-mode executors whose process died
        # without closing them (the Docker backend labels each with its creator's pid).
        try:
            from dsh_bash_docker import sweep_orphaned_containers  # noqa: PLC0415 - optional extra
        except ImportError:
            return
        await sweep_orphaned_containers()

    # -- exec --------------------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return posixpath.join(self.workdir, path)

    def _throttle(self, wanted: bool) -> AbstractAsyncContextManager[Any]:
        # inspect's own subprocess limiter (the same name as its subprocess() uses), when asked.
        return inspect_concurrency("subprocesses", os.cpu_count() or 1) if wanted else nullcontext()

    def _command_for(self, command: str, user: str | None) -> tuple[str, str | None]:
        """(the command, the request's ``user``) that run ``command`` as ``user``: the executor's
        per-command user where the backend switches users (Docker), else runuser when commands run
        as root (local, SSH as root), else :class:`SandboxUserUnsupportedError`."""
        if user is None or user in (self.user_name, str(self.uid)):
            return command, None
        if self.switches_users:
            return command, user
        if self.uid != 0:
            raise SandboxUserUnsupportedError(
                f"dsh-bash: commands run as {self.user_name} (uid {self.uid}), who cannot switch to "
                f"user {user!r}, and the backend cannot run a command as another user"
            )
        if self.runuser is None:
            raise SandboxUserUnsupportedError(
                f"dsh-bash: cannot run as {user!r}: no runuser where commands run"
            )
        return as_user(command, user, self.runuser), None

    async def _run(
        self,
        command: str,
        *,
        user: str | None = None,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_ms: float | None = None,
    ) -> BashRunResult:
        """Run ``command`` as ``user`` (None: as the executor's user), through :meth:`_command_for`."""
        workdir = self.workdir if cwd is None else self._path(cwd)
        fields: dict[str, Any] = {"workdir": workdir}
        if stdin is not None:
            fields["stdin"] = stdin
        if env:
            fields["env"] = env
        if timeout_ms is not None:
            if timeout_ms > self.executor.config.max_timeout_ms:
                # inspect's caller asked for this timeout: raise the cap rather than clamp (only
                # ever upwards, so concurrent calls cannot lower each other's).
                self.executor.reconfigure(max_timeout_ms=timeout_ms)
            fields["timeout_ms"] = timeout_ms
        line, fields["user"] = self._command_for(command, user)
        try:
            if fields["user"] is not None and not self._entered_by_others:
                # The sample's directory (0700) is where the command starts: another user may enter
                # it from now on (0711), not list or write it.
                await self.executor.exec(
                    f"chmod 0711 -- {argv_to_command([self.workdir])}", timeout_ms=_HOUSEKEEPING_MS
                )
                self._entered_by_others = True
            return await self.executor.exec(line, **fields)
        except BashInfrastructureError as exc:
            if exc.reason != "user_unsupported" or fields["user"] is None:
                raise _translate_infra(exc, workdir) from exc
        # The backend cannot switch users (learnt once per sample): runuser, or unsupported.
        self.switches_users = False
        line, fields["user"] = self._command_for(command, user)
        try:
            return await self.executor.exec(line, **fields)
        except BashInfrastructureError as exc:
            raise _translate_infra(exc, workdir) from exc

    async def exec(  # noqa: PLR0917 - inspect's signature
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,  # noqa: ASYNC109 - inspect's signature
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        command = argv_to_command(cmd)
        timeout_ms = None if timeout is None else float(timeout) * 1000.0
        async with self._throttle(concurrency):
            result = await self._run(command, user=user, stdin=input, cwd=cwd, env=env, timeout_ms=timeout_ms)
            if result.timed_out:
                # The executor killed the command (and every process it started) at the timeout.
                raise TimeoutError(f"dsh-bash: {cmd[0]!r} timed out after {result.timeout_ms / 1000:g} s")
            returncode = returncode_of(result.exit_code, result.signal)
            if returncode == 126:
                # bash's status for a file it found but could not execute: inspect wants PermissionError.
                check = not_executable_script(cmd[0])
                probe = await self._run(check, user=user, cwd=cwd, env=env, timeout_ms=_HOUSEKEEPING_MS)
                if probe.exit_code == 0:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), cmd[0])
        return ExecResult(
            success=returncode == 0,
            returncode=returncode,
            stdout=result.stdout.text,
            stderr=result.stderr.text,
        )

    # -- files -------------------------------------------------------------------------------------

    async def _through_seam(
        self, operation: Callable[[], Awaitable[_T]], file: str
    ) -> tuple[bool, _T | None]:
        """``(True, what operation returned)`` (the executor's ``read_file``/``write_file``); ``(False,
        None)`` where the backend moves no files, or reads less at once than inspect allows (then the
        commands move it, as before). Its refusals as inspect's exceptions."""
        if self._files_unsupported:
            return False, None
        try:
            return True, await operation()
        except BashInfrastructureError as exc:
            if exc.reason != "files_unsupported":
                raise
            self._files_unsupported = True
            return False, None
        except FileOperationError as exc:
            if exc.reason == "file_too_large" and (
                self.executor.config.max_file_bytes < SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
            ):
                return False, None
            raise _inspect_error(exc, file) from None

    def _file_error(self, result: BashRunResult, file: str) -> Exception | None:
        code = result.exit_code
        if code == 0:
            return None
        if code == NOT_FOUND:
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), file)
        if code == IS_DIRECTORY:
            return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), file)
        if code == NO_PERMISSION:
            return PermissionError(errno.EACCES, os.strerror(errno.EACCES), file)
        if result.timed_out:
            return TimeoutError(f"dsh-bash: file operation on {file!r} timed out")
        detail = result.stderr.text.strip()
        why = "failed" if code == BROKEN else f"failed (exit {code}, signal {result.signal})"
        return OSError(errno.EIO, f"dsh-bash: file operation {why}: {detail}", file)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        path = self._path(file)
        done, _ = await self._through_seam(
            lambda: self.executor.write_file(path, data, make_parents=True), file
        )
        if done:
            return
        # No files in the seam here: the bytes go to the command's stdin, exact; the script creates
        # parents and says why it failed.
        result = await self._run(write_script(path), stdin=data, timeout_ms=_HOUSEKEEPING_MS)
        error = self._file_error(result, file)
        if error is not None:
            raise error

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        path = self._path(file)
        done, read = await self._through_seam(lambda: self.executor.read_file(path), file)
        if done and read is not None:
            if len(read) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:  # inspect's limit, as it is now
                raise OutputLimitExceededError(
                    limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
                )
            return read.decode("utf-8") if text else read
        # Output is text (invalid UTF-8 replaced), so bytes travel in base64, in chunks that stay
        # inside the executor's output limit.
        limit = self.executor.config.max_output_bytes
        blocks = max(1, min(_MAX_CHUNK, int(limit * 0.7) // 4 * 3) // _BLOCK)
        first = await self._run(read_start_script(path, blocks, _BLOCK), timeout_ms=_HOUSEKEEPING_MS)
        error = self._file_error(first, file)
        if error is not None:
            raise error
        size_line, _, encoded = first.stdout.text.partition("\n")
        size = int(size_line.strip())
        if size > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(
                limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
            )
        parts = [base64.b64decode(encoded)]
        offset = blocks
        # Read until a short chunk: the file may have changed since its size was taken.
        while len(parts[-1]) == blocks * _BLOCK:
            chunk = await self._run(
                read_chunk_script(path, offset, blocks, _BLOCK), timeout_ms=_HOUSEKEEPING_MS
            )
            error = self._file_error(chunk, file)
            if error is not None:
                raise error
            parts.append(base64.b64decode(chunk.stdout.text))
            offset += blocks
            if offset * _BLOCK > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE + _BLOCK:
                raise OutputLimitExceededError(
                    limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
                )
        data = b"".join(parts)
        return data.decode("utf-8") if text else data

    # -- connection --------------------------------------------------------------------------------

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """A shell where the sample's commands run: ``docker exec`` into the container, or ``ssh``.

        Read from the executor's public ``container_id`` (Docker) and its config's ``host`` (SSH), so
        a third-party backend with either gets the same. The local backend has none.
        """
        config = self.executor.config
        container = getattr(self.executor, "container_id", None)
        if isinstance(container, str):
            login = user or getattr(config, "user", None)
            who = f"--user {argv_to_command([login])} " if login else ""
            return SandboxConnection(
                type=SANDBOX_TYPE,
                command=f"docker exec -it {who}-w {argv_to_command([self.workdir])} {container} bash",
                container=container,
            )
        host = getattr(config, "host", None)
        if isinstance(host, str):
            login = user or getattr(config, "username", None)
            words = ["ssh", "-t", "-p", str(getattr(config, "port", 22))]
            for key in getattr(config, "client_keys", None) or []:
                words += ["-i", key]
            known_hosts = getattr(config, "known_hosts", None)
            if known_hosts:
                words += ["-o", f"UserKnownHostsFile={known_hosts}"]
            words += [
                f"{login}@{host}" if login else host,
                f"cd {argv_to_command([self.workdir])} && exec bash",
            ]
            return SandboxConnection(type=SANDBOX_TYPE, command=argv_to_command(words))
        raise NotImplementedError(
            "dsh-bash: this backend has no connection to offer (the local backend runs commands here)"
        )


def _inspect_error(exc: FileOperationError, file: str) -> Exception:
    """A refusal of the seam as the exception inspect's sandbox API names for it."""
    if exc.reason == "file_not_found":
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), file)
    if exc.reason == "is_a_directory":
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), file)
    if exc.reason == "permission_denied":
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), file)
    if exc.reason == "file_too_large":
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR
        too_large: Exception = OutputLimitExceededError(limit_str=limit, truncated_output=None)
        return too_large
    return OSError(errno.EIO, f"dsh-bash: {exc}", file)
