"""The SSH backend against an sshd that is really elsewhere: a Debian container with its own PID
namespace and users (``tests/sshd_container.py``), through ``dsh-bash conformance --config FILE``:
the checks the place can change (``kit_targets.SSH_CONTAINER_CHECKS``).

The CLI is the ``dsh-bash`` console script of this interpreter's environment, run in a subprocess
with ``tests/`` on ``PYTHONPATH`` (for ``broken_ssh_backends``), as a backend author runs it. The
kit knows nothing of SSH: it plants and finds through the backend's own hooks
(:class:`dsh_bash.backend.ConformanceHooks`), which these tests also exercise directly.

Timeouts: the session fixture builds the server image when it is missing (about a minute and a
half here; ``.ci/run`` builds it beforehand), and the whole kit takes a few minutes over SSH, so
the tests that may be first to use the fixture, and the whole-kit run, carry longer ``timeout``
marks than the suite's 120 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from cli_support import console_script
from dsh_bash_conformance import CHECKS
from kit_targets import (
    MARKER_CONTAINMENT_FAILS,
    MARKER_CONTAINMENT_RACES,
    SSH_CONTAINER_CHECKS,
    expected_outcome,
)
from sshd_container import USER, SshdContainer

from dsh_bash import BashExecRequest
from dsh_bash.host import find_host_processes

pytestmark = [pytest.mark.kit, pytest.mark.ssh, pytest.mark.docker]

TESTS_DIR = Path(__file__).resolve().parent
#: A first test may build the image (about 90 s here) before its own work.
BUILD_ALLOWANCE_S = 300
ESCAPEE_CHECKS = [name for name in CHECKS if name.startswith("escapee-killed-on-")]


def _conformance(toml: Path, *args: str, timeout: float) -> tuple[int, dict[str, Any], str]:
    """``dsh-bash conformance --config TOML --json ARGS...``: exit status, the JSON report, stderr."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("DSH_BASH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [console_script(), "conformance", "--config", str(toml), "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    try:
        report = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (exit {done.returncode}): {done.stdout!r} {done.stderr!r}")
    return done.returncode, report, done.stderr


def _toml(path: Path, server: SshdContainer, backend: str = "ssh") -> Path:
    fields = server.config()
    path.write_text(
        f'backend = "{backend}"\n'
        f'host = "{fields["host"]}"\nport = {fields["port"]}\nusername = "{fields["username"]}"\n'
        f'known_hosts = "{fields["known_hosts"]}"\nclient_keys = ["{fields["client_keys"][0]}"]\n'
    )
    return path


def _bashrc(server: SshdContainer) -> str:
    done = server.exec("cat", f"/home/{USER}/.bashrc")
    assert done.returncode == 0, done.stderr
    return done.stdout


def _none_marked_in_container(server: SshdContainer, text: str, within_s: float = 15.0) -> list[str]:
    """Wait until no process in the server container carries ``text``; return what is left then.

    The kit's setsid-chain escapee, which the SSH backend cannot kill yet, ends by itself 10 s
    after it began."""
    deadline = time.monotonic() + within_s
    while (left := _marked_in_container(server, text)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _marked_in_container(server: SshdContainer, text: str) -> list[str]:
    """``ps`` lines in the server container whose command line contains ``text`` (the ps itself aside)."""
    done = server.exec("ps", "-eo", "pid=,args=")
    assert done.returncode == 0, done.stderr
    return [line.strip() for line in done.stdout.splitlines() if text in line and " ps -eo " not in line]


def _executor(server: SshdContainer) -> Any:
    from dsh_bash_ssh import SshBashExecutor, SshConfig  # noqa: PLC0415

    return SshBashExecutor(SshConfig(**server.config(grace_ms=300)))


@pytest.mark.timeout(BUILD_ALLOWANCE_S)
def test_finder_reports_pids_where_the_commands_run(sshd_container: SshdContainer) -> None:
    """``kit_find_processes`` scans the SSH host's /proc: pids of the container's PID namespace.

    This host shares the container's kernel, so its own /proc sees the same processes, but under
    other pids (the first of each ``NSpid`` line): those would name nothing, or the wrong process,
    on the SSH host, where the kit kills leftovers by pid.
    """
    marker = "kitmark-finder-0123abcd"
    probe = _executor(sshd_container)  # never opened: the kit calls the hooks on such an executor

    async def main() -> None:
        async with _executor(sshd_container) as ex:
            task = await ex.start(ex.resolve(BashExecRequest(command=f"sleep 60; : {marker}")))
            # Called from this thread, whose event loop is running: the hook must not need it.
            remote = probe.kit_find_processes(marker)
            assert remote, "the finder saw no process carrying the marker on the SSH host"
            for pid in remote:
                cmdline = sshd_container.exec("cat", f"/proc/{pid}/cmdline").stdout
                assert marker in cmdline, (pid, cmdline)
            translated = []
            for pid in find_host_processes(marker):
                status = Path(f"/proc/{pid}/status").read_text()
                nspid = re.search(r"^NSpid:\s+(.*)$", status, re.MULTILINE)
                assert nspid is not None
                translated.append(int(nspid.group(1).split()[-1]))
                assert int(nspid.group(1).split()[0]) == pid
            assert sorted(translated) == remote
            assert not set(remote) & set(find_host_processes(marker)), "pid namespaces should differ"
            assert await ex.kill(task.id) is True
        assert probe.kit_find_processes(marker) == []

    anyio.run(main)


@pytest.mark.timeout(BUILD_ALLOWANCE_S)
def test_planting_reaches_new_logins_and_is_put_back(sshd_container: SshdContainer) -> None:
    """``kit_plant_ambient`` writes a managed block at the top of the remote ``~/.bashrc`` (above
    Debian's early return for non-interactive shells), nests, and leaves the file as it was."""
    original = _bashrc(sshd_container)
    probe = _executor(sshd_container)
    outer = {"KIT_OUTER": "outer value with 'quotes', spaces\nand a newline"}
    inner = {**outer, "KIT_INNER": "inner $HOME `x`"}
    show = 'printf "%s|%s" "$KIT_OUTER" "${KIT_INNER-unset}"'

    async def seen() -> str:
        async with _executor(sshd_container) as ex:
            result = await ex.exec(show)
            return str(result.stdout.text)

    with probe.kit_plant_ambient(outer) as overrides:
        assert overrides == {}
        assert anyio.run(seen) == f"{outer['KIT_OUTER']}|unset"
        with probe.kit_plant_ambient(inner):
            assert anyio.run(seen) == f"{outer['KIT_OUTER']}|{inner['KIT_INNER']}"
        assert anyio.run(seen) == f"{outer['KIT_OUTER']}|unset"
        assert "KIT_INNER" not in _bashrc(sshd_container)
    assert _bashrc(sshd_container) == original
    assert anyio.run(seen) == "|unset"


#: The checks the container's place can change (``kit_targets.SSH_CONTAINER_CHECKS``; SSH on this
#: host runs the whole kit; ``DSH_TEST_SSH_CONTAINER_KIT=all``: the whole kit here too), in two runs
#: of the command, which workers take in parallel (one run of the whole kit took two minutes, the
#: longest single test of the suite, and so the last to end when it started late).
KIT_CHECKS = (
    list(CHECKS) if os.environ.get("DSH_TEST_SSH_CONTAINER_KIT") == "all" else list(SSH_CONTAINER_CHECKS)
)
_HALF = -(-len(KIT_CHECKS) // 2)
KIT_PARTS = [KIT_CHECKS[start : start + _HALF] for start in range(0, len(KIT_CHECKS), _HALF)]


def test_the_parts_are_the_checks() -> None:
    assert [name for part in KIT_PARTS for name in part] == KIT_CHECKS


@pytest.mark.timeout(BUILD_ALLOWANCE_S + 300)
@pytest.mark.parametrize("part", range(len(KIT_PARTS)), ids=lambda index: f"part{index + 1}")
def test_cli_conformance_passes_every_check(sshd_container: SshdContainer, tmp_path: Path, part: int) -> None:
    checks = KIT_PARTS[part]
    original = _bashrc(sshd_container)
    code, report, err = _conformance(
        _toml(tmp_path / "ssh.toml", sshd_container), "--check", *checks, timeout=BUILD_ALLOWANCE_S + 240
    )
    failed = [
        (r["name"], r["outcome"], r["message"])
        for r in report["results"]
        if r["outcome"] != expected_outcome("ssh", r["name"], "ssh-container")
    ]
    # Every check passes, the containment and outcome ones included: foreground commands and
    # detached background tasks run under dsh-supervise in the container too.
    assert not MARKER_CONTAINMENT_FAILS["ssh"] and not MARKER_CONTAINMENT_RACES["ssh"]
    assert failed == []
    assert [r["name"] for r in report["results"]] == checks
    assert (code, report["contract_ok"]) == (0, True)
    # The kit knew the SSH host through the backend's hooks: its only note is the planting one.
    notes = [line for line in err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "~/.bashrc" in notes[0], err
    assert _bashrc(sshd_container) == original
    assert _none_marked_in_container(sshd_container, "kitmark-") == []


@pytest.mark.timeout(BUILD_ALLOWANCE_S)
def test_cli_catches_a_kill_that_misses_processes_on_the_remote_host(
    sshd_container: SshdContainer, tmp_path: Path
) -> None:
    """``GroupOnlyKillSsh`` kills only its commands' process groups on the SSH host: the escapee
    checks fail, and they fail because the kit looked on the SSH host.

    With this host's /proc instead of the backend's finder, a server that is really on another
    machine shows nothing: the escapee checks would pass (no survivor in sight) and
    escapee-killed-on-aclose would fail for the wrong reason (its escapee is not "alive" before
    aclose). This container shares our kernel, so a host scan does see the survivors, but under
    host pids: the checks fail, yet the kit's cleanup, which kills leftovers by pid on the SSH host
    after reading ``/proc/PID/cmdline`` there, misses every one of them and leaves them running
    (tried: the escapees stayed in the container). So the test demands that the failures name
    survivors, and that nothing carrying a kit marker is left in the container afterwards: the
    cleanup found them there, by their pids there.
    """
    control = "timeout-kills-children"  # the command's own group is killed as it should be
    toml = _toml(tmp_path / "broken.toml", sshd_container, "broken_ssh_backends:GroupOnlyKillSsh.from_fields")
    code, report, err = _conformance(
        toml, "--check", *ESCAPEE_CHECKS, control, timeout=BUILD_ALLOWANCE_S - 30
    )
    results = {r["name"]: r for r in report["results"]}
    assert {name: r["outcome"] for name, r in results.items()} == {
        **dict.fromkeys(ESCAPEE_CHECKS, "failed"),
        control: "passed",
    }, report["results"]
    for name in ESCAPEE_CHECKS:
        message = results[name]["message"]
        # The remote finder saw the survivors: the check names them, or (when this backend's
        # slower kill, a script over SSH, let the task outlive its wait bound first, as under
        # load) the cleanup counts them; either number came from the SSH host's /proc.
        if "did not finish within" not in message:
            assert re.search(r"processes \[\d+(, \d+)*\] carrying kitmark-", message), (name, message)
        assert re.search(r"kit cleanup killed [1-9]\d* leftover", message), (name, message)
    # Only "beyond" checks failed: the contract holds and the run passes.
    assert (code, report["contract_ok"]) == (0, True), err
    assert _marked_in_container(sshd_container, "kitmark-") == []
