"""Configuration of the Docker backend."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from dsh_bash import BudgetConfig
from dsh_bash.backend import ContainmentSetting

__all__ = ["DockerConfig"]

_IMAGE_ONLY = ("environment", "network", "mem_limit", "cpus", "read_only", "labels", "mounts", "cap_add")


class DockerConfig(BudgetConfig):
    """Exactly one of ``image`` (a container made, owned and removed by the executor) or ``container``.

    ``cwd`` defaults to the container's working directory (``/`` when the image sets none).
    """

    image: str | None = None
    container: str | None = None
    docker_host: str | None = None
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

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be positive")
        return value

    @model_validator(mode="after")
    def _one_mode(self) -> Self:
        if (self.image is None) == (self.container is None):
            raise ValueError(
                "give exactly one of 'image' (a container is created) or 'container' (an existing one)"
            )
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
