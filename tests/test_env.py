"""Unit tests for the environment policy: scrub, allow, the model-friendly set, explicit env."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from dsh_bash import DEFAULT_ENV_SCRUB
from dsh_bash._env import build_command_env
from dsh_bash.backend import (
    MODEL_FRIENDLY_ENV,
    is_scrubbed,
)

EXPECTED_MODEL_FRIENDLY = {
    "NO_COLOR": "1",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "MANPAGER": "cat",
    "GIT_EDITOR": "true",
    "GIT_TERMINAL_PROMPT": "0",
    "DEBIAN_FRONTEND": "noninteractive",
    "PYTHONUNBUFFERED": "1",
}

# One name per default pattern, in pattern order.
SCRUBBED_BY_DEFAULT = [
    "MY_API_KEY",
    "SOME_SECRET_X",
    "GH_TOKEN",
    "DB_PASSWORD",
    "X_PASSWD",
    "AWS_CREDENTIALS",
    "DSH_FOO",
]
KEPT_BY_DEFAULT = ["HOME", "PATH", "USER", "LANG", "PWD", "SHELL", "DSHFOO", "X_DSH_FOO"]


def build(ambient: dict[str, str], **kwargs: object) -> dict[str, str]:
    kwargs.setdefault("scrub", DEFAULT_ENV_SCRUB)
    return build_command_env(ambient, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", SCRUBBED_BY_DEFAULT)
def test_each_default_pattern_scrubs_its_name(name: str) -> None:
    assert is_scrubbed(name, DEFAULT_ENV_SCRUB)
    env = build({name: "s3cr3t", "HOME": "/home/u"})
    assert name not in env
    assert env["HOME"] == "/home/u"
    assert "s3cr3t" not in env.values()


def test_every_default_pattern_is_exercised() -> None:
    # Each name is scrubbed by exactly the pattern at its index and by no other default.
    for pattern, name in zip(DEFAULT_ENV_SCRUB, SCRUBBED_BY_DEFAULT, strict=True):
        matching = [other for other in DEFAULT_ENV_SCRUB if is_scrubbed(name, [other])]
        assert matching == [pattern], (name, matching)


@pytest.mark.parametrize(
    "name", ["my_secret_thing", "gh_token", "Db_Password", "x_passwd", "aws_credential", "dsh_foo", "api_Key"]
)
def test_scrub_is_case_insensitive(name: str) -> None:
    assert is_scrubbed(name, DEFAULT_ENV_SCRUB)
    assert name not in build({name: "v"})


@pytest.mark.parametrize("name", KEPT_BY_DEFAULT)
def test_non_matching_names_pass(name: str) -> None:
    assert not is_scrubbed(name, DEFAULT_ENV_SCRUB)
    assert build({name: "value"})[name] == "value"


def test_ambient_values_pass_through_unchanged() -> None:
    ambient = {"HOME": "/home/u", "PATH": "/usr/bin:/bin", "EMPTY": "", "SPACES": " a b "}
    env = build(ambient)
    for name, value in ambient.items():
        assert env[name] == value


def test_env_allow_readmits_a_scrubbed_name() -> None:
    ambient = {"GH_TOKEN": "t", "NPM_TOKEN": "n"}
    assert not is_scrubbed("GH_TOKEN", DEFAULT_ENV_SCRUB, ["GH_TOKEN"])
    assert is_scrubbed("NPM_TOKEN", DEFAULT_ENV_SCRUB, ["GH_TOKEN"])
    env = build(ambient, allow=["GH_TOKEN"])
    assert env["GH_TOKEN"] == "t"
    assert "NPM_TOKEN" not in env


def test_env_allow_accepts_globs() -> None:
    env = build({"SSH_AUTH_SOCK_KEY": "a", "SSH_KEY_PATH": "b", "API_KEY": "c"}, allow=["SSH_*"])
    assert env["SSH_AUTH_SOCK_KEY"] == "a"
    assert env["SSH_KEY_PATH"] == "b"
    assert "API_KEY" not in env


def test_env_allow_does_not_admit_names_that_were_never_ambient() -> None:
    env = build({}, allow=["GH_TOKEN"])
    assert "GH_TOKEN" not in env


def test_custom_scrub_replaces_the_defaults() -> None:
    ambient = {"MY_API_KEY": "k", "GH_TOKEN": "t", "FOOBAR": "f", "foo_x": "g", "HOME": "/h"}
    assert is_scrubbed("FOOBAR", ["FOO*"])
    assert not is_scrubbed("MY_API_KEY", ["FOO*"])
    env = build(ambient, scrub=["FOO*"])
    assert env["MY_API_KEY"] == "k"
    assert env["GH_TOKEN"] == "t"
    assert env["HOME"] == "/h"
    assert "FOOBAR" not in env
    assert "foo_x" not in env


def test_empty_scrub_keeps_everything() -> None:
    ambient = {"MY_API_KEY": "k", "DSH_X": "d"}
    assert not is_scrubbed("MY_API_KEY", [])
    env = build(ambient, scrub=[])
    assert env["MY_API_KEY"] == "k"
    assert env["DSH_X"] == "d"


def test_scrub_pattern_is_a_whole_name_glob_not_a_substring() -> None:
    assert is_scrubbed("DSH_FOO", ["DSH_*"])
    assert not is_scrubbed("X_DSH_FOO", ["DSH_*"])
    assert not is_scrubbed("TOKENS_X", ["TOKEN"])
    assert is_scrubbed("TOKEN", ["TOKEN"])


def test_scrub_accepts_a_generator_of_patterns() -> None:
    env = build({"A_KEY": "1", "B": "2"}, scrub=(pattern for pattern in ["*KEY*"]))
    assert env == {"B": "2", **EXPECTED_MODEL_FRIENDLY}


def test_model_friendly_set_is_exactly_the_contract_set() -> None:
    assert dict(MODEL_FRIENDLY_ENV) == EXPECTED_MODEL_FRIENDLY
    assert build({}) == EXPECTED_MODEL_FRIENDLY


def test_model_friendly_set_overrides_ambient() -> None:
    env = build({"TERM": "xterm-256color", "PAGER": "less", "NO_COLOR": "", "GIT_EDITOR": "vim"})
    assert env["TERM"] == "dumb"
    assert env["PAGER"] == "cat"
    assert env["NO_COLOR"] == "1"
    assert env["GIT_EDITOR"] == "true"


def test_explicit_env_wins_over_ambient_and_model_friendly_set() -> None:
    env = build(
        {"TERM": "vt100", "HOME": "/ambient"},
        explicit={"TERM": "xterm", "HOME": "/explicit", "NEW": "n"},
    )
    assert env["TERM"] == "xterm"
    assert env["HOME"] == "/explicit"
    assert env["NEW"] == "n"


def test_explicit_env_is_not_scrubbed() -> None:
    env = build({"MY_TOKEN": "ambient"}, explicit={"MY_TOKEN": "given", "DSH_MARK": "m"})
    assert env["MY_TOKEN"] == "given"
    assert env["DSH_MARK"] == "m"


@pytest.mark.parametrize("name", ["BASH_ENV", "ENV"])
def test_ambient_rc_file_variables_are_dropped(name: str) -> None:
    env = build({name: "/home/u/.bashrc", "HOME": "/home/u"}, scrub=[])
    assert name not in env
    assert env["HOME"] == "/home/u"


@pytest.mark.parametrize("name", ["BASH_ENV", "ENV"])
def test_ambient_rc_file_variables_are_dropped_even_when_allowed(name: str) -> None:
    assert name not in build({name: "/rc"}, allow=["*"])


@pytest.mark.parametrize("name", ["BASH_ENV", "ENV"])
def test_explicit_rc_file_variables_are_kept(name: str) -> None:
    env = build({name: "/ambient_rc"}, explicit={name: "/explicit_rc"})
    assert env[name] == "/explicit_rc"


def test_rc_variable_lookalikes_pass() -> None:
    env = build({"BASH_ENVIRONMENT": "a", "ENVIRONMENT": "b", "env": "c"}, scrub=[])
    assert env["BASH_ENVIRONMENT"] == "a"
    assert env["ENVIRONMENT"] == "b"
    assert env["env"] == "c"


def test_inputs_are_not_mutated() -> None:
    ambient = {"MY_API_KEY": "k", "TERM": "xterm", "BASH_ENV": "/rc", "HOME": "/h"}
    explicit = {"TERM": "vt100", "X": "1"}
    ambient_copy, explicit_copy = dict(ambient), dict(explicit)
    env = build(ambient, explicit=explicit)
    assert ambient == ambient_copy
    assert explicit == explicit_copy
    assert env is not ambient
    assert env is not explicit
    env["NEW"] = "1"
    assert "NEW" not in ambient


def test_model_friendly_set_is_not_mutated_by_building() -> None:
    build({"TERM": "xterm"}, explicit={"TERM": "vt100", "NEW": "1"})
    assert dict(MODEL_FRIENDLY_ENV) == EXPECTED_MODEL_FRIENDLY


def test_read_only_mappings_are_accepted() -> None:
    env = build(MappingProxyType({"HOME": "/h"}), explicit=MappingProxyType({"X": "1"}))  # type: ignore[arg-type]
    assert env["HOME"] == "/h"
    assert env["X"] == "1"


def test_empty_explicit_env_changes_nothing() -> None:
    assert build({"HOME": "/h"}, explicit={}) == build({"HOME": "/h"}, explicit=None)


def test_changes_to_os_environ_are_seen_by_the_next_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # The base built from os.environ is reused while os.environ is unchanged: every kind of change
    # (a new value, a new name, a removed name, a scrubbed one) must show in the next build.
    import os  # noqa: PLC0415

    monkeypatch.setenv("VISIBLE_FOR_TEST", "one")
    first = build_command_env(os.environ, scrub=DEFAULT_ENV_SCRUB)
    assert first["VISIBLE_FOR_TEST"] == "one"
    first["VISIBLE_FOR_TEST"] = "mutated by the caller"
    assert build_command_env(os.environ, scrub=DEFAULT_ENV_SCRUB)["VISIBLE_FOR_TEST"] == "one"
    monkeypatch.setenv("VISIBLE_FOR_TEST", "two")
    assert build_command_env(os.environ, scrub=DEFAULT_ENV_SCRUB)["VISIBLE_FOR_TEST"] == "two"
    monkeypatch.setenv("ADDED_FOR_TEST", "x")
    monkeypatch.setenv("FOR_TEST_API_KEY", "secret")
    built = build_command_env(os.environ, scrub=DEFAULT_ENV_SCRUB)
    assert built["ADDED_FOR_TEST"] == "x" and "FOR_TEST_API_KEY" not in built
    monkeypatch.delenv("VISIBLE_FOR_TEST")
    assert "VISIBLE_FOR_TEST" not in build_command_env(os.environ, scrub=DEFAULT_ENV_SCRUB)
    assert build_command_env(os.environ, scrub=())["FOR_TEST_API_KEY"] == "secret"
