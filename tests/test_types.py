"""Unit tests for the vocabulary types: request/spec validation, the live task handle, reads, errors."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dsh_bash import (
    AbortController,
    BashExecRequest,
    BashExecSpec,
    BashInfrastructureError,
    BashTask,
    BashTaskId,
    BashTaskRead,
    CollectedOutput,
    ConfigError,
    DshBashError,
    ExecutorClosedError,
    OwnerToken,
    UnknownTaskError,
)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


SPEC_BASE: dict[str, Any] = {
    "command": "true",
    "workdir": "/tmp",
    "timeout_ms": 1000,
    "owner": None,
    "user": None,
}


def make_request(**fields: Any) -> BashExecRequest:
    return BashExecRequest(**{"command": "true", **fields})


def make_spec(**fields: Any) -> BashExecSpec:
    return BashExecSpec(**{**SPEC_BASE, **fields})


MODEL_FACTORIES = pytest.mark.parametrize("make", [make_request, make_spec], ids=["request", "spec"])


def assert_refused_naming(exc_info: pytest.ExceptionInfo[ValueError], field: str) -> None:
    """The error is a ValueError whose message names ``field`` (and, for pydantic, whose loc is it)."""
    assert isinstance(exc_info.value, ValueError)
    assert field in str(exc_info.value)
    if isinstance(exc_info.value, ValidationError):
        locs = [error["loc"] for error in exc_info.value.errors()]
        assert any(loc and loc[0] == field for loc in locs), locs


# -- NUL in command / workdir ----------------------------------------------------------------


@MODEL_FACTORIES
@pytest.mark.parametrize("command", ["\x00", "echo a\x00b", "echo hi\x00"])
def test_nul_in_command_is_refused_naming_command(make: Any, command: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(command=command)
    assert_refused_naming(exc_info, "command")


@MODEL_FACTORIES
@pytest.mark.parametrize("workdir", ["\x00", "/tmp/a\x00b"])
def test_nul_in_workdir_is_refused_naming_workdir(make: Any, workdir: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(workdir=workdir)
    assert_refused_naming(exc_info, "workdir")


def test_request_without_workdir_leaves_it_none() -> None:
    assert make_request().workdir is None


# -- timeout_ms ------------------------------------------------------------------------------

BAD_TIMEOUTS = [0, 0.0, -1, -0.5, math.inf, -math.inf, math.nan, True, False, "100", "1e3", b"100", [100]]


@MODEL_FACTORIES
@pytest.mark.parametrize("field", ["timeout_ms", "task_timeout_ms"])
@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_timeout_that_is_not_a_positive_finite_number_is_refused_naming_its_field(
    make: Any, field: str, timeout: object
) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(**{field: timeout})
    assert_refused_naming(exc_info, field)


@MODEL_FACTORIES
@pytest.mark.parametrize("timeout", [1, 5_000, 10**9, 0.5, 1e-3, 123.25])
def test_positive_finite_int_or_float_timeout_is_accepted(make: Any, timeout: float) -> None:
    value = make(timeout_ms=timeout).timeout_ms
    assert value == timeout
    assert isinstance(value, float)


def test_request_timeout_defaults_to_none() -> None:
    assert make_request().timeout_ms is None


@MODEL_FACTORIES
def test_timeout_too_large_for_a_float_is_refused_with_value_error_naming_timeout_ms(make: Any) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(timeout_ms=10**400)
    assert_refused_naming(exc_info, "timeout_ms")


# -- task_timeout_ms (R-task-timeout) ---------------------------------------------------------


@MODEL_FACTORIES
def test_task_timeout_defaults_to_none_and_takes_a_number(make: Any) -> None:
    assert make().task_timeout_ms is None
    value = make(task_timeout_ms=1500).task_timeout_ms
    assert value == 1500.0 and isinstance(value, float)


# -- env ---------------------------------------------------------------------------------------

BAD_ENV_NAMES = ["1A", "A-B", "", "A B", "A=B", "A\n", "É", "A.B", "9"]


@MODEL_FACTORIES
@pytest.mark.parametrize("name", BAD_ENV_NAMES, ids=repr)
def test_env_name_that_is_not_a_shell_identifier_is_refused_naming_env(make: Any, name: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(env={name: "v"})
    assert_refused_naming(exc_info, "env")


@MODEL_FACTORIES
@pytest.mark.parametrize("name", ["A", "_", "_A1", "a_b_C9", "PATH", "x" * 200])
def test_env_name_that_is_a_shell_identifier_is_accepted(make: Any, name: str) -> None:
    assert make(env={name: "v"}).env == {name: "v"}


@MODEL_FACTORIES
@pytest.mark.parametrize("value", ["\x00", "a\x00b", "abc\x00"], ids=repr)
def test_env_value_with_nul_is_refused_naming_env(make: Any, value: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(env={"NAME": value})
    assert_refused_naming(exc_info, "env")


@MODEL_FACTORIES
@pytest.mark.parametrize("value", [1, 1.5, None, b"bytes", True, ["a"]], ids=repr)
def test_env_value_that_is_not_a_string_is_refused_naming_env(make: Any, value: object) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(env={"NAME": value})
    assert_refused_naming(exc_info, "env")


@MODEL_FACTORIES
def test_env_name_that_is_not_a_string_is_refused_naming_env(make: Any) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(env={1: "v"})
    assert_refused_naming(exc_info, "env")


@MODEL_FACTORIES
def test_env_that_is_not_a_mapping_is_refused_naming_env(make: Any) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(env=[("A", "b")])
    assert_refused_naming(exc_info, "env")


@MODEL_FACTORIES
def test_env_accepts_any_mapping_and_keeps_empty_values_and_odd_text(make: Any) -> None:
    env = MappingProxyType({"A": "", "B": "x y=z\n€"})
    assert make(env=env).env == {"A": "", "B": "x y=z\n€"}


# -- frozen, extra, required -------------------------------------------------------------------


@MODEL_FACTORIES
@pytest.mark.parametrize("field", ["command", "workdir", "timeout_ms", "owner", "env"])
def test_models_are_frozen(make: Any, field: str) -> None:
    model = make()
    before = getattr(model, field)
    with pytest.raises(ValidationError):
        setattr(model, field, None)
    assert getattr(model, field) == before


@MODEL_FACTORIES
def test_unknown_field_is_refused(make: Any) -> None:
    with pytest.raises(ValueError, match="timeout"):
        make(timeout=5)


@pytest.mark.parametrize("field", ["workdir", "timeout_ms", "owner", "user"])
def test_spec_requires_field(field: str) -> None:
    fields = {key: value for key, value in SPEC_BASE.items() if key != field}
    with pytest.raises(ValueError) as exc_info:
        BashExecSpec(**fields)
    assert_refused_naming(exc_info, field)


@MODEL_FACTORIES
@pytest.mark.parametrize("user", ["root", "nobody", "1000", "www-data", "a.b_c-d", "_x"])
def test_user_names_and_uids_are_accepted(make: Any, user: str) -> None:
    assert make(user=user).user == user


@MODEL_FACTORIES
@pytest.mark.parametrize(
    "user", ["", "-rf", ".hidden", "a b", "root:root", "a/b", "x\x00", "é", "$(id)", "a" * 257, 0, b"root"]
)
def test_a_user_that_is_no_name_or_uid_is_refused_naming_user(make: Any, user: object) -> None:
    with pytest.raises(ValueError) as exc_info:
        make(user=user)
    assert_refused_naming(exc_info, "user")


@pytest.mark.parametrize("field", ["workdir", "timeout_ms"])
def test_spec_refuses_none_for_workdir_and_timeout(field: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        make_spec(**{field: None})
    assert_refused_naming(exc_info, field)


def test_spec_accepts_explicit_none_owner() -> None:
    assert make_spec(owner=None).owner is None


def test_spec_and_request_carry_owner_signal_stdin_and_env_verbatim() -> None:
    signal = AbortController().signal
    owner = OwnerToken("session-1: anything at all")
    fields = {"owner": owner, "signal": signal, "stdin": b"\x00\xff", "env": {"A": "1"}}
    for model in (make_request(**fields), make_spec(**fields)):
        assert model.owner == owner
        assert model.signal is signal
        assert model.stdin == b"\x00\xff"
        assert model.env == {"A": "1"}


@MODEL_FACTORIES
@pytest.mark.parametrize("stdin", ["text", b"bytes", "", b""], ids=repr)
def test_stdin_accepts_str_and_bytes_unchanged(make: Any, stdin: str | bytes) -> None:
    value = make(stdin=stdin).stdin
    assert value == stdin
    assert type(value) is type(stdin)


# -- properties ----------------------------------------------------------------------------------

# Text with a UTF-8 form: lone surrogates are refused (test_security_fuzz.py covers them).
TEXT_WITHOUT_NUL = st.text(alphabet=st.characters(exclude_characters="\x00", codec="utf-8"))
TEXT_WITH_NUL = st.tuples(st.text(), st.text()).map(lambda parts: parts[0] + "\x00" + parts[1])


@settings(deadline=None, max_examples=150)
@given(command=TEXT_WITHOUT_NUL)
def test_any_command_without_nul_is_accepted_and_round_trips(command: str) -> None:
    request = BashExecRequest(command=command)
    assert request.command == command
    assert BashExecRequest.model_validate(request.model_dump()) == request
    spec = BashExecSpec(command=command, workdir="/", timeout_ms=1, owner=None, user=None)
    assert spec.command == command
    assert BashExecSpec.model_validate(spec.model_dump()) == spec


@settings(deadline=None, max_examples=150)
@given(command=TEXT_WITH_NUL)
def test_any_command_with_nul_is_refused_naming_command(command: str) -> None:
    with pytest.raises(ValueError, match="command"):
        BashExecRequest(command=command)
    with pytest.raises(ValueError, match="command"):
        BashExecSpec(command=command, workdir="/", timeout_ms=1, owner=None, user=None)


# -- BashTask ---------------------------------------------------------------------------------------


def test_task_starts_running_with_no_outcome() -> None:
    task = BashTask(BashTaskId("t1"), "sleep 1", OwnerToken("me"))
    assert task.id == "t1"
    assert task.command == "sleep 1"
    assert task.owner == "me"
    assert task.status == "running"
    assert task.exit_code is None
    assert task.signal is None
    assert task.end_cause is None


def test_task_can_be_created_outside_an_event_loop_and_be_ownerless() -> None:
    task = BashTask(BashTaskId("t"), "true", None)
    assert task.owner is None
    assert task.status == "running"


@pytest.mark.parametrize(
    ("status", "exit_code", "signal", "end_cause"),
    [
        ("completed", 0, None, "exited"),
        ("completed", 3, None, "exited"),
        ("completed", None, "SIGSEGV", "signaled"),
        ("killed", None, "SIGTERM", "killed"),
        ("killed", None, "SIGKILL", "aborted"),
        ("killed", None, None, "closed"),
        ("killed", None, None, "lost"),
    ],
)
def test_task_finish_sets_final_fields(
    status: Any, exit_code: int | None, signal: str | None, end_cause: Any
) -> None:
    task = BashTask(BashTaskId("t"), "true", None)
    task._finish(status, exit_code, signal, end_cause)
    assert (task.status, task.exit_code, task.signal, task.end_cause) == (
        status,
        exit_code,
        signal,
        end_cause,
    )
    assert "end_cause" in repr(task)


@pytest.mark.anyio
async def test_task_wait_blocks_until_finish_then_sees_final_fields() -> None:
    task = BashTask(BashTaskId("t"), "true", None)
    seen: list[tuple[object, ...]] = []

    async def waiter() -> None:
        await task.wait()
        seen.append((task.status, task.exit_code, task.signal, task.end_cause))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert seen == []
            task._finish("completed", 7, None, "exited")
    assert seen == [("completed", 7, None, "exited")] * 2


@pytest.mark.anyio
async def test_task_wait_returns_at_once_after_finish() -> None:
    task = BashTask(BashTaskId("t"), "true", None)
    task._finish("killed", None, "SIGTERM", "killed")
    with anyio.fail_after(5):
        await task.wait()
        await task.wait()
    assert task.status == "killed"


@pytest.mark.anyio
async def test_task_wait_can_be_cancelled_by_its_caller() -> None:
    task = BashTask(BashTaskId("t"), "true", None)
    with anyio.move_on_after(0.01) as scope:
        await task.wait()
    assert scope.cancelled_caught
    assert task.status == "running"


# -- BashTaskRead ------------------------------------------------------------------------------------


def make_read(lossy: bool, dropped: int) -> BashTaskRead:
    return BashTaskRead(
        task=BashTask(BashTaskId("t"), "true", None),
        delta="x",
        lossy=lossy,
        dropped_bytes=dropped,
        stdout_spill_path=None,
        stderr_spill_path="/tmp/spill",
    )


@pytest.mark.parametrize(("lossy", "dropped"), [(True, 0), (False, 1), (False, 10_000)])
def test_task_read_refuses_lossy_inconsistent_with_dropped_bytes(lossy: bool, dropped: int) -> None:
    with pytest.raises(ValueError, match="lossy"):
        make_read(lossy, dropped)


@pytest.mark.parametrize(("lossy", "dropped"), [(False, 0), (True, 1), (True, 10_000)])
def test_task_read_accepts_lossy_consistent_with_dropped_bytes(lossy: bool, dropped: int) -> None:
    read = make_read(lossy, dropped)
    assert (read.lossy, read.dropped_bytes) == (lossy, dropped)
    assert read.stderr_spill_path == "/tmp/spill"


def test_task_read_refuses_negative_dropped_bytes() -> None:
    with pytest.raises(ValueError, match="dropped_bytes"):
        make_read(False, -1)


def test_task_read_keeps_the_live_task_handle() -> None:
    task = BashTask(BashTaskId("t"), "true", None)
    read = BashTaskRead(
        task=task, delta="", lossy=False, dropped_bytes=0, stdout_spill_path=None, stderr_spill_path=None
    )
    task._finish("completed", 0, None, "exited")
    assert read.task is task
    assert read.task.status == "completed"


# -- errors ------------------------------------------------------------------------------------------


def test_error_hierarchy_matches_contract() -> None:
    assert issubclass(BashInfrastructureError, DshBashError)
    assert issubclass(ExecutorClosedError, BashInfrastructureError)
    assert issubclass(UnknownTaskError, DshBashError)
    assert issubclass(UnknownTaskError, LookupError)
    assert issubclass(ConfigError, DshBashError)
    assert issubclass(ConfigError, ValueError)
    assert issubclass(DshBashError, Exception)
    assert not issubclass(UnknownTaskError, BashInfrastructureError)
    assert not issubclass(ConfigError, BashInfrastructureError)


def test_collected_output_round_trips_raw_bytes_through_json() -> None:
    # Output need not be UTF-8: its bytes go as base64 in JSON, and come back exactly.
    collected = CollectedOutput(
        text="a\ufffdb", truncated=False, spill_path=None, total_bytes=3, data=b"a\xffb"
    )
    dumped = collected.model_dump_json()
    assert '"data":"Yf9i"' in dumped
    assert CollectedOutput.model_validate_json(dumped) == collected
