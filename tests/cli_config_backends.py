"""Backends named by ``module:attr`` in the configurations of ``tests/test_cli_config.py``.

The CLI runs in a subprocess with ``tests/`` on ``PYTHONPATH``, so ``cli_config_backends:NAME``
resolves to the callables below.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from dsh_bash_local import LocalBashExecutor, LocalConfig
from pydantic import Field


def local_factory(**fields: Any) -> LocalBashExecutor:
    """A third-party style factory: the config fields as keyword arguments, an unopened executor back."""
    return LocalBashExecutor(LocalConfig(**fields))


class FixedAmbientConfig(LocalConfig):
    """The local config, plus the ambient environment itself (instead of this process's)."""

    ambient: dict[str, str] = Field(default_factory=dict)


class FixedAmbientExecutor(LocalBashExecutor):
    """A local backend whose commands' ambient environment is ``PATH`` plus the ``ambient`` field.

    Planting variables in ``os.environ`` does not reach its commands: without a hook the kit's
    environment checks cannot plant anything.
    """

    def __init__(self, config: FixedAmbientConfig) -> None:
        super().__init__(config)
        self._ambient = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **config.ambient}

    def _ambient_env(self) -> Mapping[str, str]:
        return self._ambient


class PlantingExecutor(FixedAmbientExecutor):
    """The same, telling the kit how to plant ambient variables: through the ``ambient`` field."""

    def kit_plant_ambient(
        self, variables: Mapping[str, str]
    ) -> contextlib.AbstractContextManager[dict[str, Any]]:
        assert isinstance(self.config, FixedAmbientConfig)
        return contextlib.nullcontext({"ambient": {**self.config.ambient, **variables}})


def fixed_ambient(**fields: Any) -> FixedAmbientExecutor:
    return FixedAmbientExecutor(FixedAmbientConfig(**fields))


def planting(**fields: Any) -> PlantingExecutor:
    return PlantingExecutor(FixedAmbientConfig(**fields))
