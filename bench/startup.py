"""Start-up of the ``dsh-bash`` command (issue 29, item 6): wall-clock medians, side by side.

Five programs, each started as a fresh process, in turns (``python -c pass``, ``bash -c true``, the stack,
``dsh-bash --help``, ``dsh-bash run true``, then again), so that drift hits all of them equally:

- ``python -c pass``: this interpreter (with this environment's ``site`` and ``.pth`` files) doing
  nothing, the floor of any Python command line;
- ``bash -c true``: a shell doing nothing, what ``dsh-bash run true`` runs;
- the stack: this interpreter importing what ``dsh-bash run`` cannot run without (pydantic with one
  model validated, anyio running one ``sleep(0)`` on asyncio) and nothing of dsh-bash: the floor
  under ``run true`` while the seams are pydantic models and the executor an anyio one. What
  ``run true`` takes beyond it is dsh-bash's own share (imports, the parser, the command itself);
- ``dsh-bash --help`` and ``dsh-bash run true``: the console script of the environment this
  interpreter belongs to (the ``dsh-bash`` beside ``sys.executable``; ``--cli PATH`` for another).

Each figure is the median of ``--runs`` starts, timed from before the fork to the reaped exit, stdin
from ``/dev/null`` and stdout and stderr to ``/dev/null``. Before timing, each program runs twice with
``PYTHONDONTWRITEBYTECODE`` removed from its environment (as for every timed run): modules whose
cached bytecode was missing or stale are compiled once and then loaded from their caches, as in an
installed environment; an interpreter that may not write them would compile them on every start.
The targets are absolute (``run true`` at most 0.2 s, ``--help`` at most 0.1 s), on the machine the
figures come from; the ratio ``run true / python -c pass`` is the figure to compare across machines.

    python bench/startup.py [--runs N] [--cli PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The targets of issue 29, item 6, in seconds.
RUN_TARGET_S = 0.2
HELP_TARGET_S = 0.1


def default_cli() -> Path:
    """The ``dsh-bash`` console script of this interpreter's environment."""
    return Path(sys.executable).parent / "dsh-bash"


#: The stack's own start-up: what every ``dsh-bash run`` does before any of dsh-bash's code runs.
#: The interpreter must be the CLI's (its environment holds pydantic and anyio).
STACK_FLOOR = """\
import anyio
from pydantic import BaseModel, Field

class Probe(BaseModel):
    command: str = Field(min_length=1)

Probe(command="true")

async def tick() -> None:
    await anyio.sleep(0)

anyio.run(tick)
"""
STACK = "the stack (pydantic + anyio)"


def programs(cli: Path) -> dict[str, list[str]]:
    python = cli.parent / "python"
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "bash -c true": ["bash", "-c", "true"],
        STACK: [str(python if python.exists() else sys.executable), "-c", STACK_FLOOR],
        "dsh-bash --help": [str(cli), "--help"],
        "dsh-bash run true": [str(cli), "run", "true"],
    }


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _start(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of one run of ``argv``."""
    began = time.perf_counter()
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    _pid, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - began
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {process.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def measure(runs: int, cli: Path | None = None) -> dict[str, Any]:
    """Medians (ms) of ``runs`` starts of each program, alternating; the raw samples; the load."""
    cli = cli or default_cli()
    if not cli.exists():
        raise RuntimeError(f"{cli} does not exist: install dsh-bash into this environment (pip install -e .)")
    env = _environment()
    argvs = programs(cli)
    for argv in argvs.values():  # warm-up: bytecode caches written, files in the page cache
        for _ in range(2):
            _start(argv, env)
    load_before = os.getloadavg()
    wall: dict[str, list[float]] = {name: [] for name in argvs}
    cpu: dict[str, list[float]] = {name: [] for name in argvs}
    for _ in range(runs):
        for name, argv in argvs.items():
            seconds, cpu_seconds = _start(argv, env)
            wall[name].append(seconds * 1000)
            cpu[name].append(cpu_seconds * 1000)
    load_after = os.getloadavg()
    medians = {name: statistics.median(values) for name, values in wall.items()}
    return {
        "runs": runs,
        "cli": str(cli),
        "python": sys.executable,
        "median_ms": medians,
        "cpu_median_ms": {name: statistics.median(values) for name, values in cpu.items()},
        "samples_ms": wall,
        "load": [round(x, 2) for x in (*load_before, *load_after)],
        "run_over_python": medians["dsh-bash run true"] / medians["python -c pass"],
        "own_share_ms": medians["dsh-bash run true"] - medians[STACK],
        "help_over_python": medians["dsh-bash --help"] / medians["python -c pass"],
        "run_met": medians["dsh-bash run true"] <= RUN_TARGET_S * 1000,
        "help_met": medians["dsh-bash --help"] <= HELP_TARGET_S * 1000,
    }


def report(result: dict[str, Any]) -> str:
    """The figures, the ratios and one pass/miss line per target."""
    medians, cpu = result["median_ms"], result["cpu_median_ms"]
    width = max(len(name) for name in medians)
    lines = [f"start-up, medians of {result['runs']} runs each, alternating (wall ms, CPU ms):"]
    lines += [f"  {name:<{width}}  {medians[name]:7.1f}  {cpu[name]:7.1f}" for name in medians]
    load = result["load"]
    lines += [
        f"  dsh-bash run true / python -c pass: {result['run_over_python']:.2f}x",
        f"  dsh-bash run true - the stack:      {result['own_share_ms']:.1f} ms (dsh-bash's own share)",
        f"  dsh-bash --help / python -c pass:   {result['help_over_python']:.2f}x",
        f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, "
        f"{load[3]:.2f} {load[4]:.2f} {load[5]:.2f} after",
        f"target dsh-bash run true <= {RUN_TARGET_S:g} s: {'pass' if result['run_met'] else 'miss'} "
        f"({medians['dsh-bash run true'] / 1000:.3f} s)",
        f"target dsh-bash --help <= {HELP_TARGET_S:g} s: {'pass' if result['help_met'] else 'miss'} "
        f"({medians['dsh-bash --help'] / 1000:.3f} s)",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="starts of each program (default 30)")
    parser.add_argument("--cli", type=Path, help="the dsh-bash to time (default: beside sys.executable)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (samples included)")
    args = parser.parse_args()
    result = measure(args.runs, args.cli)
    print(json.dumps(result, indent=1) if args.json else report(result))


if __name__ == "__main__":
    main()
