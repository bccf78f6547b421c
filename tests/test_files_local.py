"""read_file/write_file on the local backend, beyond the kit's checks: what only this host shows (a
mode kept, a file in a directory the user may not write, a FIFO never blocking, the error's pickling).
The kit's `file-*` checks run on every backend (test_conformance_*)."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import anyio
import pytest
from dsh_bash_local import LocalBashExecutor

from dsh_bash import FILE_REFUSALS, BashInfrastructureError, FileOperationError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_error_carries_its_reason_through_pickling() -> None:
    for reason in FILE_REFUSALS:
        copy = pickle.loads(pickle.dumps(FileOperationError("message", reason=reason)))
        assert (type(copy), str(copy), copy.reason) == (FileOperationError, "message", reason)
    with pytest.raises(ValueError, match="unknown file refusal"):
        FileOperationError("x", reason="nope")  # type: ignore[arg-type]


async def test_a_rewrite_keeps_the_mode_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "script.sh"
    target.write_bytes(b"old")
    target.chmod(0o751)
    async with LocalBashExecutor.from_fields(cwd=str(tmp_path)) as ex:
        await ex.write_file("script.sh", b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o751
    assert sorted(os.listdir(tmp_path)) == ["script.sh"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give a file to another user (CI runs as root)")
async def test_another_users_file_is_rewritten_in_place_keeping_its_owner(tmp_path: Path) -> None:
    """A rename would give the file to the writer: a file of another user (writable to this one) is
    rewritten in place instead, the one case besides an unwritable directory where that is so."""
    target = tmp_path / "theirs"
    target.write_bytes(b"old")
    os.chown(target, 65534, 65534)
    async with LocalBashExecutor.from_fields() as ex:
        await ex.write_file(str(target), b"new")
    found = target.stat()
    assert target.read_bytes() == b"new" and (found.st_uid, found.st_gid) == (65534, 65534)


async def test_a_fifo_is_refused_at_once_never_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    async with LocalBashExecutor.from_fields() as ex:
        with anyio.fail_after(5), pytest.raises(FileOperationError) as read:
            await ex.read_file(str(fifo))
        with anyio.fail_after(5), pytest.raises(FileOperationError) as written:
            await ex.write_file(str(fifo), b"x")
    assert read.value.reason == written.value.reason == "not_a_regular_file"


async def test_bad_paths_and_other_users_are_refused_before_anything_happens(tmp_path: Path) -> None:
    async with LocalBashExecutor.from_fields(cwd=str(tmp_path)) as ex:
        with pytest.raises(ValueError, match="NUL"):
            await ex.read_file("a\0b")
        with pytest.raises(TypeError, match="bytes"):
            await ex.write_file("a", "text")  # type: ignore[arg-type]
        for names_a_directory in (f"{tmp_path}/", "sub/..", "."):
            with pytest.raises(FileOperationError) as directory:
                await ex.write_file(names_a_directory, b"x")
            assert directory.value.reason == "is_a_directory"
        with pytest.raises(BashInfrastructureError) as other:
            await ex.read_file("a", user="nobody-such-user")
    assert other.value.reason == "user_unsupported"
    assert os.listdir(tmp_path) == []


class _FailingFiles(LocalBashExecutor):
    async def _read_file(self, path: str, *, user: str | None, max_bytes: int) -> bytes:
        raise OSError(5, "Input/output error", path)


async def test_a_backends_own_exception_comes_as_the_contracts_error(tmp_path: Path) -> None:
    async with _FailingFiles.from_fields(cwd=str(tmp_path)) as ex:
        with pytest.raises(BashInfrastructureError) as failed:
            await ex.read_file("f")
    assert failed.value.reason == "unclassified" and "Input/output error" in str(failed.value)
