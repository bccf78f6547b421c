"""The sandbox policy's step (protocol 10, ``native/confine.c``) as a backend runs it: exec'd by the
command's supervisor as its own image, and asked where commands run which Landlock ABI the kernel has."""

from __future__ import annotations

__all__ = ["CONFINE_FROM_SUPERVISOR", "confine_probe_argv", "landlock_abi_from_probe"]

#: The step's argv prefix for a backend whose commands' supervisor execs them: ``/proc/self/exe`` is
#: then the supervisor's own image (a sealed copy, or the file checked before its exec), never a file
#: a command could have replaced since (issue 30).
CONFINE_FROM_SUPERVISOR: tuple[str, ...] = ("/proc/self/exe", "--confine")


def confine_probe_argv(supervisor: str) -> list[str]:
    """Run where commands run: prints ``landlock ABI`` (0 without Landlock)."""
    return [supervisor, "--confine", "--probe"]


def landlock_abi_from_probe(exit_code: int | None, stdout: bytes) -> int:
    """The ABI the probe printed; 0 for anything else (a binary without the step, a failure)."""
    said = stdout.decode("ascii", "replace").split()
    ok = exit_code == 0 and len(said) == 2 and said[0] == "landlock" and said[1].isdigit()
    return int(said[1]) if ok else 0
