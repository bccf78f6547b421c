"""The conformance kit against the SSH backend (asyncio only: asyncssh is asyncio-only).

A throwaway sshd is started by ``tests/ssh_support.py``; without root or sshd every test skips with
``backend unavailable: ...`` (a failure in CI).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
from dsh_bash_conformance import CHECKS, KitTarget, run_kit
from kit_targets import (
    FILE_CHECKS,
    MARKER_CONTAINMENT_FAILS,
    MARKER_CONTAINMENT_RACES,
    expected_outcome,
    reused_target,
)
from ssh_support import SshServer, ssh_target

pytestmark = [pytest.mark.kit, pytest.mark.ssh]


@pytest.mark.parametrize("name", list(CHECKS))
def test_check(name: str, ssh_server: SshServer) -> None:
    target = reused_target(("ssh", ssh_server.port), lambda: ssh_target(ssh_server, "asyncio"))
    report = run_kit(target, only=[name])
    [result] = report.results
    print(f"{target.name} {result.name} ({result.kind}) {result.outcome} in {result.duration_s:.2f}s")
    if result.message:
        print(result.message)
    # Every check, containment and outcome ones included, passes: commands and detached tasks run
    # under dsh-supervise (the lists stay, empty, so that the Docker and SSH tests read alike).
    assert name not in MARKER_CONTAINMENT_RACES["ssh"] | MARKER_CONTAINMENT_FAILS["ssh"]
    expected = expected_outcome("ssh", name)
    assert result.outcome == expected, f"{result.name} ({result.kind}) {result.outcome}: {result.message}"


@pytest.mark.parametrize("name", sorted(FILE_CHECKS))
def test_file_check_without_an_sftp_subsystem(name: str, server_without_sftp: SshServer) -> None:
    """Files move through the host's sftp-server over an exec channel where sshd offers no SFTP."""
    target = reused_target(
        ("ssh-without-sftp", server_without_sftp.port), lambda: ssh_target(server_without_sftp, "asyncio")
    )
    [result] = run_kit(target, only=[name]).results
    assert result.outcome == "passed", f"{result.name} {result.outcome}: {result.message}"


@pytest.mark.parametrize("name", sorted(FILE_CHECKS))
def test_file_check_without_any_sftp(name: str, server_without_sftp: SshServer) -> None:
    """With no sftp-server to run either (``exec_sftp_server=False``) the backend says files are
    unsupported (``files_unsupported``): the kit reports the check not applicable, never failed."""

    def make() -> KitTarget:
        target = ssh_target(server_without_sftp, "asyncio")
        return replace(target, make_executor=partial(server_without_sftp.executor, exec_sftp_server=False))

    target = reused_target(("ssh-no-sftp-at-all", server_without_sftp.port), make)
    [result] = run_kit(target, only=[name]).results
    assert result.outcome == "not_applicable", f"{result.name} {result.outcome}: {result.message}"
