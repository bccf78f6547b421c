"""Peak memory growth of this process over a stretch of work, on Linux.

``ru_maxrss`` only ever grows, so a peak reached while importing hides any later growth below it.
Instead the kernel's high-water mark is reset (``/proc/self/clear_refs``, value 5) at the start,
and the growth is the new high-water mark (``VmHWM``) minus the resident size at the start.
"""

from __future__ import annotations

import re

__all__ = ["PeakMeter"]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as handle:
        found = re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(found.group(1)) / 1024


class PeakMeter:
    """``PeakMeter()`` starts measuring; ``growth_mib()`` is the peak RSS since then minus the RSS then."""

    def __init__(self) -> None:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        self.base_mib = _status_mib("VmRSS")

    def growth_mib(self) -> float:
        return _status_mib("VmHWM") - self.base_mib
