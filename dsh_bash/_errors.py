"""The error hierarchy every backend raises."""

from __future__ import annotations

__all__ = [
    "BashInfrastructureError",
    "ConfigError",
    "DshBashError",
    "ExecutorClosedError",
    "UnknownTaskError",
]


class DshBashError(Exception):
    """Base class of every error this project raises on purpose."""


class BashInfrastructureError(DshBashError):
    """The command could not be started, or the backend failed under it so no truthful result exists."""


class ExecutorClosedError(BashInfrastructureError):
    """The executor is not open: its block was not entered yet, or it was closed."""


class UnknownTaskError(DshBashError, LookupError):
    """No background task with that id was ever started on this executor."""


class ConfigError(DshBashError, ValueError):
    """A configuration value, file or backend name is unusable; the message names which and why."""
