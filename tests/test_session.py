"""The sessions' replay and capture (dsh_bash._session), run through a real bash.

Each step wraps a command as a session command, runs it with ``bash --noprofile --norc -c`` (the
capture going to a file, the way a backend on the harness's host gets it), reads the capture back
and computes the next state, as the executor does. These are the helpers' own tests; the seam's
(``BashExecutor.session``) come with the kit's checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_bash._session import (
    SHELL_WORDS,
    CaptureError,
    SessionState,
    defined_names,
    leaves_state_as_is,
    parse_capture,
    parse_exports,
    session_replay,
    state_after,
    wrap_in_session,
)

BASH = shutil.which("bash") or "/bin/bash"
BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KEEP": "base", "LC_ALL": "C"}


def step(
    tmp_path: Path,
    command: str,
    state: SessionState,
    *,
    env: Mapping[str, str] = BASE_ENV,
    explicit_env: tuple[str, ...] = (),
    explicit_cwd: bool = False,
    scrub: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[bytes], SessionState]:
    capture = tmp_path / "capture"
    capture.unlink(missing_ok=True)
    replay = session_replay(state, explicit_env=explicit_env, explicit_cwd=explicit_cwd)
    script = wrap_in_session(command, replay, capture_file=str(capture))
    done = subprocess.run(
        [BASH, "--noprofile", "--norc", "-c", script],
        capture_output=True,
        env=dict(env),
        cwd=str(tmp_path),
        timeout=20,
        check=False,
    )
    after = state_after(
        parse_capture(capture.read_bytes()), env, previous=state, explicit=explicit_env, scrub=scrub, allow=()
    )
    return done, after


def test_directory_variables_and_functions_carry_to_the_next_command(tmp_path: Path) -> None:
    done, state = step(tmp_path, "cd /tmp && export A=1 && f() { echo f; }", SessionState())
    assert done.returncode == 0 and state.cwd == os.path.realpath("/tmp")
    done, state = step(tmp_path, "pwd; echo $A; f", state)
    assert done.stdout == f"{os.path.realpath('/tmp')}\n1\nf\n".encode() and done.stderr == b""
    done, state = step(tmp_path, "unset A", state)
    done, state = step(tmp_path, "echo ${A-gone}", state)
    assert done.stdout == b"gone\n" and "A" not in state.env


def test_a_variable_of_the_base_environment_unset_stays_unset(tmp_path: Path) -> None:
    _, state = step(tmp_path, "unset KEEP; export KEEP2=x", SessionState())
    assert state.unset == ("KEEP",) and state.env == {"KEEP2": "x"}
    done, _ = step(tmp_path, "echo ${KEEP-gone} $KEEP2", state)
    assert done.stdout == b"gone x\n"


def test_options_shopt_aliases_and_umask_carry(tmp_path: Path) -> None:
    _, state = step(
        tmp_path, "set -o pipefail; shopt -s extglob; alias ll='echo aliased'; umask 027", SessionState()
    )
    done, _ = step(
        tmp_path,
        "set -o | grep -w pipefail; shopt extglob; ll; umask; false | true; echo $?",
        state,
    )
    lines = done.stdout.decode().split("\n")
    assert lines[0].split() == ["pipefail", "on"]
    assert lines[1].split() == ["extglob", "on"]
    assert lines[2:5] == ["aliased", "0027", "1"]


def test_a_function_that_needs_extglob_replays(tmp_path: Path) -> None:
    _, state = step(
        tmp_path, "shopt -s extglob\ng() { case x.py in *.@(py|sh)) echo yes;; esac; }", SessionState()
    )
    done, _ = step(tmp_path, "g", state)
    assert done.stdout == b"yes\n" and done.stderr == b""


def test_a_traced_session_shows_the_command_alone(tmp_path: Path) -> None:
    """`set -x` carries, and traces the command, not the prologue nor the capture."""
    _, state = step(tmp_path, "set -x", SessionState())
    done, state = step(tmp_path, "echo hi", state)
    assert done.stdout == b"hi\n" and done.stderr == b"+ echo hi\n"
    assert "set -o xtrace" in state.options


def test_errexit_applies_to_the_command_not_to_the_prologue(tmp_path: Path) -> None:
    _, state = step(tmp_path, "set -e; cd /tmp", SessionState())
    done, _ = step(tmp_path, "false; echo not-reached", state)
    assert done.returncode == 1 and done.stdout == b""


def test_scrubbed_names_never_enter_a_state(tmp_path: Path) -> None:
    _, state = step(
        tmp_path,
        "export GITHUB_TOKEN=t MY_SECRET=s OK=1",
        SessionState(),
        scrub=("*TOKEN*", "*SECRET*"),
    )
    assert state.env == {"OK": "1"}


def test_names_the_request_sets_win_over_the_session_for_that_command(tmp_path: Path) -> None:
    _, state = step(tmp_path, "export A=session B=session; cd /tmp", SessionState())
    request_env = {**BASE_ENV, "A": "request", "B": "request"}
    done, after = step(
        tmp_path, "echo $A; pwd; B=own", state, env=request_env, explicit_env=("A", "B"), explicit_cwd=True
    )
    assert done.stdout == f"request\n{tmp_path.resolve()}\n".encode()
    assert after.env == {"A": "session", "B": "own"}  # B: the command's own change wins


def test_a_directory_that_is_gone_is_said_and_the_command_still_runs(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    _, state = step(tmp_path, f"cd {gone}", SessionState())
    gone.rmdir()
    done, _ = step(tmp_path, "echo ran", state)
    assert done.stdout == b"ran\n"
    assert b"session directory" in done.stderr and str(gone).encode() in done.stderr


def test_the_exit_status_is_the_commands_own(tmp_path: Path) -> None:
    done, _ = step(tmp_path, "exit 7", SessionState())
    assert done.returncode == 7


def test_what_a_command_wrote_to_the_descriptor_before_is_ignored(tmp_path: Path) -> None:
    _, state = step(tmp_path, "echo junk >&19; export B=2", SessionState())
    assert state.env == {"B": "2"}


def test_a_capture_cut_short_or_missing_is_refused() -> None:
    with pytest.raises(CaptureError, match="no state came back"):
        parse_capture(b"junk")
    with pytest.raises(CaptureError, match="cut short"):
        parse_capture(b"\0dsh-session-2\0\0cwd\0/tmp\n\0env\0")


def test_the_double_quoted_form_of_older_bash_parses() -> None:
    data = (
        b'declare -x A="a\\"b\\\\c\\$d\\`e\nf"\n'
        b"declare -x B\n"
        b'export C="3"\n'
        b"declare -rx D=$'\\303\\251\\n'\n"
    )
    assert parse_exports(data) == {"A": 'a"b\\c$d`e\nf', "C": "3", "D": "\u00e9\n"}


def _from_bytes(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30) | st.binary(max_size=30).map(_from_bytes))
def test_any_value_survives_capture_and_replay(tmp_path_factory: pytest.TempPathFactory, value: str) -> None:
    """A value with quotes, `$`, backslashes, newlines, control or non-UTF-8 bytes comes back from
    `export -p` and is replayed into the next shell byte for byte."""
    if "\0" in value:
        return  # no variable holds NUL
    tmp_path = tmp_path_factory.mktemp("value")
    state = SessionState(env={"V": value})
    done, after = step(tmp_path, 'printf %s "$V"', state)
    assert done.stdout == value.encode("utf-8", "surrogateescape")
    assert after.env["V"] == value


def test_a_capture_file_used_again_never_gives_an_earlier_commands_state(tmp_path: Path) -> None:
    """The local backend keeps a session's capture file for its next command, which overwrites it
    in place: a command that never gets to write its own capture (it execs another program) must not
    be read as leaving the state the earlier one wrote there, nor a shorter capture be misread by
    what a longer one left past its end."""
    capture = tmp_path / "capture"
    first = wrap_in_session(
        "export A=$(printf '%0500d' 0)", "", capture_id="first", capture_file=str(capture)
    )
    subprocess.run([BASH, "--noprofile", "--norc", "-c", first], check=True, env=BASE_ENV, timeout=20)
    assert parse_capture(capture.read_bytes(), "first").env["A"] == "0" * 500
    second = wrap_in_session("export B=1", "", capture_id="second", capture_file=str(capture))
    subprocess.run([BASH, "--noprofile", "--norc", "-c", second], check=True, env=BASE_ENV, timeout=20)
    taken = parse_capture(capture.read_bytes(), "second")
    assert taken.env.get("B") == "1" and "A" not in taken.env
    third = wrap_in_session("exec true", "", capture_id="third", capture_file=str(capture))
    subprocess.run([BASH, "--noprofile", "--norc", "-c", third], check=True, env=BASE_ENV, timeout=20)
    with pytest.raises(CaptureError, match="no state came back"):
        parse_capture(capture.read_bytes(), "third")


@pytest.mark.anyio
async def test_a_link_a_command_puts_in_place_of_its_capture_file_is_never_written_through(
    tmp_path: Path,
) -> None:
    """Local: the session's capture file is kept for its next command. A command that replaces it
    with a link to another file must not make the next command's capture overwrite that file."""
    from dsh_bash_local import LocalBashExecutor  # noqa: PLC0415

    from dsh_bash import BashExecRequest  # noqa: PLC0415

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    async with LocalBashExecutor.from_fields(cwd=str(tmp_path)) as ex:
        session = ex.session()
        swap = f'f=$(readlink /proc/$$/fd/19); rm -f "$f"; ln -s {victim} "$f"'
        first = await ex.run(ex.resolve(BashExecRequest(command=swap, session=session)))
        assert first.session is not None and first.session.kept_previous is not None
        second = await ex.run(ex.resolve(BashExecRequest(command="export A=1", session=session)))
        assert second.session is not None and second.session.kept_previous is None
    assert victim.read_text() == "precious\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_name_the_policy_scrubs_after_a_reconfigure_leaves_the_sessions(tmp_path: Path) -> None:
    from dsh_bash_local import LocalBashExecutor  # noqa: PLC0415

    from dsh_bash import DEFAULT_ENV_SCRUB, BashExecRequest  # noqa: PLC0415

    async with LocalBashExecutor.from_fields(cwd=str(tmp_path)) as ex:
        session = ex.session()
        await ex.run(ex.resolve(BashExecRequest(command="export LATER_HIDDEN=1 KEPT=1", session=session)))
        ex.reconfigure(env_scrub=(*DEFAULT_ENV_SCRUB, "LATER_*"))
        seen = await ex.run(
            ex.resolve(BashExecRequest(command='echo "${LATER_HIDDEN-none} $KEPT"', session=session))
        )
        assert seen.stdout.text == "none 1\n"


# -- commands that cannot change the state (run without the capture) ----------------------------------


@pytest.mark.parametrize(
    "command",
    [
        "true",
        "ls -la /tmp",
        "git status",
        "pytest -x tests/",
        "python -m http.server 8000",
        "ls *.py",
        "make CC=clang",
        "  echo done  ",
        "pwd\n",
        "exit 3",
        "./run.sh --fast",
    ],
)
def test_a_plain_command_leaves_the_state_as_is(command: str) -> None:
    assert leaves_state_as_is(command, frozenset())


@pytest.mark.parametrize(
    "command",
    [
        "cd /tmp",
        "export A=1",
        "A=1 ls",
        "x=1",
        "unset A",
        "set -e",
        "shopt -s extglob",
        "umask 077",
        "alias ll=ls",
        "f() { :; }",
        "source env.sh",
        ". env.sh",
        "eval ls",
        "exec ls",
        "printf -v PATH x",
        "read A",
        "command cd /",
        "builtin cd /",
        "declare -x A=1",
        "pushd /",
        "trap x EXIT",
        "enable -n cd",
        "ls; cd /",
        "ls && cd /",
        "ls | cd /",
        "ls\ncd /",
        "echo $(cd /)",
        "echo `cd /`",
        "ls > out",
        "ls 'a b'",
        'ls "$HOME"',
        "echo ${A:=1}",
        "ls # x",
        "(cd /)",
        "{ cd /; }",
        "if true; then :; fi",
        "ls\n\n",
        "",
    ],
)
def test_a_command_that_may_change_the_state_is_captured(command: str) -> None:
    assert not leaves_state_as_is(command, frozenset())


def test_a_command_named_like_a_function_or_alias_of_the_session_is_captured(tmp_path: Path) -> None:
    _, state = step(
        tmp_path,
        "ls() { cd /; }; function my-tool { :; }; function do { :; }; shopt -s expand_aliases; "
        "alias gs='cd /'; alias -- -x=y",
        SessionState(),
    )
    # bash prints a function named by a reserved word as `function do () `.
    assert defined_names(state) == {"ls", "my-tool", "do", "gs", "-x"}
    for command in ("ls", "ls -la", "my-tool x", "gs"):
        assert not leaves_state_as_is(command, defined_names(state))
    assert leaves_state_as_is("git status", defined_names(state))


def test_the_shell_words_are_this_bashs_builtins_and_reserved_words() -> None:
    listed = subprocess.run(
        [BASH, "--noprofile", "--norc", "-c", "compgen -b; compgen -k"],
        capture_output=True,
        text=True,
        check=True,
        env=BASE_ENV,
    ).stdout.split()
    assert set(listed) <= SHELL_WORDS, set(listed) - SHELL_WORDS
