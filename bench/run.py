"""Every benchmark of issue 7 in one command: one markdown table, a PNG chart, the machine they ran on.

    python bench/run.py [--backends local,docker,ssh]
                        [--only latency,throughput,background,conformance,startup]
                        [--quick] [--mib N] [--runs N] [--tasks N] [--startup-runs N] [--out DIR]

Builds the Docker test image the way the tests do (``tests/docker_support.py``) and starts a
throwaway sshd on a loopback port (``tests/ssh_support.py``, needs root; set
``DSH_TEST_SSH_USER`` to choose the login). Every compared figure is measured side by side with
its baseline in the same run, alternating, as medians; the ratio is what is compared, absolute
figures are context. Writes ``results.md`` (machine + table), ``results.json`` (every raw figure)
and ``results.png`` (the chart) into ``--out`` (default: this directory). ``--quick`` is a smoke run:
few repetitions, 64 MiB instead of 1 GiB, 20 tasks, 5 kit checks; its figures are not results.
``startup`` (``bench/startup.py``, with the local backend) times the ``dsh-bash`` command of this
interpreter's environment against ``python -c pass`` and ``bash -c true``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
TESTS = BENCH.parent / "tests"
sys.path[:0] = [str(BENCH), str(TESTS)]

import files  # noqa: E402
import latency  # noqa: E402
import startup  # noqa: E402
import throughput  # noqa: E402
from targets import BACKENDS  # noqa: E402

PARTS = ("latency", "throughput", "background", "conformance", "startup", "files")
QUICK_KIT_CHECKS = [
    "exit-code-reported",
    "timeout-classified",
    "kill-running-task",
    "read-consuming",
    "aclose-bounded",
]


@dataclass
class Row:
    """One line of the table: a figure of dsh-bash, its baseline's figure, their ratio and the target."""

    measure: str
    backend: str
    baseline: str
    subject: str  # formatted figure
    baseline_value: str
    ratio: float | None
    target: str
    verdict: str  # "pass", "miss" or "-" (context only)
    target_value: float | None = None  # the target as a number on the ratio's (or figure's) scale
    part: str = ""  # one of PARTS
    run: int = 1  # which run (of results.json's "runs") measured it


def _parted(part: str, rows: list[Row]) -> list[Row]:
    for row in rows:
        row.part = part
    return rows


def _ratio_verdict(ratio: float, at_most: float | None = None, at_least: float | None = None) -> str:
    if at_most is not None and ratio > at_most:
        return "miss"
    if at_least is not None and ratio < at_least:
        return "miss"
    return "pass"


# -- the machine -------------------------------------------------------------------------------------


def _first_line(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0] if text else "unavailable"


def machine() -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = "unknown"
    with contextlib.suppress(OSError), open("/proc/meminfo") as handle:
        memory = f"{int(handle.readline().split()[1]) / 2**20:.0f} GiB"
    import asyncssh  # noqa: PLC0415

    return {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu}, {os.cpu_count()} CPUs",
        "memory": memory,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "docker": _first_line(["docker", "version", "--format", "Engine {{.Server.Version}}"]),
        "openssh": _first_line(["ssh", "-V"]),
        "asyncssh": asyncssh.__version__,
        "load_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


# -- the parts --------------------------------------------------------------------------------------


LATENCY_TARGETS = {  # (backend, baseline substring) -> (target text, at_most, at_least)
    ("local", "asyncio"): ("≤ 1.2x", 1.2, None),
    ("docker", "CONTAINER true (CLI)"): ("≤ 0.1x", 0.1, None),
    ("ssh", "reused connection"): ("≤ 1.5x", 1.5, None),
    ("ssh", "ssh CLI"): ("≤ 1/50x (50x faster)", 1 / 50, None),
    # Issue 31: a command in a shell session costs at most a fifth more than a plain one.
    ("local", "in a shell session"): ("≤ 1.2x", 1.2, None),
    ("docker", "in a shell session"): ("≤ 1.2x", 1.2, None),
    ("ssh", "in a shell session"): ("≤ 1.2x", 1.2, None),
    # Issue 33: a command under the default policy costs at most 1.3x on local, 1.1x on Docker.
    ("local", "workspace-write policy"): ("≤ 1.3x", 1.3, None),
    ("docker", "workspace-write policy"): ("≤ 1.1x", 1.1, None),
    ("ssh", "workspace-write policy"): ("≤ 1.1x", 1.1, None),
}


def latency_rows(backends: list[str], runs: int, context: dict[str, Any], server: Any) -> list[Row]:
    measured: list[tuple[str, str, float, float]] = []
    if "local" in backends:
        measured += asyncio.run(latency.bench_local(runs))
    if "docker" in backends:
        measured += asyncio.run(latency.bench_docker(max(10, runs // 3), context["image"]))
    if "ssh" in backends:
        measured += asyncio.run(latency.bench_ssh(max(10, runs // 2), server))
    rows = []
    for backend, baseline, subject_ms, baseline_ms in measured:
        ratio = subject_ms / baseline_ms
        target, verdict, target_value = "-", "-", None
        for (name, key), (text, at_most, at_least) in LATENCY_TARGETS.items():
            if name == backend and key in baseline:
                target, verdict = text, _ratio_verdict(ratio, at_most, at_least)
                target_value = at_most if at_most is not None else at_least
        rows.append(
            Row("latency of `true`, median ms", backend, baseline, f"{subject_ms:.2f}", f"{baseline_ms:.2f}",
                ratio, target, verdict, target_value)
        )  # fmt: skip
    return rows


def throughput_rows(backends: list[str], mib: int, runs: int, context: dict[str, Any]) -> list[Row]:
    rows = []
    for backend in backends:
        result = throughput.measure_pair(backend, mib * 2**20, runs, context)
        label = throughput.BASELINE_LABELS[result["baseline"]]
        ratio = result["subject_mb_s"] / result["baseline_mb_s"]
        rows.append(
            Row(f"{mib} MiB of stdout, MB/s", backend, label, f"{result['subject_mb_s']:.0f}",
                f"{result['baseline_mb_s']:.0f}", ratio, "≥ 1.5x", _ratio_verdict(ratio, at_least=1.5),
                1.5)
        )  # fmt: skip
        growth = result["subject_rss_growth_mib"]
        rows.append(
            Row(f"{mib} MiB of stdout, peak RSS growth MiB", backend, label, f"{growth:.1f}",
                f"{result['baseline_rss_growth_mib']:.1f}", None, "≤ 16 MiB",
                "pass" if growth <= 16 else "miss", 16.0)
        )  # fmt: skip
        _raw["throughput"].append(result)
    return rows


def background_rows(
    backends: list[str], tasks: int, read_seconds: float, context: dict[str, Any]
) -> list[Row]:
    rows = []
    for backend in backends:
        done = subprocess.run(
            [sys.executable, str(BENCH / "background.py"), "--backend", backend, "--tasks", str(tasks),
             "--read-seconds", str(read_seconds), "--context", json.dumps(context)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"background tasks on {backend} failed:\n{done.stderr.strip()}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        _raw["background"].append(result)
        many, read = result["many"], result["read"]
        rows.append(
            Row(f"{tasks} background tasks at once: wall s (slowest start s)", backend, "-",
                f"{many['wall_s']:.2f} ({many['slowest_start_s']:.2f})", "-", None, "-", "-")
        )  # fmt: skip
        rows.append(
            Row(f"{tasks} background tasks at once: peak RSS growth MiB", backend, "-",
                f"{many['rss_growth_mib']:.1f}", "-", None, "-", "-")
        )  # fmt: skip
        ratio = read["large_us_per_kib"] / read["small_us_per_kib"]
        rows.append(
            Row("`read_output` µs per KiB of delta, at a large total vs a small one", backend,
                f"an identical fresh task at {read['small_total_mib']:.1f} MiB, read in turns",
                f"{read['large_us_per_kib']:.2f} at {read['large_total_mib']:.1f} MiB",
                f"{read['small_us_per_kib']:.2f}", ratio, "≈ 1x (≤ 1.5x)",
                _ratio_verdict(ratio, at_most=1.5), 1.5)
        )  # fmt: skip
    return rows


def conformance_rows(backends: list[str], quick: bool, context: dict[str, Any], server: Any) -> list[Row]:
    from dsh_bash_conformance import run_kit  # noqa: PLC0415

    rows = []
    for backend in backends:
        if backend == "local":
            from kit_targets import local_target  # noqa: PLC0415

            target = local_target("asyncio")
        elif backend == "docker":
            from docker_support import docker_target  # noqa: PLC0415

            target = docker_target("image", "asyncio", context["image"])
        else:
            from ssh_support import ssh_target  # noqa: PLC0415

            target = ssh_target(server)
        began = time.perf_counter()
        report = run_kit(target, only=QUICK_KIT_CHECKS if quick else None)
        took = time.perf_counter() - began
        passed = sum(r.outcome == "passed" for r in report.results)
        slowest = max(report.results, key=lambda r: r.duration_s)
        _raw["conformance"].append(
            {"backend": backend, "seconds": took, "checks": len(report.results), "passed": passed,
             "durations": {r.name: r.duration_s for r in report.results}}
        )  # fmt: skip
        failed = "".join(f"; {r.outcome}: {r.name}" for r in report.failed)
        rows.append(
            Row(f"conformance kit runtime s ({len(report.results)} checks)", backend,
                f"{passed}/{len(report.results)} passed{failed}; slowest: {slowest.name} "
                f"{slowest.duration_s:.1f} s",
                f"{took:.1f}", "-", None, "-", "-")
        )  # fmt: skip
    return rows


def files_rows(backends: list[str], runs: int, context: dict[str, Any], server: Any) -> list[Row]:
    """50 MiB written and read back (issue 32), Docker and SSH (local has no channel to compare)."""
    results = []
    if "docker" in backends:
        results.append(asyncio.run(files.bench_docker(50, runs, context["image"], context["labels"])))
    if "ssh" in backends:
        results.append(asyncio.run(files.bench_ssh(50, runs, server)))
    rows = []
    for result in results:
        _raw["files"].append(result)
        for backend, baseline, subject_s, baseline_s, target, at_most in files.rows(result):
            ratio = subject_s / baseline_s
            verdict = "-" if at_most is None else _ratio_verdict(ratio, at_most=at_most)
            rows.append(
                Row("50 MiB written and read back, median s", backend, baseline, f"{subject_s:.2f}",
                    f"{baseline_s:.2f}", ratio, target, verdict, at_most)
            )  # fmt: skip
    return rows


def startup_rows(runs: int) -> list[Row]:
    """``dsh-bash run true`` and ``dsh-bash --help`` against ``python -c pass`` and ``bash -c true``."""
    result = startup.measure(runs)
    _raw["startup"].append(result)
    print(startup.report(result), file=sys.stderr, flush=True)
    ms = result["median_ms"]
    run, helped = ms["dsh-bash run true"], ms["dsh-bash --help"]
    python, bash, stack = ms["python -c pass"], ms["bash -c true"], ms[startup.STACK]
    run_target, help_target = startup.RUN_TARGET_S * 1000, startup.HELP_TARGET_S * 1000
    measure = f"start-up, wall ms (median of {runs})"
    return [
        Row(f"{measure}: `dsh-bash run true`", "local", "`python -c pass` (the same interpreter)",
            f"{run:.1f}", f"{python:.1f}", run / python, f"≤ {run_target:.0f} ms",
            "pass" if run <= run_target else "miss", run_target),
        Row(f"{measure}: `dsh-bash run true`", "local", "`bash -c true`", f"{run:.1f}", f"{bash:.1f}",
            run / bash, "-", "-"),
        Row(f"{measure}: `dsh-bash run true`", "local",
            "the stack alone: pydantic (one model validated) and anyio.run on asyncio, no dsh-bash",
            f"{run:.1f}", f"{stack:.1f}", run / stack, "-", "-"),
        Row(f"{measure}: `dsh-bash --help`", "local", "`python -c pass` (the same interpreter)",
            f"{helped:.1f}", f"{python:.1f}", helped / python, f"≤ {help_target:.0f} ms",
            "pass" if helped <= help_target else "miss", help_target),
    ]  # fmt: skip


_raw: dict[str, list[Any]] = {part: [] for part in PARTS if part != "latency"}


# -- output -----------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| measure | backend | baseline | dsh-bash | baseline | ratio | target | met |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(
            f"| {r.measure} | {r.backend} | {r.baseline} | {r.subject} | {r.baseline_value} | {ratio} | "
            f"{r.target} | {r.verdict} |"
        )
    return "\n".join(lines)


def _chart_label(panel: str, row: Row) -> str:
    if "read_output" in panel:
        return row.backend
    if row.part == "startup":
        return row.measure.rpartition(": ")[2].strip("`")  # the program
    return f"{row.backend} vs {row.baseline[:48]}"


def chart(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = [
        ("latency of `true`: dsh-bash / baseline", [r for r in rows if r.measure.startswith("latency")],
         "ratio"),
        ("stdout throughput: dsh-bash / baseline", [r for r in rows if r.measure.endswith("MB/s")], "ratio"),
        ("peak RSS growth while streaming (MiB)", [r for r in rows if "RSS growth MiB" in r.measure
                                                   and "stdout" in r.measure], "value"),
        ("read_output cost per KiB: large total / small", [r for r in rows if "read_output" in r.measure],
         "ratio"),
        ("start-up of the dsh-bash command, wall ms", [r for r in rows if r.part == "startup"
                                                        and r.target_value is not None], "value"),
    ]  # fmt: skip
    panels = [p for p in panels if p[1]]
    if not panels:
        return
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 + 1.1 * sum(len(p[1]) for p in panels)))
    axes_list = [axes] if len(panels) == 1 else list(axes)
    for axis, (name, panel_rows, kind) in zip(axes_list, panels, strict=True):
        labels = [_chart_label(name, r) for r in panel_rows]
        values = [(r.ratio or 0.0) if kind == "ratio" else float(r.subject.split()[0]) for r in panel_rows]
        colours = ["tab:green" if r.verdict == "pass" else "tab:red" if r.verdict == "miss" else "tab:gray"
                   for r in panel_rows]  # fmt: skip
        axis.barh(labels, values, color=colours)
        for index, (value, row) in enumerate(zip(values, panel_rows, strict=True)):
            axis.text(value, index, f" {value:.2f}{'x' if kind == 'ratio' else ''}  (target {row.target})",
                      va="center", fontsize=8)  # fmt: skip
            if row.target_value is not None:  # the target, as a black tick across the bar
                axis.plot([row.target_value] * 2, [index - 0.45, index + 0.45], color="black", linewidth=2)
        if kind == "ratio":
            axis.axvline(1.0, color="gray", linewidth=0.8, linestyle=":")
        axis.set_title(name, fontsize=10)
        axis.invert_yaxis()
        targets = [r.target_value for r in panel_rows if r.target_value is not None]
        axis.set_xlim(0, max([*values, *targets, 0.5]) * 1.6)
        axis.tick_params(labelsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- the run ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def environment(backends: list[str], notes: list[str]) -> Iterator[tuple[dict[str, Any], Any]]:
    """The Docker image and the sshd the benchmarks need: (context for bench/targets.py, server)."""
    context: dict[str, Any] = {}
    server = None
    docker_support: Any = None
    try:
        if "docker" in backends:
            docker_support = importlib.import_module("docker_support")
            reason = docker_support.docker_available()
            if reason is not None:
                raise SystemExit(f"Docker: {reason} (leave it out: --backends local,ssh)")
            context["image"] = docker_support.build_test_image()
            context["labels"] = {docker_support.SESSION_LABEL: docker_support.SESSION_ID}
        if "ssh" in backends:
            import ssh_support  # noqa: PLC0415

            reason = ssh_support._unavailable()
            if reason is not None:
                raise SystemExit(f"SSH: {reason} (leave it out: --backends local,docker)")
            server = ssh_support.start_server()
            fields = server.config()
            context["ssh"] = {name: fields[name] for name in ("host", "port", "username", "client_keys",
                                                               "known_hosts")}  # fmt: skip
            notes.append(f"SSH logs in as `{fields['username']}` on a throwaway sshd (tests/ssh_support.py).")
        yield context, server
    finally:
        if server is not None:
            import ssh_support  # noqa: PLC0415

            ssh_support.stop_server(server)
        if docker_support is not None:
            docker_support.remove_session_containers()


def _machine_line(about: dict[str, str]) -> str:
    return "; ".join(
        [
            f"{about['cpu']}, {about['memory']} RAM",
            about["os"],
            f"Python {about['python']}",
            f"Docker {about['docker']}",
            about["openssh"],
            f"asyncssh {about['asyncssh']}",
            f"load average {about['load_at_start']} at the start, {about['load_at_end']} at the end",
            f"{about['when']}, {about['benchmark_minutes']} min.",
        ]
    )


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"runs": [], "rows": []}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def render(data: dict[str, Any]) -> tuple[str, list[Row]]:
    """results.md's text and the rows in table order (by part, then backend)."""
    rows = [Row(**r) for r in data["rows"]]
    rows.sort(key=lambda r: (PARTS.index(r.part), BACKENDS.index(r.backend)))
    runs = {run["run"]: run for run in data["runs"]}
    several = len(runs) > 1
    lines = ["# Benchmark results", ""]
    for number, run in sorted(runs.items()):
        about = run["machine"]
        prefix = (
            f"Run {number} ({', '.join(run['backends'])}: {', '.join(run['parts'])}). " if several else ""
        )
        lines += [
            f"{prefix}Machine: {_machine_line(about)}",
            "",
            f"Settings: {run['settings']}.",
            "",
            *[f"{note}\n" for note in run["notes"]],
        ]
    text = table(rows)
    if several:
        text = "\n".join(
            line.replace("| measure |", "| run | measure |", 1).replace("|---|", "|---|---|", 1)
            if index < 2
            else f"| {rows[index - 2].run} {line}"
            for index, line in enumerate(text.splitlines())
        )
    lines.append(text)
    return "\n".join(lines) + "\n", rows


README_BEGIN = "<!-- results: written by bench/run.py -->"
README_END = "<!-- end of results -->"


def _update_readme(readme: Path, results: str) -> None:
    """Put the results (without their title) between the markers of ``readme``, if it has them."""
    if not readme.exists():
        return
    text = readme.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        return
    body = results.split("\n", 2)[2] if results.startswith("# ") else results
    readme.write_text(f"{text[: begin + len(README_BEGIN)]}\n{body}\n![chart](results.png)\n\n{text[end:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="local,docker,ssh", help="comma-separated (default: all)")
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts (default: all)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repetitions, small sizes")
    parser.add_argument("--runs", type=int, help="latency repetitions (default 100, quick 15)")
    parser.add_argument("--mib", type=int, help="MiB of stdout streamed (default 1024, quick 64)")
    parser.add_argument("--throughput-runs", type=int, help="alternating transfers (default 3, quick 1)")
    parser.add_argument("--tasks", type=int, help="concurrent background tasks (default 200, quick 20)")
    parser.add_argument("--read-seconds", type=float, help="read_output writer runtime (default 15, quick 3)")
    parser.add_argument("--startup-runs", type=int, help="starts of each program (default 30, quick 5)")
    parser.add_argument("--out", type=Path, default=BENCH, help="where results.{md,json,png} go")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the rows of these backends and parts in OUT/results.json, keep the others "
        "(e.g. re-measure SSH alone: --backends ssh --merge)",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rewrite the table, README and chart from results.json",
    )
    args = parser.parse_args()
    if args.render:
        data = _load(args.out / "results.json")
        text, ordered = render(data)
        _write(args.out, data, text, ordered)
        return
    backends = [b for b in args.backends.split(",") if b]
    parts = [p for p in args.only.split(",") if p]
    for name in backends:
        if name not in BACKENDS:
            parser.error(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    for name in parts:
        if name not in PARTS:
            parser.error(f"unknown part {name!r}; known: {', '.join(PARTS)}")
    quick = args.quick
    runs = args.runs or (15 if quick else 100)
    mib = args.mib or (64 if quick else 1024)
    throughput_runs = args.throughput_runs or (1 if quick else 3)
    tasks = args.tasks or (20 if quick else 200)
    read_seconds = args.read_seconds or (3.0 if quick else 15.0)
    startup_runs = args.startup_runs or (5 if quick else 30)
    files_runs = 1 if quick else 5

    about = machine()
    notes: list[str] = []
    rows: list[Row] = []
    began = time.monotonic()
    with environment(backends, notes) as (context, server):
        if "latency" in parts:
            print("latency ...", file=sys.stderr, flush=True)
            rows += _parted("latency", latency_rows(backends, runs, context, server))
        if "throughput" in parts:
            print("throughput ...", file=sys.stderr, flush=True)
            rows += _parted("throughput", throughput_rows(backends, mib, throughput_runs, context))
        if "background" in parts:
            print("background tasks ...", file=sys.stderr, flush=True)
            rows += _parted("background", background_rows(backends, tasks, read_seconds, context))
        if "conformance" in parts:
            print("conformance kit ...", file=sys.stderr, flush=True)
            rows += _parted("conformance", conformance_rows(backends, quick, context, server))
        if "files" in parts and set(backends) & {"docker", "ssh"}:
            print("files ...", file=sys.stderr, flush=True)
            rows += _parted("files", files_rows(backends, files_runs, context, server))
        if "startup" in parts and "local" in backends:
            print("start-up ...", file=sys.stderr, flush=True)
            rows += _parted("startup", startup_rows(startup_runs))
    about["load_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    about["benchmark_minutes"] = f"{(time.monotonic() - began) / 60:.1f}"

    by_part = {  # the settings of the parts that ran
        "latency": f"latency medians of {runs} local runs "
        f"(Docker {max(10, runs // 3)}, SSH {max(10, runs // 2)})",
        "throughput": f"{mib} MiB streamed, medians of {throughput_runs} alternating transfers, "
        "each in a fresh interpreter",
        "background": f"{tasks} background tasks; read_output over {read_seconds:g} s",
        "startup": f"start-up medians of {startup_runs} starts of each program",
        "files": f"50 MiB round trips, medians of {files_runs} alternating runs",
    }
    settings = f"{'QUICK SMOKE RUN (not results): ' if quick else ''}" + "; ".join(
        text for part, text in by_part.items() if part in parts
    )
    args.out.mkdir(parents=True, exist_ok=True)
    data = _load(args.out / "results.json") if args.merge else {"runs": [], "rows": []}
    # Rows of what this run measured replace those of earlier runs; the others stay.
    data["rows"] = [r for r in data["rows"] if not (r["part"] in parts and r["backend"] in backends)]
    number = max((run["run"] for run in data["runs"]), default=0) + 1
    for row in rows:
        row.run = number
    data["rows"] += [asdict(r) for r in rows]
    data["runs"].append(
        {"run": number, "machine": about, "settings": settings, "notes": notes, "backends": backends,
         "parts": parts, "raw": _raw}
    )  # fmt: skip
    used = {r["run"] for r in data["rows"]}
    data["runs"] = [run for run in data["runs"] if run["run"] in used]
    text, ordered = render(data)
    _write(args.out, data, text, ordered)


def _write(out: Path, data: dict[str, Any], text: str, rows: list[Row]) -> None:
    print(text)
    (out / "results.md").write_text(text)
    _update_readme(out / "README.md", text)
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    latest = data["runs"][-1]["machine"]
    chart(rows, out / "results.png", f"dsh-bash vs baselines; {latest['cpu']}; {latest['when']}")


if __name__ == "__main__":
    main()
