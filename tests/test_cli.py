"""``dsh-bash run``: through the installed console script (a real process) and through ``main`` in-process.

Exit status convention under test: the command's own exit code; 128+n when killed by signal n;
124 when the executor's timeout killed it (whatever the shell's status); 2 for usage and setup errors.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_support import console_script
from dsh_bash_cli import main

import dsh_bash

try:
    import dsh_bash_local  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the checkout's state
    pytest.skip(f"backend unavailable: dsh_bash_local cannot be imported ({exc})", allow_module_level=True)


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


Runner = Callable[..., Outcome]


@pytest.fixture(params=["process", "in-process"])
def run_cli(request: pytest.FixtureRequest, capfd: pytest.CaptureFixture[str]) -> Runner:
    """Run ``dsh-bash ARGS...`` one way or the other; return exit status, stdout and stderr."""
    if request.param == "process":

        def run_process(*args: str) -> Outcome:
            done = subprocess.run(
                [console_script(), *args],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            return Outcome(done.returncode, done.stdout, done.stderr)

        return run_process

    def run_in_process(*args: str) -> Outcome:
        # capfd: the command's output goes to file descriptors 1 and 2, not through sys.stdout.
        capfd.readouterr()
        code = main(list(args))
        captured = capfd.readouterr()
        return Outcome(code, captured.out, captured.err)

    return run_in_process


def test_echo_goes_to_stdout(run_cli: Runner) -> None:
    result = run_cli("run", "echo hello")
    assert result == Outcome(0, "hello\n", "")


def test_output_passes_through_exactly(run_cli: Runner) -> None:
    result = run_cli("run", "printf 'no newline'")
    assert result == Outcome(0, "no newline", "")


def test_stderr_is_separate(run_cli: Runner) -> None:
    result = run_cli("run", "echo out; echo err >&2")
    assert result == Outcome(0, "out\n", "err\n")


def test_words_after_double_dash_are_joined(run_cli: Runner) -> None:
    result = run_cli("run", "--", "echo", "-n", "a", "b")
    assert result == Outcome(0, "a b", "")


def test_exit_code_passes_through(run_cli: Runner) -> None:
    result = run_cli("run", "echo partial; exit 7")
    assert result == Outcome(7, "partial\n", "")


def test_signal_gives_128_plus_n(run_cli: Runner) -> None:
    result = run_cli("run", "kill -TERM $$")
    assert result.code == 128 + 15
    assert "timed out" not in result.err


def test_timeout(run_cli: Runner) -> None:
    result = run_cli("run", "--timeout-ms", "200", "--", "echo started; sleep 5; echo never")
    assert result.code == 124
    assert result.out == "started\n"
    assert result.err == "dsh-bash: timed out after 200ms\n"


def test_timeout_above_the_default_cap_is_honoured(run_cli: Runner) -> None:
    result = run_cli("run", "--timeout-ms", "900000", "echo ok")
    assert result == Outcome(0, "ok\n", "")


def test_output_beyond_the_kept_tail_is_passed_through_and_names_a_kept_spill_file(run_cli: Runner) -> None:
    result = run_cli("run", "head -c 200000 /dev/zero | tr '\\0' a; echo oops >&2")
    assert result.code == 0
    assert result.out == "a" * 200_000  # every byte passed through, not only the kept tail
    prefix = "oops\ndsh-bash: stdout: 200000 bytes, more than the executor keeps (64000); full output: "
    assert result.err.startswith(prefix)
    assert result.err.endswith("\n")
    path = Path(result.err.removeprefix(prefix).rstrip("\n"))
    # The executor deletes its own spill files when it closes; the CLI keeps a copy.
    assert path.is_file()
    assert path.read_bytes() == b"a" * 200_000
    shutil.rmtree(path.parent, ignore_errors=True)


def test_notice_starts_its_own_line(run_cli: Runner) -> None:
    result = run_cli("run", "--timeout-ms", "200", "--", "printf err >&2; sleep 5")
    assert result.code == 124
    assert result.err == "err\ndsh-bash: timed out after 200ms\n"


def test_cwd(run_cli: Runner, tmp_path: Path) -> None:
    result = run_cli("run", "--cwd", str(tmp_path), "pwd")
    assert result.code == 0
    assert os.path.realpath(result.out.rstrip("\n")) == os.path.realpath(tmp_path)


def test_missing_cwd_is_an_error(run_cli: Runner, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = run_cli("run", "--cwd", str(missing), "pwd")
    assert result.code == 2
    assert result.out == ""
    assert result.err.startswith("dsh-bash: error: ")
    assert str(missing) in result.err
    assert result.err.count("\n") == 1


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((), id="no-subcommand"),
        pytest.param(("run",), id="no-command"),
        pytest.param(("frobnicate",), id="unknown-subcommand"),
        pytest.param(("run", "--timeout-ms", "soon", "true"), id="timeout-not-a-number"),
        pytest.param(("run", "--timeout-ms", "0", "true"), id="timeout-zero"),
        pytest.param(("run", "--timeout-ms", "nan", "true"), id="timeout-nan"),
        pytest.param(("run", "--bogus", "true"), id="unknown-option"),
    ],
)
def test_bad_arguments_exit_2(run_cli: Runner, args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert result.code == 2
    assert result.out == ""
    assert "usage: dsh-bash" in result.err


def test_help_exits_0(run_cli: Runner) -> None:
    result = run_cli("run", "--help")
    assert result.code == 0
    assert "--timeout-ms" in result.out


def test_version_is_the_installed_distributions(run_cli: Runner) -> None:
    """``--version`` prints ``dsh_bash.__version__``, which pyproject.toml reads as the package's version."""
    result = run_cli("--version")
    assert (result.code, result.out, result.err) == (0, f"dsh-bash {dsh_bash.__version__}\n", "")
    assert importlib.metadata.version("dsh-bash") == dsh_bash.__version__


def test_python_dash_m_runs_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dsh_bash_cli", "run", "echo out; echo err >&2; exit 3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


UNNEEDED_BY_RUN = (
    "dsh_bash_conformance",
    "dsh_tool_bash",
    "dsh_bash_docker",
    "dsh_bash_ssh",
    "mcp",
    "yaml",
    "docker",
    "asyncssh",
)
RUN_AND_LIST_IMPORTS = f"""
import sys
from dsh_bash_cli import main
main(["run", "true"])
seen = {{name.partition(".")[0] for name in sys.modules}} | set(sys.modules)
print(" ".join(sorted(seen & {{*{UNNEEDED_BY_RUN!r}, "dsh_bash_cli._doctor"}})))
"""


def test_run_imports_no_other_subcommand() -> None:
    """``dsh-bash run`` stays quick: the kit, the tools, the doctor, other backends and optional
    libraries are not imported on its path."""
    done = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_IMPORTS], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""
