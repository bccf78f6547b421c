"""The start-time filter of a scan for one command's processes (issue 15, marker containment).

A process that started before the command cannot have inherited its marker, so a scan by the
command's exact marker skips it before reading its environment (which can be megabytes). Both
scanners are tested on this host's real processes: the host /proc scan (``scan_processes``, the
Docker backend's fallback from the host) and the bash KILL script (run in the container or on the
SSH host), fed the command's start the way a boot script reports it.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsh_bash.host import _proc_scan as _procscan
from dsh_bash.host import (
    boot_ticks,
    scan_processes,
)
from dsh_bash.remote import (
    KILL,
    find_boot_ok,
    kill_args,
)

#: What a boot script does to report the command's start (see dsh_bash.remote.BOOT_AT): its own
#: pid ($1) as the process that becomes the command by exec.
REPORT_START = (
    r"""read -r up _ < /proc/uptime; printf '\0dsh-bash-boot-at:%s:%s\0\0dsh-bash-boot-ok\0' "$up" "$1" """
)


@pytest.fixture
def marker() -> str:
    return f"tok{uuid.uuid4().hex[:10]}-1"


@pytest.fixture
def sleepers(marker: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def marked_sleeper(marker: str, sleepers: list[subprocess.Popen[bytes]]) -> int:
    """A sleeper carrying ``marker``, in a session of its own (so no other's group holds it)."""
    env = dict(os.environ, DSH_BASH_MARK=marker)
    proc = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True)
    sleepers.append(proc)
    # Popen returns once the exec closed its error pipe, which the kernel does before it sets up
    # the new environment: until then /proc/PID/environ reads empty (a loaded rehearsal saw it).
    deadline = time.monotonic() + 5.0
    environ = Path(f"/proc/{proc.pid}/environ")
    while marker.encode() not in environ.read_bytes():
        assert time.monotonic() < deadline, f"{environ} never showed {marker}"
        time.sleep(0.005)
    return proc.pid


@pytest.mark.timeout(30)
def test_a_host_scan_for_one_command_skips_processes_started_before_it(
    marker: str, sleepers: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    older = marked_sleeper(marker, sleepers)
    time.sleep(0.1)  # ten clock ticks: well past the filter's slack
    since = boot_ticks()
    newer = marked_sleeper(marker, sleepers)
    read: list[str] = []
    real = _procscan._read_file

    def recording(path: str) -> bytes:
        read.append(path)
        return real(path)

    monkeypatch.setattr(_procscan, "_read_file", recording)
    entries = {entry.pid: entry for entry in scan_processes(marker.encode(), since=since)}
    assert entries[newer].marker == marker
    assert f"/proc/{newer}/environ" in read
    # Listed (its stat was read) but unmarked, and its environment never read.
    assert entries[older].marker is None
    assert f"/proc/{older}/environ" not in read
    # Without a start (the executor-wide scan by prefix) both are found.
    unfiltered = {entry.pid: entry.marker for entry in scan_processes(marker.encode())}
    assert unfiltered[older] == unfiltered[newer] == marker


def kill_list(marker: str, *, exact: bool, start: object = None) -> set[int]:
    args = kill_args("list", 0, marker, exact=exact, start=start)  # type: ignore[arg-type]
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", KILL, "dsh-bash", *args],
        capture_output=True,
        timeout=20,
        check=True,
    )
    return {int(word) for word in done.stdout.split()}


@pytest.mark.timeout(30)
def test_the_kill_script_for_one_command_skips_processes_started_before_it(
    marker: str, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    older = marked_sleeper(marker, sleepers)
    # The process that becomes the command by exec (SSH's BOOT) started before the command too.
    own = marked_sleeper(marker, sleepers)
    time.sleep(0.1)
    report = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", REPORT_START, "dsh-bash", str(own)],
        capture_output=True,
        timeout=10,
        check=True,
    ).stdout
    found = find_boot_ok(report)
    assert found is not None and found[0] == 0 and found[1] == len(report), report
    start = found[2]
    assert start is not None and start.pid == own, report
    newer = marked_sleeper(marker, sleepers)
    assert kill_list(marker, exact=True, start=start) & {older, own, newer} == {own, newer}
    # Without a start, and for a prefix (the executor-wide scan), nothing is skipped.
    assert kill_list(marker, exact=True) & {older, own, newer} == {older, own, newer}
    prefix = marker.rsplit("-", 1)[0] + "-"
    assert kill_list(prefix, exact=False, start=start) & {older, own, newer} == {older, own, newer}


def test_a_boot_report_without_or_with_a_broken_start_leaves_kills_unfiltered() -> None:
    ok = b"\0dsh-bash-boot-ok\0"
    # An older boot script (no record), an unreadable /proc/uptime (empty), rc noise in front.
    assert find_boot_ok(b"noise" + ok + b"out") == (5, 5 + len(ok), None)
    assert find_boot_ok(b"\0dsh-bash-boot-at::0\0" + ok) == (21, 21 + len(ok), None)
    # Only a record right before BOOT_OK counts; one in the noise before it is ignored.
    assert find_boot_ok(b"\0dsh-bash-boot-at:5.00:0\0x" + ok) == (26, 26 + len(ok), None)
    found = find_boot_ok(b"rc\0dsh-bash-boot-at:12345.6:42\0" + ok)
    assert found is not None and found[0] == 2 and found[2] is not None
    assert (found[2].uptime_cs, found[2].pid) == (1234560, 42)
