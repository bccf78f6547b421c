"""Run the conformance kit again and again against the sound backends while the machine is kept busy.

    .venv/bin/python bench/kit_under_load.py --runs 10 --backends local,docker,ssh \
        --loads cpu,procs --locales C.UTF-8,C --out bench/kit_under_load.json

Loads (started before a combination's runs, stopped after them, each in its own process group):

- ``cpu``: four busy processes (``while :; do :; done``).
- ``procs``: many short-lived processes: a loop that starts 30 ``sleep`` processes and kills them,
  over and over.
- ``none``: no extra load.

Each (locale, load, backend) combination runs in a child interpreter whose environment has the locale
(``LANG=C.UTF-8`` with ``LC_ALL`` unset, or ``LC_ALL=C``): the local backend's commands inherit it; the
Docker (image mode, asyncio) and SSH backends' commands run under their own environment, only the kit
runs under the locale there. The child runs the whole kit ``--runs`` times and prints one JSON line per
run. Results: a table on stdout (and ``--markdown``), the raw runs in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOADS = {
    "none": None,
    "cpu": "for i in 1 2 3 4; do (while :; do :; done) & done; wait",
    "procs": 'while :; do p=""; for i in $(seq 30); do sleep 5 & p="$p $!"; done; kill $p; wait; done',
}
LOCALES = {
    "C.UTF-8": {"LANG": "C.UTF-8", "LC_ALL": None, "LC_CTYPE": None, "LC_COLLATE": None},
    "C": {"LC_ALL": "C"},
}


def _child(backend: str, runs: int) -> None:
    """Run the kit ``runs`` times against ``backend``; one JSON line per run on stdout."""
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from dsh_bash_conformance import KitTarget, run_kit  # noqa: PLC0415

    cleanup = None
    if backend == "local":
        from kit_targets import local_target  # noqa: PLC0415

        target: KitTarget = local_target("asyncio")
    elif backend == "docker":
        from docker_support import build_test_image, docker_target, remove_session_containers  # noqa: PLC0415

        target = docker_target("image", "asyncio", build_test_image())
        cleanup = remove_session_containers
    elif backend == "ssh":
        from ssh_support import ssh_target, start_server, stop_server  # noqa: PLC0415

        server = start_server()
        target = ssh_target(server, "asyncio")

        def cleanup() -> None:
            stop_server(server)

    else:
        raise SystemExit(f"unknown backend {backend!r}")
    from kit_targets import MARKER_CONTAINMENT_FAILS, MARKER_CONTAINMENT_RACES  # noqa: PLC0415

    # Failures a backend is known to have (containment not built yet on Docker and SSH): listed
    # apart, so that a run counts as clean when nothing else failed, and a change of them shows.
    expected = MARKER_CONTAINMENT_FAILS.get(backend, frozenset()) | MARKER_CONTAINMENT_RACES.get(
        backend, frozenset()
    )
    try:
        for run in range(runs):
            started = time.monotonic()
            report = run_kit(target)
            print(
                json.dumps(
                    {
                        "run": run,
                        "seconds": round(time.monotonic() - started, 1),
                        "passed": sum(r.outcome == "passed" for r in report.results),
                        "total": len(report.results),
                        "failed": {
                            r.name: f"{r.outcome}: {r.message}"
                            for r in report.failed
                            if not (r.name in expected and r.outcome == "failed")
                        },
                        "expected_failures": sorted(
                            r.name for r in report.failed if r.name in expected and r.outcome == "failed"
                        ),
                    }
                ),
                flush=True,
            )
    finally:
        if cleanup is not None:
            cleanup()


def _start_load(name: str) -> subprocess.Popen[bytes] | None:
    script = LOADS[name]
    if script is None:
        return None
    return subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _stop_load(process: subprocess.Popen[bytes] | None) -> None:
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _env(locale: str) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in LOCALES[locale].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| locale | load | backend | runs | clean runs | failed checks (times) | known failures |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        failed = Counter(name for run in row["runs"] for name in run["failed"])
        names = ", ".join(f"`{name}` ({count})" for name, count in sorted(failed.items())) or "none"
        clean = sum(not run["failed"] for run in row["runs"])
        known = sorted({name for run in row["runs"] for name in run.get("expected_failures", [])})
        every = all(sorted(known) == run.get("expected_failures", []) for run in row["runs"])
        known_text = ", ".join(f"`{name}`" for name in known) or "none"
        if known and not every:
            known_text += " (not in every run)"
        lines.append(
            f"| {row['locale']} | {row['load']} | {row['backend']} | {len(row['runs'])} | {clean} | {names} "
            f"| {known_text} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10, help="kit runs per combination (default 10)")
    parser.add_argument("--backends", default="local", help="comma-separated: local, docker, ssh")
    parser.add_argument("--loads", default="cpu,procs", help="comma-separated: none, cpu, procs")
    parser.add_argument("--locales", default="C.UTF-8,C", help="comma-separated: C.UTF-8, C")
    parser.add_argument("--out", type=Path, help="write every run as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.runs)
        return
    rows: list[dict[str, Any]] = []
    for locale in args.locales.split(","):
        for load in args.loads.split(","):
            for backend in args.backends.split(","):
                process = _start_load(load)
                runs: list[dict[str, Any]] = []
                try:
                    child = subprocess.Popen(
                        [sys.executable, __file__, "--child", backend, "--runs", str(args.runs)],
                        stdout=subprocess.PIPE,
                        env=_env(locale),
                        cwd=ROOT,
                        text=True,
                    )
                    assert child.stdout is not None
                    for line in child.stdout:
                        if not line.startswith("{"):
                            continue
                        run = json.loads(line)
                        runs.append(run)
                        failed = ", ".join(run["failed"]) or "-"
                        print(
                            f"{locale:8} {load:6} {backend:7} run {run['run']}: "
                            f"{run['passed']}/{run['total']} passed in {run['seconds']} s; failed: {failed}",
                            flush=True,
                        )
                    child.wait()
                finally:
                    _stop_load(process)
                rows.append({"locale": locale, "load": load, "backend": backend, "runs": runs})
                if args.out:
                    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    table = _table(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
