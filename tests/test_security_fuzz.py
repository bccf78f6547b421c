"""Security: fuzzing ``BashExecRequest`` and the tools' arguments never crashes, never hangs, and
every refusal names what is wrong.

Three layers, each with its own oracle:

- request construction (pure): a value the contract allows is accepted unchanged; anything else
  raises ``ValueError`` whose every error points at a field that is really wrong, and whose message
  names it;
- execution on the local backend: an accepted request either runs (output and environment arrive
  intact) or fails with ``BashInfrastructureError`` naming the problem, within a bound per example;
- tool calls (the JSON a model sends): the toolset never raises, never reports an ``internal``
  error, and an invalid call names the argument, the tool or the JSON problem.

Commands in the executed layers are never arbitrary text run as a shell command (the tests run as
root): fuzzed text travels inside a quoted here-document, as an environment value, or as stdin.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import anyio
import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsh_bash import AbortController, BashExecRequest, BashExecutor, BashInfrastructureError, OwnerToken
from dsh_tool_bash import BashToolset

pytestmark = [pytest.mark.faults]

FIELDS = ("command", "workdir", "timeout_ms", "signal", "stdin", "env", "owner")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: Per-example bound for executed examples (commands here finish in milliseconds).
EXAMPLE_BOUND_S = 15


def _fast(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        database=None,
    )


# -- strategies -------------------------------------------------------------------------------------

odd_text = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(codec=None, categories=["Cs", "Co", "Cn", "Cc", "Zl", "Zp", "Mn"])),
    st.text(alphabet=st.sampled_from(["\x00", "=", "\n", "'", '"', "$", "\\", "\udc80", "\ud800", "é", "𝄞"])),
)
not_str = st.one_of(st.integers(), st.floats(), st.binary(max_size=8), st.lists(st.integers(), max_size=2))
huge_int = st.integers(min_value=10**300, max_value=10**400) | st.integers(max_value=-(10**20))
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**6), max_value=10**9),
    huge_int,
    st.booleans(),
    st.sampled_from(["100", "1e3", "", "nan"]),
    st.none(),
)
env_names = st.one_of(
    st.from_regex(ENV_NAME, fullmatch=True).filter(lambda s: len(s) < 40),
    odd_text,
    st.integers(),
)
env_values = st.one_of(odd_text, not_str, st.none())
envs = st.one_of(
    st.none(),
    st.dictionaries(env_names, env_values, max_size=4),
    st.lists(st.text(), max_size=2),
    st.text(max_size=5),
)

request_fields = st.fixed_dictionaries(
    {},
    optional={
        "command": st.one_of(odd_text, not_str, st.none()),
        "workdir": st.one_of(odd_text, not_str, st.none()),
        "timeout_ms": numbers,
        "stdin": st.one_of(
            odd_text, st.binary(max_size=64), st.integers(), st.lists(st.integers(), max_size=2)
        ),
        "env": envs,
        "owner": st.one_of(st.text(max_size=10), st.integers(), st.none()),
        "signal": st.one_of(st.none(), st.just("aborted"), st.integers()),
        "extra": st.integers(),
    },
)

# -- the oracle -------------------------------------------------------------------------------------


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _utf8_clean(value: str) -> bool:
    """Encodable as UTF-8 (no lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _valid_timeout(value: object) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and number > 0


def _valid_env(value: object) -> bool:
    if value is None:
        return True
    if not isinstance(value, Mapping):
        return False
    return all(
        isinstance(name, str)
        and ENV_NAME.fullmatch(name) is not None
        and isinstance(item, str)
        and "\x00" not in item
        and _utf8_clean(item)
        and len(name) + len(item.encode()) + 2 <= 131_072
        for name, item in value.items()
    )


def wrong_fields(fields: Mapping[str, Any]) -> set[str]:
    """The fields of ``fields`` that the contract refuses."""
    wrong = set()
    for name, value in fields.items():
        if name not in FIELDS:
            wrong.add(name)
        elif name == "command":
            if not _is_str(value) or "\x00" in value or not _utf8_clean(value):
                wrong.add(name)
        elif name == "workdir":
            if value is not None and (not _is_str(value) or "\x00" in value or not _utf8_clean(value)):
                wrong.add(name)
        elif name == "timeout_ms":
            if not _valid_timeout(value):
                wrong.add(name)
        elif name == "stdin":
            if value is not None and not (
                isinstance(value, bytes) or (_is_str(value) and _utf8_clean(value))
            ):
                wrong.add(name)
        elif name == "env":
            if not _valid_env(value):
                wrong.add(name)
        elif name == "owner":
            if value is not None and not _is_str(value):
                wrong.add(name)
        elif name == "signal" and value is not None:
            wrong.add(name)
    if "command" not in fields:
        wrong.add("command")
    return wrong


# -- layer 1: construction --------------------------------------------------------------------------


@_fast(600)
@given(request_fields)
def test_request_construction_accepts_exactly_the_contract(fields: dict[str, Any]) -> None:
    expected_wrong = wrong_fields(fields)
    try:
        request = BashExecRequest(**fields)
    except ValueError as exc:
        assert expected_wrong, f"refused a valid request {fields!r}: {exc}"
        named = set()
        errors = getattr(exc, "errors", None)
        if callable(errors):
            for error in errors():
                loc = error.get("loc", ())
                named.add(str(loc[0]) if loc else "")
        else:
            named = {name for name in FIELDS if name in str(exc)}
        assert named, f"the error names no field: {exc}"
        assert named <= expected_wrong, f"blamed {named - expected_wrong} for {fields!r}: {exc}"
        assert any(name in str(exc) for name in named), str(exc)
        return
    assert not expected_wrong, f"accepted {expected_wrong} in {fields!r}"
    for name, value in fields.items():
        got = getattr(request, name)
        if name == "timeout_ms" and value is not None:
            assert got == float(value)
        elif name == "env" and value is not None:
            assert got == dict(value)
        else:
            assert got == value, name


def test_huge_fields_are_accepted_or_refused_quickly() -> None:
    """Tens of megabytes in a field: validated in bounded time, nothing copied pathologically."""
    big = "x" * 20_000_000
    with _wall(10):
        assert BashExecRequest(command=big).command is big
        assert BashExecRequest(command="true", stdin=big.encode()).stdin == big.encode()
        with pytest.raises(ValueError, match="env value of BIG is too long"):
            BashExecRequest(command="true", env={"BIG": big})
        edge = "v" * (131_072 - len("EDGE") - 2)
        assert BashExecRequest(command="true", env={"EDGE": edge}).env == {"EDGE": edge}
        with pytest.raises(ValueError, match="env value of EDGE is too long"):
            BashExecRequest(command="true", env={"EDGE": edge + "v"})
        with pytest.raises(ValueError, match="command"):
            BashExecRequest(command=big + "\x00")
        with pytest.raises(ValueError, match="env"):
            BashExecRequest(command="true", env={f"N{i}": "v" for i in range(100_000)} | {"bad name": "v"})


class _wall:
    """Fails the block when it took longer than ``limit_s`` (pure code: nothing to cancel)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s

    def __enter__(self) -> None:
        import time  # noqa: PLC0415

        self._start = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        import time  # noqa: PLC0415

        elapsed = time.monotonic() - self._start
        assert elapsed < self.limit_s, f"took {elapsed:.1f}s"


# -- layer 2: execution on the local backend ----------------------------------------------------------

HEREDOC_END = "DSH_FUZZ_END"


def _heredoc(text: str) -> str:
    return f"cat <<'{HEREDOC_END}'\n{text}\n{HEREDOC_END}"


def _expected_output(text: str) -> str:
    return text


safe_payload = st.one_of(odd_text, st.text(min_size=1000, max_size=5000)).filter(
    lambda text: "\x00" not in text and HEREDOC_END not in text and _utf8_clean(text)
)
workdirs = st.one_of(
    st.none(),
    st.sampled_from(
        ["/", "/tmp", ".", "..", "/nonexistent/dir", "/etc/hostname", "", " ", "~", "-n", "--", "relative"]
    ),
    odd_text.filter(lambda text: "\x00" not in text and _utf8_clean(text)),
)
env_for_run = st.dictionaries(
    st.from_regex(r"DSHF_[A-Za-z0-9_]{0,10}", fullmatch=True),
    odd_text.filter(lambda text: "\x00" not in text and _utf8_clean(text)),
    max_size=3,
)
run_timeouts = st.one_of(
    st.none(), st.floats(min_value=1, max_value=5000), st.integers(1, 10**12), st.just(1e308)
)


async def _run_one(
    payload: str,
    workdir: str | None,
    env: dict[str, str],
    stdin: bytes | str | None,
    timeout_ms: float | None,
    *,
    make: Callable[..., BashExecutor] | None = None,
) -> None:
    fields = {"grace_ms": 200, "max_output_bytes": 4096, "timeout_ms": 5000, "max_timeout_ms": 10_000}
    executor = LocalBashExecutor(LocalConfig(**fields)) if make is None else make(**fields)
    names = sorted(env)
    show_env = "".join(f'; printf "\\0%s" "${name}"' for name in names)
    stdin_part = "; wc -c | tr -d ' \\n' >&2" if stdin is not None else ""
    command = _heredoc(payload) + "\n:" + show_env + stdin_part
    request = BashExecRequest(command=command, workdir=workdir, env=env, stdin=stdin, timeout_ms=timeout_ms)
    with anyio.fail_after(EXAMPLE_BOUND_S):
        async with executor as ex:
            spec = ex.resolve(request)
            assert spec.timeout_ms <= 10_000
            # Remote examples keep the default workdir, which exists where they run.
            usable = make is not None or (os.path.isdir(spec.workdir) and os.access(spec.workdir, os.X_OK))
            try:
                result = await ex.run(spec)
            except BashInfrastructureError as exc:
                assert not usable, f"refused a usable workdir {spec.workdir!r}: {exc}"
                assert f"workdir {spec.workdir!r}" in str(exc), str(exc)
                return
            assert usable, f"ran in an unusable workdir {spec.workdir!r}"
    if result.timed_out:
        assert spec.timeout_ms < 1000, result  # only a tiny timeout may cut these commands
        return
    assert result.exit_code == 0, result
    parts = result.stdout.text.split("\0") if result.stdout.total_bytes <= 4096 else None
    if parts is not None:
        assert parts[0] == _expected_output(payload) + "\n"
        assert parts[1:] == [_expected_output(env[name]) for name in names]
    if stdin is not None:
        size = len(stdin.encode()) if isinstance(stdin, str) else len(stdin)
        assert result.stderr.text == str(size)


@_fast(60)
@given(
    payload=safe_payload,
    workdir=workdirs,
    env=env_for_run,
    stdin=st.one_of(st.none(), st.binary(max_size=2000), odd_text.filter(_utf8_clean)),
    timeout=run_timeouts,
)
def test_fuzzed_requests_run_or_fail_with_a_named_error(
    payload: str, workdir: str | None, env: dict[str, str], stdin: bytes | str | None, timeout: float | None
) -> None:
    anyio.run(_run_one, payload, workdir, env, stdin, timeout)


@pytest.mark.parametrize("backend", ["docker", "ssh"])
@settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.filter_too_much,
    ],
)
@given(
    payload=safe_payload,
    env=env_for_run,
    stdin=st.one_of(st.none(), st.binary(max_size=2000), odd_text.filter(_utf8_clean)),
)
def test_fuzzed_requests_cross_the_remote_transports_intact(
    request: pytest.FixtureRequest, backend: str, payload: str, env: dict[str, str], stdin: bytes | str | None
) -> None:
    """The same property through Docker's exec API (JSON Env) and SSH's stdin header."""
    if backend == "docker":
        from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

        container = request.getfixturevalue("docker_session_container")

        def make(**fields: Any) -> BashExecutor:
            return DockerBashExecutor(DockerConfig(container=container, **fields))

    else:
        server = request.getfixturevalue("ssh_server")

        def make(**fields: Any) -> BashExecutor:
            return server.executor(**fields)  # type: ignore[no-any-return]

    anyio.run(partial(_run_one, payload, None, env, stdin, None, make=make))


def test_a_megabyte_command_and_stdin_run_intact() -> None:
    payload = ("é𝄞 line\n" * 100_000)[:-1]
    stdin = bytes(range(256)) * 20_000

    async def main() -> None:
        await _run_one(payload, None, {"DSHF_BIG": "v" * 100_000}, stdin, None)

    anyio.run(main)


def test_an_environment_too_large_to_start_is_named() -> None:
    """Each entry is within the kernel's per-string limit, but together they exceed ARG_MAX."""
    env = {f"DSHF_{i}": "v" * 100_000 for i in range(60)}

    async def main() -> None:
        async with LocalBashExecutor(LocalConfig(grace_ms=200)) as ex:
            with pytest.raises(BashInfrastructureError, match=r"environment \(env\) is too large"):
                await ex.exec("true", env=env)
            assert (await ex.exec("echo still-works")).stdout.text == "still-works\n"

    anyio.run(main)


def test_an_already_aborted_signal_is_refused_with_its_reason() -> None:
    async def main() -> None:
        controller = AbortController()
        controller.abort("fuzz")
        async with LocalBashExecutor(LocalConfig(grace_ms=200)) as ex:
            with pytest.raises(BashInfrastructureError, match="abort"):
                await ex.exec("true", signal=controller.signal)

    anyio.run(main)


# -- layer 3: tool calls ----------------------------------------------------------------------------

SAFE_COMMANDS = ["true", "echo fuzz", "printf '%s' \"$HOME\" >/dev/null", ": \udc80 é 𝄞", ": é 𝄞", "exit 3"]
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    huge_int,
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
argument_names = st.sampled_from(
    [
        "command",
        "description",
        "timeout_ms",
        "workdir",
        "run_in_background",
        "open_stdin",
        "task_id",
        "input",
        "close",
        "yield_ms",
        "env",
        "stdin",
        "owner",
        "",
    ]
) | st.text(max_size=8)
argument_values = st.one_of(st.sampled_from(SAFE_COMMANDS), json_values)
tool_arguments = st.one_of(
    st.dictionaries(argument_names, argument_values, max_size=5),
    st.fixed_dictionaries(
        {"command": st.one_of(st.sampled_from(SAFE_COMMANDS), json_values)},
        optional={
            "timeout_ms": st.one_of(json_scalars, st.floats(min_value=1, max_value=3000)),
            "workdir": st.one_of(st.sampled_from(["/", "/tmp", "/nonexistent", "rel"]), json_scalars),
            "run_in_background": json_scalars,
            "open_stdin": json_scalars,
            "description": json_values,
        },
    ),
    st.fixed_dictionaries(
        {
            "task_id": st.sampled_from(["bash-1", "bash-2", "bash-999"]),
            "input": st.one_of(
                st.sampled_from(["y\\n", "\\^C", "\\<up>\\x00", "\\", "\\q", "\\x4", "\\<", "\\^"]),
                odd_text,
                json_values,
            ),
        },
        optional={"close": json_scalars, "yield_ms": st.one_of(json_scalars, st.floats(0, 50))},
    ),
    st.fixed_dictionaries(
        {"task_id": st.one_of(st.sampled_from(["bash-1", "bash-2", "bash-999"]), json_values)}
    ),
    st.none(),
    odd_text,
    json_values,
)
TOOLS = ("bash", "bash_output", "bash_input", "bash_kill")
tool_names = st.sampled_from(TOOLS) | st.text(max_size=12)

DOCUMENTED_ERRORS = {
    "unknown_tool",
    "invalid_arguments",
    "aborted",
    "infrastructure",
    "executor_closed",
    "unknown_task",
    "other_owner",
    "too_many_running",
    "task_ended",
    "input_closed",
    "input_not_open",
    "input_full",
    "input_broken",
}
KNOWN_ARGUMENTS = (
    "command",
    "description",
    "timeout_ms",
    "workdir",
    "run_in_background",
    "open_stdin",
    "task_id",
    "input",
    "close",
    "yield_ms",
)


def _as_wire(arguments: object, as_json: bool) -> Any:
    """The arguments as a model sends them: a dict, or a JSON string (when it can be one)."""
    if not as_json:
        return arguments
    import json  # noqa: PLC0415

    try:
        return json.dumps(arguments)
    except (TypeError, ValueError):
        return arguments


async def _call_one(calls: list[tuple[str, Any]]) -> None:
    config = LocalConfig(grace_ms=200, timeout_ms=3000, max_timeout_ms=5000, cwd="/tmp")
    with anyio.fail_after(EXAMPLE_BOUND_S):
        async with LocalBashExecutor(config) as ex:
            tools = BashToolset(ex, owner=OwnerToken("fuzz"), max_running=3)
            for name, arguments in calls:
                result = await tools.call(name, arguments)
                assert isinstance(result.text, str) and result.text
                if not result.is_error:
                    assert name in TOOLS
                    continue
                kind = result.data.get("error")
                assert kind in DOCUMENTED_ERRORS, result
                if kind == "unknown_tool":
                    assert "unknown tool" in result.text
                elif kind == "invalid_arguments":
                    assert result.text.startswith(f"invalid arguments for {name}: "), result.text
                    detail = result.text.split(": ", 1)[1]
                    assert (
                        any(f'"{arg}"' in detail or arg in detail for arg in KNOWN_ARGUMENTS)
                        or "JSON" in detail
                        or "unknown argument" in detail
                    ), result.text
                elif kind == "unknown_task":
                    assert result.text.startswith("unknown bash task"), result.text
                elif kind == "infrastructure":
                    assert "workdir" in result.text or "/" in result.text, result.text


@_fast(150)
@given(st.lists(st.tuples(tool_names, tool_arguments, st.booleans()), min_size=1, max_size=4))
def test_fuzzed_tool_calls_never_crash_and_name_the_problem(calls: list[tuple[str, Any, bool]]) -> None:
    anyio.run(_call_one, [(name, _as_wire(arguments, as_json)) for name, arguments, as_json in calls])


# -- what the fuzzing found, pinned -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"command": "echo \ud800"}, "command is not valid text"),
        ({"command": "echo \udc80"}, "command is not valid text"),
        ({"command": "true", "workdir": "/tmp/\udcff"}, "workdir is not valid text"),
        ({"command": "true", "stdin": "\udfff"}, "stdin is not valid text"),
        ({"command": "true", "env": {"A": "\ud83d"}}, "env value of A is not valid text"),
        ({"command": b"true"}, "command"),
        ({"command": "true", "workdir": b"/tmp"}, "workdir"),
        ({"command": "true", "owner": b"me"}, "owner"),
        ({"command": "true", "env": {"BIG": "v" * 200_000}}, "env value of BIG is too long"),
    ],
)
def test_findings_are_refused_with_the_field_named(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        BashExecRequest(**fields)


def test_binary_stdin_stays_binary() -> None:
    """A bytearray (or memoryview) was decoded into text by lax validation; it is binary input."""
    data = bytes(range(256))
    assert BashExecRequest(command="cat", stdin=bytearray(data)).stdin == data
    assert BashExecRequest(command="cat", stdin=memoryview(data)).stdin == data

    async def main() -> None:
        async with LocalBashExecutor(LocalConfig(grace_ms=200)) as ex:
            result = await ex.exec("od -An -tx1 | tr -d ' \\n'", stdin=bytearray(data))
            assert result.stdout.text == data.hex()

    anyio.run(main)
