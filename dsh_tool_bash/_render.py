"""What the model reads: pure functions from executor results to tool text.

The joining rule, everywhere: output text is copied verbatim except for control characters (see
:func:`escape_controls`); a notice (``[stderr]``, ``[exit code: 1]``,
...) is a line of its own, so a newline goes before it unless the text so far is empty or already ends
with one, and a newline goes after it only when something follows. The renderer never adds a trailing
newline of its own: a text ends with the command's own output or with the last notice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from dsh_bash import BashRunResult, BashTaskStatus, CollectedOutput, EndCause, SandboxPolicy

__all__ = [
    "NO_NEW_OUTPUT",
    "NO_OUTPUT",
    "UNAVAILABLE",
    "completion_notice",
    "escape_controls",
    "join",
    "lossy_line",
    "policy_line",
    "render_output",
    "render_run",
    "status_line",
    "status_summary",
    "truncation_line",
]

NO_OUTPUT = "(no output)"
NO_NEW_OUTPUT = "(no new output)"
UNAVAILABLE = "(unavailable)"


#: What :func:`escape_controls` rewrites: C0 controls but tab and newline, DEL, C1 controls, a CR not
#: followed by LF, and a run of backslashes that would otherwise read as the start of an escape.
_CONTROLS = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f"
_ESCAPED = re.compile(rf"\\+(?=x[0-9a-fA-F]{{2}}|[{_CONTROLS}]|\r(?!\n))|\r(?!\n)|[{_CONTROLS}]")


def _escape(match: re.Match[str]) -> str:
    found = match.group()
    if found[0] == "\\":
        return found * 2
    return f"\\x{ord(found):02x}"


def escape_controls(text: str) -> str:
    """``text`` with no raw terminal control characters, for the model (and whoever displays its input).

    Every C0 control except tab and newline, DEL, every C1 control (U+0080-U+009F), and a CR that does not
    end a CRLF line end is shown as ``\\xHH``, ``HH`` its code point in lowercase hex (ESC is ``\\x1b``,
    BEL ``\\x07``, a lone CR ``\\x0d``, CSI ``\\x9b``). So that the command's own text cannot pass for
    such an escape, a run of backslashes followed by ``xHH`` (or by a character about to be escaped) is
    doubled. Reading it back: in a run of backslashes before ``xHH``, each pair is one backslash, and an
    odd last one with ``xHH`` is the character U+00HH; any other backslash is the command's own.
    """
    return _ESCAPED.sub(_escape, text)


class Line(str):
    """A notice: rendered as a line of its own."""

    __slots__ = ()


def join(pieces: Iterable[str]) -> str:
    """Join output text (plain ``str``) and notices (:class:`Line`) by the module's rule."""
    out: list[str] = []
    last = ""  # the text so far ends with this piece (empty pieces are skipped)
    after_line = False
    for piece in pieces:
        if not piece:
            continue
        if isinstance(piece, Line):
            if last and not last.endswith("\n"):
                out.append("\n")
            out.append(piece)
            after_line = True
        else:
            if after_line:
                out.append("\n")
            out.append(piece)
            after_line = False
        last = piece
    return "".join(out)


def truncation_line(spill_path: str | None) -> Line:
    return Line(f"[output truncated; full output: {spill_path or UNAVAILABLE}]")


def _stream(output: CollectedOutput) -> list[str]:
    pieces: list[str] = [escape_controls(output.text)]
    if output.truncated:
        pieces.append(truncation_line(output.spill_path))
    return pieces


def render_run(result: BashRunResult) -> str:
    """The text of a finished foreground command (its ``aborted`` flag is the caller's business)."""
    pieces: list[str] = []
    stdout, stderr = result.stdout, result.stderr
    pieces += _stream(stdout)
    if stderr.text or stderr.truncated:
        pieces.append(Line("[stderr]"))
        pieces += _stream(stderr)
    if not stdout.text and not stdout.truncated and not stderr.text and not stderr.truncated:
        pieces = [Line(NO_OUTPUT)]
    if result.timed_out:
        pieces.append(Line(f"[timed out after {round(result.timeout_ms)}ms]"))
    if result.signal is not None:
        pieces.append(Line(f"[killed by signal: {result.signal}]"))
    elif result.exit_code is not None and result.exit_code != 0:
        pieces.append(Line(f"[exit code: {result.exit_code}]"))
    return join(pieces)


#: What a command that ran into its sandbox policy prints (the errors the policy's rules give), and the
#: signals of its limits.
_POLICY_ERRORS = ("Permission denied", "Read-only file system", "Network is unreachable", " 403")
_LIMIT_SIGNALS = ("SIGXCPU", "SIGXFSZ")


def policy_line(policy: SandboxPolicy | None, workdir: str, said: str, signal: str | None) -> Line | None:
    """``[sandbox policy: ...]`` when what a command ``said`` (its stderr, or a background task's
    output) or its end's ``signal`` shows what ``policy`` refuses (an error its rules give, a limit's
    signal), else None: the model is told the refusal came from outside the command, and that it
    cannot be lifted from inside."""
    if policy is None or not policy.active:
        return None
    refused = signal in _LIMIT_SIGNALS or any(error in said for error in _POLICY_ERRORS)
    if not refused:
        return None
    rules: list[str] = []
    if policy.filesystem == "workspace-write":
        rules.append(f"writes only beneath {', '.join((workdir, *policy.writable))}")
    if policy.deny_read:
        rules.append(f"unreadable: {', '.join(policy.deny_read)}")
    if policy.network == "allow-list":
        hosts = ", ".join(policy.allow_hosts) or "none"
        rules.append(f"network: only through its HTTP proxy (HTTPS_PROXY), to {hosts}")
    elif policy.network != "all":
        rules.append("no network" if policy.network == "none" else "network: its own loopback only")
    limits = [f"{name} {value}" for name, value in policy.limits.model_dump().items() if value is not None]
    if limits:
        rules.append(f"limits: {', '.join(limits)}")
    return Line(
        f"[sandbox policy: {'; '.join(rules)}. An error above may be the policy's, which nothing in "
        "the command can lift: work within it]"
    )


def status_summary(
    status: BashTaskStatus, exit_code: int | None, signal: str | None, end_cause: EndCause | None = None
) -> str:
    """``running``, ``completed, exit code: N``, ``completed, signal: NAME``, ``killed[, signal: NAME]``,
    ``killed, timed out`` (its ``task_timeout_ms`` ended it)."""
    if status == "running":
        return "running"
    if status == "killed":
        if end_cause == "timed_out":
            return "killed, timed out"
        return f"killed, signal: {signal}" if signal is not None else "killed"
    if signal is not None:
        return f"completed, signal: {signal}"
    if exit_code is not None:
        return f"completed, exit code: {exit_code}"
    return "completed"


def status_line(
    status: BashTaskStatus,
    exit_code: int | None,
    signal: str | None,
    *,
    waiting: bool = False,
    end_cause: EndCause | None = None,
) -> str:
    """``[status: ...]``; a running task blocked reading its input gets ``, waiting for input``."""
    summary = status_summary(status, exit_code, signal, end_cause)
    if waiting and status == "running":
        summary += ", waiting for input"
    return f"[status: {summary}]"


def lossy_line(spill_paths: Sequence[str | None]) -> Line:
    """``[some output was dropped from memory; full output: PATHS]``: existing paths, comma-separated."""
    paths = [path for path in spill_paths if path]
    return Line(f"[some output was dropped from memory; full output: {', '.join(paths) or UNAVAILABLE}]")


def render_output(delta: str, *, lossy: bool, spill_paths: Sequence[str | None], status: str) -> str:
    """The text of ``bash_output``: the delta (or ``(no new output)``), the lossy line, the status line.

    ``spill_paths`` is stdout's then stderr's; ``status`` is a :func:`status_line`.
    """
    pieces: list[str] = [escape_controls(delta)] if delta else [Line(NO_NEW_OUTPUT)]
    if lossy:
        pieces.append(lossy_line(spill_paths))
    pieces.append(Line(status))
    return join(pieces)


def completion_notice(task_id: str, summary: str) -> str:
    """The one-line notice of ``on_completion``; ``summary`` is a :func:`status_summary`."""
    return f"background bash task {task_id} finished: {summary}. Read its output with bash_output."
