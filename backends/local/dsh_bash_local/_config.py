"""Configuration of the local backend."""

from __future__ import annotations

from dsh_bash import BudgetConfig

__all__ = ["LocalConfig"]


class LocalConfig(BudgetConfig):
    """The shared budgets, plus where bash and the spill directory live.

    ``cwd`` defaults to the process's working directory when the executor is made.
    """

    bash: str = "bash"
    spill_dir: str | None = None
