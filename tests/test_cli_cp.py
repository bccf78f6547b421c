"""``dsh-bash cp``: a file into and out of where commands run, on the local backend.

Most cases run ``main`` in-process (quick); stdin, stdout and an unwritable stdout go through the
installed console script, as a user runs it. Every path where "commands run" is a path of this
machine here, so each copy is checked on the file itself.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_support import console_script
from dsh_bash_cli import main

try:
    import dsh_bash_local  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the checkout's state
    pytest.skip(f"backend unavailable: dsh_bash_local cannot be imported ({exc})", allow_module_level=True)

EVERY_BYTE = bytes(range(256)) * 3
ERROR = "dsh-bash: error: "


@dataclass(frozen=True)
class Outcome:
    code: int
    out: bytes
    err: str


Runner = Callable[..., Outcome]


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run in ``tmp_path`` (the local backend's default working directory, inherited by the console
    script), with no ``DSH_BASH_*`` overrides from around."""
    monkeypatch.chdir(tmp_path)
    for name in [name for name in os.environ if name.startswith("DSH_BASH_")]:
        monkeypatch.delenv(name)
    yield


@pytest.fixture
def cp(capfdbinary: pytest.CaptureFixture[bytes]) -> Runner:
    """``dsh-bash cp ARGS...`` through ``main``: exit status, stdout (bytes) and stderr."""

    def run(*args: str) -> Outcome:
        capfdbinary.readouterr()
        code = main(["cp", *args])
        captured = capfdbinary.readouterr()
        return Outcome(code, captured.out, captured.err.decode())

    return run


def cp_process(*args: str, stdin: bytes = b"", stdout: int = subprocess.PIPE) -> Outcome:
    """``dsh-bash cp ARGS...`` through the console script, ``stdin`` on its standard input; its stdout
    buffered, as a user's is (``PYTHONUNBUFFERED`` is taken out)."""
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [console_script(), "cp", *args],
        input=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=environment,
        timeout=60,
        check=False,
    )
    return Outcome(done.returncode, done.stdout or b"", done.stderr.decode())


def error(message: str) -> Outcome:
    return Outcome(2, b"", f"{ERROR}{message}\n")


# -- copies -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", EVERY_BYTE], ids=["empty", "every-byte"])
def test_copy_in_and_back_out_is_exact(cp: Runner, tmp_path: Path, data: bytes) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    there = tmp_path / "there.bin"
    assert cp(str(source), f":{there}") == Outcome(0, b"", "")
    assert there.read_bytes() == data
    back = tmp_path / "back.bin"
    assert cp(f":{there}", str(back)) == Outcome(0, b"", "")
    assert back.read_bytes() == data


def test_three_mib_of_random_bytes_in_and_out(cp: Runner, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024)
    (tmp_path / "random.bin").write_bytes(data)
    assert cp("random.bin", ":there.bin") == Outcome(0, b"", "")  # relative: the default working directory
    assert (tmp_path / "there.bin").read_bytes() == data
    assert cp(":there.bin", "back.bin") == Outcome(0, b"", "")
    assert (tmp_path / "back.bin").read_bytes() == data


def test_stdin_in(tmp_path: Path) -> None:
    there = tmp_path / "from-stdin.bin"
    assert cp_process("-", f":{there}", stdin=EVERY_BYTE) == Outcome(0, b"", "")
    assert there.read_bytes() == EVERY_BYTE


def test_stdout_out(tmp_path: Path) -> None:
    there = tmp_path / "there.bin"
    there.write_bytes(EVERY_BYTE)
    assert cp_process(f":{there}", "-") == Outcome(0, EVERY_BYTE, "")


def test_out_to_a_local_directory_takes_the_remote_name(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file.bin").write_bytes(EVERY_BYTE)
    (tmp_path / "local").mkdir()
    assert cp(":sub/file.bin", "local") == Outcome(0, b"", "")
    assert os.listdir(tmp_path / "local") == ["file.bin"]
    assert (tmp_path / "local" / "file.bin").read_bytes() == EVERY_BYTE


@pytest.mark.parametrize("dest", [":remote/", ":remote"], ids=["trailing-slash", "existing-directory"])
def test_in_to_a_remote_directory_takes_the_local_name(cp: Runner, tmp_path: Path, dest: str) -> None:
    (tmp_path / "remote").mkdir()
    (tmp_path / "local.bin").write_bytes(EVERY_BYTE)
    assert cp(str(tmp_path / "local.bin"), dest) == Outcome(0, b"", "")
    assert os.listdir(tmp_path / "remote") == ["local.bin"]
    assert (tmp_path / "remote" / "local.bin").read_bytes() == EVERY_BYTE


def test_in_to_colon_alone_is_the_default_working_directory(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "local.bin").write_bytes(EVERY_BYTE)
    assert cp("sub/local.bin", ":") == Outcome(0, b"", "")
    assert (tmp_path / "local.bin").read_bytes() == EVERY_BYTE


def test_stdin_to_a_remote_directory_is_refused_before_reading(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    assert cp("-", ":remote/") == error(
        "cp: DEST ':remote/' names a directory and stdin has no file name: write DEST as :remote/NAME"
    )
    assert os.listdir(tmp_path / "remote") == []


def test_parents_makes_the_directories(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "local.bin").write_bytes(EVERY_BYTE)
    deep = tmp_path / "a" / "b" / "c.bin"
    assert cp("local.bin", f":{deep}") == error(
        f":{deep}: file_not_found: cannot write {deep}: No such file or directory"
    )
    assert not (tmp_path / "a").exists()
    assert cp("--parents", "local.bin", f":{deep}") == Outcome(0, b"", "")
    assert deep.read_bytes() == EVERY_BYTE


def test_relative_remote_paths_are_under_cwd(cp: Runner, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "rel").mkdir(parents=True)
    (tmp_path / "local.bin").write_bytes(EVERY_BYTE)
    assert cp("--cwd", str(work), "local.bin", ":rel/in.bin") == Outcome(0, b"", "")
    assert (work / "rel" / "in.bin").read_bytes() == EVERY_BYTE
    assert not (tmp_path / "rel").exists()
    assert cp("--cwd", str(work), ":rel/in.bin", "out.bin") == Outcome(0, b"", "")
    assert (tmp_path / "out.bin").read_bytes() == EVERY_BYTE


def test_an_existing_local_file_is_replaced_whole_and_keeps_its_mode(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "there.bin").write_bytes(EVERY_BYTE)
    local = tmp_path / "dest" / "file.bin"
    local.parent.mkdir()
    local.write_bytes(b"old contents, longer than nothing" * 100)
    local.chmod(0o640)
    assert cp(":there.bin", str(local)) == Outcome(0, b"", "")
    assert local.read_bytes() == EVERY_BYTE
    assert stat.S_IMODE(local.stat().st_mode) == 0o640
    assert os.listdir(local.parent) == ["file.bin"]  # no temporary file left beside it


def test_a_new_local_file_has_the_mode_the_umask_leaves(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "there.bin").write_bytes(EVERY_BYTE)
    before = os.umask(0o027)
    try:
        assert cp(":there.bin", "new.bin") == Outcome(0, b"", "")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o640  # not mkstemp's 0o600


def test_a_local_link_is_written_through(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "there.bin").write_bytes(EVERY_BYTE)
    (tmp_path / "target.bin").write_bytes(b"old")
    (tmp_path / "link").symlink_to("target.bin")
    assert cp(":there.bin", "link") == Outcome(0, b"", "")
    assert os.readlink(tmp_path / "link") == "target.bin"
    assert (tmp_path / "target.bin").read_bytes() == EVERY_BYTE


def test_a_local_fifo_is_written_into_not_replaced(cp: Runner, tmp_path: Path) -> None:
    """A device or FIFO as DEST (``/dev/null``, ``<(...)``) has nothing to rename over: written into."""
    (tmp_path / "there.bin").write_bytes(EVERY_BYTE)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader there, so the write does not wait
    try:
        assert cp(":there.bin", str(fifo)) == Outcome(0, b"", "")
        received = os.read(reader, 65_536)
    finally:
        os.close(reader)
    assert received == EVERY_BYTE
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


# -- errors -----------------------------------------------------------------------------------------


def test_missing_remote_file(cp: Runner, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert cp(f":{missing}", "out.bin") == error(
        f":{missing}: file_not_found: cannot read {missing}: No such file or directory"
    )
    assert not (tmp_path / "out.bin").exists()


def test_missing_or_unreadable_local_source(cp: Runner, tmp_path: Path) -> None:
    assert cp("nope.bin", ":there.bin") == error("cannot read nope.bin: No such file or directory")
    (tmp_path / "dir").mkdir()
    assert cp("dir", ":there.bin") == error("cannot read dir: Is a directory")
    assert sorted(os.listdir(tmp_path)) == ["dir"]


ONE_SIDE = "cp: exactly one of SRC and DEST must be a path where commands run, written :PATH"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            (":a", ":b"),
            f"{ONE_SIDE} (both are; a local name that starts with ':' is written ./:NAME)",
            id="both",
        ),
        pytest.param(("a", "b"), f"{ONE_SIDE} (neither is)", id="neither"),
        pytest.param(("-", "-"), f"{ONE_SIDE} (neither is)", id="stdin-to-stdout"),
        pytest.param((":", "b"), "cp: SRC ':' names no file: write :PATH", id="colon-alone-as-source"),
    ],
)
def test_usage_errors(cp: Runner, tmp_path: Path, args: tuple[str, str], message: str) -> None:
    (tmp_path / "a").write_bytes(b"a")
    assert cp(*args) == error(message)
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_a_file_over_max_file_bytes(cp: Runner, tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text('backend = "local"\nmax_file_bytes = 1024\n')
    data = bytes(range(256)) * 4  # 1024 bytes
    (tmp_path / "fits.bin").write_bytes(data)
    (tmp_path / "big.bin").write_bytes(data + b"!")
    assert cp("--config", str(config), ":fits.bin", "-") == Outcome(0, data, "")
    big = tmp_path / "big.bin"
    assert cp("--config", str(config), ":big.bin", "out.bin") == error(
        f":big.bin: file_too_large: {big} holds 1025 bytes, more than max_file_bytes (1024)"
    )
    assert not (tmp_path / "out.bin").exists()


def test_another_user_is_passed_to_the_backend(cp: Runner, tmp_path: Path) -> None:
    (tmp_path / "there.bin").write_bytes(b"x")
    result = cp("--user", "dsh-no-such-user", ":there.bin", "out.bin")
    assert (result.code, result.out) == (2, b"")
    assert result.err.startswith(f"{ERROR}cannot run the command as user 'dsh-no-such-user': ")
    assert result.err.count("\n") == 1
    assert not (tmp_path / "out.bin").exists()


def test_an_unwritable_stdout(tmp_path: Path) -> None:
    (tmp_path / "there.bin").write_bytes(b"x")
    with open("/dev/full", "wb") as full:
        result = cp_process(":there.bin", "-", stdout=full.fileno())
    assert result == error("cannot write stdout: No space left on device")


def test_stdout_whose_reader_went_away(tmp_path: Path) -> None:
    """As for ``run``: status 141, nothing said (``dsh-bash cp :FILE - | head -c 1`` with a short head)."""
    (tmp_path / "there.bin").write_bytes(EVERY_BYTE)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = cp_process(":there.bin", "-", stdout=write_end)
    finally:
        os.close(write_end)
    assert result == Outcome(141, b"", "")
