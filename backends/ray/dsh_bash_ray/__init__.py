"""The Ray backend: an executor whose commands run on one node of a Ray cluster.

See ``README.md`` beside this package. Install with the ``ray`` extra; entry point ``ray``.
"""

from __future__ import annotations

from ._dialer import RayDialer
from ._node_host import NodeInfo
from ._ray_config import RayConfig
from ._ray_executor import RayBashExecutor, ray_executor

__all__ = ["NodeInfo", "RayBashExecutor", "RayConfig", "RayDialer", "ray_executor"]
