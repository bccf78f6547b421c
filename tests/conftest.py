"""Shared test configuration.

A test that cannot run because its backend is missing (no Docker daemon, no SSH server, a backend
package not importable) skips with a reason starting ``backend unavailable:``. Locally that is a
skip; in CI (environment variable ``CI`` equal to ``true``, which ``.ci/run`` sets) it is a failure,
so a broken CI setup cannot pass by skipping everything. A skipped test is reported as failed; a
skipped module (``pytest.skip(..., allow_module_level=True)``) is listed at the end and fails the run.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Generator
from typing import Any

import pluggy
import pytest
from anyio._backends._asyncio import TestRunner

#: Docker, SSH (host sshd and containerized sshd), fault-suite and remote-engine (TLS, SSH) fixtures
#: for every test module.
pytest_plugins = ["docker_support", "ssh_support", "sshd_container", "fault_support", "remote_engines"]

#: Reason prefix of skips that CI turns into failures.
BACKEND_UNAVAILABLE = "backend unavailable:"

_skipped_modules: list[str] = []


def _is_anyio_unix_reader_race(context: dict[str, Any]) -> bool:
    """The race in anyio 4.16's asyncio UNIX socket streams (the Docker engine client's transport):
    a read cancelled by a bound leaves ``loop.add_reader(sock, future.set_result)`` registered until
    the future's done callback runs, so a socket turning readable in that same loop pass sets the
    result of the already cancelled future. asyncio only logs such a callback error; anyio's test
    runner re-raises every one in the test. Only exactly this shape is let through (and logged):
    ``InvalidStateError`` from a callback that is ``set_result`` of a cancelled future.
    See docs/faults.md ("Found and not fixed")."""
    callback = getattr(context.get("handle"), "_callback", None)
    future = getattr(callback, "__self__", None)
    return (
        isinstance(context.get("exception"), asyncio.InvalidStateError)
        and getattr(callback, "__name__", "") == "set_result"
        and isinstance(future, asyncio.Future)
        and future.cancelled()
    )


_anyio_exception_handler = TestRunner._exception_handler


def _exception_handler(self: TestRunner, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if _is_anyio_unix_reader_race(context):
        logging.getLogger("tests").warning("ignored anyio's UNIX socket reader race: %s", context["message"])
        return
    _anyio_exception_handler(self, loop, context)


TestRunner._exception_handler = _exception_handler  # type: ignore[method-assign]


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
