"""The environment policy, written once: every backend calls :func:`build_command_env`."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import Any

__all__ = ["MODEL_FRIENDLY_ENV", "RC_FILE_VARIABLES", "build_command_env", "dropped_names", "is_scrubbed"]

MODEL_FRIENDLY_ENV: Mapping[str, str] = MappingProxyType(
    {
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
)

# Non-interactive bash sources $BASH_ENV (and sh-mode bash $ENV): an ambient value would make
# every command read an rc file, so they are dropped from the ambient set (explicit env may set them).
RC_FILE_VARIABLES: frozenset[str] = frozenset({"BASH_ENV", "ENV"})


@lru_cache(maxsize=64)
def _compile(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns), re.IGNORECASE)


def is_scrubbed(name: str, scrub: Iterable[str], allow: Iterable[str] = ()) -> bool:
    """True when ``name`` matches a scrub glob (case-insensitively) and no allow glob."""
    scrub_re = _compile(tuple(scrub))
    if scrub_re is None or not scrub_re.match(name):
        return False
    allow_re = _compile(tuple(allow))
    return allow_re is None or not allow_re.match(name)


@lru_cache(maxsize=64)
def _dropped_names(scrub: tuple[str, ...], allow: tuple[str, ...]) -> dict[str, bool]:
    """Per policy, the verdict on each name seen so far: ambient names repeat on every command."""
    return {}


def dropped_names(ambient: Iterable[str], *, scrub: Iterable[str], allow: Iterable[str] = ()) -> list[str]:
    """The names of ``ambient`` that the policy drops (scrubbed, or rc-file variables), in order.

    What a backend takes out of the environment of the processes it starts for itself (spill
    writers, boot wrappers, kill scripts): they get the command's scrubbed ambient, never more.
    """
    scrub, allow = tuple(scrub), tuple(allow)
    dropped = _dropped_names(scrub, allow)
    names = []
    for name in ambient:
        drop = dropped.get(name)
        if drop is None:
            drop = dropped[name] = name in RC_FILE_VARIABLES or is_scrubbed(name, scrub, allow)
        if drop:
            names.append(name)
    return names


def build_command_env(
    ambient: Mapping[str, str],
    *,
    scrub: Iterable[str],
    allow: Iterable[str] = (),
    explicit: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The command's environment: scrubbed ambient, then the model-friendly set, then ``explicit``."""
    scrub, allow = tuple(scrub), tuple(allow)
    raw = _raw_environ(ambient)
    cached = _last_base.get((scrub, allow)) if raw is not None else None
    if cached is not None and cached[0] == raw:
        env = dict(cached[1])
    else:
        env = _scrubbed_base(ambient, scrub, allow)
        if raw is not None:
            if len(_last_base) >= 8:
                _last_base.clear()
            _last_base[(scrub, allow)] = (dict(raw), dict(env))
    if explicit:
        env.update(explicit)
    return env


#: Per policy, the last ``os.environ`` seen (its raw bytes) and the base built from it: the host
#: backends build an environment per command, and decoding ``os.environ`` each time is most of the
#: cost of a short command's set-up. Compared whole on every call, so a change is never missed.
_last_base: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[dict[Any, Any], dict[str, str]]] = {}


def _raw_environ(ambient: Mapping[str, str]) -> dict[Any, Any] | None:
    """``os.environ``'s own undecoded dict (CPython keeps it as ``_data``), else None."""
    if ambient is not os.environ:
        return None
    raw = getattr(ambient, "_data", None)
    return raw if isinstance(raw, dict) else None


def _scrubbed_base(
    ambient: Mapping[str, str], scrub: tuple[str, ...], allow: tuple[str, ...]
) -> dict[str, str]:
    dropped = _dropped_names(scrub, allow)
    env: dict[str, str] = {}
    for name, value in ambient.items():
        drop = dropped.get(name)
        if drop is None:
            drop = dropped[name] = name in RC_FILE_VARIABLES or is_scrubbed(name, scrub, allow)
        if not drop:
            env[name] = value
    env.update(MODEL_FRIENDLY_ENV)
    return env
