"""Kit targets for the backends this repository tests."""

from __future__ import annotations

from typing import Any

from dsh_bash_conformance import KitTarget
from dsh_bash_local import LocalBashExecutor, LocalConfig


def local_target(anyio_backend: str) -> KitTarget:
    """The local backend: commands are subprocesses of this process; ambient env is ``os.environ``."""

    def make_executor(**overrides: Any) -> LocalBashExecutor:
        return LocalBashExecutor(LocalConfig(**overrides))

    return KitTarget(name=f"local[{anyio_backend}]", make_executor=make_executor, anyio_backend=anyio_backend)
