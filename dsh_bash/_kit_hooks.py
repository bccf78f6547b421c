"""What a backend tells the conformance kit about where its commands run (optional methods).

Two things the kit (``dsh_bash_conformance``, run as ``dsh-bash conformance --config FILE``) needs
cannot be read from a configuration: how to put variables into the ambient environment of the
backend's commands, and how to find the processes the commands started. A backend that knows
implements :class:`ConformanceHooks` on its executor class; the kit calls the methods on an
executor made from the configuration that is never opened. Every method is optional: the kit uses
each one it finds and falls back, with a note, to this host (``os.environ`` and ``/proc``).

All of them are synchronous and may be called from any thread, also from one whose event loop is
running (a check's): a backend whose mechanics are async runs them with :func:`run_in_fresh_loop`.
This module imports nothing of the kit, and the kit is not needed to use it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "FIND_PROCESSES",
    "ConformanceHooks",
    "parse_pids",
    "run_in_fresh_loop",
]

T = TypeVar("T")


@runtime_checkable
class ConformanceHooks(Protocol):
    """The optional methods of an executor class that the conformance kit uses (all synchronous)."""

    def kit_plant_ambient(self, variables: Mapping[str, str]) -> AbstractContextManager[Mapping[str, Any]]:
        """Make ``variables`` part of the ambient environment of executors created inside the block.

        The mapping the context manager yields is merged into the config fields of every executor
        the kit makes inside the block (a check's own overrides win): ``{}`` when the planting
        happened where the commands run, ``{"environment": ...}`` when it is a config field.
        ``variables`` holds every variable planted by enclosing blocks too (a hook never merges
        layers itself); leaving the block restores what was there before it.
        """
        ...

    def kit_find_processes(self, marker: str) -> list[int]:
        """Live (non-zombie) processes, where the commands run, whose command line contains ``marker``.

        Pids as seen there (the kit kills leftovers by these pids through an executor). The scan
        itself must not show ``marker`` on a command line (it would find itself): pass it on stdin
        or in the environment, as :data:`FIND_PROCESSES` expects.
        """
        ...

    def kit_notes(self) -> list[str]:
        """What the kit's checks cannot see or prove with this configuration, printed before the run."""
        ...

    def kit_failing_open(self) -> Mapping[str, Any] | None:
        """Config overrides under which opening an executor of this configuration fails.

        As late in the open as the backend can make it fail (after it acquired what a failed open
        might leave: a container, a connection, a spill directory), so that the kit's
        ``nothing-left-by-failed-open`` check proves something. None: no change makes it fail (the
        check is then not applicable). Without this hook (or :meth:`kit_open_leftovers`) the check
        is reported not applicable.
        """
        ...

    def kit_open_leftovers(self, executor: Any) -> list[str]:
        """What ``executor`` (made with :meth:`kit_failing_open`'s overrides, whose open just failed)
        left behind where the commands run: one description per thing, ``[]`` when nothing."""
        ...


# Reads the marker from its stdin's first line (never an argument: a scan for a value must not find
# itself on its own command line) and prints the pid of every live process but itself whose command
# line (its arguments joined) contains it, one per line. Bash builtins only: no process is forked.
FIND_PROCESSES = r"""
IFS= read -r want || exit 2
[ -n "$want" ] || exit 2
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  read -r stat 2>/dev/null < "$d/stat" || continue
  rest=${stat##*) }
  case ${rest%% *} in Z|X|x) continue ;; esac
  mapfile -d '' -t args 2>/dev/null < "$d/cmdline" || continue
  IFS=$'\1'; line="${args[*]}"; IFS=$' \t\n'
  case $line in *"$want"*) echo "$p" ;; esac
done
exit 0
"""


def parse_pids(out: bytes) -> list[int]:
    """The pids :data:`FIND_PROCESSES` printed, sorted; raises ``ValueError`` on anything else."""
    return sorted(int(line) for line in out.decode("ascii").split())


def run_in_fresh_loop(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn()`` to completion on a new asyncio event loop in a new thread, and return its result.

    Callable from any thread, also one whose own event loop is running; the caller blocks meanwhile.
    """
    box: dict[str, Any] = {}

    async def main() -> T:
        return await fn()

    def worker() -> None:
        try:
            box["value"] = asyncio.run(main())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=worker, name="dsh-bash-kit-hook", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value
