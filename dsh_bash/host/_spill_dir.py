"""Private spill files on this host's filesystem (for backends whose commands run on this host)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable

__all__ = ["HostSpillDir", "HostSpillFile"]

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CAPTURE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC


class HostSpillFile:
    """One spill file, created 0600 and exclusively inside the 0700 directory (never via a link)."""

    __slots__ = ("_dir", "_fd", "_name", "path")

    #: Written synchronously: a failure raises OSError at once, the file is never lost later; it
    #: exists from its opening on.
    lost = False
    pending = False

    def __init__(self, directory: HostSpillDir, name: str) -> None:
        self._dir = directory
        self._name = name
        self._fd: int | None = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=directory.fd)
        self.path = os.path.join(directory.path, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def delete(self, gone: Callable[[], None]) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._name, dir_fd=self._dir.fd)
        gone()  # unlinked and closed: the blocks are free (an error above raises before this)


#: Where session capture files go when it can take them: a memory filesystem, on which the dozen
#: small writes of a capture cost a command about 0.2 ms less than on a disk's (ext4, bench/README).
_CAPTURE_PARENT = "/dev/shm"


def _private_directory(parent: str | None) -> tuple[str, int]:
    path = tempfile.mkdtemp(prefix="dsh-bash-", dir=parent)
    return path, os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


class HostSpillDir:
    """A directory only the owner can enter, under a name nobody can predict; removed at close.
    Session capture files go to one of its own in memory (``/dev/shm``) where there is one."""

    def __init__(self, parent: str | None, capture_parent: str | None = _CAPTURE_PARENT) -> None:
        self.path, self.fd = _private_directory(parent)
        self._capture_parent = capture_parent
        #: The capture files' directory (path, fd), made at the first; the spill directory's own
        #: when the memory filesystem cannot take it.
        self._captures: tuple[str, int] | None = None

    def new_file(self, suffix: str) -> HostSpillFile:
        return HostSpillFile(self, f"{secrets.token_hex(12)}.{suffix}")

    def new_capture_file(self) -> str:
        """A fresh empty file (mode 0600) a session command's bash opens as its capture descriptor:
        made here first, so that a sandbox can bind just it writable into a read-only view."""
        if self._captures is None:
            self._captures = (self.path, self.fd)
            if self._capture_parent is not None and os.path.isdir(self._capture_parent):
                with contextlib.suppress(OSError):
                    self._captures = _private_directory(self._capture_parent)
        try:
            return _new_capture_file(*self._captures)
        except OSError:
            if self._captures[1] == self.fd:
                raise
        return _new_capture_file(self.path, self.fd)  # the memory filesystem is full

    @property
    def capture_directory(self) -> str | None:
        """The capture files' own directory, once made (None: none, or the spill directory)."""
        captures = self._captures
        return None if captures is None or captures[1] == self.fd else captures[0]

    def remove(self) -> None:
        captures, self._captures = self._captures, None
        if captures is not None and captures[1] != self.fd:
            os.close(captures[1])
            shutil.rmtree(captures[0], ignore_errors=True)
        os.close(self.fd)
        shutil.rmtree(self.path, ignore_errors=True)


def _new_capture_file(directory: str, directory_fd: int) -> str:
    for _ in range(8):
        name = f"{secrets.token_hex(10)}.session"  # not a spill file's width: names of their own
        try:
            fd = os.open(name, _CAPTURE_FLAGS, 0o600, dir_fd=directory_fd)
        except FileExistsError:
            continue  # something (planted, or chance) has that name: another one
        os.close(fd)
        return os.path.join(directory, name)
    raise OSError(f"no fresh name for a capture file in {directory}")
