"""What ``~/.ssh/config`` may and may not do to host-key checking (issue 30, "Host keys").

With ``use_user_ssh_config=True`` the SSH backend reads the user's ``~/.ssh/config``. These tests
write one (``HOME`` points at a temporary directory, so the real user's ``~/.ssh`` is never read or
touched) with each setting that would turn checking off, against the test sshd of ssh_support, and
show that an unknown host key is still refused and that the setting is named in a warning and in
the error; and that configs that name real known_hosts files still connect. Jump hosts
(``ProxyJump``) go through a second sshd whose host key is unknown.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ssh_support import TEST_USER, SshServer, start_server

from dsh_bash import BashInfrastructureError

pytestmark = [pytest.mark.anyio, pytest.mark.ssh]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME of the test's own with an empty ``~/.ssh``: no config, no known_hosts, no keys."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


@pytest.fixture(scope="module")
def jump_server(ssh_server: SshServer) -> Iterator[SshServer]:
    """A second sshd (a host key of its own, which no known_hosts of the session pins)."""
    server = start_server()
    try:
        yield server
    finally:
        # Not ssh_support.stop_server: it empties the .bashrc the session's server relies on.
        server.process.terminate()
        try:
            server.process.wait(5)
        except subprocess.TimeoutExpired:
            server.process.kill()
        shutil.rmtree(server.directory, ignore_errors=True)


def _pinned(server: SshServer) -> str:
    """The known_hosts line pinning ``server``'s host key."""
    return Path(server.known_hosts).read_text()


def _executor(server: SshServer, **fields: Any) -> Any:
    from dsh_bash_ssh import SshBashExecutor, SshConfig  # noqa: PLC0415

    values: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "username": TEST_USER,
        "client_keys": [server.user_key],
        "use_user_ssh_config": True,
        "warm_channel": False,
        "containment": "marker",
        "connect_timeout_ms": 5000,
    }
    values.update(fields)
    return SshBashExecutor(SshConfig(**values))


async def _refused(server: SshServer, **fields: Any) -> BashInfrastructureError:
    with pytest.raises(BashInfrastructureError) as info:
        async with _executor(server, **fields):
            pass
    return info.value


async def _runs(server: SshServer, **fields: Any) -> None:
    async with _executor(server, **fields) as ex:
        result = await ex.exec("echo logged-in")
        assert result.stdout.text == "logged-in\n", result


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        record.getMessage()
        for record in caplog.records
        if record.name == "dsh_bash.ssh" and record.levelno >= logging.WARNING
    )


def _write_config(home: Path, text: str, server: SshServer) -> Path:
    config = home / ".ssh" / "config"
    config.write_text(text.format(home=home, host=server.host, port=server.port))
    return config


#: Settings asyncssh honours that turn host-key checking off (``UserKnownHostsFile none`` leaves
#: asyncssh no known_hosts at all: it then accepts any key), in the places a config may say them.
#: Each: the config, the file (under ~/.ssh) and the line that says it.
OFF_SWITCHES = {
    "top-level": ("UserKnownHostsFile none\n", "config", 1),
    "equals-sign": ("Port {port}\nUserKnownHostsFile=none\n", "config", 2),
    "host-block": ("Host other.example\n  Port 22\nHost {host}\n  UserKnownHostsFile none\n", "config", 4),
    "host-star": ("Host *\n  UserKnownHostsFile none\n", "config", 2),
    "included": ("Include config.d/*\n", "config.d/lab", 2),
}


@pytest.mark.parametrize("case", list(OFF_SWITCHES))
async def test_known_hosts_none_in_the_user_config_does_not_switch_checking_off(
    ssh_server: SshServer, home: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    text, file, line = OFF_SWITCHES[case]
    if case == "included":
        (home / ".ssh" / "config.d").mkdir()
        (home / ".ssh" / "config.d" / "lab").write_text("# the lab's hosts\nUserKnownHostsFile none\n")
    _write_config(home, text, ssh_server)
    caplog.set_level(logging.WARNING, logger="dsh_bash.ssh")
    error = await _refused(ssh_server)  # before issue 30's fix: logged in, the key never checked
    assert error.reason == "host_key_rejected", error
    where = f"{home / '.ssh' / file}:{line}"
    assert where in str(error) and "UserKnownHostsFile none" in str(error), error
    warned = _warnings(caplog)
    assert where in warned and "UserKnownHostsFile none" in warned, warned
    assert not (home / ".ssh" / "known_hosts").exists()


#: Configs whose known_hosts settings name no readable known_hosts file.
NO_REAL_FILE = {
    "none": "UserKnownHostsFile none\n",
    "dev-null": "UserKnownHostsFile /dev/null\n",
    "missing": (
        "UserKnownHostsFile ~/.ssh/known_hosts.d/%k\nGlobalKnownHostsFile /nonexistent/ssh_known_hosts\n"
    ),
}


@pytest.mark.parametrize("case", list(NO_REAL_FILE))
async def test_a_config_naming_no_real_known_hosts_file_falls_back_to_the_user_known_hosts(
    ssh_server: SshServer, home: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _write_config(home, NO_REAL_FILE[case], ssh_server)
    (home / ".ssh" / "known_hosts").write_text(_pinned(ssh_server))
    caplog.set_level(logging.WARNING, logger="dsh_bash.ssh")
    # Before the fix: "none" logged in unverified and said nothing, "/dev/null" refused the pinned
    # key, the missing files failed as "cannot reach SSH host" (FileNotFoundError).
    await _runs(ssh_server)
    warned = _warnings(caplog)
    assert f"{config}:1" in warned, warned
    assert str(home / ".ssh" / "known_hosts") in warned, warned


@pytest.mark.parametrize("value", ["no", "off", "accept-new"])
async def test_strict_host_key_checking_off_never_accepts_an_unknown_key(
    ssh_server: SshServer, home: Path, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _write_config(home, f"Host {{host}}\n  StrictHostKeyChecking {value}\n", ssh_server)
    caplog.set_level(logging.WARNING, logger="dsh_bash.ssh")
    error = await _refused(ssh_server)
    # asyncssh never read StrictHostKeyChecking, so the key was refused before the fix too, but
    # neither the error nor a warning said the config's setting was not honoured.
    assert error.reason == "host_key_rejected", error
    setting = f"StrictHostKeyChecking {value}"
    assert f"{config}:2" in str(error) and setting in str(error), error
    assert f"{config}:2" in _warnings(caplog) and setting in _warnings(caplog)
    assert not (home / ".ssh" / "known_hosts").exists(), "accept-new learned the key"


def _jump_config(home: Path, server: SshServer, jump: SshServer, jump_extra: str = "") -> None:
    _write_config(
        home,
        "Host jump\n"
        "  HostName 127.0.0.1\n"
        f"  Port {jump.port}\n"
        f"  User {TEST_USER}\n"
        f"  IdentityFile {jump.user_key}\n"
        f"{jump_extra}"
        "Host {host}\n"
        "  ProxyJump jump\n",
        server,
    )


def _jump_logins(jump: SshServer) -> int:
    return (jump.directory / "sshd.log").read_text().count(f"Accepted publickey for {TEST_USER}")


async def test_an_explicit_known_hosts_verifies_the_jump_hosts_too(
    ssh_server: SshServer, jump_server: SshServer, home: Path, tmp_path: Path
) -> None:
    _jump_config(home, ssh_server, jump_server, "  UserKnownHostsFile none\n  StrictHostKeyChecking no\n")
    target_only = tmp_path / "target_only"
    target_only.write_text(_pinned(ssh_server))
    # Before the fix asyncssh opened the ProxyJump hop with ~/.ssh/config alone: the jump host's
    # key went unchecked although known_hosts was given.
    error = await _refused(ssh_server, known_hosts=str(target_only))
    assert error.reason == "host_key_rejected", error
    assert f"jump host 127.0.0.1:{jump_server.port}" in str(error), error
    assert str(target_only) in str(error), error
    both = tmp_path / "both"
    both.write_text(_pinned(ssh_server) + _pinned(jump_server))
    before = _jump_logins(jump_server)
    await _runs(ssh_server, known_hosts=str(both))
    assert _jump_logins(jump_server) == before + 1, "the connection did not go through the jump host"


async def test_a_jump_hosts_known_hosts_none_is_not_honoured(
    ssh_server: SshServer, jump_server: SshServer, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _jump_config(home, ssh_server, jump_server, "  UserKnownHostsFile none\n")
    known_hosts = home / ".ssh" / "known_hosts"
    known_hosts.write_text(_pinned(ssh_server))
    caplog.set_level(logging.WARNING, logger="dsh_bash.ssh")
    error = await _refused(ssh_server)  # before the fix: logged in through the unchecked jump host
    assert error.reason == "host_key_rejected", error
    assert f"jump host 127.0.0.1:{jump_server.port}" in str(error), error
    assert f"{home / '.ssh' / 'config'}:6" in _warnings(caplog)
    known_hosts.write_text(_pinned(ssh_server) + _pinned(jump_server))
    await _runs(ssh_server)


async def test_a_good_user_config_still_connects(
    ssh_server: SshServer, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pinned = home / ".ssh" / "pinned_hosts"
    pinned.write_text(_pinned(ssh_server))
    caplog.set_level(logging.WARNING, logger="dsh_bash.ssh")
    good = [
        # The pinned file by a ~ path, strict checking said out loud.
        "Host {host}\n  UserKnownHostsFile ~/.ssh/pinned_hosts\n  StrictHostKeyChecking yes\n",
        # OpenSSH's usual pair, the second absent (before the fix: FileNotFoundError, reported as
        # "cannot reach SSH host").
        "UserKnownHostsFile ~/.ssh/pinned_hosts ~/.ssh/known_hosts2\n",
    ]
    for text in good:
        _write_config(home, text, ssh_server)
        await _runs(ssh_server)
    # No setting at all: ~/.ssh/known_hosts.
    (home / ".ssh" / "config").unlink()
    pinned.rename(home / ".ssh" / "known_hosts")
    await _runs(ssh_server)
    assert "known_hosts" not in _warnings(caplog) and "StrictHostKeyChecking" not in _warnings(caplog)
