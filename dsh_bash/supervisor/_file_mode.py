"""The supervisor's file mode (protocol 9, ``native/files.c``): a file read or written as the user the
supervisor runs as, for a backend whose own channel cannot take that user's permissions (Docker's
archive API reads and writes as root). The backend runs :func:`file_read_argv` or
:func:`file_write_argv` (the data on stdin) where its commands run, as the command's user, and hands
the exit status to :func:`check_file_mode`."""

from __future__ import annotations

from .._errors import BashInfrastructureError, FileOperationError, FileRefusal
from .._protocol import temporary_file_name

__all__ = ["FILE_MODE_REFUSALS", "check_file_mode", "file_read_argv", "file_write_argv"]

#: The exit statuses of a refusal (nothing read or written), as native/files.c defines them.
FILE_MODE_REFUSALS: dict[int, FileRefusal] = {
    80: "file_not_found",
    81: "is_a_directory",
    82: "not_a_regular_file",
    83: "permission_denied",
    84: "file_too_large",
    85: "no_space",
}


def file_read_argv(supervisor: str, path: str, max_bytes: int) -> list[str]:
    """Prints the bytes of the absolute ``path``, at most ``max_bytes`` of them (a larger file is refused)."""
    return [supervisor, "--read-file", path, "--max-bytes", str(max_bytes)]


def file_write_argv(supervisor: str, path: str, size: int, *, make_parents: bool) -> list[str]:
    """Writes the ``size`` bytes of its stdin as the absolute ``path``, through a fresh file beside it
    renamed over it once whole; fewer or more bytes than ``size``: nothing is put in place."""
    argv = [supervisor, "--write-file", path, "--temp-name", temporary_file_name(), "--size", str(size)]
    return [*argv, "--make-parents"] if make_parents else argv


def check_file_mode(exit_code: int | None, stderr: bytes, path: str, doing: str) -> None:
    """Nothing for exit status 0; a :class:`FileOperationError` for a refusal; else a
    :class:`BashInfrastructureError` (``doing``: "read" or "write", for the message)."""
    if exit_code == 0:
        return
    said = stderr.decode("utf-8", "replace").strip()[:500]
    reason = FILE_MODE_REFUSALS.get(exit_code) if exit_code is not None else None
    if reason is not None:
        raise FileOperationError(said or f"cannot {doing} {path}", reason=reason)
    raise BashInfrastructureError(
        f"could not {doing} {path} through dsh-supervise (exit status {exit_code}): {said}",
        reason="unclassified",
    )
