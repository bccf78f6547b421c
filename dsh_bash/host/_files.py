"""``read_file`` and ``write_file`` on this host (``R-file-*``): plain system calls, run in a worker thread.

As the harness's user, which is the commands' user on this host (a host backend refuses another).
A read follows links as ``cat`` would; a write goes to a fresh file beside the target, renamed over
it once whole, and never writes through a link at the target (it replaces the link).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat

from .._errors import FileOperationError, FileRefusal
from .._protocol import temporary_file_name

__all__ = ["read_host_file", "write_host_file"]

_READ_CHUNK = 1 << 20


def _refusal(exc: OSError, path: str, doing: str) -> FileOperationError:
    """``exc`` of a system call on ``path`` as the refusal it is; anything else goes on as it is."""
    reason: FileRefusal
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        reason = "file_not_found"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = "permission_denied"
    elif exc.errno == errno.EISDIR:
        reason = "is_a_directory"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        reason = "no_space"
    elif exc.errno == errno.ENXIO:
        reason = "not_a_regular_file"
    else:
        raise exc
    return FileOperationError(f"cannot {doing} {path}: {exc.strerror}", reason=reason)


def _check_kind(mode: int, path: str) -> None:
    if stat.S_ISDIR(mode):
        raise FileOperationError(f"{path} is a directory", reason="is_a_directory")
    if not stat.S_ISREG(mode):
        raise FileOperationError(
            f"{path} is not a regular file (a device, FIFO or socket)", reason="not_a_regular_file"
        )


def read_host_file(path: str, max_bytes: int) -> bytes:
    """The bytes of ``path``; refused past ``max_bytes`` (checked on its size, and again while
    reading: a file that grows is cut off, never returned short)."""
    try:
        # Non-blocking: opening a FIFO nobody writes would wait for ever (it is refused below).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise _refusal(exc, path, "read") from None
    try:
        found = os.fstat(fd)
        _check_kind(found.st_mode, path)
        if found.st_size > max_bytes:
            raise FileOperationError(
                f"{path} holds {found.st_size} bytes, more than max_file_bytes ({max_bytes})",
                reason="file_too_large",
            )
        chunks: list[bytes] = []
        taken = 0
        while True:
            try:
                chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - taken))
            except OSError as exc:
                raise _refusal(exc, path, "read") from None
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            taken += len(chunk)
            if taken > max_bytes:
                raise FileOperationError(
                    f"{path} grew past max_file_bytes ({max_bytes}) while it was read",
                    reason="file_too_large",
                )
    finally:
        os.close(fd)


def write_host_file(path: str, data: bytes, *, make_parents: bool) -> None:
    """``data`` as the file ``path``: written whole into a fresh file of its directory and renamed over
    it; where only the file is writable (its directory is not), or it is another user's, rewritten in
    place (not atomic: nothing else can keep its owner)."""
    directory = posixpath.dirname(path)  # the executor refused a path that names a directory
    if make_parents and directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise _refusal(exc, directory, "make the directory") from None
    try:
        existing: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise _refusal(exc, path, "write") from None
    if existing is not None and not stat.S_ISLNK(existing.st_mode):
        _check_kind(existing.st_mode, path)
    regular = existing is not None and stat.S_ISREG(existing.st_mode)
    if regular:
        # A file the user may not write stays unwritten, though its directory would let a rename
        # replace it (`echo >FILE` would fail too): opened for writing, touching nothing.
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK))
        except OSError as exc:
            raise _refusal(exc, path, "write") from None
    if regular and existing is not None and existing.st_uid != os.geteuid():
        _write_in_place(path, data)
        return
    temp = posixpath.join(directory, temporary_file_name())
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if regular and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            _write_in_place(path, data)  # the directory is not ours to write, the file may be
            return
        raise _refusal(exc, path, "write") from None
    try:
        try:
            _write_all(fd, data)
            if regular and existing is not None:
                os.fchmod(fd, stat.S_IMODE(existing.st_mode))
        finally:
            os.close(fd)
        os.rename(temp, path)
    except OSError as exc:
        _unlink_quietly(temp)
        raise _refusal(exc, path, "write") from None
    except BaseException:
        _unlink_quietly(temp)
        raise


def _write_in_place(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise _refusal(exc, path, "write") from None
    try:
        _check_kind(os.fstat(fd).st_mode, path)
        _write_all(fd, data)
    except OSError as exc:
        raise _refusal(exc, path, "write") from None
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
