"""Configuration of the SSH backend."""

from __future__ import annotations

import getpass
from typing import Self

from pydantic import Field, field_validator, model_validator

from dsh_bash import BudgetConfig
from dsh_bash.backend import ContainmentSetting

__all__ = ["SshConfig"]


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "root"


class SshConfig(BudgetConfig):
    """Where and how to log in. Host keys are verified; nothing is read from ``~/.ssh`` unless asked.

    ``cwd`` defaults to the login's home directory (learned when the executor connects).
    """

    host: str
    port: int = 22
    username: str = Field(default_factory=_current_user)
    #: Private key files to authenticate with.
    client_keys: list[str] | None = None
    #: An ssh-agent socket to authenticate with (besides ``client_keys``).
    agent_path: str | None = None
    #: A known_hosts file that pins the host's key (and the keys of jump hosts ``~/.ssh/config``
    #: gives). Required unless ``use_user_ssh_config`` (then the known_hosts files ``~/.ssh/config``
    #: names, when readable, else ``~/.ssh/known_hosts``) or ``insecure_skip_host_key_check``.
    known_hosts: str | None = None
    #: Accept any host key (jump hosts' too): open to a man in the middle. Logged as a warning at
    #: every connect. Nothing else turns host-key checking off, ``~/.ssh/config`` included.
    insecure_skip_host_key_check: bool = False
    connect_timeout_ms: float = 10_000
    keepalive_interval_ms: float = 15_000
    #: Channels open at once on the connection (commands, spill writers, plus one kept for kills).
    max_channels: int = 8
    #: Keep one channel logged in ahead of the next command (a login shell waiting on the host):
    #: commands then skip opening a channel and the login shell's start. Holds one of the
    #: ``max_channels`` (given up to whoever needs it) and one idle shell process on the host.
    warm_channel: bool = True
    #: When the server offers no SFTP subsystem, run the host's ``sftp-server`` program over an
    #: exec channel instead (looked for at the usual paths and on PATH), so that background tasks
    #: still detach and dsh-supervise can still be installed. ``False``: never.
    exec_sftp_server: bool = True
    #: Use ``~/.ssh/config``, ``~/.ssh/known_hosts``, default keys and ``SSH_AUTH_SOCK``; never to
    #: turn host-key checking off (``UserKnownHostsFile none``, ``StrictHostKeyChecking no``: overruled
    #: with a warning; see the backend's README, "Host keys and ``~/.ssh/config``").
    use_user_ssh_config: bool = False
    #: ``auto``: commands (foreground ones and detached background tasks) under dsh-supervise (put
    #: into ``~/.cache/dsh-bash`` on the host at open) when it runs there, else the environment
    #: marker (said in a warning at open); ``subreaper``: refuse to open without it; ``marker``:
    #: never use it.
    containment: ContainmentSetting = "auto"

    @field_validator("port")
    @classmethod
    def _port(cls, value: int) -> int:
        if not 0 < value < 65536:
            raise ValueError("must be between 1 and 65535")
        return value

    @field_validator("max_channels")
    @classmethod
    def _channels(cls, value: int) -> int:
        if not 2 <= value <= 64:
            raise ValueError("must be between 2 and 64 (one channel is reserved for kills)")
        return value

    @field_validator("connect_timeout_ms", "keepalive_interval_ms")
    @classmethod
    def _positive(cls, value: float) -> float:
        if isinstance(value, bool) or not value > 0 or value == float("inf"):
            raise ValueError("must be a positive finite number")
        return value

    @model_validator(mode="after")
    def _trust(self) -> Self:
        if (
            self.known_hosts is None
            and not self.insecure_skip_host_key_check
            and not self.use_user_ssh_config
        ):
            raise ValueError(
                "known_hosts is required to verify the host key (or set use_user_ssh_config=True to use "
                "~/.ssh/known_hosts, or insecure_skip_host_key_check=True to skip verification)"
            )
        if self.known_hosts is not None and self.insecure_skip_host_key_check:
            raise ValueError("known_hosts and insecure_skip_host_key_check=True contradict each other")
        if not self.client_keys and self.agent_path is None and not self.use_user_ssh_config:
            raise ValueError(
                "no way to authenticate: give client_keys, agent_path, or use_user_ssh_config=True"
            )
        return self
