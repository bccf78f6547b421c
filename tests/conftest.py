"""Shared test configuration.

A test that cannot run because its backend is missing (no Docker daemon, no SSH server, a backend
package not importable) skips with a reason starting ``backend unavailable:``. Locally that is a
skip; in CI (environment variable ``CI`` equal to ``true``, which ``.ci/run`` sets) it is a failure,
so a broken CI setup cannot pass by skipping everything. A skipped test is reported as failed; a
skipped module (``pytest.skip(..., allow_module_level=True)``) is listed at the end and fails the run.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pluggy
import pytest

#: Docker, SSH and fault-suite fixtures for every test module.
pytest_plugins = ["docker_support", "ssh_support", "fault_support"]

#: Reason prefix of skips that CI turns into failures.
BACKEND_UNAVAILABLE = "backend unavailable:"

_skipped_modules: list[str] = []


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
