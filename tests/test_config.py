"""Unit tests for BudgetConfig: defaults, validation of every budget, and with_changes."""

from __future__ import annotations

import contextlib
import math

import pytest
from dsh_bash_docker import DockerConfig
from dsh_bash_local import LocalConfig
from dsh_bash_ssh import SshConfig
from pydantic import ValidationError

from dsh_bash import DEFAULT_ENV_SCRUB, BudgetConfig, ConfigError

BUDGETS = [
    "timeout_ms",
    "max_timeout_ms",
    "max_output_bytes",
    "max_spill_bytes",
    "max_spill_total_bytes",
    "grace_ms",
]
BAD_BUDGET_VALUES = [0, 0.0, -1, -1.5, math.inf, -math.inf, math.nan, True, False, "100", None]

MIB = 1024 * 1024


def test_defaults_match_contract() -> None:
    config = BudgetConfig()
    assert config.timeout_ms == 120_000
    assert config.max_timeout_ms == 600_000
    assert config.max_output_bytes == 64_000
    assert config.max_spill_bytes == 64 * MIB
    assert config.max_spill_total_bytes == 1024 * MIB
    assert config.grace_ms == 3_000
    assert config.cwd is None
    assert config.env_allow == ()


def test_default_env_scrub_patterns_match_contract() -> None:
    expected = {"*KEY*", "*SECRET*", "*TOKEN*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*", "DSH_*"}
    assert set(BudgetConfig().env_scrub) == expected
    assert len(BudgetConfig().env_scrub) == len(expected)
    assert set(DEFAULT_ENV_SCRUB) == expected


#: Every backend's config class, with what it needs besides the budgets (R-config-budgets holds for all).
CONFIG_CLASSES: list[tuple[type[BudgetConfig], dict[str, object]]] = [
    (BudgetConfig, {}),
    (LocalConfig, {}),
    (DockerConfig, {"image": "debian"}),
    (SshConfig, {"host": "example.org"}),
]


@pytest.mark.parametrize(
    ("config_class", "required"), CONFIG_CLASSES, ids=lambda c: getattr(c, "__name__", "")
)
@pytest.mark.parametrize("field", BUDGETS)
@pytest.mark.parametrize("value", BAD_BUDGET_VALUES, ids=repr)
def test_budget_that_is_not_a_positive_finite_number_is_refused_naming_field(
    config_class: type[BudgetConfig], required: dict[str, object], field: str, value: object
) -> None:
    """A ConfigError (the contract's), never pydantic's ValidationError (issue 29: the backends'
    config classes raised that)."""
    with pytest.raises(ConfigError) as exc_info:
        config_class(**required, **{field: value})
    assert not isinstance(exc_info.value, ValidationError)
    assert str(exc_info.value).startswith(f"{config_class.__name__}: {field}: ")


@pytest.mark.parametrize("field", BUDGETS)
@pytest.mark.parametrize("value", BAD_BUDGET_VALUES, ids=repr)
def test_with_changes_refuses_bad_budget_with_config_error_naming_field(field: str, value: object) -> None:
    config = BudgetConfig()
    before = config.model_dump()
    with pytest.raises(ConfigError, match=field):
        config.with_changes(**{field: value})
    assert config.model_dump() == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_ms", 1),
        ("timeout_ms", 0.5),
        ("max_timeout_ms", 600_000.5),
        ("max_output_bytes", 1),
        ("max_spill_bytes", 1),
        ("max_spill_total_bytes", 10**12),
        ("grace_ms", 0.001),
    ],
)
def test_positive_finite_budget_is_accepted(field: str, value: float) -> None:
    assert getattr(BudgetConfig(**{field: value}), field) == value
    assert getattr(BudgetConfig().with_changes(**{field: value}), field) == value


def test_timeout_above_max_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_ms"):
        BudgetConfig(timeout_ms=1_001, max_timeout_ms=1_000)


def test_lowering_max_timeout_below_default_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="max_timeout_ms"):
        BudgetConfig(max_timeout_ms=1_000)


def test_timeout_equal_to_max_timeout_is_accepted() -> None:
    config = BudgetConfig(timeout_ms=1_000, max_timeout_ms=1_000)
    assert config.timeout_ms == config.max_timeout_ms == 1_000


def test_with_changes_refuses_timeout_above_max_timeout_naming_it() -> None:
    config = BudgetConfig()
    with pytest.raises(ConfigError, match="timeout_ms"):
        config.with_changes(timeout_ms=600_001)
    with pytest.raises(ConfigError, match="max_timeout_ms"):
        config.with_changes(max_timeout_ms=119_999)
    assert config.timeout_ms == 120_000
    assert config.max_timeout_ms == 600_000


def test_with_changes_returns_validated_copy_and_leaves_original_unchanged() -> None:
    config = BudgetConfig()
    changed = config.with_changes(timeout_ms=5_000, max_output_bytes=10, env_allow=["GH_TOKEN"])
    assert changed is not config
    assert isinstance(changed, BudgetConfig)
    assert changed.timeout_ms == 5_000
    assert changed.max_output_bytes == 10
    assert changed.env_allow == ("GH_TOKEN",)
    assert changed.max_timeout_ms == config.max_timeout_ms
    assert changed.env_scrub == config.env_scrub
    assert config == BudgetConfig()


def test_with_changes_can_move_timeout_and_max_together() -> None:
    changed = BudgetConfig().with_changes(timeout_ms=900_000, max_timeout_ms=1_000_000)
    assert (changed.timeout_ms, changed.max_timeout_ms) == (900_000, 1_000_000)


def test_with_changes_without_fields_returns_equal_copy() -> None:
    config = BudgetConfig(grace_ms=10)
    assert config.with_changes() == config


@pytest.mark.parametrize("unknown", ["timeout", "max_output", "image"])
def test_with_changes_refuses_unknown_field_naming_it(unknown: str) -> None:
    config = BudgetConfig()
    with pytest.raises(ConfigError, match=unknown):
        config.with_changes(**{unknown: 1})
    assert config == BudgetConfig()


def test_with_changes_names_every_bad_field() -> None:
    with pytest.raises(ConfigError) as exc_info:
        BudgetConfig().with_changes(grace_ms=0, max_spill_bytes=-1)
    message = str(exc_info.value)
    assert "grace_ms" in message
    assert "max_spill_bytes" in message


def test_config_is_frozen() -> None:
    config = BudgetConfig()
    with pytest.raises(ValidationError):
        config.timeout_ms = 1  # type: ignore[misc]
    assert config.timeout_ms == 120_000


def test_unknown_constructor_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_output"):
        BudgetConfig(max_output=5)  # type: ignore[call-arg]


@pytest.mark.parametrize("field", ["env_scrub", "env_allow"])
def test_pattern_list_given_as_plain_string_is_refused_naming_field(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BudgetConfig(**{field: "*KEY*"})
    with pytest.raises(ConfigError, match=field):
        BudgetConfig().with_changes(**{field: "*KEY*"})


def test_setting_env_scrub_replaces_the_defaults() -> None:
    config = BudgetConfig(env_scrub=["FOO_*"])
    assert config.env_scrub == ("FOO_*",)


def test_empty_env_scrub_is_allowed() -> None:
    assert BudgetConfig(env_scrub=[]).env_scrub == ()


def test_cwd_with_nul_is_refused_naming_cwd() -> None:
    with pytest.raises(ConfigError, match="cwd"):
        BudgetConfig(cwd="/tmp\x00x")


def test_cwd_is_kept() -> None:
    assert BudgetConfig(cwd="/srv/app").cwd == "/srv/app"


@pytest.mark.parametrize("field", BUDGETS)
def test_with_changes_lets_only_config_error_escape_for_a_huge_int(field: str) -> None:
    config = BudgetConfig()
    with contextlib.suppress(ConfigError):  # accepting the value would be fine too
        config.with_changes(**{field: 10**400})


def test_max_running_tasks_must_be_a_positive_whole_number() -> None:
    from dsh_bash import BudgetConfig, ConfigError  # noqa: PLC0415

    assert BudgetConfig().max_running_tasks is None
    assert BudgetConfig(max_running_tasks=3).max_running_tasks == 3
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(ConfigError, match="max_running_tasks"):
            BudgetConfig().with_changes(max_running_tasks=bad)


def test_default_task_cap_follows_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource  # noqa: PLC0415

    from dsh_bash import default_task_cap  # noqa: PLC0415

    for soft, cap in ((1024, 112), (256, 16), (65536, 4096), (resource.RLIM_INFINITY, 4096), (4224, 512)):
        monkeypatch.setattr(resource, "getrlimit", lambda _which, soft=soft: (soft, resource.RLIM_INFINITY))
        assert default_task_cap() == cap, soft
