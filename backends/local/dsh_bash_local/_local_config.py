"""Configuration of the local backend."""

from __future__ import annotations

from dsh_bash.host import HostConfig

__all__ = ["LocalConfig"]


class LocalConfig(HostConfig):
    """The shared budgets, plus where bash and the spill directory live (``bash``, ``spill_dir``).

    ``cwd`` defaults to the process's working directory when the executor is made.
    """
