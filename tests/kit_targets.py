"""Kit targets for the backends this repository tests."""

from __future__ import annotations

from typing import Any

from dsh_bash_conformance import CHECKS, CheckOutcome, KitTarget
from dsh_bash_local import LocalBashExecutor, LocalConfig

#: The checks a backend fails when it finds a command's processes by their environment marker and
#: takes its outcome from in-band reports (Docker with ``containment = "marker"``, as it was before;
#: issue "containment that holds against hostile commands"). Their tests expect exactly these to
#: fail, so one that starts passing is noticed. SSH runs every command under dsh-supervise
#: (foreground ones under ``--frame``, detached background tasks under ``--detach``): it fails none.
MARKER_CONTAINMENT_FAILS: dict[str, frozenset[str]] = {
    "docker": frozenset(
        {
            "escapee-without-environment-killed",
            "escapee-rewriting-environment-killed",
            # Root in the container without CAP_SYS_PTRACE (image mode drops all capabilities)
            # cannot read a non-dumpable process's environment.
            "non-dumpable-escapee-killed",
            # The boot wrapper's nonce is in its initial environment, which the command reads.
            "forged-outcome-ignored",
            # The engine sees a signal death as exit status 128+n only, and nobody here sent it.
            "self-kill-reported-as-signal",
            "self-signal-reports-neither",
            "end-cause-signaled",
        }
    ),
    "ssh": frozenset(),
}
#: Checks whose escapee these backends kill or miss by chance: a setsid fork chain races each
#: kill-script scan (its newest generation is born after the scan). Either outcome is accepted there,
#: but never an error or a hang. A supervisor's kill passes repeat until none is left: no race.
MARKER_CONTAINMENT_RACES: dict[str, frozenset[str]] = {
    "docker": frozenset({"setsid-chain-killed"}),
    "ssh": frozenset(),
}


#: The checks of input to a running task (R-input-*) that use open input
#: (``input-off-by-default`` starts no task with it: it passes everywhere), and of terminals (R-term-*).
INPUT_CHECKS = frozenset(
    name
    for name, each in CHECKS.items()
    if each.clause.startswith("R-input-") and name != "input-off-by-default"
)
TERMINAL_CHECKS = frozenset(name for name, each in CHECKS.items() if each.clause.startswith("R-term-"))
#: Where the kit reports them ``not_applicable`` (the backend refuses ``open_stdin`` or ``terminal``,
#: reason ``interactive_unsupported``, or its reads say ``waiting_for_input=None``); tests expect
#: exactly that, so a backend that starts taking them is noticed. The bwrap example refuses open input
#: for good: bwrap's own process holds the shell's stdin, so a command that closed its stdin could not
#: be told (see its README).
INPUT_NOT_YET: dict[str, frozenset[str]] = {
    "docker": frozenset(),
    "ssh": frozenset(),
    "bwrap": INPUT_CHECKS | TERMINAL_CHECKS,
}


def expected_outcome(backend: str, name: str) -> CheckOutcome:
    """What check ``name`` must report against this repository's ``backend`` (``docker``, ``ssh``,
    ``bwrap``)."""
    return "not_applicable" if name in INPUT_NOT_YET[backend] else "passed"


def local_target(anyio_backend: str) -> KitTarget:
    """The local backend: commands are subprocesses of this process; ambient env is ``os.environ``."""

    def make_executor(**overrides: Any) -> LocalBashExecutor:
        return LocalBashExecutor(LocalConfig(**overrides))

    return KitTarget(name=f"local[{anyio_backend}]", make_executor=make_executor, anyio_backend=anyio_backend)
