"""dsh-supervise's file mode (protocol 9, native/files.c): a file read or written as the user the
binary runs as, the refusals as exit statuses (dsh_bash.supervisor.FILE_MODE_REFUSALS). Run here as
this test's user; the permission refusals as another user are in tests/test_files_docker.py (uid
65534 in a container), and the kit's file checks run through this mode there too."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from dsh_bash import BashInfrastructureError, FileOperationError
from dsh_bash.supervisor import (
    FILE_MODE_REFUSALS,
    check_file_mode,
    file_read_argv,
    file_write_argv,
    supervisor_binary,
)

BINARY = supervisor_binary()  # bin/test builds it before the tests run


def _run(argv: list[str], data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=data, capture_output=True, timeout=30, check=False)


def _read(path: Path | str, max_bytes: int = 1 << 20) -> bytes:
    done = _run(file_read_argv(str(BINARY), str(path), max_bytes))
    check_file_mode(done.returncode, done.stderr, str(path), "read")
    return done.stdout


def _write(path: Path | str, data: bytes, *, make_parents: bool = False, size: int | None = None) -> None:
    argv = file_write_argv(
        str(BINARY), str(path), len(data) if size is None else size, make_parents=make_parents
    )
    done = _run(argv, data)
    check_file_mode(done.returncode, done.stderr, str(path), "write")


def _reason(call: object, *args: object, **fields: object) -> str:
    with pytest.raises(FileOperationError) as refused:
        call(*args, **fields)  # type: ignore[operator]
    return refused.value.reason


def test_bytes_go_both_ways_exactly(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4000  # past one read of the copy loop
    _write(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == data
    assert _read(tmp_path / "f") == data
    _write(tmp_path / "empty", b"")
    assert _read(tmp_path / "empty") == b""


def test_reads_are_refused_with_their_reasons_and_never_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: an open that blocked would hang here
    (tmp_path / "big").write_bytes(b"x" * 11)
    assert _reason(_read, tmp_path / "missing") == "file_not_found"
    assert _reason(_read, tmp_path) == "is_a_directory"
    assert _reason(_read, tmp_path / "fifo") == "not_a_regular_file"
    assert _reason(_read, tmp_path / "big", 10) == "file_too_large"
    assert _read(tmp_path / "big", 11) == b"x" * 11


def test_a_write_replaces_the_file_whole_keeps_its_mode_and_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    target.chmod(0o640)
    _write(target, b"new")
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    (tmp_path / "victim").write_bytes(b"precious")
    (tmp_path / "link").symlink_to(tmp_path / "victim")
    _write(tmp_path / "link", b"written")
    assert (tmp_path / "victim").read_bytes() == b"precious"
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "link").read_bytes() == b"written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "link", "victim"]  # no temporary file


def test_input_that_ends_early_or_runs_on_puts_nothing_in_place(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"kept")
    for data, size in ((b"abc", 4), (b"abcde", 4)):
        with pytest.raises(BashInfrastructureError, match="nothing was put in place"):
            _write(target, data, size=size)
    assert target.read_bytes() == b"kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_writes_are_refused_with_their_reasons_and_make_parents_makes_them(tmp_path: Path) -> None:
    assert _reason(_write, tmp_path / "no" / "such", b"x") == "file_not_found"
    assert _reason(_write, tmp_path, b"x") == "is_a_directory"
    os.mkfifo(tmp_path / "fifo")
    assert _reason(_write, tmp_path / "fifo", b"x") == "not_a_regular_file"
    _write(tmp_path / "made" / "on" / "the" / "way", b"deep", make_parents=True)
    assert (tmp_path / "made" / "on" / "the" / "way").read_bytes() == b"deep"


def test_every_refusal_status_is_a_reason_and_usage_errors_are_not() -> None:
    assert sorted(FILE_MODE_REFUSALS) == [80, 81, 82, 83, 84, 85]
    for argv in (
        [str(BINARY), "--read-file", "/x"],  # no --max-bytes
        [str(BINARY), "--write-file", "relative", "--temp-name", "t", "--size", "1"],
        [str(BINARY), "--write-file", "/x", "--temp-name", "a/b", "--size", "1"],
        [str(BINARY), "--read-file", "/x", "--max-bytes", "1", "--size", "1"],
    ):
        done = _run(argv)
        assert done.returncode == 125, (argv, done.stderr)
        with pytest.raises(BashInfrastructureError):
            check_file_mode(done.returncode, done.stderr, "/x", "read")
