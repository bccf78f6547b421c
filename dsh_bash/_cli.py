"""The ``dsh-bash`` command line.

Subcommands:

``dsh-bash run [--cwd DIR] [--timeout-ms N] -- COMMAND``
    Run one command on the local backend, the way an agent's tool call would. The command's stdout
    text goes to stdout and its stderr text to stderr, byte for byte as the executor collected them
    (UTF-8, invalid bytes replaced). Then, on stderr, one notice per event: ``dsh-bash: timed out
    after Nms``, and ``dsh-bash: stdout truncated; full output: PATH`` (or ``(unavailable)``) for
    each truncated stream. The exit status is:

    - ``124`` when the executor's timeout killed the command (as GNU ``timeout`` does), whatever
      the command's own status was;
    - ``128 + n`` when the command was killed by signal ``n``;
    - otherwise the command's exit code;
    - ``2`` for bad arguments and configuration or infrastructure errors (one ``dsh-bash: error:``
      line on stderr), ``130`` when interrupted with Ctrl-C.

    A truncated stream's spill file belongs to the executor, which deletes it when it closes; the
    CLI keeps it by linking (or copying) it into a directory of its own under the temporary
    directory before the executor closes, and prints that path. Those files are not cleaned up.

Later subcommands (``conformance``, ``doctor``, ``mcp``) plug into the same subparser table.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

import anyio
import anyio.to_thread
from pydantic import ValidationError

from ._config import config_error_from
from ._errors import BashInfrastructureError, ConfigError, DshBashError

if TYPE_CHECKING:
    from ._types import BashRunResult

__all__ = ["main"]

PROG = "dsh-bash"

#: Exit status when the executor's timeout killed the command (GNU ``timeout`` uses the same).
EXIT_TIMED_OUT = 124
#: Exit status for usage, configuration and infrastructure errors (argparse uses 2 as well).
EXIT_USAGE = 2
#: Exit status when the CLI itself was interrupted (SIGINT).
EXIT_INTERRUPTED = 130

_Handler = Callable[[argparse.Namespace], int]


class _CliError(Exception):
    """A problem to report as one ``dsh-bash: error:`` line, exit status 2."""


# -- argument parsing --------------------------------------------------------------------------------


def _timeout_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="An async shell executor for AI agents: commands that never hang, leak or lose output.",
    )
    commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run one command on the local backend",
        description=(
            "Run COMMAND with a fresh non-interactive bash on the local backend. Its stdout and stderr "
            "are passed through; notices (timeout, truncation) follow on stderr. Exit status: the "
            "command's, 128+n when killed by signal n, 124 when timed out, 2 on usage or setup errors."
        ),
        epilog="Put the command after '--' when it starts with '-'; several words are joined with spaces.",
    )
    run.add_argument("--cwd", metavar="DIR", help="working directory (default: the current one)")
    run.add_argument(
        "--timeout-ms",
        metavar="N",
        type=_timeout_ms,
        help="kill the command after N milliseconds (default: 120000)",
    )
    run.add_argument("command", nargs="+", metavar="COMMAND", help="the bash command line")
    run.set_defaults(handler=_cmd_run)
    return parser


# -- output -------------------------------------------------------------------------------------------


def _write(stream: TextIO, text: str) -> None:
    """Write ``text`` exactly; fall back to UTF-8 bytes when the stream's encoding cannot hold it."""
    if not text:
        return
    try:
        stream.write(text)
    except UnicodeEncodeError:
        buffer = getattr(stream, "buffer", None)
        if buffer is None:
            encoding = stream.encoding or "ascii"
            stream.write(text.encode(encoding, "replace").decode(encoding))
        else:
            stream.flush()
            buffer.write(text.encode("utf-8", "surrogateescape"))
            buffer.flush()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _error(message: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.stderr.flush()
    return EXIT_USAGE


# -- run ----------------------------------------------------------------------------------------------


def _keep_spill(spill_path: str | None, name: str, keep_dir: list[str]) -> str | None:
    """Preserve a spill file beyond the executor's close; return its new path, or None if it is gone."""
    if spill_path is None:
        return None
    try:
        if not keep_dir:
            keep_dir.append(tempfile.mkdtemp(prefix=f"{PROG}-output-"))
        target = os.path.join(keep_dir[0], name)
        try:
            os.link(spill_path, target, follow_symlinks=False)
        except OSError:  # another filesystem, or links not allowed: copy
            shutil.copyfile(spill_path, target, follow_symlinks=False)
    except OSError:
        return None
    return target


async def _run_local(
    command: str, cwd: str | None, timeout_ms: float | None
) -> tuple[BashRunResult, dict[str, str | None]]:
    try:
        # Imported here: the seam must not depend on a backend, and other subcommands do not need it.
        from dsh_bash_local import LocalBashExecutor, LocalConfig  # noqa: PLC0415
    except ImportError as exc:
        raise _CliError(f"the local backend (dsh_bash_local) cannot be imported: {_one_line(exc)}") from exc

    fields: dict[str, object] = {}
    if cwd is not None:
        fields["cwd"] = cwd
    if timeout_ms is not None:
        # An explicit timeout on the command line is the user's decision: the model-facing cap
        # (max_timeout_ms) is raised to it rather than silently clamping it.
        fields["timeout_ms"] = timeout_ms
        default_max = LocalConfig.model_fields["max_timeout_ms"].default
        if isinstance(default_max, int | float) and timeout_ms > default_max:
            fields["max_timeout_ms"] = timeout_ms
    try:
        config = LocalConfig.model_validate(fields)
    except ValidationError as exc:
        raise config_error_from(exc, "LocalConfig") from None

    kept: dict[str, str | None] = {}
    keep_dir: list[str] = []
    async with LocalBashExecutor(config) as executor:
        result = await executor.exec(command)
        # The executor deletes its spill files when it closes: keep them for the user first.
        for name, output in (("stdout", result.stdout), ("stderr", result.stderr)):
            if output.truncated:
                kept[name] = await anyio.to_thread.run_sync(_keep_spill, output.spill_path, name, keep_dir)
    return result, kept


def _exit_status(result: BashRunResult) -> int:
    if result.timed_out:
        return EXIT_TIMED_OUT
    if result.signal is not None:
        try:
            return 128 + int(signal.Signals[result.signal])
        except KeyError:
            return 128
    if result.exit_code is not None:
        return result.exit_code
    return 1


def _cmd_run(args: argparse.Namespace) -> int:
    command = " ".join(args.command)
    cwd: str | None = args.cwd
    if cwd is not None:
        cwd = os.path.abspath(cwd)
        if not os.path.isdir(cwd):
            raise _CliError(f"--cwd {args.cwd}: not a directory")
    result, kept = anyio.run(_run_local, command, cwd, args.timeout_ms)

    _write(sys.stdout, result.stdout.text)
    sys.stdout.flush()
    _write(sys.stderr, result.stderr.text)

    notices: list[str] = []
    if result.timed_out:
        notices.append(f"{PROG}: timed out after {round(result.timeout_ms)}ms")
    for name, output in (("stdout", result.stdout), ("stderr", result.stderr)):
        if output.truncated:
            path = kept.get(name)
            notices.append(f"{PROG}: {name} truncated; full output: {path or '(unavailable)'}")
    if notices:
        # Each notice on a line of its own, even after stderr text without a final newline.
        separator = "\n" if result.stderr.text and not result.stderr.text.endswith("\n") else ""
        _write(sys.stderr, separator + "".join(f"{line}\n" for line in notices))
    sys.stderr.flush()
    return _exit_status(result)


# -- entry point --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsh-bash`` command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: _Handler = args.handler
    try:
        return handler(args)
    except (_CliError, ConfigError, BashInfrastructureError) as exc:
        return _error(_one_line(exc))
    except DshBashError as exc:
        return _error(f"{type(exc).__name__}: {_one_line(exc)}")
    except ValidationError as exc:  # a request field the executor refused
        return _error(_one_line(config_error_from(exc, "request")))
    except KeyboardInterrupt:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``dsh-bash run ... | head``): say nothing more, as other tools do.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
