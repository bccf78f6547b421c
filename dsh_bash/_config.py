"""Budgets and environment policy fields that every backend's config carries."""

from __future__ import annotations

import math
import resource
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

# BaseModel's metaclass, whose public name pydantic does not give: subclassed below, never called.
from pydantic._internal._model_construction import ModelMetaclass

from ._errors import ConfigError
from ._policy import SandboxPolicy

__all__ = ["DEFAULT_ENV_SCRUB", "BudgetConfig", "config_error_from"]

DEFAULT_ENV_SCRUB: tuple[str, ...] = (
    "*KEY*",
    "*SECRET*",
    "*TOKEN*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "DSH_*",
)

# The fields that ``reconfigure`` may change on an open executor.
BUDGET_FIELDS: frozenset[str] = frozenset(
    {
        "timeout_ms",
        "max_timeout_ms",
        "max_output_bytes",
        "max_spill_bytes",
        "max_spill_total_bytes",
        "grace_ms",
        "env_scrub",
        "env_allow",
        "max_running_tasks",
        "max_file_bytes",
    }
)


#: Descriptors a running task may hold in the harness (pipes, a status socket, a pidfd, spill files),
#: and those kept for everything else, when the task cap is derived from the descriptor limit.
_FDS_PER_TASK = 8
_FDS_RESERVED = 128
#: The derived cap never exceeds this, whatever the descriptor limit.
_TASK_CAP_CEILING = 4096


def default_task_cap() -> int:
    """The default ``max_running_tasks``: what this process's descriptor limit leaves room for
    (``(RLIMIT_NOFILE - 128) // 8``, at least 16, at most 4096)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _TASK_CAP_CEILING
    return max(16, min(_TASK_CAP_CEILING, (soft - _FDS_RESERVED) // _FDS_PER_TASK))


class _RaisesConfigError(ModelMetaclass):
    """Construction (``LocalConfig(grace_ms=0)``) raises :class:`ConfigError` naming the field
    (R-config-budgets), never pydantic's own error. By the metaclass, not ``__init__``: pydantic runs
    a custom ``__init__`` inside ``model_validate`` too, and would wrap the ConfigError in its own."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            raise config_error_from(exc, cls.__name__) from None


class BudgetConfig(BaseModel, metaclass=_RaisesConfigError):
    """Shared budgets (all positive and finite; ``timeout_ms <= max_timeout_ms``) and env policy.

    A bad value raises :class:`ConfigError` naming the field, from the constructor as from
    :meth:`with_changes`; ``model_validate`` keeps pydantic's ``ValidationError``."""

    # defer_build (inherited): a config class builds its validator when first used, not at import
    # (a process that runs the local backend never builds BudgetConfig's or HostConfig's own).
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    timeout_ms: float = 120_000
    max_timeout_ms: float = 600_000
    max_output_bytes: int = 64_000
    max_spill_bytes: int = 64 * 1024 * 1024
    max_spill_total_bytes: int = 1024 * 1024 * 1024
    grace_ms: float = 3_000
    #: Background tasks that may run at once; one more is refused (reason ``task_limit``). None: derived
    #: from this process's descriptor limit when the executor is made (:func:`default_task_cap`).
    max_running_tasks: int | None = None
    #: The largest file ``read_file`` returns (a larger one is refused, reason ``file_too_large``).
    max_file_bytes: int = 64 * 1024 * 1024
    cwd: str | None = None
    #: What a foreground run's processes still alive when its shell exits become: ``kill``ed before
    #: the result (a `server &`, a fork bomb's last generations: nothing of one command reaches the
    #: next), or ``keep``: left running, holding the output for at most ``grace_ms``, until ``aclose``.
    #: Background tasks keep theirs either way (``kill(id)`` and ``aclose`` end them).
    foreground_leftovers: Literal["kill", "keep"] = "kill"
    env_scrub: tuple[str, ...] = DEFAULT_ENV_SCRUB
    env_allow: tuple[str, ...] = ()
    #: What every command may write and read, and its limits (``docs/design/policy.md``); a request
    #: may narrow it, never widen it. In a config file also ``"unrestricted"`` or ``"workspace-write"``
    #: (the preset: :meth:`SandboxPolicy.workspace_write`). Default: unrestricted, no step runs.
    policy: SandboxPolicy = SandboxPolicy()

    @field_validator(
        "timeout_ms",
        "max_timeout_ms",
        "max_output_bytes",
        "max_spill_bytes",
        "max_spill_total_bytes",
        "grace_ms",
        "max_file_bytes",
        mode="before",
    )
    @classmethod
    def _positive_finite(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a positive finite number, got {value!r}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite or value <= 0:
            raise ValueError(f"must be a positive finite number, got {value!r}")
        return value

    @field_validator("max_running_tasks", mode="before")
    @classmethod
    def _task_cap(cls, value: object) -> object:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"must be a positive whole number (or null for the default), got {value!r}")
        return value

    @field_validator("env_scrub", "env_allow", mode="before")
    @classmethod
    def _patterns(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError("must be a list of glob patterns, not a single string")
        return value

    @field_validator("policy", mode="before")
    @classmethod
    def _policy(cls, value: object) -> object:
        if value == "unrestricted":
            return SandboxPolicy()
        if value == "workspace-write":
            return SandboxPolicy.workspace_write()
        if isinstance(value, str):
            raise ValueError(f"{value!r} is not a preset: 'unrestricted', 'workspace-write' or a table")
        if isinstance(value, dict) and value.get("preset") is not None:
            fields = {name: item for name, item in value.items() if name != "preset"}
            if value["preset"] == "workspace-write":
                return SandboxPolicy.workspace_write(**fields)
            if value["preset"] == "unrestricted":
                return SandboxPolicy.model_validate(fields)
            raise ValueError(f"preset {value['preset']!r}: 'unrestricted' or 'workspace-write'")
        return value

    @field_validator("cwd", mode="after")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("must not contain a NUL character")
        return value

    @model_validator(mode="after")
    def _timeout_within_max(self) -> Self:
        if self.timeout_ms > self.max_timeout_ms:
            raise ValueError(
                f"timeout_ms ({self.timeout_ms:g}) must not exceed max_timeout_ms ({self.max_timeout_ms:g})"
            )
        return self

    def with_changes(self, **fields: Any) -> Self:
        """A validated copy with ``fields`` replaced; raises :class:`ConfigError` naming the field."""
        unknown = sorted(set(fields) - set(type(self).model_fields))
        if unknown:
            raise ConfigError(f"{type(self).__name__}: unknown field(s) {', '.join(unknown)}")
        try:
            return type(self).model_validate({**self.model_dump(), **fields})
        except ValidationError as exc:
            raise config_error_from(exc, type(self).__name__) from None


def config_error_from(exc: ValidationError, where: str) -> ConfigError:
    """Turn pydantic's error into one :class:`ConfigError` that names each bad field and why."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(config)"
        problems.append(f"{field}: {error['msg']}")
    return ConfigError(f"{where}: " + "; ".join(problems))
