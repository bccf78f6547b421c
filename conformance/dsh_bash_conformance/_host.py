"""Host-side helpers of a kit target: finding marked processes and planting ambient variables.

``find_host_processes`` is the public backend API's (:mod:`dsh_bash.backend`): backends use it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from dsh_bash.host import (
    find_host_processes,
    plant_in_os_environ,
)

__all__ = ["find_host_processes", "patch_os_environ"]


@contextlib.contextmanager
def patch_os_environ(variables: Mapping[str, str]) -> Iterator[None]:
    """Set ``variables`` in ``os.environ`` for the block, then restore every one of them."""
    with plant_in_os_environ(variables):
        yield
