"""``read_file`` and ``write_file`` over SFTP (``R-file-*``), never through a command's output.

One SFTP client per executor, opened at the first file operation on a channel of its own (the pool's
``open_sftp``: the server's SFTP subsystem, else its ``sftp-server`` over an exec channel) and opened
again after it broke. Permissions are the login's, applied by the server.
"""

from __future__ import annotations

import logging
import posixpath
import stat

import anyio
import asyncssh

from dsh_bash import BashInfrastructureError, FileOperationError, FileRefusal
from dsh_bash.backend import temporary_file_name

from ._connection import ChannelPool, RequestRefused

__all__ = ["RemoteFiles"]

log = logging.getLogger("dsh_bash.ssh")

#: SFTP status codes, as the refusal each is (anything else is the backend failing).
_REFUSALS: dict[int, FileRefusal] = {
    asyncssh.FX_NO_SUCH_FILE: "file_not_found",
    asyncssh.FX_NO_SUCH_PATH: "file_not_found",
    asyncssh.FX_NOT_A_DIRECTORY: "file_not_found",
    asyncssh.FX_LINK_LOOP: "file_not_found",
    asyncssh.FX_PERMISSION_DENIED: "permission_denied",
    asyncssh.FX_WRITE_PROTECT: "permission_denied",
    asyncssh.FX_FILE_IS_A_DIRECTORY: "is_a_directory",
    asyncssh.FX_NO_SPACE_ON_FILESYSTEM: "no_space",
    asyncssh.FX_QUOTA_EXCEEDED: "no_space",
}


class RemoteFiles:
    """The files of the executor's login, through its SFTP client."""

    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool
        self._client: asyncssh.SFTPClient | None = None
        self._opening = anyio.Lock()

    async def _sftp(self) -> asyncssh.SFTPClient:
        async with self._opening:
            if self._client is None:
                try:
                    self._client = await self._pool.open_sftp()
                except RequestRefused as exc:
                    raise BashInfrastructureError(
                        f"{self._pool.where} offers no SFTP (and exec_sftp_server is off): {exc}; nothing "
                        "was read or written",
                        reason="files_unsupported",
                    ) from None
            return self._client

    def _broken(self, exc: BaseException, path: str) -> BashInfrastructureError:
        """The SFTP channel failed under an operation: dropped (the next one opens another)."""
        client, self._client = self._client, None
        if client is not None:
            client.exit()
        return BashInfrastructureError(
            f"the SFTP channel to {self._pool.where} failed on {path}: {exc}", reason="connection_lost"
        )

    def _translated(self, exc: BaseException, path: str, doing: str) -> Exception:
        """What the caller gets for ``exc`` of an SFTP operation: the server's refusal as a
        :class:`FileOperationError`, the channel failing as the backend failing."""
        if isinstance(exc, asyncssh.SFTPError) and not isinstance(exc, asyncssh.SFTPConnectionLost):
            return self._refused(exc, path, doing)
        return self._broken(exc, path)

    def _refused(self, exc: asyncssh.SFTPError, path: str, doing: str) -> Exception:
        reason = _REFUSALS.get(exc.code)
        if reason is None:  # a server's generic failure says nothing a caller could act on
            return BashInfrastructureError(
                f"cannot {doing} {path} on {self._pool.where}: SFTP status {exc.code}: {exc.reason}",
                reason="unclassified",
            )
        return FileOperationError(f"cannot {doing} {path}: {exc.reason}", reason=reason)

    async def read(self, path: str, max_bytes: int) -> bytes:
        sftp = await self._sftp()
        try:
            found = await sftp.stat(path)
            _check_kind(found, path)
            if found.size is not None and found.size > max_bytes:
                raise FileOperationError(
                    f"{path} holds {found.size} bytes, more than max_file_bytes ({max_bytes})",
                    reason="file_too_large",
                )
            async with sftp.open(path, "rb", encoding=None) as handle:
                data = await handle.read(max_bytes + 1)
            assert isinstance(data, bytes)  # binary mode, no encoding
        except (asyncssh.Error, OSError) as exc:
            raise self._translated(exc, path, "read") from None
        if len(data) > max_bytes:
            raise FileOperationError(
                f"{path} grew past max_file_bytes ({max_bytes}) while it was read", reason="file_too_large"
            )
        return data

    async def write(self, path: str, data: bytes, *, make_parents: bool) -> None:
        sftp = await self._sftp()
        directory = posixpath.dirname(path)  # the executor refused a path that names a directory
        temp = posixpath.join(directory, temporary_file_name())
        created = False
        try:
            if make_parents and directory:
                await sftp.makedirs(directory, exist_ok=True)
            try:
                existing: asyncssh.SFTPAttrs | None = await sftp.lstat(path)
            except asyncssh.SFTPNoSuchFile:
                existing = None
            regular = existing is not None and existing.type == asyncssh.FILEXFER_TYPE_REGULAR
            if existing is not None and existing.type != asyncssh.FILEXFER_TYPE_SYMLINK:
                _check_kind(existing, path)
            mode = (existing.permissions or 0o644) & 0o7777 if regular and existing is not None else 0o666
            if regular:
                # A file the login may not write stays unwritten, though its directory would let a
                # rename replace it: opened for writing (no truncation), touching nothing.
                async with sftp.open(path, "r+b", encoding=None):
                    pass
            try:
                handle = await sftp.open(temp, "xb", asyncssh.SFTPAttrs(permissions=mode), encoding=None)
            except asyncssh.SFTPPermissionDenied:
                if not regular:
                    raise
                # The directory is not the login's to write, the file may be: rewritten in place.
                async with sftp.open(path, "wb", encoding=None) as in_place:
                    await in_place.write(data)
                return
            created = True
            async with handle:
                await handle.write(data)
            await sftp.posix_rename(temp, path)
            created = False
        except (asyncssh.Error, OSError) as exc:
            raise self._translated(exc, path, "write") from None
        finally:
            if created:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    try:
                        await sftp.remove(temp)
                    except (asyncssh.Error, OSError) as exc:
                        log.warning("removing %s on %s failed: %s", temp, self._pool.where, exc)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.exit()


def _check_kind(attrs: asyncssh.SFTPAttrs, path: str) -> None:
    kind = attrs.type
    if kind == asyncssh.FILEXFER_TYPE_DIRECTORY:
        raise FileOperationError(f"{path} is a directory", reason="is_a_directory")
    if kind != asyncssh.FILEXFER_TYPE_REGULAR:
        if kind == asyncssh.FILEXFER_TYPE_UNKNOWN and attrs.permissions is not None:
            if stat.S_ISREG(attrs.permissions):  # a version 3 server says it in the mode alone
                return
            if stat.S_ISDIR(attrs.permissions):
                raise FileOperationError(f"{path} is a directory", reason="is_a_directory")
        raise FileOperationError(
            f"{path} is not a regular file (a device, FIFO or socket)", reason="not_a_regular_file"
        )
