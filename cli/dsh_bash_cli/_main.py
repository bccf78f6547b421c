"""The ``dsh-bash`` command line.

Subcommands:

``dsh-bash run [--config FILE] [--cwd DIR] [--timeout-ms N] [--json] -- COMMAND``
    Run one command on the local backend (or, with ``--config``, on the backend the file describes),
    loaded with ``load_executor`` either way, so ``DSH_BASH_<FIELD>`` variables apply with or without
    a file; ``--cwd`` and ``--timeout-ms`` override ``cwd`` and ``timeout_ms``. Its stdout and stderr
    are passed through as they come, its stdin forwarded when it is not a terminal (``_run``); then,
    on stderr, one notice per event: ``dsh-bash: timed out after Nms``, and for a stream longer than
    the executor keeps, ``dsh-bash: stdout: N bytes, more than the executor keeps (M); full output:
    PATH`` (or ``(unavailable)``). ``--json`` prints the whole result as JSON instead. The exit
    status is:

    - ``124`` when the timeout killed the command (as GNU ``timeout`` does), whatever the command's
      own status was;
    - ``128 + n`` when the command was killed by signal ``n``;
    - ``141`` when stdout's reader went away (the command is killed);
    - otherwise the command's exit code;
    - ``2`` for bad arguments and configuration or infrastructure errors, and for a stdout or stderr
      that cannot be written (one ``dsh-bash: error:`` line on stderr), ``130`` when interrupted
      with Ctrl-C.

    A spill file belongs to the executor, which deletes it when it closes; the CLI keeps it by
    linking (or copying) it into a directory of its own under the temporary directory before the
    executor closes, and prints that path. Those files are not cleaned up. A backend whose spill
    files live elsewhere (in a container, on an SSH host) reports ``(unavailable)``.

``dsh-bash cp [--config FILE] [--cwd DIR] [--user USER] [--parents] SRC DEST``
    Copy one file into or out of where the backend runs commands, as ``docker cp`` does (``_cp``):
    exactly one of SRC and DEST is ``:PATH`` (absolute, or relative to the executor's working
    directory, which ``--cwd`` sets as for ``run``), the other a local path or ``-`` (stdin, stdout).
    The executor is loaded as for ``run``; the file moves with ``read_file`` or ``write_file``
    (``--user`` and ``--parents`` passed on). Prints nothing; exit status 0, or 2 with one
    ``dsh-bash: error:`` line (a refusal names the ``:PATH`` and its reason).

``dsh-bash conformance --config FILE [--check NAME ...] [--json] [--anyio-backend B] [--check-timeout S]``
    Run the conformance kit against the configured backend (``dsh_bash_conformance.config_target``):
    one line per check as it finishes (on a terminal, a progress counter on stderr), then the
    verdict; ``--json`` prints the report as JSON instead. Exit status 0 when every contract check
    passed ("beyond" checks never fail the run), 1 otherwise, 2 for unknown check names and bad
    configuration. ``--list`` lists the checks (name, kind, clause, rule) and needs no configuration.

``dsh-bash doctor [--config FILE] [--timeout S]``
    Check that the configured backend (without ``--config``: the local one) can run commands
    (``dsh_bash_cli._doctor``): one ``ok``/``FAIL`` line per step, with a fix for each failure.
    Exit status 0 when all are ok, 1 when one failed, 2 when the configuration does not load.

``dsh-bash mcp --config FILE [--http [HOST:]PORT] [--max-running N] [--no-background] [...]``
    Serve the bash tools over the Model Context Protocol (``dsh_tool_bash.mcp``, extra ``mcp``):
    over stdio, or with ``--http`` over streamable HTTP on loopback unless HOST says otherwise (the
    URL goes to stderr). Over HTTP, ``--token-file PATH`` or ``DSH_MCP_TOKEN`` sets the bearer token
    every request must carry (required beyond loopback); ``--max-sessions`` and
    ``--max-running-total`` cap sessions and background tasks across sessions. Runs until SIGTERM,
    SIGINT or the end of stdin; exit status 0, 130 after SIGINT, 2 when the configuration or the token
    does not load, a non-loopback HOST has no token, or the address cannot be bound. See
    ``dsh_tool_bash/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, TextIO

from ._fds import discard_stdout
from ._text import one_line, write

# Everything else is imported by the subcommand that needs it, when it runs: ``dsh-bash run`` must not
# pay for the kit, the tools, the registry or the backends it does not use.
if TYPE_CHECKING:
    from dsh_bash_conformance import CheckResult

    from dsh_bash import BashExecutor

    from ._doctor import Finding

__all__ = ["console", "main"]

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


class _PrintVersion(argparse.Action):
    """``--version``: imports dsh_bash only when asked (the command line's start-up stays light)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help=str(kwargs.get("help", "")))

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from dsh_bash import __version__

        print(f"{PROG} {__version__}")
        parser.exit()


def _positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number above zero, of ``unit`` (named in the error)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of {unit}: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text!r}")
        return value

    return parse


_timeout_ms = _positive("milliseconds")
_seconds = _positive("seconds")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="An async shell executor for AI agents: commands that never hang, leak or lose output.",
    )
    parser.add_argument("--version", action=_PrintVersion, help="print the version and exit")
    commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run one command on the local backend (or the one --config describes)",
        description=(
            "Run COMMAND with a fresh non-interactive bash on the local backend. Its stdout and stderr "
            "are passed through; notices (timeout, truncation) follow on stderr. Exit status: the "
            "command's, 128+n when killed by signal n, 124 when timed out, 2 on usage or setup errors."
        ),
        epilog="Put the command after '--' when it starts with '-'; several words are joined with spaces.",
    )
    run.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML or YAML backend configuration (default: the local backend with default settings)",
    )
    run.add_argument("--cwd", metavar="DIR", help="working directory (default: the current one)")
    run.add_argument(
        "--timeout-ms",
        metavar="N",
        type=_timeout_ms,
        help="kill the command after N milliseconds (default: 120000)",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="run to the end, then print the whole result as JSON instead of passing output through",
    )
    run.add_argument("command", nargs="+", metavar="COMMAND", help="the bash command line")
    run.set_defaults(handler=_cmd_run)
    _add_cp_parser(commands)
    _add_conformance_parser(commands)
    _add_doctor_parser(commands)
    _add_mcp_parser(commands)
    return parser


# -- output -------------------------------------------------------------------------------------------


def _error(message: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.stderr.flush()
    return EXIT_USAGE


# -- run ----------------------------------------------------------------------------------------------


#: The backend without ``--config``: the local one, by reference (no entry-point scan at start-up),
#: loaded as a file would be, so ``DSH_BASH_<FIELD>`` variables apply the same way.
LOCAL_SOURCE: dict[str, object] = {"backend": "dsh_bash_local:LocalBashExecutor.from_fields"}


def _load_executor(config: str | None, cwd: str | None) -> BashExecutor:
    """The executor of ``--config FILE`` (without it: the local backend), unopened, its ``cwd`` set by
    ``--cwd`` when given; ``DSH_BASH_<FIELD>`` variables apply either way (``run`` and ``cp``)."""
    from dsh_bash import load_executor

    if config is None and cwd is not None:
        # Only here: with a file, the directory is where the backend's commands run (not this host).
        given = cwd
        cwd = os.path.abspath(cwd)
        if not os.path.isdir(cwd):
            raise _CliError(f"--cwd {given}: not a directory")
    source = LOCAL_SOURCE if config is None else config
    return load_executor(source, **({"cwd": cwd} if cwd is not None else {}))


def _cmd_run(args: argparse.Namespace) -> int:
    import anyio

    from . import _run

    command = " ".join(args.command)
    executor = _load_executor(args.config, args.cwd)
    if args.timeout_ms is not None:
        # As without --config: an explicit timeout raises the configured cap rather than being clamped.
        cap = max(args.timeout_ms, executor.config.max_timeout_ms)
        executor.reconfigure(timeout_ms=args.timeout_ms, max_timeout_ms=cap)
    try:
        if args.json:
            return anyio.run(_run.run_json, executor, command)
        return _run.finish_streamed(anyio.run(_run.run_streaming, executor, command))
    except _run.RunFailed as exc:
        raise _CliError(str(exc)) from exc


# -- cp -----------------------------------------------------------------------------------------------


def _add_cp_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cp = commands.add_parser(
        "cp",
        help="copy a file into or out of where commands run",
        description=(
            "Copy one file between this machine and where the backend runs commands, as docker cp does: "
            "exactly one of SRC and DEST is :PATH (absolute, or relative to the backend's working "
            "directory), the other a local path, or '-' for stdin (SRC) or stdout (DEST). A directory "
            "as DEST (a local one, or :PATH/) gets a file of SRC's name. Exit status 0, printing nothing; "
            "2 on usage, configuration, file and backend errors."
        ),
        epilog="A local name that starts with ':' is written ./:NAME.",
    )
    cp.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML or YAML backend configuration (default: the local backend with default settings)",
    )
    cp.add_argument(
        "--cwd", metavar="DIR", help="the directory a relative :PATH is in (default: the backend's own)"
    )
    cp.add_argument(
        "--user", metavar="USER", help="read or write the file as USER would (where the backend can)"
    )
    cp.add_argument("--parents", action="store_true", help="make the missing directories of a :DEST")
    cp.add_argument("src", metavar="SRC", help=":PATH, a local file, or '-' for stdin")
    cp.add_argument("dest", metavar="DEST", help=":PATH, a local file or directory, or '-' for stdout")
    cp.set_defaults(handler=_cmd_cp)


def _cmd_cp(args: argparse.Namespace) -> int:
    from . import _cp

    try:
        how = _cp.plan(args.src, args.dest)
        _cp.copy(
            how,
            lambda: _load_executor(args.config, args.cwd),
            user=args.user,
            make_parents=args.parents,
        )
    except _cp.CopyFailed as exc:
        raise _CliError(str(exc)) from exc
    return 0


# -- conformance --------------------------------------------------------------------------------------


def _add_conformance_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    conformance = commands.add_parser(
        "conformance",
        help="run the conformance kit against a configured backend",
        description=(
            "Run the conformance kit against the backend FILE describes: one line per check as it "
            "finishes, then the verdict. Exit status 0 when every contract check passed ('beyond' "
            "checks never fail the run), 1 when one did not, 2 on usage or configuration errors."
        ),
    )
    conformance.add_argument("--config", metavar="FILE", help="the backend's TOML or YAML configuration")
    conformance.add_argument(
        "--check",
        metavar="NAME",
        nargs="+",
        action="extend",
        help="run only these checks (repeatable; default: all; --list shows the names)",
    )
    conformance.add_argument("--json", action="store_true", help="print the report as JSON")
    conformance.add_argument(
        "--list", action="store_true", help="list the checks (name, kind, clause, rule) and exit"
    )
    conformance.add_argument(
        "--anyio-backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop (default: asyncio)",
    )
    conformance.add_argument(
        "--check-timeout",
        metavar="S",
        type=_seconds,
        default=30.0,
        help="wall-clock limit of one check in seconds (default: 30)",
    )
    conformance.add_argument(
        "--verbose",
        action="store_true",
        help="show the backend's log messages on stderr (some checks provoke logged errors on purpose)",
    )
    conformance.set_defaults(handler=_cmd_conformance)


class _Progress:
    """``[i/N] running NAME...`` on a terminal's stderr, erased before each result line."""

    def __init__(self, stream: TextIO | None, names: list[str]) -> None:
        self._stream = stream
        self._names = names
        self._shown = False

    def show(self, index: int) -> None:
        if self._stream is None or index >= len(self._names):
            return
        self.clear()
        self._stream.write(f"[{index + 1}/{len(self._names)}] running {self._names[index]}...")
        self._stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._stream is not None and self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from dsh_bash_conformance import CHECKS, config_target, run_kit
    except ImportError as exc:
        raise _CliError(
            f"the conformance kit (dsh_bash_conformance) cannot be imported: {one_line(exc)}"
        ) from exc

    import json
    import logging

    if args.list:
        if args.json:
            rows = [
                {"name": c.name, "kind": c.kind, "clause": c.clause, "rule": c.rule} for c in CHECKS.values()
            ]
            sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        else:
            width = max(len(name) for name in CHECKS)
            clause_width = max(len(c.clause) for c in CHECKS.values())
            for c in CHECKS.values():
                write(sys.stdout, f"{c.name:<{width}} {c.kind:<8} {c.clause:<{clause_width}} {c.rule}\n")
        return 0
    if args.config is None:
        raise _CliError("conformance: --config FILE is required (or --list to see the checks)")
    names: list[str] = list(dict.fromkeys(args.check)) if args.check else list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise _CliError(
            f"unknown check name(s): {', '.join(unknown)} (dsh-bash conformance --list shows them)"
        )

    built = config_target(args.config, anyio_backend=args.anyio_backend, check_timeout_s=args.check_timeout)
    log = logging.getLogger("dsh_bash")
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format=f"{PROG}: log: %(name)s: %(message)s")
    else:
        # The checks provoke logged errors on purpose (a raising listener): keep them off the output.
        log.addHandler(logging.NullHandler())
    for note in built.notes:
        write(sys.stderr, f"{PROG}: note: {note}\n")
    width = max(len(name) for name in names)
    progress = _Progress(sys.stderr if sys.stderr.isatty() else None, names)
    done = 0

    def on_result(result: CheckResult) -> None:
        nonlocal done
        done += 1
        progress.clear()
        if not args.json:
            write(sys.stdout, result.line(width) + "\n")
            sys.stdout.flush()
        progress.show(done)

    progress.show(0)
    try:
        report = run_kit(built.target, only=names, on_result=on_result)
    finally:
        progress.clear()
    if args.json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        failed = [r.name for r in report.failed]
        if failed:
            write(sys.stdout, f"not passed: {', '.join(failed)}\n")
        write(sys.stdout, report.verdict() + "\n")
    sys.stdout.flush()
    return 0 if report.contract_ok else 1


# -- doctor -------------------------------------------------------------------------------------------


def _add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check that a configured backend can run commands",
        description=(
            "Load FILE, open the backend and check that bash runs, the default working directory "
            "exists, a spill file can be made and setsid is present; one ok/FAIL line per step, "
            "with a fix for each failure. Exit status 0 when all are ok, 1 when one failed, 2 when "
            "the configuration does not load."
        ),
    )
    doctor.add_argument(
        "--config",
        metavar="FILE",
        help="the backend's TOML or YAML configuration (default: the local backend, DSH_BASH_* applied)",
    )
    doctor.add_argument(
        "--timeout",
        metavar="S",
        type=_seconds,
        default=30.0,
        help="bound in seconds for opening the backend and for each step (default: 30)",
    )
    doctor.set_defaults(handler=_cmd_doctor)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ._doctor import run_doctor

    config_failed = False
    failures = 0

    def report(finding: Finding) -> None:
        nonlocal config_failed, failures
        label = "ok" if finding.ok else "FAIL"
        write(sys.stdout, f"{label:<5} {finding.step:<8} {finding.detail}\n")
        if not finding.ok:
            failures += 1
            config_failed = config_failed or finding.step == "config"
            if finding.fix:
                write(sys.stdout, f"{'':<14} fix: {finding.fix}\n")
        sys.stdout.flush()

    source = LOCAL_SOURCE if args.config is None else args.config
    all_ok = run_doctor(source, timeout_s=args.timeout, report=report)
    if config_failed:
        return EXIT_USAGE
    if all_ok:
        write(sys.stdout, f"{PROG} doctor: all ok\n")
        return 0
    write(sys.stdout, f"{PROG} doctor: {failures} step(s) failed\n")
    return 1


# -- mcp ----------------------------------------------------------------------------------------------


def _max_running(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _add_mcp_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    mcp = commands.add_parser(
        "mcp",
        help="serve the bash tools over the Model Context Protocol",
        description=(
            "Serve the bash, bash_output, bash_input and bash_kill tools over MCP on the backend FILE "
            "describes: over stdio (one client), or with --http over streamable HTTP at http://HOST:PORT/mcp "
            "(many clients, each session its own owner of background tasks). Stops on SIGTERM, SIGINT "
            "or end of stdin (stdio), closing the executor. Needs the 'mcp' extra."
        ),
    )
    mcp.add_argument(
        "--config", metavar="FILE", required=True, help="the backend's TOML or YAML configuration"
    )
    mcp.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve streamable HTTP instead of stdio; HOST defaults to 127.0.0.1 (port 0: any free port; "
        "the URL is printed on stderr)",
    )
    mcp.add_argument(
        "--max-running",
        metavar="N",
        type=_max_running,
        default=10,
        help="running background tasks allowed per session (default: 10)",
    )
    mcp.add_argument(
        "--max-running-total",
        metavar="N",
        type=_max_running,
        help="running background tasks allowed across all sessions (default: 4 x --max-running)",
    )
    mcp.add_argument(
        "--max-sessions",
        metavar="N",
        type=_max_running,
        default=16,
        help="with --http: live sessions allowed at once; one more is refused with HTTP 503 (default: 16)",
    )
    mcp.add_argument(
        "--token-file",
        metavar="PATH",
        help="with --http: every request must carry 'Authorization: Bearer TOKEN', TOKEN being the first "
        "line of PATH (mode 600 or stricter); or set the DSH_MCP_TOKEN environment variable. Required "
        "unless HOST is loopback",
    )
    mcp.add_argument(
        "--no-background", action="store_true", help="offer the bash tool alone, without background tasks"
    )
    mcp.add_argument(
        "--session-idle-timeout",
        metavar="S",
        type=_seconds,
        default=1800.0,
        help="with --http: end a session (and kill its tasks) after S seconds without a request in flight "
        "or an open stream (default: 1800)",
    )
    mcp.set_defaults(handler=_cmd_mcp)


def _cmd_mcp(args: argparse.Namespace) -> int:
    try:
        # needs the optional mcp SDK
        from dsh_tool_bash.mcp import TOKEN_ENV, read_token_file, run_server, token_from_environment
    except ImportError as exc:
        raise _CliError(f"dsh-bash mcp needs the mcp extra: pip install 'dsh-bash[mcp]' ({exc})") from exc
    try:
        # Taken out of the environment whatever the transport: no command inherits it.
        from_env = token_from_environment()
        token = from_env
        if args.token_file is not None:
            if args.http is None:
                raise _CliError("mcp: --token-file is for --http (stdio needs no token)")
            if from_env is not None:
                raise _CliError(f"mcp: give the token once: --token-file or {TOKEN_ENV}, not both")
            token = read_token_file(args.token_file)
        if args.max_running_total is not None and args.max_running_total < args.max_running:
            raise _CliError(
                f"mcp: --max-running-total {args.max_running_total} is below --max-running {args.max_running}"
            )
        return run_server(
            args.config,
            http=args.http,
            background=not args.no_background,
            max_running=args.max_running,
            max_running_total=args.max_running_total,
            max_sessions=args.max_sessions,
            token=token if args.http is not None else None,
            session_idle_timeout=args.session_idle_timeout,
        )
    except OSError as exc:  # the HTTP address cannot be bound
        raise _CliError(f"mcp: {one_line(exc)}") from exc
    except ValueError as exc:
        from pydantic import ValidationError

        from dsh_bash import ConfigError

        if isinstance(exc, ConfigError | ValidationError):
            raise
        raise _CliError(one_line(exc)) from exc


# -- entry point --------------------------------------------------------------------------------------


def console() -> NoReturn:
    """The ``dsh-bash`` program (console script and ``python -m dsh_bash_cli``): :func:`main`, then exit.

    Before exiting it freezes the garbage collector's view (:func:`gc.freeze`): the interpreter's
    final collections then skip every object that exists, which saves a short command a tenth of its
    run time. Everything else about exiting is as usual (atexit handlers, flushed streams).
    """
    import gc

    from ._fds import claim_standard_fds

    claim_standard_fds()
    code = main()
    gc.freeze()
    sys.exit(code)


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
    except _CliError as exc:
        return _error(one_line(exc))
    except KeyboardInterrupt:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``dsh-bash run ... | head``): say nothing more, as other tools do.
        discard_stdout()
        return 141
    except Exception as exc:
        message = _error_message(exc)
        if message is None:
            raise
        return _error(message)


def _error_message(exc: Exception) -> str | None:
    """The ``error:`` line for an error of dsh-bash or of a request's validation; None for anything else."""
    # Imported only now: such an error can only come from code that imported these modules already.
    from pydantic import ValidationError

    from dsh_bash import BashInfrastructureError, ConfigError, DshBashError
    from dsh_bash.backend import config_error_from

    if isinstance(exc, ConfigError | BashInfrastructureError):
        return one_line(exc)
    if isinstance(exc, DshBashError):
        return f"{type(exc).__name__}: {one_line(exc)}"
    if isinstance(exc, ValidationError):  # a request field the executor refused
        return one_line(config_error_from(exc, "request"))
    return None
