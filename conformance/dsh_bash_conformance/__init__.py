"""dsh_bash_conformance: one suite of checks, written against the executor contract, for any backend.

Describe the backend as a :class:`KitTarget` and call :func:`run_kit`::

    from dsh_bash_conformance import KitTarget, run_kit
    report = run_kit(KitTarget(name="mine", make_executor=lambda **cfg: MyExecutor(MyConfig(**cfg))))
    print(report.summary())

Checks are registered with :func:`check` into :data:`CHECKS` (in definition order); each is an
``async def fn(ctx: CheckContext) -> None`` that raises :class:`CheckFailed` on a violation.

:func:`watched` and :func:`call_watched` run code in a daemon thread the caller abandons when it
overruns (:class:`Abandoned`), as the kit runs each check; ``dsh-bash doctor`` uses them too.
"""

import importlib

from ._config_target import ConfigTarget, config_target, find_namespaced_processes
from ._harness import (
    CHECKS,
    Check,
    CheckContext,
    CheckFailed,
    CheckKind,
    CheckOutcome,
    CheckResult,
    KitReport,
    KitTarget,
    LatencyCache,
    NotApplicable,
    check,
    run_kit,
)
from ._host import find_host_processes, patch_os_environ
from ._watchdog import Abandoned, call_watched, watched

# Importing the check modules registers their checks, in this order.
for _module in (
    "_checks_outcome",
    "_checks_processes",
    "_checks_tasks",
    "_checks_session",
    "_checks_files",
    "_checks_policy",
    "_checks_reads",
    "_checks_input",
    "_checks_output",
    "_checks_env",
    "_checks_listeners",
    "_checks_closed",
    "_checks_beyond",
    "_checks_containment",
):
    importlib.import_module(f"{__name__}.{_module}")
del _module


__all__ = [
    "CHECKS",
    "Abandoned",
    "Check",
    "CheckContext",
    "CheckFailed",
    "CheckKind",
    "CheckOutcome",
    "CheckResult",
    "ConfigTarget",
    "KitReport",
    "KitTarget",
    "LatencyCache",
    "NotApplicable",
    "call_watched",
    "check",
    "config_target",
    "find_host_processes",
    "find_namespaced_processes",
    "patch_os_environ",
    "run_kit",
    "watched",
]
