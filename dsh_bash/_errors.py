"""The error hierarchy every backend raises, and the machine-readable reasons of infrastructure errors."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "FILE_REFUSALS",
    "INFRA_REASONS",
    "INPUT_REFUSALS",
    "BashInfrastructureError",
    "ConfigError",
    "DshBashError",
    "ExecutorClosedError",
    "FileOperationError",
    "FileRefusal",
    "InfraReason",
    "InputRefusal",
    "TaskInputError",
    "UnknownTaskError",
]

#: Why an infrastructure error happened, for code that branches on it (never parse the message).
#: The meaning of each value is documented in ``docs/contract.md``; the set only grows.
InfraReason = Literal[
    # Nothing was started.
    "closed",  # the executor is not open (ExecutorClosedError)
    "already_aborted",  # the spec's abort signal was aborted before the start
    "workdir_missing",  # the working directory does not exist
    "workdir_not_directory",  # it exists but is not a directory
    "workdir_not_accessible",  # it is a directory the command's user cannot enter
    "shell_missing",  # no usable bash where commands run
    "start_failed",  # the process could not be created (fork, exec, descriptors, a refused start)
    "spill_unavailable",  # the private spill directory could not be created or used (at open)
    "task_limit",  # max_running_tasks background tasks run already
    "interactive_unsupported",  # open_stdin was asked of a backend (or mode) that cannot keep stdin open
    "session_unknown",  # the spec's session is not one of this executor's, or belongs to another owner
    "session_unsupported",  # a session was asked of a backend (or mode) that cannot carry one
    "files_unsupported",  # read_file/write_file on a backend (or mode) that cannot move files
    "policy_unenforceable",  # a sandbox policy rule that cannot be applied where commands run (required)
    # Where commands run could not be reached or set up.
    "engine_unreachable",  # the Docker engine does not answer
    "image_missing",  # the image is not there and may not be pulled
    "container_missing",  # the named container does not exist or is not running (at open)
    "user_unknown",  # the configured (or the spec's) user does not exist where commands run
    "user_unsupported",  # the spec's user is not one this backend can run commands as
    "host_unreachable",  # the SSH host cannot be reached (DNS, refused, timed out)
    "auth_failed",  # the SSH server refused every credential
    "host_key_rejected",  # the SSH host key did not verify
    "cluster_unreachable",  # the Ray cluster cannot be reached
    "no_node_fits",  # no live node of the Ray cluster fits the placement in time
    # The backend failed under a command that was running.
    "container_gone",  # the container stopped or was removed
    "connection_lost",  # the connection to the engine or host dropped
    "command_lost",  # the backend lost track of the command (its supervisor died, its status is gone)
    "node_lost",  # the Ray node the commands ran on (or its node host) died
    # Anything else; the message says what.
    "unclassified",
]

#: Every reason, in the order above.
INFRA_REASONS: tuple[InfraReason, ...] = get_args(InfraReason)


class DshBashError(Exception):
    """Base class of every error this project raises on purpose."""


class BashInfrastructureError(DshBashError):
    """The command could not be started, or the backend failed under it so no truthful result exists.

    ``reason`` says why, as one of :data:`INFRA_REASONS`; the message is for people.
    """

    def __init__(self, message: str, *, reason: InfraReason = "unclassified") -> None:
        super().__init__(message)
        if reason not in INFRA_REASONS:
            raise ValueError(f"unknown infrastructure error reason {reason!r}")
        self.reason: InfraReason = reason

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the reason across pickling (worker processes, logging handlers that copy records).
        return (_rebuild, (type(self), str(self), self.reason))


def _rebuild(
    cls: type[BashInfrastructureError], message: str, reason: InfraReason
) -> BashInfrastructureError:
    error = cls.__new__(cls)
    BashInfrastructureError.__init__(error, message, reason=reason)
    return error


class ExecutorClosedError(BashInfrastructureError):
    """The executor is not open: its block was not entered yet, or it was closed."""

    def __init__(self, message: str, *, reason: InfraReason = "closed") -> None:
        super().__init__(message, reason=reason)


class UnknownTaskError(DshBashError, LookupError):
    """No background task with that id was ever started on this executor."""


#: Why ``write_input`` or ``close_input`` refused (:attr:`TaskInputError.reason`); the set only grows.
InputRefusal = Literal[
    "task_ended",  # the task ended, or its kill began
    "input_closed",  # close_input was called
    "input_not_open",  # the task was started without open_stdin
    "input_broken",  # the command closed its stdin (or it could not be written any more)
    "input_full",  # the write would leave more than MAX_PENDING_INPUT bytes unread by the command
    "other_owner",  # the task belongs to another owner
    "not_terminal",  # resize_terminal on a task without a terminal
    "terminal_no_close",  # close_input on a terminal task: a terminal ends by hang-up (kill)
]

#: Every input refusal, in the order above.
INPUT_REFUSALS: tuple[InputRefusal, ...] = get_args(InputRefusal)


class TaskInputError(DshBashError):
    """Input or a close of input the task cannot take; nothing of it was sent.

    ``reason`` says why, as one of :data:`INPUT_REFUSALS`; the message is for people.
    """

    def __init__(self, message: str, *, reason: InputRefusal) -> None:
        super().__init__(message)
        if reason not in INPUT_REFUSALS:
            raise ValueError(f"unknown input refusal reason {reason!r}")
        self.reason: InputRefusal = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_input_error, (type(self), str(self), self.reason))


def _rebuild_input_error(cls: type[TaskInputError], message: str, reason: InputRefusal) -> TaskInputError:
    error = cls.__new__(cls)
    TaskInputError.__init__(error, message, reason=reason)
    return error


class ConfigError(DshBashError, ValueError):
    """A configuration value, file or backend name is unusable; the message names which and why."""


#: Why ``read_file`` or ``write_file`` refused (:attr:`FileOperationError.reason`); the set only grows.
FileRefusal = Literal[
    "file_not_found",  # the path (or, for a write without make_parents, its directory) does not exist
    "is_a_directory",  # the path is a directory
    "not_a_regular_file",  # a device, FIFO or socket
    "permission_denied",  # the user may not read it, or may not write or create it there
    "file_too_large",  # a read of a file over max_file_bytes
    "no_space",  # the write ran out of space or quota
]

#: Every file refusal, in the order above.
FILE_REFUSALS: tuple[FileRefusal, ...] = get_args(FileRefusal)


class FileOperationError(DshBashError):
    """A file ``read_file`` or ``write_file`` could not read or write; nothing was returned or left
    half-written. ``reason`` says why, as one of :data:`FILE_REFUSALS`; the message names the path."""

    def __init__(self, message: str, *, reason: FileRefusal) -> None:
        super().__init__(message)
        if reason not in FILE_REFUSALS:
            raise ValueError(f"unknown file refusal reason {reason!r}")
        self.reason: FileRefusal = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_file_error, (type(self), str(self), self.reason))


def _rebuild_file_error(
    cls: type[FileOperationError], message: str, reason: FileRefusal
) -> FileOperationError:
    error = cls.__new__(cls)
    FileOperationError.__init__(error, message, reason=reason)
    return error
