"""``dsh-bash run`` as a pipeline member: output passed through as it comes, stdin forwarded, a gone or
full stdout ending the command and the CLI cleanly, ``--json``, and the CLI README's examples.

Every case runs the installed console script in a real process (the way users meet it). Waits are
generous bounds on progress (the test fails when the CLI holds output back), never timings.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pty
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cli_support import console_script

ROOT = Path(__file__).resolve().parent.parent
CLI_README = ROOT / "cli" / "dsh_bash_cli" / "README.md"


DSH = console_script()


def _read_line(stream: object, within_s: float) -> bytes:
    """One line from a pipe, or fail after ``within_s``."""
    fd = stream.fileno()  # type: ignore[attr-defined]
    line = b""
    deadline = time.monotonic() + within_s
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"no whole line within {within_s} s (got {line!r}): output is held back")
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


def test_output_arrives_while_the_command_runs(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    command = f"echo first; while [ ! -e {flag} ]; do sleep 0.05; done; echo second"
    with subprocess.Popen(
        [DSH, "run", "--timeout-ms", "60000", command], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    ) as cli:
        assert cli.stdout is not None
        # The command waits for the flag, which only comes after "first" was read here.
        assert _read_line(cli.stdout, 20) == b"first\n"
        flag.touch()
        assert cli.stdout.read() == b"second\n"
        assert cli.wait(timeout=20) == 0


def test_stdout_and_stderr_keep_their_order_in_one_file() -> None:
    done = subprocess.run(
        [DSH, "run", "echo 1; sleep 0.3; echo 2 >&2; sleep 0.3; echo 3; sleep 0.3; echo 4 >&2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, b"1\n2\n3\n4\n")


def test_a_reader_that_goes_away_ends_the_command_and_the_cli_with_141(tmp_path: Path) -> None:
    tag = tmp_path.name
    with subprocess.Popen(
        [DSH, "run", f"echo a; exec -a dsh-test-{tag} sleep 30; echo b"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    ) as cli:
        assert cli.stdout is not None and cli.stderr is not None
        assert _read_line(cli.stdout, 20) == b"a\n"
        cli.stdout.close()  # as `| head -1` does after its line
        # Well before the command's 30 s: the CLI notices the reader is gone while the command is quiet.
        assert cli.wait(timeout=15) == 141
        assert cli.stderr.read() == b""  # quietly, as other tools do
    survivors = subprocess.run(
        ["pgrep", "-f", f"dsh-test-{tag}"], capture_output=True, text=True, check=False
    )
    assert survivors.stdout == "", "the command outlived the CLI"


def test_a_flood_into_a_closed_pipe_ends_at_once() -> None:
    with subprocess.Popen([DSH, "run", "yes"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) as cli:
        assert cli.stdout is not None
        assert os.read(cli.stdout.fileno(), 2) == b"y\n"
        cli.stdout.close()
        assert cli.wait(timeout=15) == 141


def test_piped_stdin_is_forwarded() -> None:
    done = subprocess.run([DSH, "run", "cat"], input=b"x\n", capture_output=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"x\n", b"")


def test_stdin_larger_than_the_input_queue_is_forwarded_whole() -> None:
    payload = os.urandom(3 * 1024 * 1024)  # three times MAX_PENDING_INPUT: the CLI must wait, not fail
    done = subprocess.run(
        [DSH, "run", "sha256sum | cut -d' ' -f1"],
        input=payload,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == hashlib.sha256(payload).hexdigest()


def test_a_file_on_stdin_is_forwarded(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes(b"from a file\n")
    with source.open("rb") as stdin:
        done = subprocess.run([DSH, "run", "cat"], stdin=stdin, capture_output=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, b"from a file\n")


@pytest.mark.parametrize("kind", ["devnull", "terminal"])
def test_a_terminal_or_dev_null_on_stdin_is_not_forwarded(kind: str) -> None:
    """The command's stdin is then /dev/null, as without the CLI (R-proc-stdin-empty)."""
    command = "readlink /proc/self/fd/0; cat; echo end"
    if kind == "devnull":
        done = subprocess.run(
            [DSH, "run", command], stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False
        )
    else:
        leader, follower = pty.openpty()
        try:
            done = subprocess.run(
                [DSH, "run", command], stdin=follower, capture_output=True, timeout=60, check=False
            )
        finally:
            os.close(leader)
            os.close(follower)
    assert (done.returncode, done.stdout) == (0, b"/dev/null\nend\n")


def test_a_full_stdout_is_one_error_line_and_the_command_is_stopped() -> None:
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [DSH, "run", "echo hi; sleep 30"],
            stdout=full,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            timeout=20,
            check=False,
        )
    assert done.returncode == 2
    assert done.stderr == (
        b"dsh-bash: error: cannot write the command's stdout: No space left on device; the command was "
        b"killed\n"
    )


def test_a_closed_stdout_is_one_error_line() -> None:
    done = subprocess.run(
        ["sh", "-c", f"'{DSH}' run 'echo hi' >&-"],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == (
        b"dsh-bash: error: cannot write the command's stdout: it was closed when dsh-bash started; the "
        b"command was killed\n"
    )


def test_a_closed_stdout_costs_nothing_when_the_command_writes_nothing() -> None:
    done = subprocess.run(
        ["sh", "-c", f"'{DSH}' run 'echo only-err >&2; exit 3' >&-"],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (3, b"only-err\n")


def test_json_is_the_whole_result_with_a_kept_spill_file() -> None:
    done = subprocess.run(
        [DSH, "run", "--json", "head -c 70000 /dev/zero | tr '\\0' a; printf '\\377' >&2; exit 4"],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert done.returncode == 4
    assert done.stderr == b""
    result = json.loads(done.stdout)
    assert (result["exit_code"], result["timed_out"], result["signal"]) == (4, False, None)
    assert result["stdout"]["total_bytes"] == 70_000 and result["stdout"]["truncated"] is True
    assert result["stdout"]["text"] == "a" * 64_000
    kept = Path(result["stdout"]["spill_path"])
    assert kept.read_bytes() == b"a" * 70_000  # kept past the executor's close
    shutil.rmtree(kept.parent, ignore_errors=True)
    assert result["stderr"]["text"] == "\ufffd"
    assert base64.urlsafe_b64decode(result["stderr"]["data"]) == b"\xff"


def test_json_takes_piped_stdin_whole() -> None:
    done = subprocess.run(
        [DSH, "run", "--json", "wc -c"], input=b"12345", capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0
    assert json.loads(done.stdout)["stdout"]["text"].strip() == "5"


def test_json_timeout_is_124() -> None:
    done = subprocess.run(
        [DSH, "run", "--json", "--timeout-ms", "200", "sleep 5"],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert done.returncode == 124
    assert json.loads(done.stdout)["timed_out"] is True


# -- the README's examples --------------------------------------------------------------------------


def _readme_examples() -> list[tuple[str, str]]:
    """Each ``$ command`` of the CLI README's ``console`` blocks and the lines shown under it."""
    text = CLI_README.read_text()
    examples: list[tuple[str, str]] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        command: str | None = None
        output: list[str] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                if command is not None:
                    examples.append((command, "".join(output)))
                command, output = line[2:], []
            else:
                output.append(line + "\n")
        if command is not None:
            examples.append((command, "".join(output)))
    return examples


EXAMPLES = _readme_examples()


def test_the_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize(("command", "expected"), EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_readme_example(command: str, expected: str, tmp_path: Path) -> None:
    """Run as the README shows it: bash, the venv's dsh-bash first on PATH, stderr into stdout."""
    env = {**os.environ, "PATH": f"{Path(DSH).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DSH_BASH_TIMEOUT_MS", None)
    done = subprocess.run(
        ["bash", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.stdout.decode() == expected
