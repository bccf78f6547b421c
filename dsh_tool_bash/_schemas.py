"""The tools' arguments as pydantic models, their JSON schemas, and readable validation errors.

Every model forbids unknown arguments (a model cannot pass ``env`` or ``stdin``) and validates strictly:
a number given as a string, or a boolean given as ``"true"``, is refused with a message the model can act
on. ``null`` is accepted for every optional argument and means "not given".
"""

from __future__ import annotations

import copy
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "BashArgs",
    "BashForegroundArgs",
    "BashInputArgs",
    "BashKillArgs",
    "BashOutputArgs",
    "describe_validation_error",
    "input_schema",
]

PositiveMs = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: The longest ``input`` of one ``bash_input`` call, in characters (before the escapes are decoded).
MAX_INPUT_CHARS = 65_536
#: The longest ``yield_ms`` of ``bash_input``.
MAX_YIELD_MS = 30_000


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BashForegroundArgs(_Args):
    """Arguments of ``bash`` when the toolset offers no background tasks."""

    command: str = Field(description="The bash command line to run.")
    description: str | None = Field(
        default=None,
        description=(
            "What the command does, in 5-10 words, for the person watching "
            "(for example 'List the files in src'). It does not change what runs."
        ),
    )
    timeout_ms: PositiveMs | None = Field(
        default=None,
        description="Kill the command after this many milliseconds.",
    )
    workdir: str | None = Field(
        default=None,
        description=(
            "Directory to run this command in (absolute, or relative to the default working directory), "
            "for this call alone."
        ),
    )
    restart: bool | None = Field(
        default=False,
        description=(
            "Start from a fresh shell: forget the current directory, variables, functions, aliases and "
            "options that earlier calls left, then run the command."
        ),
    )


class BashArgs(BashForegroundArgs):
    """Arguments of ``bash`` when background tasks are offered."""

    run_in_background: bool | None = Field(
        default=False,
        description=(
            "Start the command as a background task and return its task id at once, instead of waiting "
            "for it. Use for servers, watchers and long builds; then read its output with bash_output "
            "and stop it with bash_kill. timeout_ms does not apply to background tasks."
        ),
    )
    open_stdin: bool | None = Field(
        default=False,
        description=(
            "With run_in_background only: keep the task's stdin open, so that you can answer its prompts "
            "with bash_input. Without it the task's stdin is empty."
        ),
    )
    yield_ms: PositiveMs | None = Field(
        default=None,
        description=(
            "Wait at most this many milliseconds for the command: if it is still running then, it goes on "
            "as a background task and the call returns its task id and its output so far (read more with "
            "bash_output, stop it with bash_kill). timeout_ms still applies to it. For commands that may "
            "or may not end soon: a test run, a build, a server whose start you want to see."
        ),
    )
    terminal: bool | None = Field(
        default=False,
        description=(
            "With run_in_background only: run the task on a 24x80 terminal (its input open, as with "
            "open_stdin), for programs that need one: REPLs, ssh/sudo password prompts, full-screen "
            "programs. Its output is what the terminal shows (input echoed, \\r\\n line ends)."
        ),
    )


class BashOutputArgs(_Args):
    task_id: str = Field(description="The id of a background task, as returned by bash (e.g. 'bash-3').")


class BashKillArgs(_Args):
    task_id: str = Field(description="The id of the background task to stop (e.g. 'bash-3').")


class BashInputArgs(_Args):
    task_id: str = Field(description="The id of a background task started with open_stdin (e.g. 'bash-3').")
    input: str = Field(
        max_length=MAX_INPUT_CHARS,
        description=(
            "What to type, in the escape notation of the tool's description: \\n ends a line. "
            f"At most {MAX_INPUT_CHARS} characters."
        ),
    )
    close: bool | None = Field(
        default=False,
        description="Close the task's stdin after the input: it then reads end of file (like Ctrl-D).",
    )
    yield_ms: Annotated[float, Field(ge=0, le=MAX_YIELD_MS, allow_inf_nan=False)] | None = Field(
        default=1000,
        description=(
            "Wait up to this many milliseconds (0 to 30000) for the task to answer before returning its "
            "new output; returns earlier when the task ends."
        ),
    )


def _clean(node: Any) -> Any:
    """Drop pydantic's titles and ``default: null``; collapse ``X | None`` to ``X``."""
    if isinstance(node, list):
        return [_clean(item) for item in node]
    if not isinstance(node, dict):
        return node
    cleaned: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "default" and value is None:
            continue
        if key == "properties" and isinstance(value, dict):
            cleaned[key] = {name: _clean(prop) for name, prop in value.items()}
            continue
        cleaned[key] = _clean(value)
    any_of = cleaned.get("anyOf")
    if isinstance(any_of, list):
        kept = [item for item in any_of if item != {"type": "null"}]
        if len(kept) == 1 and isinstance(kept[0], dict):
            del cleaned["anyOf"]
            merged = dict(kept[0])
            merged.update(cleaned)
            cleaned = merged
    return cleaned


def input_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments: an object, ``additionalProperties: false``, no titles."""
    schema = _clean(model.model_json_schema())
    assert isinstance(schema, dict)
    schema.pop("description", None)  # the class docstring is for developers, not for the model
    return copy.deepcopy(schema)


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line naming each problem: unknown, missing and ill-typed arguments."""
    allowed = ", ".join(model.model_fields)
    problems: list[str] = []
    unknown: list[str] = []
    for error in exc.errors():
        loc = error.get("loc", ())
        name = str(loc[0]) if loc else ""
        kind = error.get("type", "")
        if kind == "extra_forbidden":
            unknown.append(name)
        elif kind == "missing":
            problems.append(f'missing required argument "{name}"')
        elif name:
            problems.append(f'argument "{name}": {error.get("msg", "invalid")}')
        else:
            problems.append(str(error.get("msg", "invalid")))
    if unknown:
        names = ", ".join(f'"{name}"' for name in unknown)
        noun = "argument" if len(unknown) == 1 else "arguments"
        problems.insert(0, f"unknown {noun} {names} (allowed: {allowed})")
    return "; ".join(problems) or str(exc)
