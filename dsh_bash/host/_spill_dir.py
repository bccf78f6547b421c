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


class HostSpillDir:
    """A directory only the owner can enter, under a name nobody can predict; removed at close."""

    def __init__(self, parent: str | None) -> None:
        self.path = tempfile.mkdtemp(prefix="dsh-bash-", dir=parent)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def new_file(self, suffix: str) -> HostSpillFile:
        return HostSpillFile(self, f"{secrets.token_hex(12)}.{suffix}")

    def new_capture_file(self) -> str:
        """A fresh empty file (mode 0600) a session command's bash opens as its capture descriptor:
        made here first, so that a sandbox can bind just it writable into a read-only view."""
        for _ in range(8):
            name = f"{secrets.token_hex(10)}.session"  # not a spill file's width: names of their own
            try:
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
            except FileExistsError:
                continue  # something (planted, or chance) has that name: another one
            os.close(fd)
            return os.path.join(self.path, name)
        raise OSError(f"no fresh name for a capture file in {self.path}")

    def remove(self) -> None:
        os.close(self.fd)
        shutil.rmtree(self.path, ignore_errors=True)
