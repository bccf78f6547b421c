"""The local backend's infrastructure errors carry the right machine-readable ``reason``."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import AbortController, BashExecRequest, BashInfrastructureError, ExecutorClosedError
from dsh_bash.host._host_executor import host_support_problem

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _executor(**fields: object) -> LocalBashExecutor:
    return LocalBashExecutor(LocalConfig(grace_ms=300, **fields))  # type: ignore[arg-type]


async def _reason_of_run(ex: LocalBashExecutor, **request: object) -> str:
    with pytest.raises(BashInfrastructureError) as caught:
        await ex.exec("true", **request)
    return caught.value.reason


async def test_workdir_reasons(tmp_path: Path) -> None:
    plain_file = tmp_path / "file"
    plain_file.write_text("x")
    async with _executor() as ex:
        assert await _reason_of_run(ex, workdir=str(tmp_path / "nope")) == "workdir_missing"
        assert await _reason_of_run(ex, workdir=str(plain_file)) == "workdir_not_directory"
        assert await _reason_of_run(ex, workdir=str(plain_file / "below")) == "workdir_missing"


async def test_user_unsupported(tmp_path: Path) -> None:
    import pwd  # noqa: PLC0415

    uid = os.geteuid()
    other = "nobody" if uid != pwd.getpwnam("nobody").pw_uid else "root"
    witness = tmp_path / "ran"
    async with _executor() as ex:
        # Its own user, by name or uid, runs as usual; any other is refused before anything starts.
        for me in (pwd.getpwuid(uid).pw_name, str(uid)):
            assert (await ex.exec("id -u", user=me)).stdout.text == f"{uid}\n"
        for user in (other, "dsh-bash-no-such-user", "4242"):
            assert await _reason_of_run(ex, user=user) == "user_unsupported"
            with pytest.raises(BashInfrastructureError) as refused:
                await ex.start(ex.resolve(BashExecRequest(command=f": > {witness}", user=user)))
            assert refused.value.reason == "user_unsupported"
        assert not witness.exists()


async def test_workdir_not_accessible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root may enter any directory, so the permission the check consults is denied here instead.
    real_access = os.access
    locked = str(tmp_path / "locked")
    os.mkdir(locked, 0o700)
    monkeypatch.setattr(os, "access", lambda path, mode: path != locked and real_access(path, mode))
    async with _executor() as ex:
        assert await _reason_of_run(ex, workdir=locked) == "workdir_not_accessible"


async def test_missing_shell_is_shell_missing() -> None:
    async with _executor(bash="no-such-bash-dsh") as ex:
        assert await _reason_of_run(ex) == "shell_missing"


async def test_unusable_spill_parent_is_spill_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BashInfrastructureError) as caught:
        async with _executor(spill_dir=str(tmp_path / "missing" / "deeper")):
            pass
    assert caught.value.reason == "spill_unavailable"


async def test_already_aborted_and_closed() -> None:
    controller = AbortController()
    controller.abort()
    async with _executor() as ex:
        assert await _reason_of_run(ex, signal=controller.signal) == "already_aborted"
    with pytest.raises(ExecutorClosedError) as caught:
        await ex.exec("true")
    assert caught.value.reason == "closed"


def test_the_reason_survives_pickling() -> None:
    error = BashInfrastructureError("gone", reason="container_gone")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.reason) == (BashInfrastructureError, "gone", "container_gone")
    closed = pickle.loads(pickle.dumps(ExecutorClosedError("shut")))
    assert (type(closed), closed.reason) == (ExecutorClosedError, "closed")


def test_an_unknown_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown infrastructure error reason"):
        BashInfrastructureError("x", reason="nonsense")  # type: ignore[arg-type]


def test_this_host_is_supported_and_others_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_support_problem() is None
    monkeypatch.setattr(sys, "platform", "darwin")
    problem = host_support_problem()
    assert problem is not None and "Linux only" in problem and "darwin" in problem


async def test_opening_elsewhere_than_linux_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(BashInfrastructureError, match="Linux only") as caught:
        async with _executor():
            pass
    assert caught.value.reason == "start_failed"
