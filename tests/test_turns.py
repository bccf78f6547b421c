"""tests/turns.py: a test marked ``serial`` runs while no other test does, and is not starved.

Each case holds turns in other processes (a real ``flock`` between processes, as between pytest-xdist
workers) and watches when a turn in this process begins.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import turns

HERE = Path(__file__).resolve().parent


def _holder(directory: Path, *, alone: bool) -> subprocess.Popen[str]:
    """A process that takes a turn, says ``held``, and keeps it until its stdin closes."""
    code = (
        "import sys, turns\n"
        f"with turns.turn({str(directory)!r}, alone={alone}):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "held\n"
    return process


def _release(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    process.wait(10)


def _until_gate_held(directory: Path, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    with open(directory / "gate", "a") as gate:
        while True:
            try:
                fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(gate, fcntl.LOCK_UN)
            assert time.monotonic() < deadline, "nobody took the gate"
            time.sleep(0.01)


def _started_after(directory: Path, *, alone: bool, release: subprocess.Popen[str], wait_s: float) -> float:
    """Start a turn in a thread, release ``release`` after ``wait_s``; how long the turn took to begin."""
    began: list[float] = []

    def take() -> None:
        with turns.turn(str(directory), alone=alone):
            began.append(time.monotonic())

    started = time.monotonic()
    thread = threading.Thread(target=take)
    thread.start()
    time.sleep(wait_s)
    _release(release)
    thread.join(10)
    assert began, "the turn never began"
    return began[0] - started


def test_shared_turns_run_together(tmp_path: Path) -> None:
    other = _holder(tmp_path, alone=False)
    try:
        with turns.turn(str(tmp_path), alone=False):
            pass  # did not wait for the other shared turn
    finally:
        _release(other)


def test_a_turn_alone_waits_for_the_shared_turns_under_way(tmp_path: Path) -> None:
    other = _holder(tmp_path, alone=False)
    assert _started_after(tmp_path, alone=True, release=other, wait_s=0.5) >= 0.5


def test_no_shared_turn_starts_while_one_alone_runs(tmp_path: Path) -> None:
    alone = _holder(tmp_path, alone=True)
    assert _started_after(tmp_path, alone=False, release=alone, wait_s=0.5) >= 0.5


def test_a_waiting_turn_alone_holds_back_new_shared_turns(tmp_path: Path) -> None:
    """Writer preference: while a turn alone waits for a shared one to end, a new shared turn waits too."""
    first = _holder(tmp_path, alone=False)
    code = f"import turns\nwith turns.turn({str(tmp_path)!r}, alone=True):\n    print('alone', flush=True)\n"
    waiting_alone = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=HERE
    )
    _until_gate_held(tmp_path)  # it holds the gate and waits on 'running'
    assert waiting_alone.poll() is None
    try:
        assert _started_after(tmp_path, alone=False, release=first, wait_s=0.5) >= 0.5
    finally:
        assert waiting_alone.communicate(timeout=10)[0] == "alone\n"


def test_without_a_directory_a_turn_begins_at_once(tmp_path: Path) -> None:
    with turns.turn(None, alone=True), turns.turn(str(tmp_path / "gone"), alone=True):
        pass
