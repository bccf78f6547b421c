"""The sandbox policy's step (protocol 10, its network rules 11, ``native/confine.c``) as a backend runs
it: exec'd by the command's supervisor as its own image, and asked where commands run what it can
apply there."""

from __future__ import annotations

from .._policy import ConfinementProbe

__all__ = ["CONFINE_FROM_SUPERVISOR", "confine_probe_argv", "confinement_from_probe"]

#: The step's argv prefix for a backend whose commands' supervisor execs them: ``/proc/self/exe`` is
#: then the supervisor's own image (a sealed copy, or the file checked before its exec), never a file
#: a command could have replaced since (issue 30).
CONFINE_FROM_SUPERVISOR: tuple[str, ...] = ("/proc/self/exe", "--confine")


def confine_probe_argv(supervisor: str) -> list[str]:
    """Run where commands run: prints ``landlock ABI`` (0 without Landlock), ``loopback 1|0`` and
    ``processes 1|0``."""
    return [supervisor, "--confine", "--probe"]


def confinement_from_probe(exit_code: int | None, stdout: bytes) -> ConfinementProbe:
    """What the probe printed; nothing applicable for anything else (a binary without the step, a
    failure). A binary of protocol 10 prints no ``loopback`` line: it has no network rules."""
    said = dict(line.split(" ", 1) for line in stdout.decode("ascii", "replace").splitlines() if " " in line)
    abi = said.get("landlock", "")
    if exit_code != 0 or not abi.isdigit():
        return ConfinementProbe()
    return ConfinementProbe(
        landlock_abi=int(abi), loopback=said.get("loopback") == "1", processes=said.get("processes") == "1"
    )
