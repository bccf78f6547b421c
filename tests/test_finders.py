"""One table of process shapes for every way a command's processes are found by their marker.

Marker containment has two finders, one design: the host kit's /proc scan (``scan_processes`` and
``signal_marked``: the local backend without the supervisor, the Docker backend's look from this host)
and the remote kit's ``KILL`` script (bash, where the commands run: in a container, on an SSH host).
Both are asked here, in list mode, about the same real processes of this host, and must give the
same answers. The supervisor finds a command's processes another way (its subtree, as their
subreaper), which the conformance kit's escapee checks hold on every backend.

A row is a shape a hostile command can take; ``EXACT`` and ``PREFIX`` say whether its process must be
found by the command's exact marker and by the executor's prefix.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsh_bash.host import scan_processes
from dsh_bash.remote import KILL, kill_args

MARK = "DSH_BASH_MARK"

# A process whose environment holds exactly the given entries, duplicates included (os.execve takes
# a mapping, so the raw execve of libc): ``python3 -c EXEC_RAW_ENV ENTRY... -- ARGV...``.
EXEC_RAW_ENV = """
import ctypes, sys
split = sys.argv.index("--")
entries, argv = sys.argv[1:split], sys.argv[split + 1:]
def array(items):
    values = (ctypes.c_char_p * (len(items) + 1))(*[item.encode() for item in items], None)
    return values
ctypes.CDLL(None, use_errno=True).execve(argv[0].encode(), array(argv), array(entries))
raise SystemExit(f"execve failed: {ctypes.get_errno()}")
"""


@dataclass
class Shape:
    """How to start the shape's process, given the command's marker; and what must find it."""

    start: Callable[[str], list[str]]  # argv, run with the marker already in its environment
    exact: bool
    prefix: bool
    env: Callable[[str], dict[str, str]] = lambda marker: {MARK: marker}


def _sleep() -> list[str]:
    return ["/bin/sleep", "30"]


def _raw_env(*entries: str) -> list[str]:
    return [sys.executable, "-c", EXEC_RAW_ENV, *entries, "--", *_sleep()]


SHAPES = {
    "the command's own process": Shape(lambda m: _sleep(), exact=True, prefix=True),
    # setsid and a double fork: the process left the group and its parent, not the environment.
    "escaped with setsid and a double fork": Shape(
        lambda m: ["/bin/bash", "-c", "setsid bash -c '/bin/sleep 30 & wait' & wait"], exact=True, prefix=True
    ),
    "another executor's marker": Shape(
        lambda m: _sleep(), exact=False, prefix=False, env=lambda m: {MARK: "other" + m}
    ),
    "another command of the same executor": Shape(
        lambda m: _sleep(), exact=False, prefix=True, env=lambda m: {MARK: m + "0"}
    ),
    "the marker's text in another variable": Shape(
        lambda m: _sleep(), exact=False, prefix=False, env=lambda m: {"NOT_IT": f"{MARK}={m}"}
    ),
    # A hostile process puts a decoy first: getenv() would say decoy, yet it still carries ours.
    "a decoy marker before the real one": Shape(
        lambda m: _raw_env(f"{MARK}=decoy", f"{MARK}={m}"), exact=True, prefix=True, env=lambda m: {}
    ),
    # The documented escape of marker containment (docs/security.md): only the supervisor holds it.
    "an environment cleared with env -i": Shape(
        lambda m: ["/usr/bin/env", "-i", *_sleep()], exact=False, prefix=False
    ),
}


def python_finder(marker: str, *, exact: bool) -> set[int]:
    """The host kit: the pids a kill by marker signals (an exact value, or the executor's prefix)."""
    return {
        entry.pid
        for entry in scan_processes(marker.encode())
        if entry.alive and entry.marker is not None and (not exact or entry.marker == marker)
    }


def bash_finder(marker: str, *, exact: bool, path: str | None = None) -> set[int]:
    """The remote kit: the pids the KILL script lists (it signals the same ones)."""
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", KILL, "dsh-bash", *kill_args("list", 0, marker, exact=exact)],
        capture_output=True,
        timeout=20,
        check=True,
        env={**os.environ, "PATH": path or os.environ.get("PATH", "/usr/bin:/bin")},
    )
    return {int(word) for word in done.stdout.split()}


def bash_finder_without_grep(marker: str, *, exact: bool) -> set[int]:
    """The KILL script where no grep reads NUL-separated records (busybox's may not): it then splits
    each environment in bash, the other of its two paths."""
    with tempfile.TemporaryDirectory() as bin_dir:
        fake = Path(bin_dir) / "grep"
        fake.write_text("#!/bin/sh\nexit 2\n")
        fake.chmod(0o755)
        return bash_finder(marker, exact=exact, path=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")


FINDERS: dict[str, Callable[..., set[int]]] = {
    "host scan": python_finder,
    "KILL script": bash_finder,
    "KILL script, no grep -z": bash_finder_without_grep,
}


def _processes(*, zombies: bool) -> dict[int, int]:
    """Every process of this host and its parent; zombies (and dead entries) only with ``zombies``."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b") ", 1)[1].split()
            except (OSError, IndexError):
                continue
            if (fields[0] in (b"Z", b"X")) == zombies:
                parents[int(name)] = int(fields[1])
    return parents


def _descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it (by parent pid), read from /proc."""
    parents = _processes(zombies=False)
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found.update(children)
        frontier.extend(children)
    return found


def _sleepers(pid: int) -> set[int]:
    """The sleeps a shape started (the bash and python wrappers around them are not what it is about)."""
    sleeping = set()
    for candidate in _descendants(pid):
        try:
            with open(f"/proc/{candidate}/cmdline", "rb") as handle:
                if handle.read().startswith(b"/bin/sleep\0"):
                    sleeping.add(candidate)
        except OSError:
            continue
    return sleeping


@pytest.fixture
def executor_marker() -> str:
    return f"tok{uuid.uuid4().hex[:10]}-"


@pytest.fixture
def started(executor_marker: str) -> Iterator[Callable[[Shape, str], set[int]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(shape: Shape, marker: str) -> set[int]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **shape.env(marker)}
        proc = subprocess.Popen(shape.start(marker), env=env, start_new_session=True)
        procs.append(proc)
        deadline = time.monotonic() + 10
        while not (sleepers := _sleepers(proc.pid)):
            assert time.monotonic() < deadline, f"the shape's sleep did not start: {shape}"
            time.sleep(0.02)
        return sleepers

    yield start
    for proc in procs:
        for pid in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        proc.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("finder", FINDERS)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_a_shape_is_found_as_its_row_says(
    shape_name: str, finder: str, executor_marker: str, started: Callable[[Shape, str], set[int]]
) -> None:
    shape = SHAPES[shape_name]
    marker = executor_marker + "1"
    pids = started(shape, marker)
    find = FINDERS[finder]
    by_exact = find(marker, exact=True) & pids
    by_prefix = find(executor_marker, exact=False) & pids
    assert (by_exact == pids, by_prefix == pids) == (shape.exact, shape.prefix), (by_exact, by_prefix, pids)
    # Not found means none of them: a shape is found whole or not at all.
    assert by_exact in (set(), pids) and by_prefix in (set(), pids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("finder", FINDERS)
def test_a_zombie_is_not_listed(
    finder: str, executor_marker: str, started: Callable[[Shape, str], set[int]]
) -> None:
    """A marked process that exited and was not reaped is not alive: nothing to kill, nothing left."""
    marker = executor_marker + "1"
    # The parent execs into a sleep and never reaps the child it forked, which exits a second later:
    # a child that exited at once could be reaped by bash itself before its exec (a rehearsal's
    # LC_ALL=C run: no zombie in 10 s). `env sleep` is not a `/bin/sleep` the shape's look counts.
    shape = Shape(
        lambda m: ["/bin/bash", "-c", "/usr/bin/env sleep 1 & exec /bin/sleep 30"], exact=True, prefix=True
    )
    [parent] = started(shape, marker)
    deadline = time.monotonic() + 10
    # Both: the child may exit before the parent's exec is through (its environment unreadable while
    # the exec swaps its memory: a finder then misses the parent, which this test is not about).
    while not (
        (zombies := {pid for pid, ppid in _processes(zombies=True).items() if ppid == parent})
        and Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"/bin/sleep\0")
    ):
        assert time.monotonic() < deadline, "the child never became a zombie under a parent that exec'd sleep"
        time.sleep(0.02)
    found = FINDERS[finder](marker, exact=True)
    assert parent in found and not (found & zombies), (found, zombies)


def test_the_raw_environment_helper_makes_duplicates() -> None:
    """The decoy row stands only if the process really holds both entries."""
    out = subprocess.run(
        [sys.executable, "-c", EXEC_RAW_ENV, "A=1", "A=2", "--", "/bin/cat", "/proc/self/environ"],
        capture_output=True,
        timeout=10,
        check=True,
    ).stdout
    assert out == b"A=1\0A=2\0"
