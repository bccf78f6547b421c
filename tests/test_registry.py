"""load_executor and the backend registry."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import ConfigError, _registry, load_executor, registered_backends
from dsh_bash.backend import MARKER_VAR


def make_local(**fields: Any) -> LocalBashExecutor:
    """A module:attr factory, as a third party would write one."""
    return LocalBashExecutor(LocalConfig(**fields))


def not_an_executor(**fields: Any) -> object:
    return object()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DSH_BASH_"):
            monkeypatch.delenv(name)


def test_local_is_registered() -> None:
    assert "local" in registered_backends()


def test_the_built_in_names_are_the_distributions_entry_points() -> None:
    # The registry resolves its own backends without the metadata scan; the table must say what
    # pyproject.toml registers, or a renamed factory would load under one path and not the other.
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    registered = pyproject["project"]["entry-points"]["dsh_bash.backends"]
    assert dict(_registry._BUILT_IN_BACKENDS) == registered


def test_a_built_in_name_resolves_without_the_metadata_scan() -> None:
    # Scanning every installed distribution's entry points cost 8 ms of each start among the dev
    # environment's distributions (issue 29): a built-in name must not pay for it. Counted in a fresh
    # interpreter, the scan wrapped before dsh_bash is imported (pydantic's own scan is another group).
    probe = (
        "import importlib.metadata as md\n"
        "calls = []\n"
        "real = md.entry_points\n"
        "def counted(**params):\n"
        "    calls.append(params.get('group'))\n"
        "    return real(**params)\n"
        "md.entry_points = counted\n"
        "import dsh_bash\n"
        "dsh_bash.load_executor({'backend': 'local'})\n"
        "dsh_bash._registry.backend_factory('ssh')\n"
        "dsh_bash._registry.backend_factory('docker')\n"
        "print(calls.count(dsh_bash.ENTRY_POINT_GROUP))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0", out.stdout + out.stderr


def test_a_built_in_backend_without_its_extra_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = {**_registry._BUILT_IN_BACKENDS, "docker": "dsh_bash_no_such_module:Executor.from_fields"}
    monkeypatch.setattr(_registry, "_BUILT_IN_BACKENDS", table)
    with pytest.raises(
        ConfigError, match=r"backend 'docker' cannot be loaded .*pip install 'dsh-bash\[docker\]'"
    ):
        load_executor({"backend": "docker"})


def test_mapping_source_builds_the_named_backend() -> None:
    executor = load_executor({"backend": "local", "max_output_bytes": 123, "cwd": "/tmp"})
    assert isinstance(executor, LocalBashExecutor)
    assert executor.config.max_output_bytes == 123
    assert executor.config.cwd == "/tmp"


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "exec.toml"
    path.write_text('backend = "local"\ntimeout_ms = 5000\nenv_allow = ["GH_TOKEN"]\n')
    executor = load_executor(path)
    assert executor.config.timeout_ms == 5000
    assert executor.config.env_allow == ("GH_TOKEN",)


def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "exec.yaml"
    path.write_text("backend: local\ngrace_ms: 250\n")
    assert load_executor(str(path)).config.grace_ms == 250


def test_environment_over_file_and_overrides_over_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "exec.toml"
    path.write_text('backend = "local"\nmax_output_bytes = 100\ngrace_ms = 100\n')
    monkeypatch.setenv("DSH_BASH_MAX_OUTPUT_BYTES", "200")
    monkeypatch.setenv("DSH_BASH_GRACE_MS", "300")
    monkeypatch.setenv("DSH_BASH_ENV_SCRUB", '["*X*"]')
    executor = load_executor(path, grace_ms=400)
    assert executor.config.max_output_bytes == 200
    assert executor.config.grace_ms == 400
    assert executor.config.env_scrub == ("*X*",)


def test_the_command_marker_is_not_a_config_field(monkeypatch: pytest.MonkeyPatch) -> None:
    # dsh-bash run inside a dsh-bash command sees the marker; it must not break loading.
    monkeypatch.setenv(MARKER_VAR, "abc-1")
    assert isinstance(load_executor({"backend": "local"}), LocalBashExecutor)


def test_module_attr_backend() -> None:
    executor = load_executor({"backend": f"{__name__}:make_local", "max_output_bytes": 7})
    assert isinstance(executor, LocalBashExecutor)
    assert executor.config.max_output_bytes == 7


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({}, "backend"),
        ({"executor": {"backend": "local"}}, "found in the table 'executor': the fields go at the top level"),
        ({"backend": "nope"}, "'nope' is not registered"),
        ({"backend": "docker"}, "exactly one of 'image'"),
        ({"backend": "docker", "container": "c", "network": "bridge"}, "network only apply"),
        ({"backend": "ssh"}, "host: Field required"),
        ({"backend": "ssh", "host": "h", "client_keys": ["k"]}, "known_hosts is required"),
        ({"backend": "no_such_module:x"}, "cannot import 'no_such_module'"),
        ({"backend": f"{__name__}:missing"}, "has no attribute"),
        ({"backend": f"{__name__}:not_an_executor"}, "not a BashExecutor"),
        ({"backend": "local", "max_output_bytes": 0}, "max_output_bytes"),
        ({"backend": "local", "timeout_ms": "soon"}, "timeout_ms"),
        ({"backend": "local", "no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_sources_name_the_problem(source: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_executor(source)
    assert expected in str(info.value)


def test_bad_file_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_executor(missing)
    broken = tmp_path / "broken.toml"
    broken.write_text("backend = \n")
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        load_executor(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml.*top level"):
        load_executor(listing)
    other = tmp_path / "conf.ini"
    other.write_text("x")
    with pytest.raises(ConfigError, match=r"conf\.ini.*unknown config format"):
        load_executor(other)
    bad_value = tmp_path / "bad.toml"
    bad_value.write_text('backend = "local"\ngrace_ms = -5\n')
    with pytest.raises(ConfigError, match=r"bad\.toml.*grace_ms"):
        load_executor(bad_value)


def test_a_bad_environment_override_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSH_BASH_GRACE_MS", "-1")
    with pytest.raises(ConfigError, match="grace_ms"):
        load_executor({"backend": "local"})
    monkeypatch.delenv("DSH_BASH_GRACE_MS")
    monkeypatch.setenv("DSH_BASH_TYPO", "1")
    with pytest.raises(ConfigError, match="DSH_BASH_TYPO"):
        load_executor({"backend": "local"})
