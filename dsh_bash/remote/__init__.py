"""The remote-bash kit: bash reached through an API or a channel (a Docker exec, an SSH channel).

What a backend needs when it cannot fork the command itself and talks to a ``bash`` it started
elsewhere: the boot script's markers and reports, the kill script, spill files written on the far
side, and the exit-status trailer of a command run without the supervisor. Imports only the seam;
see ``README.md`` beside this file.

- Boot: a boot script prints :data:`BOOT_OK` (followed by :data:`BOOT_AT`, the command's
  :class:`CommandStart` on its host's clock; :func:`find_boot_ok` finds it in the first output,
  :func:`boot_ok_undecided` says when more bytes are needed) or :data:`BOOT_FAIL` and a report,
  which :func:`boot_failure` turns into the right error.
- Exit: without the supervisor the boot wrapper appends :data:`EXIT_PREFIX`, a nonce and the
  status to stdout; :class:`ExitTrailerFilter` takes it off and keeps it.
- Kill: the :data:`KILL` script (its arguments from :func:`kill_args`) signals every process
  carrying a marker, escaped ones included.
- Spill files on the far side: :data:`SPILL_DIR` (makes the private directory),
  :data:`SPILL_WRITER` (creates one file, refusing any existing path, and copies its stdin into
  it), :func:`spill_file_path` (a fresh name in the directory); :class:`QueuedSpillFile` (a
  :class:`dsh_bash.backend.SpillFile` whose bytes go to a :class:`SpillWriter` in order) and
  :class:`CommandSpills` (one command's files, waited for before its outcome is reported).
- Scripts: :func:`ascii_quote` makes one bash word in ASCII of any text (the same quoting the
  sessions' prologue uses for the values it replays).
- Sockets: :class:`CancelSafeUnixStream` wraps an anyio unix socket stream so that a read or write
  cancelled on asyncio leaves no reader behind (anyio 4.16's own can set the result of a cancelled
  future then: an error in a loop callback); the Docker engine client's socket is one.
- Imports: :func:`quiet_asyncssh_import` keeps the warning asyncssh's import prints under
  cryptography 51 off stderr (the SSH backend, and the Docker backend's ``ssh://`` engines).
"""

from __future__ import annotations

from .._bash_words import ascii_quote
from .._sockets import CancelSafeUnixStream
from ._bash_protocol import (
    BOOT_AT,
    BOOT_FAIL,
    BOOT_OK,
    EXIT_PREFIX,
    KILL,
    SPILL_DIR,
    SPILL_WRITER,
    CommandSpills,
    CommandStart,
    ExitTrailerFilter,
    QueuedSpillFile,
    SpillWriter,
    boot_failure,
    boot_ok_undecided,
    find_boot_ok,
    kill_args,
    spill_file_path,
)
from ._quiet_imports import quiet_asyncssh_import

__all__ = [
    "BOOT_AT",
    "BOOT_FAIL",
    "BOOT_OK",
    "EXIT_PREFIX",
    "KILL",
    "SPILL_DIR",
    "SPILL_WRITER",
    "CancelSafeUnixStream",
    "CommandSpills",
    "CommandStart",
    "ExitTrailerFilter",
    "QueuedSpillFile",
    "SpillWriter",
    "ascii_quote",
    "boot_failure",
    "boot_ok_undecided",
    "find_boot_ok",
    "kill_args",
    "quiet_asyncssh_import",
    "spill_file_path",
]
