"""The bash text the provider sends through the executor's public ``exec``, and how it reads results.

Everything here is pure (no inspect_ai, no executor) so it can be tested alone. The executor runs one
bash command string per call; inspect speaks argv lists, bytes and errno-style exceptions, so each
translation is a small script whose exit status the provider maps to inspect's error types. The
scripts use their own exit codes (:data:`NOT_FOUND` ...) and never print what the provider parses,
except the sizes and the base64 data it asked for.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Sequence

__all__ = [
    "BROKEN",
    "IS_DIRECTORY",
    "NOT_FOUND",
    "NO_PERMISSION",
    "PROBE_SCRIPT",
    "RUNUSER_PATHS",
    "argv_to_command",
    "as_user",
    "not_executable_script",
    "read_chunk_script",
    "read_start_script",
    "returncode_of",
    "write_script",
]

#: Exit statuses of the provider's own file scripts (chosen away from 0, 1, 2 and 126-255).
NOT_FOUND = 90
IS_DIRECTORY = 91
NO_PERMISSION = 92
BROKEN = 93

#: Where runuser lives on the distributions we know; the wrapper runs with another user's authority
#: before the command does, so it is launched by absolute path, never found through the image's PATH.
RUNUSER_PATHS = ("/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser", "/bin/runuser")

#: Run once per sample: who commands run as (uid, name), a private working directory for the sample,
#: and runuser's path when there is one (empty line otherwise).
PROBE_SCRIPT = (
    # A uid without a passwd entry (Docker's user = "4242") has no name: the uid stands for it (GNU id
    # prints it and fails, others print nothing).
    "u=$(id -u) || exit 1\n"
    "n=$(id -un 2>/dev/null) || n=$u\n"
    'd=$(mktemp -d "${TMPDIR:-/tmp}/dsh-bash-inspect.XXXXXXXXXX") || exit 1\n'
    'printf \'%s\\n\' "$u" "$n" "$d"\n'
    "for p in " + " ".join(RUNUSER_PATHS) + '; do if [ -x "$p" ]; then echo "$p"; exit 0; fi; done\n'
    "echo\n"
)


def argv_to_command(argv: Sequence[str]) -> str:
    """One bash command line that runs ``argv`` as given: every word single-quoted, nothing expanded.

    ``argv[0]`` is looked up through the command's ``PATH`` (with inspect's ``env`` applied), as
    inspect asks of a provider.
    """
    if not argv:
        raise ValueError("exec needs a command: cmd is an empty list")
    for word in argv:
        if not isinstance(word, str):
            raise TypeError(f"exec: every element of cmd must be a str, not {type(word).__name__}")
    return shlex.join(argv)


def as_user(command: str, user: str, runuser: str) -> str:
    """``command`` run by ``user`` through ``runuser`` (the caller checked that it may switch).

    Without ``--login``, runuser keeps the environment (``PATH`` and inspect's ``env`` included) and
    the working directory, and sets only ``HOME``, ``SHELL``, ``USER`` and ``LOGNAME`` for the
    target user. The inner shell is the outer one (``$BASH``), not one found through ``PATH``.
    """
    return (
        f"exec {shlex.quote(runuser)} -u {shlex.quote(user)} -- "
        f'"$BASH" --noprofile --norc -c {shlex.quote(command)}'
    )


def returncode_of(exit_code: int | None, signal_name: str | None) -> int:
    """inspect's returncode: the exit status, or ``128+n`` for a death by signal ``n`` (as shells say)."""
    if exit_code is not None:
        return exit_code
    if signal_name is None:
        return -1
    try:
        number = int(signal.Signals[signal_name])
    except KeyError:
        digits = signal_name.removeprefix("SIG")
        number = int(digits) if digits.isdigit() else 0
    return 128 + number


def _checks(path: str) -> str:
    quoted = shlex.quote(path)
    return (
        f"f={quoted}\n"
        f'if [ -d "$f" ]; then exit {IS_DIRECTORY}; fi\n'
        f'if [ ! -e "$f" ]; then exit {NOT_FOUND}; fi\n'
        f'if [ ! -r "$f" ]; then exit {NO_PERMISSION}; fi\n'
    )


def _chunk(offset_blocks: int, blocks: int, block: int) -> str:
    # dd reads whole blocks from a regular file; base64 wraps lines, which the decoder skips.
    return (
        f'dd if="$f" bs={block} skip={offset_blocks} count={blocks} 2>/dev/null | base64\n'
        f'if [ "${{PIPESTATUS[*]}}" != "0 0" ]; then exit {BROKEN}; fi\n'
    )


def read_start_script(path: str, blocks: int, block: int) -> str:
    """Check ``path``, print its size on a line, then the first chunk in base64."""
    return _checks(path) + 'wc -c <"$f" || exit ' + str(BROKEN) + "\n" + _chunk(0, blocks, block)


def read_chunk_script(path: str, offset_blocks: int, blocks: int, block: int) -> str:
    """The chunk of ``path`` at ``offset_blocks`` blocks, in base64."""
    return _checks(path) + _chunk(offset_blocks, blocks, block)


def write_script(path: str) -> str:
    """Write stdin to ``path`` (parents created), exit statuses telling why it could not."""
    quoted = shlex.quote(path)
    return (
        f"f={quoted}\n"
        f'if [ -d "$f" ]; then exit {IS_DIRECTORY}; fi\n'
        'd=$(dirname -- "$f")\n'
        'mkdir -p -- "$d" 2>/dev/null\n'
        f'if [ ! -d "$d" ]; then if [ -e "$d" ]; then exit {BROKEN}; else exit {NO_PERMISSION}; fi; fi\n'
        f'if [ -e "$f" ] && [ ! -w "$f" ]; then exit {NO_PERMISSION}; fi\n'
        f'if [ ! -e "$f" ] && [ ! -w "$d" ]; then exit {NO_PERMISSION}; fi\n'
        f'cat >"$f" || exit {BROKEN}\n'
    )


def not_executable_script(argv0: str) -> str:
    """Exit 0 when ``argv0`` names a file that exists but cannot be executed (bash's status 126)."""
    quoted = shlex.quote(argv0)
    return (
        f"c={quoted}\n"
        "case $c in\n"
        '  */*) [ -e "$c" ] && { [ -d "$c" ] || [ ! -x "$c" ]; }; exit ;;\n'
        "esac\n"
        "IFS=:\n"
        'for d in $PATH; do [ -f "$d/$c" ] && [ ! -x "$d/$c" ] && exit 0; done\n'
        "exit 1\n"
    )
