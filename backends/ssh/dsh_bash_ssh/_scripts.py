"""The SSH backend's own scripts; the scripts shared with other remote backends live in dsh_bash.

Every script runs as ``exec bash --noprofile --norc -c SCRIPT dsh-bash ARGS...`` handed to the
login shell, whose rc files may print anything: each script marks where its own output begins.
"""

from __future__ import annotations

import shlex

from dsh_bash._remote_bash import BOOT_FAIL, BOOT_OK, EXIT_PREFIX, KILL, SPILL_DIR, SPILL_WRITER

__all__ = [
    "BOOT",
    "BOOT_FAIL",
    "BOOT_OK",
    "EXIT_PREFIX",
    "KILL",
    "SCRIPT_BEGIN",
    "SETUP",
    "SETUP_END",
    "SETUP_HOME",
    "SPILL_WRITER",
    "STDERR_OK",
    "cmdline",
]

#: Written to stderr by BOOT once the command is about to start: stderr before it is rc noise.
STDERR_OK = b"\0dsh-bash-stderr-ok\0"
#: Written to stdout by every helper script before its own output (see :func:`cmdline`).
SCRIPT_BEGIN = b"\0dsh-bash-begin\0"
SETUP_HOME = b"\0dsh-bash-home\0"
SETUP_END = b"\0dsh-bash-end\0"


def cmdline(script: str, *args: str, begin_marker: bool = True) -> str:
    """The command line sent to the login shell: a clean bash (no rc file, no $BASH_ENV) runs ``script``.

    Only the script and its arguments appear here (``ps`` on the host shows them): never values.
    """
    if begin_marker:
        script = "printf '\\0dsh-bash-begin\\0'\n" + script
    words = ["bash", "--noprofile", "--norc", "-c", script, "dsh-bash", *args]
    return "BASH_ENV= ENV= exec " + " ".join(shlex.quote(word) for word in words)


# At connect: the login's environment (NUL-separated NAME=VALUE), its home (the directory sshd
# starts sessions in; $HOME may say otherwise), and a new private spill directory.
SETUP = (
    r"""
for v in $(compgen -e); do printf '%s=%s\0' "$v" "${!v}"; done
printf '\0dsh-bash-home\0'; pwd -P; printf '\0'
dir=$("""
    + SPILL_DIR.strip()
    + r""") || exit 1
printf '\0dsh-bash-end\0%s\0' "$dir"
"""
)

# $1: spill directory, $2: nonce.
#
# Values never travel on a command line (`ps` shows it): stdin starts with a header of
# NUL-terminated entries: their count, the command text, the workdir, the command's marker, "1" when
# the command is long (then it runs from a 0600 file: one execve argument is limited to 128 KiB),
# "1" when stdin data follows the header, then every NAME=VALUE of the command's final environment. Bash's `read` takes a pipe one byte at a
# time, so it never reads past the header: the command's own stdin follows intact. The login's
# exported variables are all unset (found with ${!prefix@}, no subshell) and exactly the header's
# exported, so the environment is the policy's, whatever the login added.
#
# Then, like the Docker backend's boot script: the command runs in a new session, in the foreground
# (with `&`, bash would start it with SIGINT and SIGQUIT ignored), its output relayed through two
# `cat`s; its exit status goes out in-band as a trailer carrying the nonce, and the script exits only
# once every holder of the command's pipes is gone (so the channel ends when the output really ends).
# The command alone carries the marker, so kills by marker never hit this script or its relays.
BOOT = r"""
umask 077
h=() n=0
IFS= read -r -d '' n
for ((i = 0; i < n; i++)); do IFS= read -r -d '' e || break; h+=("$e"); done
if [ "${#h[@]}" -lt 5 ] || [ "${#h[@]}" != "$n" ]; then printf '\0dsh-bash-boot-fail:incomplete header\0'; exit 125; fi
command=${h[0]} workdir=${h[1]} mark=${h[2]} long=${h[3]} input=${h[4]} nonce=$2 spill=$1
for v in ALL_VARIABLES; do [[ ${!v@a} == *x* ]] && unset -v "$v" 2>/dev/null; done
for e in "${h[@]:5}"; do export "$e" 2>/dev/null; done
unset -v h e v i n
if [ ! -e "$workdir" ]; then printf '\0dsh-bash-boot-fail:does not exist\0'; exit 125; fi
if [ ! -d "$workdir" ]; then printf '\0dsh-bash-boot-fail:is not a directory\0'; exit 125; fi
if ! cd -- "$workdir" 2>/dev/null; then printf '\0dsh-bash-boot-fail:cannot be entered\0'; exit 125; fi
if ! command -v setsid >/dev/null; then printf '\0dsh-bash-boot-fail:cannot start a session: no setsid\0'; exit 125; fi
script=
if [ "$long" = 1 ]; then
  script=$spill/$nonce.sh
  if ! (set -C; printf '%s' "$command" > "$script") 2>/dev/null; then printf '\0dsh-bash-boot-fail:cannot store the long command\0'; exit 125; fi
  command=
fi
printf '\0dsh-bash-boot-ok\0'
printf '\0dsh-bash-stderr-ok\0' >&2
exec 5> >(exec cat); out=$!
exec 6> >(exec cat >&2); err=$!
# From here this shell's own notices ("Terminated" when the command dies of a signal) must not
# reach the command's stderr: the relay above holds the real one.
exec 2>/dev/null
# stdin: /dev/null, or the channel's data through a pipe (a bash whose stdin is the channel's
# socket would take itself for an ssh login and read ~/.bashrc).
if [ "$input" = 1 ]; then exec 7< <(exec cat); else exec 7</dev/null; fi
exec 0</dev/null
if [ -n "$script" ]; then
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc "$script" <&7 >&5 2>&6 5>&- 6>&- 7<&-
else
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc -c "$command" <&7 >&5 2>&6 5>&- 6>&- 7<&-
fi
status=$?
exec 5>&- 6>&- 7<&-
[ -n "$script" ] && rm -f -- "$script"
printf '\0dsh-bash-exit:%s:%03d\0' "$nonce" "$status"
# Bash 5.1+ waits for process substitutions by pid; older ones refuse, so poll them.
wait "$out" "$err" 2>/dev/null || while kill -0 "$out" 2>/dev/null || kill -0 "$err" 2>/dev/null; do sleep 0.05; done
"""

BOOT = BOOT.replace(
    "ALL_VARIABLES", " ".join(f"${{!{c}@}}" for c in "_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
)
