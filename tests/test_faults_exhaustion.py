"""Exhaustion under REAL limits (issue 15): a fork bomb in a pids cgroup, descriptors under ``ulimit -n``.

Each case runs ``tests/exhaustion_harness.py`` as a child Python process under the limit (the test
process itself stays outside it) and asserts on the JSON line the harness prints. See docs/faults.md
("Fork bombs", "Exhaustion").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fault_support import GRACE_MS, Backend, backend_params, eventually_gone, wait_for_processes

from dsh_bash import BashExecRequest

pytestmark = [pytest.mark.faults]

HARNESS = Path(__file__).with_name("exhaustion_harness.py")
PIDS_ROOT = Path("/sys/fs/cgroup/pids")
#: The harness's grace (exhaustion_harness.GRACE_MS, the suite's GRACE_MS) in seconds, and the slack
#: the bounds allow.
GRACE_S = GRACE_MS / 1000
SLACK_S = 1.0


@contextlib.contextmanager
def pids_cgroup(limit: int) -> Iterator[Path]:
    """A fresh v1 pids cgroup with ``pids.max`` = ``limit``, removed afterwards (SIGKILLing what is left)."""
    if not (PIDS_ROOT / "cgroup.procs").exists():
        pytest.skip(f"no v1 pids cgroup hierarchy at {PIDS_ROOT}: the fork-bomb case needs a real pids limit")
    path = PIDS_ROOT / f"dsh-bash-test-{uuid.uuid4().hex[:12]}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(f"{limit}\n")
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        pytest.skip(f"cannot make a pids cgroup under {PIDS_ROOT} (needs root or a delegated cgroup): {exc}")
    try:
        yield path
    finally:
        for _ in range(200):
            pids = [int(line) for line in (path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            time.sleep(0.05)
        path.rmdir()


def run_harness(*args: str, cgroup: Path | None = None, nofile: int | None = None) -> dict[str, Any]:
    def enter_limits() -> None:
        # In the child, before exec: the harness (and everything it starts) runs under the limit.
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text("0\n")
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    done = subprocess.run(
        [sys.executable, str(HARNESS), *args],
        capture_output=True,
        text=True,
        timeout=90,
        preexec_fn=enter_limits,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"the harness printed nothing (exit {done.returncode}): {done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(lines[-1])
    print(json.dumps(report, indent=1))
    return report


@pytest.mark.timeout(120)
def test_fork_bomb_under_a_real_pids_limit_ends_in_time_and_leaves_nothing() -> None:
    with pids_cgroup(120) as cgroup:
        report = run_harness("fork-bomb", cgroup=cgroup)
        members = (cgroup / "cgroup.procs").read_text().split()
    assert "crashed" not in report and "outer" not in report, report
    assert report["containment"] == "subreaper"
    # A timed-out run returns within timeout + 2 x grace (+ slack), bomb or not.
    assert report["run"] == ["timed_out", report["run"][1]], report["run"]
    assert report["run_s"] <= 2.0 + 2 * GRACE_S + SLACK_S, report["run_s"]
    assert report["next"] == "alive\n"
    assert report["killed"] is True
    assert report["task"] == ["killed", "killed"]
    assert report["kill_s"] <= 2 * GRACE_S + SLACK_S, report["kill_s"]
    # Issue 30: a bomb whose shell exits at once leaves nothing at the result of its foreground run,
    # and kill(id) of its ended background task ends what it left (the kill sequence's bound).
    assert report["fg_bomb"] == ["exit 0", []], report["fg_bomb"]
    assert report["ended_killed"] is False
    before, left, took = report["ended_kill"]
    assert before > 0 and left == [], report["ended_kill"]
    assert took <= 2 * GRACE_S + SLACK_S, report["ended_kill"]
    assert report["room_s"] <= 2 * GRACE_S + SLACK_S, report["room_s"]  # what it left is reaped too
    # aclose raises only the library's errors; here it must not raise at all, and nothing outlives it.
    assert report["pids_full"] is True
    assert report["aclose"] == "ok"
    assert report["aclose_s"] <= 2 * GRACE_S + 0.5 + SLACK_S, report["aclose_s"]
    assert report["survivors"] == []
    assert report["survivors_after_exit"] == []
    assert members == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("containment", ["subreaper", "marker"])
def test_descriptor_exhaustion_under_a_real_ulimit_leaves_nothing(containment: str) -> None:
    report = run_harness("descriptors", containment, nofile=256)
    assert "crashed" not in report, report
    assert report["nofile"] == 256
    assert "refused" in report and report["started"] >= 10, report
    assert report["aclose"] == "ok" or report["aclose"].startswith("library error"), report["aclose"]
    assert report["survivors"] == []


#: Run in a child under a real RLIMIT_NOFILE of 64: a marked sleeper is started, the descriptors are
#: used up to the last one, then /proc is read. Prints a JSON line.
SCAN_UNDER_EMFILE = r"""
import errno, json, os, resource, signal, subprocess, sys
import anyio
from dsh_bash.host import _proc_scan as _procscan
from dsh_bash.host._proc_scan import (
    ProcScanner,
    read_proc_stat,
    signal_marked,
)
ProcScanError = getattr(_procscan, "ProcScanError", ())  # () before issue 15: nothing is caught

def outcome(fn):
    try:
        return ["returned", repr(fn())]
    except ProcScanError as exc:
        return ["ProcScanError", exc.errno]
    except OSError as exc:
        return ["OSError", exc.errno]

async def main(report):
    # The event loop runs before the descriptors run out (it needs a few of its own).
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    env = dict(os.environ, DSH_BASH_MARK="tok-1")
    sleeper = subprocess.Popen(["sleep", "30"], env=env)
    scanner = ProcScanner("tok")
    getattr(scanner, "prepare", lambda: None)()
    held = []
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        report["exhausted"] = True
        # Without a reserve: a live process must never read as gone (None, or a silent skip).
        report["stat"] = outcome(lambda: read_proc_stat(sleeper.pid))
        report["signal"] = outcome(lambda: signal_marked(sleeper.pid, "tok-1", 0, True))
        # The scanner's reserve gets it through.
        try:
            entries = await scanner.entries()
            report["found"] = [[e.pid == sleeper.pid, e.marker] for e in entries if e.marker is not None]
        except Exception as exc:
            report["found"] = repr(exc)
    finally:
        for fd in held:
            os.close(fd)
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()

report = {}
anyio.run(main, report)
print(json.dumps(report))
"""


@pytest.mark.timeout(60)
def test_a_proc_scan_never_reads_emfile_as_gone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCAN_UNDER_EMFILE], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    assert report["exhausted"] is True
    assert report["stat"] == ["ProcScanError", errno.EMFILE]
    assert report["signal"] == ["OSError", errno.EMFILE]
    assert report["found"] == [[True, "tok-1"]]


#: 14 variables of 100,000 bytes (about 1.4 MB of environment), then 300 shells that inherit them,
#: each waiting (no child of its own) on a FIFO with MARKER on its command line; then the shell waits.
#: (Not ``exec -a MARKER sleep``: the Docker test image's sleep is busybox, which goes by its name.)
LARGE_ENV_LEFTOVERS = (
    'f="/tmp/$0.fifo"; mkfifo "$f"; '
    "for n in $(seq 14); do export BIG$n=$(head -c 100000 /dev/zero | tr '\\0' x); done; "
    """for i in $(seq 300); do bash -c 'read -t 60 _ <> "$1"' "$0" "$f" & done; echo ready; wait"""
)


@pytest.mark.serial  # the scan of 300 x 1.4 MB environments is the load: no other test beside it
@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    "backend, containment",
    [
        *(pytest.param(p.values[0], "auto", marks=p.marks, id=p.id) for p in backend_params()),
        # With the marker containment Docker and SSH kill by a bash script that skips processes
        # started before the command unread (their environments are what makes a scan slow).
        *(pytest.param(p.values[0], "marker", marks=p.marks, id=f"{p.id}-marker") for p in backend_params()),
    ],
    indirect=["backend"],
)
async def test_timeouts_arrive_on_time_beside_300_large_environments(
    backend: Backend, containment: str, marker: str
) -> None:
    extra = {"containment": containment} if containment != "auto" else {}
    async with backend.make(**extra) as ex:
        try:
            task = await ex.start(
                ex.resolve(BashExecRequest(command=f"bash -c {shlex.quote(LARGE_ENV_LEFTOVERS)} {marker}"))
            )
            await wait_for_processes(marker, count=300, within_s=60)
            began = time.monotonic()
            result = await ex.exec("sleep 30", timeout_ms=1000)
            elapsed = time.monotonic() - began
            print(f"{backend.name} ({containment}): 1 s timeout beside 300 x 1.4 MB: {elapsed:.2f}s")
            assert result.timed_out
            assert elapsed <= 1.0 + 2 * GRACE_MS / 1000 + SLACK_S, elapsed
            assert await ex.kill(task.id) is True
        finally:
            # The FIFO is where the commands run (this host, or the container): removed there.
            with anyio.move_on_after(10):
                await ex.exec(f"rm -f /tmp/{marker}.fifo")
        closing = time.monotonic()
    print(f"aclose: {time.monotonic() - closing:.2f}s")
    assert await eventually_gone(marker, 10) == []
