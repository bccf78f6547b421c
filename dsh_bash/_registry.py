"""Choosing a backend by name: the entry-point registry and ``load_executor``."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ._bash_executor import BashExecutor
from ._config import config_error_from
from ._errors import ConfigError
from ._protocol import MARKER_VAR

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "ENTRY_POINT_GROUP",
    "ExecutorFactory",
    "backend_factory",
    "load_executor",
    "registered_backends",
]

ENTRY_POINT_GROUP = "dsh_bash.backends"
ENV_PREFIX = "DSH_BASH_"

#: A callable taking a backend's config fields as keyword arguments, returning an unopened executor.
ExecutorFactory = Callable[..., BashExecutor]

# Backends this distribution ships behind an extra: naming one without it installed says which.
_EXTRAS = {"docker": "docker", "ssh": "ssh", "ray": "ray"}

#: The backends this distribution ships, as its own entry points name them (pyproject.toml's
#: ``[project.entry-points."dsh_bash.backends"]``; tests/test_registry.py holds the two equal). Their
#: names are reserved and resolved without scanning every installed distribution's metadata: that
#: scan (and importing ``importlib.metadata``) was an eighth of ``dsh-bash run true`` (issue 29).
_BUILT_IN_BACKENDS: Mapping[str, str] = {
    "local": "dsh_bash_local:LocalBashExecutor.from_fields",
    "docker": "dsh_bash_docker:DockerBashExecutor.from_fields",
    "ssh": "dsh_bash_ssh:SshBashExecutor.from_fields",
    "ray": "dsh_bash_ray:ray_executor",
}


def _entry_points() -> list[EntryPoint]:
    from importlib.metadata import entry_points  # noqa: PLC0415 - only third-party names need the scan

    return list(entry_points(group=ENTRY_POINT_GROUP))


def registered_backends() -> list[str]:
    """The built-in names and those registered under the ``dsh_bash.backends`` entry-point group."""
    return sorted(set(_BUILT_IN_BACKENDS) | {ep.name for ep in _entry_points()})


def _import_attr(reference: str, *, name: str | None = None) -> Any:
    module_name, _, attr_path = reference.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"backend {reference!r}: expected 'module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        if name is not None:
            hint = f": pip install 'dsh-bash[{_EXTRAS[name]}]'" if name in _EXTRAS else ""
            raise ConfigError(f"backend {name!r} cannot be loaded ({exc}){hint}") from exc
        raise ConfigError(f"backend {reference!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            missing = f"backend {reference!r}: {module_name} has no attribute {attr_path!r}"
            raise ConfigError(missing) from None
    return obj


def backend_factory(backend: str) -> ExecutorFactory:
    """The factory of a registered backend name, or of a ``module:attr`` reference."""
    if ":" in backend:
        factory = _import_attr(backend)
    elif backend in _BUILT_IN_BACKENDS:
        factory = _import_attr(_BUILT_IN_BACKENDS[backend], name=backend)
    else:
        matches = [ep for ep in _entry_points() if ep.name == backend]
        if not matches:
            known = ", ".join(registered_backends())
            raise ConfigError(
                f"backend {backend!r} is not registered (registered: {known}; or give 'module:attr')"
            )
        try:
            factory = matches[0].load()
        except ImportError as exc:
            raise ConfigError(f"backend {backend!r} cannot be loaded ({exc})") from exc
    if not callable(factory):
        raise ConfigError(f"backend {backend!r} resolves to {factory!r}, which is not callable")
    return factory  # type: ignore[no-any-return]


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from exc
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib  # noqa: PLC0415 - only a file needs it: `dsh-bash run` reads none

            data: Any = tomllib.loads(raw.decode("utf-8"))
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml  # noqa: PLC0415 - optional extra
            except ImportError:
                raise ConfigError(f"{path}: YAML needs PyYAML: pip install 'dsh-bash[yaml]'") from None
            data = yaml.safe_load(raw) or {}
        else:
            raise ConfigError(f"{path}: unknown config format {suffix or '(none)'!r}: use .toml or .yaml")
    except ConfigError:
        raise
    except Exception as exc:  # tomllib, yaml and UTF-8 errors: the message says where
        raise ConfigError(f"{path}: not valid {suffix.lstrip('.').upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of fields, not {type(data).__name__}")
    return data


def _env_value(raw: str) -> Any:
    """An environment override's value: JSON when it parses (numbers, lists, booleans), else the text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def load_executor(source: Mapping[str, Any] | str | os.PathLike[str], /, **overrides: Any) -> BashExecutor:
    """An unopened executor from a mapping or a TOML/YAML file with a ``backend`` key.

    ``DSH_BASH_<FIELD>`` environment variables apply over the source, ``overrides`` over both.
    """
    if isinstance(source, Mapping):
        where = "config"
        fields: dict[str, Any] = dict(source)
    else:
        path = Path(source)
        where = str(path)
        fields = _read_file(path)
    origin = {name: where for name in fields}
    for name, raw in os.environ.items():
        if name.startswith(ENV_PREFIX) and name != MARKER_VAR and len(name) > len(ENV_PREFIX):
            field = name[len(ENV_PREFIX) :].lower()
            fields[field] = _env_value(raw)
            origin[field] = f"environment variable {name}"
    for name, value in overrides.items():
        fields[name] = value
        origin[name] = "override"
    backend = fields.pop("backend", None)
    if not isinstance(backend, str) or not backend:
        nested = [name for name, value in fields.items() if isinstance(value, Mapping) and "backend" in value]
        hint = (
            f" (found in the table {nested[0]!r}: the fields go at the top level of the file, in no table)"
            if backend is None and nested
            else ""
        )
        raise ConfigError(f"{where}: field 'backend': required, a backend name or 'module:attr'{hint}")
    factory = backend_factory(backend)
    try:
        executor = factory(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}{_origins(fields, origin, where)}") from None
    except ValidationError as exc:
        raise config_error_from(exc, where) from None
    except TypeError as exc:
        raise ConfigError(f"{where}: backend {backend!r} refused its fields: {exc}") from None
    if not isinstance(executor, BashExecutor):
        got = type(executor).__name__
        raise ConfigError(f"{where}: backend {backend!r} returned {got}, not a BashExecutor")
    return executor


def _origins(fields: Mapping[str, Any], origin: Mapping[str, str], where: str) -> str:
    """Name the fields that did not come from the source itself, so a bad env override is findable."""
    foreign = [f"{name} from {origin[name]}" for name in fields if origin.get(name, where) != where]
    return f" (fields set outside {where}: {', '.join(foreign)})" if foreign else ""
