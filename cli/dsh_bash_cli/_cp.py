"""``dsh-bash cp``: one file copied into or out of where commands run, as ``docker cp`` does.

Exactly one of SRC and DEST is ``:PATH``, a path where commands run (absolute, or relative to the
executor's default working directory); the other is a path on this machine, or ``-`` for stdin (as
SRC) or stdout (as DEST). The file moves through the executor's file operations (``read_file``,
``write_file``), never through a command's output: whole, as bytes, at most ``max_file_bytes`` out.

- **Out** (``:PATH`` to local): the bytes go to stdout, or to a fresh file beside the local target
  renamed over it once whole (an existing target keeps its mode; a link is written through, as
  ``cp`` does: the file it names is replaced; a device or FIFO is written into). A local directory
  as DEST means a file of the remote one's name in it.
- **In** (local to ``:PATH``): the whole local file (or stdin) is read first, before the backend is
  opened, then written with ``write_file`` (atomic where commands run, ``R-file-write``). A DEST that
  ends in ``/`` (or is ``:`` alone) means a file of SRC's name in it; so does a DEST the backend
  reports as a directory (``is_a_directory``), as ``cp`` does.

Refusals become one line naming the path as given and the reason:
``:/etc/nope: file_not_found: cannot read /etc/nope: No such file or directory``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import anyio

from ._fds import CLOSED_AT_START, discard_stdout
from ._text import one_line

if TYPE_CHECKING:
    from dsh_bash import BashExecutor, FileOperationError

__all__ = ["STDIO", "CopyFailed", "Plan", "copy", "plan"]

#: SRC ``-`` is stdin, DEST ``-`` stdout.
STDIO = "-"
#: What marks a path where commands run (as ``docker cp CONTAINER:PATH``).
REMOTE = ":"


class CopyFailed(Exception):
    """A problem to report as one ``dsh-bash: error:`` line."""


@dataclass(frozen=True)
class Plan:
    """Which way the file goes: ``remote`` is the path where commands run (without its ``:``),
    ``local`` the path on this machine or ``-``."""

    remote: str
    local: str
    inward: bool


def plan(src: str, dest: str) -> Plan:
    """Read SRC and DEST; :class:`CopyFailed` unless exactly one of them is ``:PATH``."""
    src_remote, dest_remote = src.startswith(REMOTE), dest.startswith(REMOTE)
    if src_remote == dest_remote:
        which = (
            "both are; a local name that starts with ':' is written ./:NAME" if src_remote else "neither is"
        )
        raise CopyFailed(
            f"cp: exactly one of SRC and DEST must be a path where commands run, written :PATH ({which})"
        )
    if src_remote:
        if src == REMOTE:
            raise CopyFailed("cp: SRC ':' names no file: write :PATH")
        return Plan(remote=src.removeprefix(REMOTE), local=dest, inward=False)
    return Plan(remote=dest.removeprefix(REMOTE), local=src, inward=True)


def copy(
    how: Plan, load: Callable[[], BashExecutor], *, user: str | None = None, make_parents: bool = False
) -> None:
    """Copy one file as ``how`` says, on the executor ``load`` gives (unopened; opened and closed here)."""
    if how.inward:
        target = _remote_target(how.remote, how.local)
        # A DEST taken as a file that turns out to be a directory: SRC's name in it (stdin has none).
        into = os.path.basename(how.local) if target == how.remote and how.local != STDIO else ""
        data = _read_local(how.local)
        anyio.run(partial(_write_remote, load(), target, into, data, user=user, make_parents=make_parents))
    else:
        data = anyio.run(_read_remote, load(), how.remote, user)
        _write_local(how.local, data, how.remote)


# -- in -------------------------------------------------------------------------------------------------


def _remote_target(remote: str, local: str) -> str:
    """Where a copy in goes: a DEST that names a directory (``:`` alone, or ending in ``/``) gets SRC's
    name, as ``cp`` gives it."""
    if remote and not remote.endswith("/"):
        return remote
    if local == STDIO:
        raise CopyFailed(
            f"cp: DEST '{REMOTE}{remote}' names a directory and stdin has no file name: "
            f"write DEST as {REMOTE}{remote or './'}NAME"
        )
    return remote + os.path.basename(local)


def _read_local(path: str) -> bytes:
    if path == STDIO:
        buffer = None if 0 in CLOSED_AT_START else getattr(sys.stdin, "buffer", None)
        if buffer is None:
            raise CopyFailed("cannot read stdin: it was closed when dsh-bash started")
        try:
            data: bytes = buffer.read()
        except OSError as exc:
            raise CopyFailed(f"cannot read stdin: {exc.strerror or one_line(exc)}") from exc
        return data
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise CopyFailed(f"cannot read {path}: {exc.strerror or one_line(exc)}") from exc


async def _write_remote(
    executor: BashExecutor, target: str, into: str, data: bytes, *, user: str | None, make_parents: bool
) -> None:
    from dsh_bash import FileOperationError

    async with executor:
        try:
            await executor.write_file(target, data, user=user, make_parents=make_parents)
            return
        except FileOperationError as exc:
            if exc.reason != "is_a_directory" or not into:
                raise _refused(target, exc) from exc
        # A directory there (nothing was written): the file goes into it, as cp does.
        inside = posixpath.join(target, into)
        try:
            await executor.write_file(inside, data, user=user, make_parents=make_parents)
        except FileOperationError as exc:
            raise _refused(inside, exc) from exc


# -- out ------------------------------------------------------------------------------------------------


async def _read_remote(executor: BashExecutor, path: str, user: str | None) -> bytes:
    from dsh_bash import FileOperationError

    async with executor:
        try:
            return await executor.read_file(path, user=user)
        except FileOperationError as exc:
            raise _refused(path, exc) from exc


def _write_local(dest: str, data: bytes, remote: str) -> None:
    if dest == STDIO:
        _write_stdout(data)
        return
    target = dest
    if os.path.isdir(dest):
        target = os.path.join(dest, posixpath.basename(remote))
    elif dest.endswith(os.sep):
        raise CopyFailed(f"cannot write {dest}: Not a directory")
    try:
        _replace(target, data)
    except OSError as exc:
        raise CopyFailed(f"cannot write {target}: {exc.strerror or one_line(exc)}") from exc


def _write_stdout(data: bytes) -> None:
    buffer = None if 1 in CLOSED_AT_START else getattr(sys.stdout, "buffer", None)
    if buffer is None:
        raise CopyFailed("cannot write stdout: it was closed when dsh-bash started")
    try:
        buffer.write(data)
        buffer.flush()
    except BrokenPipeError:
        raise  # the reader went away: main ends quietly with 141, as for run
    except OSError as exc:
        discard_stdout()  # the bytes Python still holds would fail again at exit
        raise CopyFailed(f"cannot write stdout: {exc.strerror or one_line(exc)}") from exc


def _replace(path: str, data: bytes) -> None:
    """Make ``path`` hold ``data``: a fresh file beside it, renamed over it once whole."""
    real = os.path.realpath(path)  # through links, as cp writes: the file a link names is replaced
    try:
        before: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        before = None
    if before is not None and not stat.S_ISREG(before.st_mode):
        # /dev/null, a FIFO, a terminal: nothing to rename over, so written into (a directory refuses).
        with open(real, "wb") as sink:
            sink.write(data)
        return
    fd, temporary = tempfile.mkstemp(prefix=".dsh-bash-", suffix=".tmp", dir=os.path.dirname(real))
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            if before is None:
                os.fchmod(file.fileno(), 0o666 & ~_umask())  # as a new file of cp's (mkstemp's is 0600)
            else:
                os.fchmod(file.fileno(), stat.S_IMODE(before.st_mode))
                with contextlib.suppress(OSError):  # only root may give a file away
                    os.fchown(file.fileno(), before.st_uid, before.st_gid)
        os.replace(temporary, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _refused(path: str, exc: FileOperationError) -> CopyFailed:
    return CopyFailed(f"{REMOTE}{path}: {exc.reason}: {one_line(exc)}")
