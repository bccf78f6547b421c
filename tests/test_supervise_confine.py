"""dsh-supervise's --confine step (protocol 10, native/confine.c; docs/design/policy.md section 2): the
command's own process restricts itself with Landlock, no_new_privs and rlimits, then execs the
command. Each test runs the installed binary on this machine (Landlock ABI 1 or later), as root: the
rules hold for root too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from dsh_bash.supervisor import confine_probe_argv, landlock_abi_from_probe, supervisor_binary

BINARY = str(supervisor_binary())  # bin/test builds it before the tests run


def _confined(options: list[str], script: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BINARY, "--confine", *options, "--", "bash", "--noprofile", "--norc", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """work/ (writable), home/.ssh/id (denied), home/readme, other/ (neither)."""
    for name in ("work", "home/.ssh", "other"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "home/.ssh/id").write_text("secret")
    (tmp_path / "home/readme").write_text("fine")
    (tmp_path / "other/present").write_text("present")
    return tmp_path


def test_the_probe_names_the_landlock_abi() -> None:
    done = subprocess.run(
        [BINARY, "--confine", "--probe"], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 0
    word, abi = done.stdout.split()
    assert word == "landlock" and int(abi) >= 1  # MECHANICS.md: ABI 7 on these machines
    assert landlock_abi_from_probe(done.returncode, done.stdout.encode()) == int(abi)
    # A binary without the step (protocol 9 and older) answers with a usage error: no Landlock.
    assert landlock_abi_from_probe(125, b"") == 0
    assert landlock_abi_from_probe(0, b"dsh-supervise 9\n") == 0
    assert confine_probe_argv(BINARY) == [BINARY, "--confine", "--probe"]


def test_writes_go_only_beneath_the_writable_paths(tree: Path) -> None:
    script = f"""
    cd {tree}
    echo in > work/new && echo wrote-inside
    echo out > other/new || echo refused-new
    echo out >> other/present || echo refused-append
    mv work/new other/moved || echo refused-move-out
    mv other/present work/taken || echo refused-move-in
    ln other/present work/hard || echo refused-link
    rm other/present || echo refused-remove
    mkdir other/d || echo refused-mkdir
    """
    done = _confined(["--write", str(tree / "work")], script)
    assert done.stdout.split() == [
        "wrote-inside", "refused-new", "refused-append", "refused-move-out", "refused-move-in",
        "refused-link", "refused-remove", "refused-mkdir",
    ], done.stderr  # fmt: skip
    assert (tree / "other/present").read_text() == "present"
    assert sorted(p.name for p in (tree / "other").iterdir()) == ["present"]


def test_a_denied_path_cannot_be_read_by_any_way_in_nor_written(tree: Path) -> None:
    (tree / "work/link").symlink_to(tree / "home/.ssh/id")
    secret = tree / "home/.ssh/id"
    unshare = shutil.which("unshare")  # util-linux: a child in new user and mount namespaces
    assert unshare is not None
    script = f"""
    cat {secret} || echo refused-direct
    cat {tree}/work/link || echo refused-link
    cat /proc/self/root{secret} || echo refused-proc-root
    cat {tree}/home/../home/.ssh/id || echo refused-dotdot
    ln {secret} {tree}/work/hard || echo refused-hard-link
    {unshare} -Urm cat {secret} || echo refused-namespace
    echo planted > {tree}/home/.ssh/authorized_keys || echo refused-write
    cat {tree}/home/readme; echo
    ls -A {tree}/home | tr '\\n' ' '; echo
    """
    done = _confined(["--write", str(tree / "work"), "--deny-read", str(tree / "home/.ssh")], script)
    lines = done.stdout.splitlines()
    assert lines[:7] == [
        "refused-direct", "refused-link", "refused-proc-root", "refused-dotdot", "refused-hard-link",
        "refused-namespace", "refused-write",
    ], done.stderr  # fmt: skip
    assert lines[7:] == ["fine", ".ssh readme "], "the rest of the tree reads as before"
    assert "secret" not in done.stdout
    assert not (tree / "home/.ssh/authorized_keys").exists()


def test_a_writable_directory_on_the_way_to_a_denied_one_keeps_its_other_entries_writable(tree: Path) -> None:
    """The working directory is the user's home, and ~/.ssh is denied: home's entries stay writable,
    ~/.ssh is neither readable nor writable; a new entry right in home is refused (listing only)."""
    home = tree / "home"
    (home / "project").mkdir()
    script = f"""
    echo ok > {home}/project/f && echo wrote-beneath
    echo more >> {home}/readme && echo appended-sibling
    cat {home}/.ssh/id || echo refused-read
    echo x > {home}/.ssh/id || echo refused-write
    echo x > {home}/new-entry || echo refused-new-entry
    """
    done = _confined(["--write", str(home), "--deny-read", str(home / ".ssh")], script)
    assert done.stdout.split() == [
        "wrote-beneath",
        "appended-sibling",
        "refused-read",
        "refused-write",
        "refused-new-entry",
    ], done.stderr
    assert (home / ".ssh/id").read_text() == "secret"


def test_a_command_cannot_lift_the_rules_for_itself_or_its_children(tree: Path) -> None:
    """A nested --confine that names more writable paths adds a layer: it narrows, never widens;
    no_new_privs holds (a setuid program cannot shed the rules); signals to processes outside are
    refused (Landlock's scoping, ABI 6), to its own children not."""
    script = f"""
    {BINARY} --confine --write / -- bash -c 'echo x > {tree}/other/new' || echo refused-after-nesting
    grep -q '^NoNewPrivs:[[:space:]]*1' /proc/self/status && echo no-new-privs
    kill -0 {os.getpid()} || echo refused-signal-out
    sleep 30 & kill $! && wait $!; echo own-child-$?
    """
    done = _confined(["--write", str(tree / "work")], script)
    assert done.stdout.split() == [
        "refused-after-nesting",
        "no-new-privs",
        "refused-signal-out",
        f"own-child-{128 + signal.SIGTERM}",
    ], done.stderr
    assert not (tree / "other/new").exists()


def test_limits_hold_soft_and_hard(tree: Path) -> None:
    script = f"""
    ulimit -n; ulimit -Hn; ulimit -v; ulimit -f
    ulimit -Hn 4096 || echo refused-raise
    head -c 4096 /dev/zero > {tree}/work/big; echo file-status-$?
    """
    limits = ["--open-files", "64", "--memory-bytes", str(2**30), "--file-bytes", "2048"]
    done = _confined(["--write", str(tree / "work"), *limits], script)
    # bash's ulimit -f counts KiB: 2048 bytes are 2; the write past them dies of SIGXFSZ.
    assert done.stdout.split() == [
        "64",
        "64",
        str(2**30 // 1024),
        "2",
        "refused-raise",
        f"file-status-{128 + signal.SIGXFSZ}",
    ], done.stderr
    assert (tree / "work/big").stat().st_size == 2048


def test_cpu_time_is_limited() -> None:
    done = _confined(["--cpu-seconds", "1"], "while :; do :; done", timeout=30)
    assert done.returncode == -signal.SIGXCPU, done  # bash itself was exec'd: it dies of the signal


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--write", "relative", "--", "true"], "absolute"),
        (["--cpu-seconds", "-1", "--", "true"], "number"),
        (["--bogus", "x", "--", "true"], "not one of its options"),
        (["--write", "/tmp"], "usage"),
        (["--", "/no/such/program"], "cannot run"),
    ],
)
def test_what_cannot_be_applied_is_refused_and_nothing_runs(options: list[str], said: str) -> None:
    done = subprocess.run(
        [BINARY, "--confine", *options], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 125 and said in done.stderr, done


def test_a_path_that_does_not_exist_is_skipped(tree: Path) -> None:
    done = _confined(
        ["--write", str(tree / "work"), "--write", "/no/such/dir", "--deny-read", "/no/such/secret"],
        f"echo x > {tree}/work/f && echo ran",
    )
    assert done.stdout == "ran\n", done.stderr


def test_a_path_under_home_is_the_commands_home(tree: Path) -> None:
    done = subprocess.run(
        [BINARY, "--confine", "--write", "/", "--deny-read", "~/.ssh", "--", "cat", f"{tree}/home/.ssh/id"],
        env={**os.environ, "HOME": str(tree / "home")},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert done.returncode == 1 and "Permission denied" in done.stderr, done
