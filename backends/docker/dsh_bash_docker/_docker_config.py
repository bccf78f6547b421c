"""Configuration of the Docker backend."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from dsh_bash import BudgetConfig
from dsh_bash.backend import ContainmentSetting, Dialer

__all__ = ["DockerConfig", "memory_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def memory_bytes(value: str | int) -> int:
    """``mem_limit`` in bytes, as the docker CLI reads it: a number, then b, k, m or g (or kb, mb, gb)."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"must be positive, not {value}")
        return value
    text = value.strip().lower()
    if text[-2:] in ("kb", "mb", "gb"):
        text = text[:-1]
    digits, unit = (text[:-1], text[-1]) if text and text[-1] in "bkmg" else (text, "")
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"{value!r} is not a memory size (a positive number with b, k, m or g: '512m')")
    return int(digits) * _UNITS[unit]


_IMAGE_ONLY = ("environment", "network", "mem_limit", "cpus", "read_only", "labels", "mounts", "cap_add")


class DockerConfig(BudgetConfig):
    """Exactly one of ``image`` (a container made, owned and removed by the executor) or ``container``.

    ``cwd`` defaults to the container's working directory (``/`` when the image sets none).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    image: str | None = None
    container: str | None = None
    #: The engine: ``unix:///path``, ``tcp://host:port`` (TLS when ``tls_*`` below, or
    #: DOCKER_TLS_VERIFY, say so) or ``ssh://user@host[:port]`` (``docker system dial-stdio`` run
    #: on that host over one SSH connection; asyncio only). None: ``DOCKER_HOST`` as the docker CLI
    #: reads it, with ``DOCKER_TLS_VERIFY`` and ``DOCKER_CERT_PATH``, else the local socket.
    docker_host: str | None = None
    #: TLS to a ``tcp://`` engine: the CA that signed the engine's certificate (None: the system's
    #: trust store) and this client's certificate and key (both or neither). Any of them set means
    #: TLS, with the engine's certificate verified; a ``tcp://`` engine without them is plain TCP.
    tls_ca_cert: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    #: Login to an ``ssh://`` engine: private keys (None: asyncssh's defaults, ~/.ssh/id_* and an
    #: agent) and a known_hosts file (None: ~/.ssh/known_hosts). The host key is always checked.
    ssh_client_keys: list[str] | None = None
    ssh_known_hosts: str | None = None
    #: Not for a config file: given by a backend that composes this one (the Ray backend's
    #: ``inner = "docker"`` relays each connection to the engine of the node it chose). Every
    #: connection to the engine is made by it, and the engine is never taken to be on this host.
    engine_dialer: Dialer | None = Field(default=None, exclude=True, repr=False)
    pull: Literal["never", "missing", "always"] = "never"
    user: str | None = None
    #: ``auto``: each command under dsh-supervise (installed into the container at open) when it
    #: runs there, else the environment marker (said in a warning at open); ``subreaper``: refuse to
    #: open without it; ``marker``: never use it.
    containment: ContainmentSetting = "auto"
    #: A command with much output (over 1 MiB) reads the rest straight from its supervisor's pipe,
    #: past the engine's relay, where this process may open it through this host's /proc (the engine
    #: on this host; this process root, or the owner of a rootless engine's user namespace). False:
    #: always the engine's stream.
    direct_output: bool = True
    #: Execs of the supervisor started ahead of the next commands of ``user`` (0: none); a command
    #: that finds one skips the engine's exec create and start. Each is one waiting process in the
    #: container (counted by ``pids_limit``) and one open connection to the engine.
    warm_execs: int = Field(default=2, ge=0, le=16)
    #: Only for an attached container (``container`` mode), on an engine on this host: a directory of
    #: this host that the container has mounted (``docker run -v DIR:/some/path``), where the network
    #: allow-list's proxies put their socket files (image mode mounts one of its own). None: the
    #: allow-list is refused there (``policy_unenforceable``).
    egress_directory: str | None = None
    # Only for a container the executor creates (image mode):
    environment: dict[str, str] = Field(default_factory=dict)
    network: str = "none"
    mem_limit: str | int | None = None
    pids_limit: int | None = 1024
    cpus: float | None = None
    read_only: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    mounts: list[str] = Field(default_factory=list)
    cap_add: list[str] = Field(default_factory=list)

    @field_validator("pids_limit")
    @classmethod
    def _pids(cls, value: int | None) -> int | None:
        if value is not None and value < 16:
            raise ValueError("must be at least 16 (each command needs a few processes, and kills need one)")
        return value

    @field_validator("mem_limit")
    @classmethod
    def _memory(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            memory_bytes(value)  # a ValueError names what is wrong
        return value

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be positive")
        return value

    @model_validator(mode="after")
    def _one_mode(self) -> Self:
        if self.engine_dialer is not None and (
            self.docker_host is not None or self.tls_ca_cert or self.tls_client_cert or self.ssh_client_keys
        ):
            raise ValueError("engine_dialer makes the connections: docker_host, tls_* and ssh_* do not apply")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("give both 'tls_client_cert' and 'tls_client_key', or neither")
        if (self.image is None) == (self.container is None):
            raise ValueError(
                "give exactly one of 'image' (a container is created) or 'container' (an existing one)"
            )
        if self.egress_directory is not None:
            if self.container is None:
                raise ValueError(
                    "egress_directory only applies to an attached container ('container' mode): "
                    "image mode mounts a directory of its own"
                )
            if not self.egress_directory.startswith("/"):
                raise ValueError(f"egress_directory must be an absolute path, not {self.egress_directory!r}")
        if self.container is not None:
            defaults = type(self).model_fields
            changed = [
                name
                for name in _IMAGE_ONLY
                if getattr(self, name) != defaults[name].get_default(call_default_factory=True)
            ]
            if self.pids_limit != defaults["pids_limit"].default:
                changed.append("pids_limit")
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} only apply to a container the executor creates ('image' mode)"
                )
        return self
