"""The supervisor kit: ``dsh-supervise``, the native per-command subreaper, and its wire formats.

Every backend can run its commands under the supervisor (``native/``: it stays the parent of
everything a command starts, so that a kill reaches processes that left the group, and it reports
the exit status in records nothing the command prints can forge). This package ships its binaries
and speaks its protocols; the host kit starts it here, the Docker and SSH backends install it where
their commands run. Imports only the seam; see ``README.md`` beside this file.

- The binaries: :func:`supervisor_binary` (the path of this package's build for an architecture),
  :func:`supervisor_problem` (why there is none), :func:`supervisor_payload` (what to install on a
  machine of a given ``uname -m``: a :class:`SupervisorPayload`), :data:`SUPERVISOR_PROTOCOL`
  (what ``dsh-supervise --version`` prints and a backend checks).
- A command for the supervisor: :func:`command_payload` (argv, environment, directory, terminal:
  the request of ``--fork-server`` and the ``x`` frame of ``--frame --spec``).
- The framed channel of ``--frame``: :func:`encode_frame` (frames to the supervisor),
  :class:`SupervisorRecords` (its status records, read), and :class:`FramedCommand`, the
  transport-independent half of a command under it (output, outcome, kills, and the side pipe
  that moves its output past a costly relay). A command may stop (SIGSTOP) its supervisor: a
  backend passes ``FramedCommand`` its ``continues``: :func:`continue_runs` of running
  :data:`CONTINUE_SUPERVISOR` (a bash script: SIGCONT to every stopped supervisor of the user) where
  the commands run, shared by all the executor's commands of that user.
- The file mode (protocol 9): :func:`file_read_argv` and :func:`file_write_argv`, a file read or
  written as the user the supervisor runs as (for a backend whose own channel cannot take that
  user's permissions), and :func:`check_file_mode`, its exit status as a refusal
  (:data:`FILE_MODE_REFUSALS`) or a failure.
- The sandbox policy's step (protocol 10; its network rules 11): :data:`CONFINE_FROM_SUPERVISOR` (its
  argv prefix where the command's supervisor execs it), :func:`confine_probe_argv` and
  :func:`confinement_from_probe` (what the step can apply where commands run: the kernel's Landlock
  ABI, whether a loopback-only network can hold).
- The detached mode's signed status file: :class:`SignedRecords` verifies it with a key of
  :data:`SUPERVISOR_KEY_SIZE` bytes.
"""

from __future__ import annotations

from ._confine import CONFINE_FROM_SUPERVISOR, confine_probe_argv, confinement_from_probe
from ._file_mode import FILE_MODE_REFUSALS, check_file_mode, file_read_argv, file_write_argv
from ._framed_command import CONTINUE_SUPERVISOR, FramedCommand, continue_runs
from ._frames import SupervisorRecords, command_payload, encode_frame
from ._native import PROTOCOL_VERSION as SUPERVISOR_PROTOCOL
from ._native import SupervisorPayload, supervisor_binary, supervisor_payload, supervisor_problem
from ._signed_records import KEY_SIZE as SUPERVISOR_KEY_SIZE
from ._signed_records import SignedRecords

__all__ = [
    "CONFINE_FROM_SUPERVISOR",
    "CONTINUE_SUPERVISOR",
    "FILE_MODE_REFUSALS",
    "SUPERVISOR_KEY_SIZE",
    "SUPERVISOR_PROTOCOL",
    "FramedCommand",
    "SignedRecords",
    "SupervisorPayload",
    "SupervisorRecords",
    "check_file_mode",
    "command_payload",
    "confine_probe_argv",
    "confinement_from_probe",
    "continue_runs",
    "encode_frame",
    "file_read_argv",
    "file_write_argv",
    "supervisor_binary",
    "supervisor_payload",
    "supervisor_problem",
]
