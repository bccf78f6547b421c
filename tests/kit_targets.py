"""Kit targets for the backends this repository tests."""

from __future__ import annotations

from typing import Any

from dsh_bash_conformance import KitTarget
from dsh_bash_local import LocalBashExecutor, LocalConfig

#: The checks a backend that finds processes by an environment marker fails (Docker and SSH until
#: they run their commands under dsh-supervise; issue "containment that holds against hostile
#: commands"). Their tests expect exactly these to fail, so one that starts passing is noticed.
MARKER_CONTAINMENT_FAILS = frozenset(
    {"escapee-without-environment-killed", "escapee-rewriting-environment-killed"}
)


def local_target(anyio_backend: str) -> KitTarget:
    """The local backend: commands are subprocesses of this process; ambient env is ``os.environ``."""

    def make_executor(**overrides: Any) -> LocalBashExecutor:
        return LocalBashExecutor(LocalConfig(**overrides))

    return KitTarget(name=f"local[{anyio_backend}]", make_executor=make_executor, anyio_backend=anyio_backend)
