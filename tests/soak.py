"""Issue 30's hostile cases, run again and again beside a CPU hog (a pytest plugin of conftest.py).

    bin/test --no-lint -n 2 -m hostile --rounds 10 --cpu-hog

- ``-m hostile`` selects the tests of issue 30's cases (``HOSTILE_TESTS``, ``HOSTILE_CHECKS``): a
  command that replaces the supervisor binary, takes over or stops a spare, stops its supervisor or
  every process of its login, plants a status file, forks a bomb whose shell exits, types into a
  terminal, holds the MCP HTTP server's connections, or a ``~/.ssh/config`` that switches host-key
  checking off; each kit check on every backend and mode the kit matrix runs it on.
- ``--rounds N`` runs every selected test N times (ids ``...[round-3]``), so a run reports how many of
  the N each one passed; pytest-xdist spreads the rounds over its workers.
- ``--cpu-hog`` keeps one busy process per CPU running for the whole session (started by the
  controller, not by each worker), at the tests' own priority: every bound is then held on a machine
  whose CPUs are taken.

Not part of CI's check: the tests run there once, without a hog (tests/README.md, "Soak").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: Test functions of issue 30's cases, by file; kit checks are matched by name (``HOSTILE_CHECKS``).
HOSTILE_TESTS: dict[str, tuple[str, ...]] = {
    "test_faults_docker.py": ("test_root_in_an_image_mode_container_cannot_replace_the_supervisor",),
    "test_ssh_supervisor_replaced.py": ("*",),
    "test_ssh_supervise.py": (
        "test_a_warm_spare_cannot_be_taken_over_by_a_command",
        "test_a_stopped_warm_spare_delays_the_next_command_by_a_second_at_most",
    ),
    "test_ssh_boot.py": ("test_a_supervised_warm_channel_cannot_be_taken_over_by_the_same_user",),
    "test_faults_ssh.py": ("test_a_planted_status_file_ends_the_task_lost",),
    "test_faults_ssh_frozen.py": ("*",),
    "test_local_fork_server.py": (
        "test_a_stopped_spare_is_continued_before_the_next_request",
        "test_a_stopped_spare_does_not_outlive_the_executor",
        "test_a_stopped_server_does_not_stall_later_commands",
    ),
    "test_abuse_interactive.py": ("test_the_issues_fork_bomb_leaves_nothing_for_the_next_command",),
    "test_faults_exhaustion.py": ("test_fork_bomb_under_a_real_pids_limit_ends_in_time_and_leaves_nothing",),
    "test_mcp_http_load.py": ("*",),
    "test_ssh_host_keys.py": ("*",),
}
HOSTILE_CHECKS = (
    "stopped-supervisor-killed-on-time",
    "stopped-spares-next-command-on-time",
    "terminal-injection-refused",
    "foreground-leftovers-killed",
)
#: A busy loop, one per CPU (``--cpu-hog``).
_HOG = "while True: pass"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("soak", "issue 30's hostile cases, again and again (tests/soak.py)")
    group.addoption("--rounds", type=int, default=1, metavar="N", help="run every selected test N times")
    group.addoption("--cpu-hog", action="store_true", help="keep every CPU busy for the whole session")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hostile: one of issue 30's hostile cases (tests/soak.py)")
    rounds = config.getoption("rounds")
    if rounds < 1:
        raise pytest.UsageError(f"--rounds must be at least 1, got {rounds}")
    if config.getoption("cpu_hog") and os.environ.get("PYTEST_XDIST_WORKER") is None:
        hogs = [
            subprocess.Popen([sys.executable, "-c", _HOG], stdin=subprocess.DEVNULL)
            for _ in range(os.cpu_count() or 1)
        ]

        def stop_hogs() -> None:
            for hog in hogs:
                hog.kill()
                hog.wait()

        config.add_cleanup(stop_hogs)


def is_hostile(item: pytest.Item) -> bool:
    """Whether ``item`` is one of issue 30's cases."""
    names = HOSTILE_TESTS.get(item.path.name, ())
    function = getattr(item, "originalname", item.name)
    if "*" in names or function in names:
        return True
    kit = item.path.name.startswith("test_conformance_")
    return kit and any(check in item.name for check in HOSTILE_CHECKS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_hostile(item):
            item.add_marker(pytest.mark.hostile)


@pytest.fixture
def soak_round(request: pytest.FixtureRequest) -> int:
    """The round this run of a test is (``--rounds``)."""
    return int(request.param)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    rounds = metafunc.config.getoption("rounds")
    if rounds > 1:
        metafunc.fixturenames.append("soak_round")
        metafunc.parametrize("soak_round", range(1, rounds + 1), indirect=True, ids=lambda n: f"round-{n}")
