"""The SSH boot script's environment sweep, run by a local bash (no sshd needed).

BOOT un-exports every variable of the login shell before it exports the policy's environment. Its
fast way asks bash for the exported names (``compgen -e`` into a scratch file in the private
directory) and then checks with ``compgen -e`` that nothing is left exported; when the scratch file
cannot be used, or its list was incomplete, BOOT sweeps every variable by prefix. These tests run
the real boot line as a login shell would and compare what the command sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dsh_bash_ssh import _scripts

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

SECRET = "DSHBOOT_SECRET_TOKEN"
LOGIN_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/nonexistent-home",
    "LANG": "C.UTF-8",
    SECRET: "s3cr3t-value",
    "DSHBOOT_OTHER_SECRET": "another-value",
}
#: The policy's environment for the command: kept login names, then the library's own entries.
KEEP = "PATH HOME LANG"
PUBLIC = ("PAGER=cat", "SHLVL=1")


def _run_boot(spill: Path, *, login_env: dict[str, str] | None = None, prefix: str = "") -> str:
    """The command's environment (``env``, sorted) when BOOT runs in a login bash with ``login_env``."""
    line = _scripts.boot_line(
        str(spill), "0123456789abcdef", "fg", "env", "/", "dsh-boot-test-1", "0", "0", KEEP, *PUBLIC
    )
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", prefix + line],
        env=login_env if login_env is not None else LOGIN_ENV,
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 0, result
    out = result.stdout
    marker = b"\0dsh-bash-boot-ok\0"
    assert marker in out, out
    lines = out.split(marker, 1)[1].decode().splitlines()
    return "\n".join(sorted(line for line in lines if not line.startswith("_=")))


def _expected() -> set[str]:
    return {
        "PATH=/usr/bin:/bin",
        "HOME=/nonexistent-home",
        "LANG=C.UTF-8",
        "PAGER=cat",
        "DSH_BASH_MARK=dsh-boot-test-1",
    }


@pytest.fixture
def spill(tmp_path: Path) -> Path:
    directory = tmp_path / "spill"
    directory.mkdir(mode=0o700)
    (directory / "exported-names").write_text("")
    return directory


def _names_in_env(env_text: str) -> set[str]:
    return {line.split("=", 1)[0] for line in env_text.splitlines()}


def test_the_fast_sweep_leaves_only_the_policy(spill: Path) -> None:
    env_text = _run_boot(spill)
    assert SECRET not in env_text
    expected_names = {entry.split("=", 1)[0] for entry in _expected()} | {"SHLVL"}
    assert _names_in_env(env_text) - {"PWD", "OLDPWD"} == expected_names
    assert set(env_text.splitlines()) >= _expected()
    # The fast way was taken: the scratch file holds the login's exported names.
    assert SECRET in (spill / "exported-names").read_text().split()


@pytest.mark.parametrize("plant", ["missing", "fifo", "dangling-link", "link-to-file", "directory"])
def test_an_unusable_scratch_file_falls_back_without_hanging(spill: Path, plant: str) -> None:
    baseline = _run_boot(spill)
    scratch = spill / "exported-names"
    scratch.unlink()
    if plant == "fifo":
        os.mkfifo(scratch)
    elif plant == "dangling-link":
        scratch.symlink_to(spill / "nowhere")
    elif plant == "link-to-file":
        target = spill / "elsewhere"
        target.write_text("")
        scratch.symlink_to(target)
    elif plant == "directory":
        scratch.mkdir()
    assert _run_boot(spill) == baseline
    if plant == "link-to-file":
        assert (spill / "elsewhere").read_text() == "", "BOOT wrote through a planted link"


def test_an_incomplete_name_list_is_caught_by_the_check(spill: Path) -> None:
    """compgen's write fails (file size limit): the stale list names only HOME; the check after the
    un-export sees what is still exported and the full sweep runs."""
    (spill / "exported-names").write_text("HOME\n")
    assert SECRET not in _run_boot(spill, prefix="trap '' XFSZ; ulimit -f 0; ")
    assert (spill / "exported-names").read_text() == "HOME\n", "the write was meant to fail"


def test_the_check_is_what_catches_an_incomplete_list(spill: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the check, the same incomplete list leaks the secret: the case above can fail."""
    fg = _scripts._BOOT_FG_QUOTED
    check = "builtin compgen -e >/dev/null 2>&1"
    assert check in fg
    monkeypatch.setattr(_scripts, "_BOOT_FG_QUOTED", fg.replace(check, "false"))
    (spill / "exported-names").write_text("HOME\n")
    assert SECRET in _run_boot(spill, prefix="trap '' XFSZ; ulimit -f 0; ")


def test_a_login_without_exported_variables(spill: Path) -> None:
    env_text = _run_boot(spill, login_env={})
    assert "DSH_BASH_MARK=dsh-boot-test-1" in env_text.splitlines()
