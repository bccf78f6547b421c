"""Shared test configuration.

A test that cannot run because its backend is missing (no Docker daemon, no SSH server, a backend
package not importable) skips with a reason starting ``backend unavailable:``. Locally that is a
skip; in CI (environment variable ``CI`` equal to ``true``, which ``.ci/run`` sets) it is a failure,
so a broken CI setup cannot pass by skipping everything. A skipped test is reported as failed; a
skipped module (``pytest.skip(..., allow_module_level=True)``) is listed at the end and fails the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Generator

import pluggy
import pytest
import turns

#: Docker, SSH (host sshd and containerized sshd), fault-suite and remote-engine (TLS, SSH) fixtures
#: for every test module; ``soak``: the ``hostile`` marker, ``--rounds`` and ``--cpu-hog``.
pytest_plugins = [
    "docker_support",
    "ssh_support",
    "sshd_container",
    "fault_support",
    "remote_engines",
    "ray_support",
    "soak",
]

#: Reason prefix of skips that CI turns into failures.
BACKEND_UNAVAILABLE = "backend unavailable:"

_skipped_modules: list[str] = []


#: Modules the quick check (``bin/test --quick``, marker ``quick``) leaves out although they need no
#: Docker engine or SSH server: each repeats what the quick check runs, on another target or through
#: another door (tests/README.md, "The quick check").
QUICK_LEAVES_OUT = {
    "test_example_bwrap.py": "the whole kit again, on the example backend through bwrap",
    "test_inspect_provider.py": "inspect_ai's own self-check and an offline eval, through the provider",
    "test_cli_catches_broken.py": "a sample of the broken-backend table, through `dsh-bash conformance`",
}
#: Files of the suite's longest tests (30-90 s each under a whole run's load): started first.
LONG_FIRST = frozenset({"test_wheel.py", "test_conformance_ssh_container.py", "test_conformance_ray.py"})
#: The markers of tests that need more than this machine's Python and bash, or build more than a
#: commit's check should (``wheel``: the wheel and a venv to install it in; ``ray``: a Ray cluster).
_NOT_QUICK_MARKERS = ("docker", "ssh", "ray", "faults", "wheel")


def _is_quick(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(name) for name in _NOT_QUICK_MARKERS):
        return False
    if item.path.name in QUICK_LEAVES_OUT:
        return False
    # The local kit on trio: the asyncio rows run every check; trio changes the event loop only.
    callspec = getattr(item, "callspec", None)
    return not (
        item.path.name == "test_conformance_local.py"
        and callspec is not None
        and callspec.params.get("anyio_backend") == "trio"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
    # The tests that run alone go first, in one run (see "tests that run alone" below): pytest-xdist
    # hands each worker a contiguous block of the list, so the first worker takes them all at the
    # start and keeps its turn from one to the next, and the others wait once, behind their first
    # tests. Where they fell before, each of them waited for the tests under way on the other
    # workers to end, the two-minute ones among them. The longest tests start each worker's block,
    # dealt in turn: a late long test is a run's tail, three workers idle behind it; and all of
    # them at the head of the first block were a chain on one worker (others steal from a block's
    # end), the run's longest path once the Ray kits made them 15 minutes of test time.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    items[:] = _dealt(items, workers)


def _dealt(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` in the order that gives each of ``workers`` a block (as pytest-xdist's worksteal
    hands them out at the start: contiguous, ``left // workers_left`` each) that starts with its
    turn of the long tests; the serial tests ahead of all, in the first block."""
    serial = [item for item in items if _serial(item)]
    long = [item for item in items if not _serial(item) and item.path.name in LONG_FIRST]
    rest = [item for item in items if not _serial(item) and item.path.name not in LONG_FIRST]
    heads: list[list[pytest.Item]] = [[] for _ in range(max(1, workers))]
    heads[0] += serial
    for index, item in enumerate(long):
        heads[index % len(heads)].append(item)
    dealt: list[pytest.Item] = []
    left = len(items)
    for index, head in enumerate(heads):
        size = left // (len(heads) - index)
        left -= size
        dealt += head
        take = max(0, size - len(head))
        dealt += rest[:take]
        del rest[:take]
    return dealt + rest


# -- tests that run alone ----------------------------------------------------------------------------
#
# bin/test runs the suite in pytest-xdist workers. A test marked ``serial`` holds a bound that the
# load of other tests stretches: it runs while no other test does (tests/turns.py). The controller
# makes the run's lock directory and names it in the environment, which its workers inherit. Turns
# are taken outside pytest-timeout's timer (``tryfirst``): a wait for a turn is not counted against a
# test's own limit.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "wheel: builds the wheel and installs it in a fresh venv (tests/test_wheel.py; not quick)"
    )
    if os.environ.get("PYTEST_XDIST_WORKER") is None and turns.LOCK_DIR_VARIABLE not in os.environ:
        directory = tempfile.mkdtemp(prefix="dsh-bash-test-locks-")
        os.environ[turns.LOCK_DIR_VARIABLE] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))


#: A turn alone kept from one serial test for the next one on this worker: the other workers drain
#: once for a run of serial tests, not before each of them.
_kept_turn: contextlib.ExitStack | None = None


def _serial(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    global _kept_turn
    held, _kept_turn = _kept_turn, None
    if held is None:
        held = contextlib.ExitStack()
        held.enter_context(turns.turn(os.environ.get(turns.LOCK_DIR_VARIABLE), alone=_serial(item)))
    try:
        yield
    finally:
        if _serial(item) and _serial(nextitem):
            _kept_turn = held
        else:
            held.close()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _kept_turn is not None:
        _kept_turn.close()


def _backend_skip(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The skip reason when CI must not accept this skip, else None."""
    if os.environ.get("CI") != "true" or not report.skipped:
        return None
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    return reason if reason.startswith(BACKEND_UNAVAILABLE) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    report = outcome.get_result()
    reason = _backend_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = f"CI=true: a backend test may not skip ({reason})"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    reason = _backend_skip(report)
    if reason is not None:
        _skipped_modules.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_modules and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _skipped_modules:
        terminalreporter.section("CI=true: backend modules may not skip", red=True)
        for line in _skipped_modules:
            terminalreporter.line(line, red=True)
