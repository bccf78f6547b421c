"""The SSH boot script's environment sweep, run by a local bash (no sshd needed).

BOOT un-exports every variable of the login shell before it exports the policy's environment. Its
fast way un-exports the names the login exported at connect (a file SETUP wrote in the private
directory) and then checks with ``compgen -e`` that nothing is left exported; when something is,
or the file cannot be used, BOOT sweeps every variable by prefix. These tests run the real boot
line (or BOOT itself) as a login shell would and compare what the command sees.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from dsh_bash_ssh import _scripts
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_bash.remote import find_boot_ok
from dsh_bash.supervisor import supervisor_binary

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
EXPECTED = {
    "PATH=/usr/bin:/bin",
    "HOME=/nonexistent-home",
    "LANG=C.UTF-8",
    "PAGER=cat",
    "DSH_BASH_MARK=dsh-boot-test-1",
}
#: The prefix sweep BOOT falls back to, and the check that decides it.
SWEEP = "builtin declare +x -- ${!_@}"
CHECK = "builtin compgen -e ||"
ARGS = ("0123456789abcdef", "fg", "env", "/", "dsh-boot-test-1", "0", "0", KEEP, "", *PUBLIC)


def _run(
    spill: Path, *, prefix: str = "", without: str = "", raw: bool = False, env: dict[str, str] | None = None
) -> str:
    """The command's environment (``env`` output, sorted, without ``_``) when the boot line runs in
    a login bash with ``env`` (LOGIN_ENV by default) after ``prefix``; ``without``: a piece of BOOT
    replaced by ``false``; ``raw``: BOOT itself is evaluated, without the boot line's checks."""
    if raw:
        script = _scripts.boot_script(detached=False, header=False, long=False, stdin=False)
        line = f"set -- {shlex.join([str(spill), *ARGS])}; eval {shlex.quote(script)}"
    else:
        line = _scripts.boot_line(str(spill), *ARGS)
    if without:
        assert without in line
        line = line.replace(without, "false")
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", prefix + line],
        env=LOGIN_ENV if env is None else env,
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 0, result
    marker = b"\0dsh-bash-boot-ok\0"
    assert marker in result.stdout, result
    lines = result.stdout.split(marker, 1)[1].decode().splitlines()
    return "\n".join(sorted(line for line in lines if not line.startswith("_=")))


def _names(env_text: str) -> set[str]:
    return {line.split("=", 1)[0] for line in env_text.splitlines()}


@pytest.fixture
def spill(tmp_path: Path) -> Path:
    """A private directory as SETUP leaves it: the login's exported names in ``exported-names``."""
    directory = tmp_path / "spill"
    directory.mkdir(mode=0o700)
    names = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", "compgen -e"], env=LOGIN_ENV, capture_output=True, check=True
    ).stdout
    (directory / "exported-names").write_bytes(names)
    return directory


def _assert_policy(env_text: str) -> None:
    assert SECRET not in env_text
    assert _names(env_text) - {"PWD", "OLDPWD"} == _names("\n".join(EXPECTED)) | {"SHLVL"}
    assert set(env_text.splitlines()) >= EXPECTED


def test_the_fast_way_alone_leaves_only_the_policy(spill: Path) -> None:
    _assert_policy(_run(spill, without=SWEEP))


def test_the_sweep_alone_leaves_only_the_policy(spill: Path) -> None:
    (spill / "exported-names").unlink()
    _assert_policy(_run(spill))


@pytest.mark.parametrize("plant", ["missing", "empty", "fifo", "dangling-link", "link-to-file", "directory"])
def test_an_unusable_names_file_falls_back_without_hanging(spill: Path, plant: str) -> None:
    names = spill / "exported-names"
    if plant != "empty":
        names.unlink()
    if plant == "empty":
        names.write_text("")
    elif plant == "fifo":
        os.mkfifo(names)
    elif plant == "dangling-link":
        names.symlink_to(spill / "nowhere")
    elif plant == "link-to-file":
        target = spill / "elsewhere"
        target.write_text("HOME\n")
        names.symlink_to(target)
    elif plant == "directory":
        names.mkdir()
    _assert_policy(_run(spill))


def test_a_name_exported_after_connect_is_caught_by_the_check(spill: Path) -> None:
    """An rc file exports a name SETUP did not see: the check finds it exported, the sweep runs."""
    _assert_policy(_run(spill, prefix=f"export {SECRET}_LATER=late; "))
    assert f"{SECRET}_LATER" not in _run(spill, prefix=f"export {SECRET}_LATER=late; ")


def test_without_the_check_a_late_name_leaks(spill: Path) -> None:
    """The case above can fail: without the check, the name exported after connect reaches the command."""
    leaked = _run(spill, prefix=f"export {SECRET}_LATER=late; ", without=CHECK)
    assert f"{SECRET}_LATER=late" in leaked


def test_a_bash_without_compgen_gets_the_sweep(spill: Path) -> None:
    """`builtin compgen` failing (status 1, as for "nothing exported") must not pass for a clean
    environment: BOOT itself sweeps (and the boot line runs it in a clean bash instead)."""
    names = spill / "exported-names"
    names.write_text("HOME\n")  # incomplete: only the sweep can make it right
    _assert_policy(_run(spill, prefix="enable -n compgen; ", raw=True))
    _assert_policy(_run(spill, prefix="enable -n compgen; "))


def test_a_login_without_exported_variables(spill: Path) -> None:
    assert "DSH_BASH_MARK=dsh-boot-test-1" in _run(spill, env={}).splitlines()


# -- the warm channel: a bash with an empty environment, waiting for its request --------------------

#: A warm request's arguments: no header, no kept names; the whole environment as entries.
WARM_ARGS = (
    "0123456789abcdef", "fg", "env", "/", "dsh-boot-test-1", "0", "0", "", "",
    "PATH=/usr/bin:/bin", "HOME=/nonexistent-home", "LANG=C.UTF-8", *PUBLIC,
)  # fmt: skip


def _warm_args(spill: Path, *, command: str = "env", stdin: bool = False) -> tuple[str, ...]:
    return (str(spill), WARM_ARGS[0], WARM_ARGS[1], command, WARM_ARGS[3], WARM_ARGS[4],
            "1" if stdin else "0", *WARM_ARGS[6:])  # fmt: skip


#: The stat program the SSH install finds (never PATH's), as BOOT and the warm line run it.
STAT = next((path for path in ("/usr/bin/stat", "/bin/stat") if os.access(path, os.X_OK)), "stat")
#: Which waits on a warm channel: a bash (WAITER), or `dsh-supervise --warm` (under the supervisor).
WAITERS = ["bash", "supervisor"]


def _identity(path: str) -> str:
    done = subprocess.run(
        [STAT, "-c", _scripts.IDENTITY_FORMAT, "--", path],
        env={"TZ": "UTC0", "LC_ALL": "C"},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def _warm_line(waiter: str, identity: str | None = None) -> str:
    if waiter == "bash":
        return _scripts.warm_line()
    binary = supervisor_binary()
    if binary is None:
        pytest.skip("no dsh-supervise build for this machine")
    identity = identity if identity is not None else _identity(str(binary))
    return _scripts.warm_line(str(binary), (STAT, identity))


def _start_warm(
    prefix: str = "",
    *,
    login_shell: tuple[str, ...] = ("bash", "--noprofile", "--norc"),
    waiter: str = "bash",
    as_nobody: bool = False,
) -> subprocess.Popen[bytes]:
    """A warm channel's login shell (LOGIN_ENV), once it waits (READY read)."""
    process = subprocess.Popen(
        [*login_shell, "-c", prefix + _warm_line(waiter)],
        env=LOGIN_ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **(_NOBODY if as_nobody else {}),
    )
    assert process.stdout is not None
    assert process.stdout.read(len(_scripts.READY)) == _scripts.READY
    return process


def _run_warm(
    request: bytes,
    *,
    prefix: str = "",
    stdin: bytes = b"",
    process: subprocess.Popen[bytes] | None = None,
    waiter: str = "bash",
) -> bytes:
    """What the command printed when a warm channel (``process``, else a new one) gets ``request``
    (then ``stdin``)."""
    process = process or _start_warm(prefix, waiter=waiter)
    out, err = process.communicate(request + stdin, timeout=20)
    assert process.returncode == 0, (out, err)
    # BOOT's first words: its BOOT_AT record (the command's start, for kills) and BOOT_OK.
    found = find_boot_ok(out)
    assert found is not None and found[0] == 0 and found[2] is not None, (out, err)
    return out[found[1] :]


def test_a_warm_channel_waits_without_the_logins_environment(spill: Path) -> None:
    process = _start_warm(prefix=f"export {SECRET}_LATER=late; ")
    try:
        environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
    finally:
        process.kill()
        process.communicate()
    assert SECRET.encode() not in environ, environ
    assert b"s3cr3t-value" not in environ + cmdline
    assert b"dsh-bash-ready" in cmdline  # the waiter itself was looked at


@pytest.mark.parametrize("waiter", WAITERS)
def test_a_warm_channel_gives_the_request_environment(spill: Path, waiter: str) -> None:
    out = _run_warm(_scripts.boot_request(_warm_args(spill), None), waiter=waiter).decode()
    _assert_policy("\n".join(sorted(line for line in out.splitlines() if not line.startswith("_="))))


@pytest.mark.parametrize(
    "command",
    [
        "printf '%s|' \"$0\" 'single' \"double\" $'tab\\there'",
        "printf '%s\\n' 'é€😀'",
        "printf '\\377\\376 odd bytes\\n'",
        "echo 'line one'\necho \"line two\" # comment\n",
        "x='$HOME `id` $(id) \\\\ !'; printf '%s' \"$x\"",
    ],
)
@pytest.mark.parametrize("waiter", WAITERS)
def test_a_warm_channel_runs_any_command_text(spill: Path, command: str, waiter: str) -> None:
    warm = _run_warm(_scripts.boot_request(_warm_args(spill, command=command), None), waiter=waiter)
    cold = subprocess.run(["bash", "--noprofile", "--norc", "-c", command], capture_output=True, check=False)
    assert warm == cold.stdout


@pytest.mark.parametrize("waiter", WAITERS)
def test_a_warm_channel_runs_a_long_command_from_a_file(spill: Path, waiter: str) -> None:
    command = "printf '%s' '" + "x" * 200_000 + "' | wc -c"
    args = _warm_args(spill, command="")
    assert _run_warm(_scripts.boot_request(args, command), waiter=waiter).strip() == b"200000"
    assert (spill / f"{WARM_ARGS[0]}.cmd").read_text() == command


@pytest.mark.parametrize("waiter", WAITERS)
def test_a_warm_channel_leaves_stdin_to_the_command(spill: Path, waiter: str) -> None:
    request = _scripts.boot_request(_warm_args(spill, command="cat", stdin=True), None)
    assert _run_warm(request, stdin=b"data\0for cat\n", waiter=waiter) == b"data\0for cat\n"


@pytest.mark.parametrize("waiter", WAITERS)
def test_a_warm_channel_closed_unused_exits_quietly(waiter: str) -> None:
    # Nothing, a cut length, a length that is not digits, a cut request.
    for request in (b"", b"00000", b"00000x0009", b"0000000009builtin"):
        process = _start_warm(waiter=waiter)
        out, _ = process.communicate(request, timeout=20)
        assert (process.returncode, out) == (0, b""), out


#: Popen's arguments for the same unprivileged user on both sides (the waiter and the taker-over).
_NOBODY: dict[str, Any] = {"user": 65534, "group": 65534, "extra_groups": []}


#: A login's channel: the warm line run by a login shell whose stdin and stdout are pipes of the user's.
_CHANNEL = 'sleep 60 | bash --noprofile --norc -c "$1" | cat >/dev/null'


def _waiting_spare(waiter: str) -> int:
    """The pid of user 65534's process waiting as a warm channel's ``waiter`` (within 5 s)."""

    def waits(argv: list[bytes]) -> bool:
        if waiter == "supervisor":  # dsh-supervise --warm BASH
            return len(argv) == 3 and argv[1] == b"--warm"
        return argv[-1:] == [b"dsh-bash"] and b"dsh-bash-ready" in argv[-2]  # bash -c WAITER dsh-bash

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
                if entry.stat().st_uid == 65534 and waits(argv):
                    return int(entry.name)
            except OSError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"no {waiter} waiter of user 65534 within 5 s")


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an unprivileged user (65534) for both sides")
def test_a_supervised_warm_channel_cannot_be_taken_over_by_the_same_user(spill: Path) -> None:
    """Issue 30: a command of the login opened the waiting spare's fds (or ptraced it), read the next
    command's request and answered in its place. Under the supervisor a process of the same user can
    neither open its fds nor read its environment (the login's) or its memory; a bash waiter
    (WAITER, without the supervisor) can be read by it (shown first: the attack itself works)."""
    attack = (
        'for path in fd/0 fd/1 environ; do if { : < "/proc/$1/$path"; } 2>/dev/null; '
        'then echo "$path opened"; else echo "$path refused"; fi; done'
    )
    results = {}
    for waiter in WAITERS:
        # As under sshd, the channel's pipes belong to the login: the user's own bash makes them.
        wrapper = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-c", _CHANNEL, "wrapper", _warm_line(waiter)],
            env=LOGIN_ENV,
            start_new_session=True,
            **_NOBODY,
        )  # fmt: skip
        try:
            pid = _waiting_spare(waiter)
            done = subprocess.run(
                ["bash", "--noprofile", "--norc", "-c", attack, "attack", str(pid)],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
                **_NOBODY,
            )
        finally:
            os.killpg(wrapper.pid, 9)
            wrapper.wait()
        results[waiter] = done.stdout
    assert "fd/0 opened" in results["bash"], results  # the attack, on the waiter that allows it
    assert "opened" not in results["supervisor"] and "fd/0 refused" in results["supervisor"], results


def test_a_replaced_supervisor_never_becomes_a_warm_channels_waiter() -> None:
    """The warm line checks the supervisor's file as BOOT does: another identity than the install's
    (the file replaced by a command) and the line ends at once, having printed nothing: no request
    ever reaches what replaced it."""
    process = subprocess.Popen(
        ["bash", "--noprofile", "--norc", "-c", _warm_line("supervisor", identity="0:0:0:not-the-install")],
        env=LOGIN_ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = process.communicate(b"0000000005exit\n", timeout=20)
    assert (process.returncode, out, err) == (0, b"", b"")


# -- a login shell that is not bash ---------------------------------------------------------------

needs_dash = pytest.mark.skipif(shutil.which("dash") is None, reason="needs dash (a POSIX sh login shell)")


@needs_dash
def test_a_posix_sh_login_runs_the_boot_line_in_a_clean_bash(spill: Path) -> None:
    line = _scripts.boot_line(str(spill), *ARGS)
    result = subprocess.run(["dash", "-c", line], env=LOGIN_ENV, capture_output=True, timeout=20, check=False)
    assert result.returncode == 0, result
    _, ok, out = result.stdout.partition(b"\0dsh-bash-boot-ok\0")
    assert ok, result
    _assert_policy("\n".join(sorted(x for x in out.decode().splitlines() if not x.startswith("_="))))


@needs_dash
def test_a_posix_sh_login_gives_a_warm_channel_an_empty_environment(spill: Path) -> None:
    process = _start_warm(login_shell=("dash",))
    assert SECRET.encode() not in Path(f"/proc/{process.pid}/environ").read_bytes()
    out = _run_warm(_scripts.boot_request(_warm_args(spill), None), process=process).decode()
    _assert_policy("\n".join(sorted(x for x in out.splitlines() if not x.startswith("_="))))


# -- the request's quoting: any text, one word, the same bytes --------------------------------------


def _from_bytes(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.binary(max_size=40).map(_from_bytes))
def test_a_request_word_is_any_text_exactly(text: str) -> None:
    """What BOOT's `set --` gets from a request word is the text's bytes, whatever they are: quotes,
    `$`, backslashes, newlines, non-UTF-8 bytes (surrogate-escaped). Nothing in it runs."""
    if "\0" in text:
        return  # no argument or variable can hold NUL; the executor refuses it earlier
    word = _scripts.ascii_quote(text)
    assert word.isascii()
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", f"printf '%s' {word}"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout == text.encode("utf-8", "surrogateescape")
