"""The SSH backend's own scripts; the scripts shared with other remote backends live in dsh_bash.

Every script runs as ``exec bash --noprofile --norc -c SCRIPT dsh-bash ARGS...`` handed to the
login shell, whose rc files may print anything: each script marks where its own output begins.
"""

from __future__ import annotations

import shlex

from dsh_bash._remote_bash import BOOT_FAIL, BOOT_OK, KILL, SPILL_DIR, SPILL_WRITER

__all__ = [
    "BOOT",
    "BOOT_FAIL",
    "BOOT_OK",
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

# $1: spill directory, $2: nonce, $3: the command text, or empty when it is long and comes in the
# header (it then runs from a 0600 file: one execve argument is limited to 128 KiB). The command
# text is no secret here: the command's own `bash -c COMMAND` shows it to `ps` anyway.
#
# Values never travel on a command line (`ps` shows it): stdin starts with a header of
# NUL-terminated entries: their count, the workdir, the command's marker, "1" when stdin data follows
# the header, the names of the login's variables the command keeps as they are (space-separated),
# the long command (or nothing), then NAME=VALUE for every other variable of the command's final
# environment. Bash's `read` takes a pipe one byte at a time, so it never reads past the header: the
# command's own stdin follows intact (sshd gives the session pipes). Every exported variable that is
# neither kept nor in the header is unset (found with ${!prefix@}, no subshell), so the environment
# is the policy's, whatever the login's rc files added.
#
# Then the script reports "started" on both streams (whatever came before is rc noise) and becomes
# the command's shell (`exec`): the channel's process is a session leader under sshd, so the
# command's process group is the channel's, and the channel's exit-status or exit-signal is the
# command's. Only the command carries the marker, so kills by marker never hit this script.
BOOT = r"""
umask 077
_dsh_h=() _dsh_n=0
IFS= read -r -d '' _dsh_n
for ((_dsh_i = 0; _dsh_i < _dsh_n; _dsh_i++)); do IFS= read -r -d '' _dsh_e || break; _dsh_h+=("$_dsh_e"); done
if [ "${#_dsh_h[@]}" -lt 5 ] || [ "${#_dsh_h[@]}" != "$_dsh_n" ]; then printf '\0dsh-bash-boot-fail:incomplete header\0'; exit 125; fi
_dsh_workdir=${_dsh_h[0]} _dsh_mark=${_dsh_h[1]} _dsh_input=${_dsh_h[2]} _dsh_keep=" ${_dsh_h[3]} " _dsh_command=${3-}
for _dsh_v in ALL_VARIABLES; do
  [[ $_dsh_v != _dsh_* && ${!_dsh_v@a} == *x* && $_dsh_keep != *" $_dsh_v "* ]] && unset -v "$_dsh_v" 2>/dev/null
done
for _dsh_e in "${_dsh_h[@]:5}"; do export "$_dsh_e" 2>/dev/null; done
if [ ! -e "$_dsh_workdir" ]; then printf '\0dsh-bash-boot-fail:does not exist\0'; exit 125; fi
if [ ! -d "$_dsh_workdir" ]; then printf '\0dsh-bash-boot-fail:is not a directory\0'; exit 125; fi
if ! cd -- "$_dsh_workdir" 2>/dev/null; then printf '\0dsh-bash-boot-fail:cannot be entered\0'; exit 125; fi
_dsh_script=
if [ -z "$_dsh_command" ]; then
  _dsh_script=$1/$2.sh
  if ! (set -C; printf '%s' "${_dsh_h[4]}" > "$_dsh_script") 2>/dev/null; then printf '\0dsh-bash-boot-fail:cannot store the long command\0'; exit 125; fi
fi
printf '\0dsh-bash-boot-ok\0'
printf '\0dsh-bash-stderr-ok\0' >&2
[ "$_dsh_input" = 1 ] || exec </dev/null
export DSH_BASH_MARK=$_dsh_mark
if [ -n "$_dsh_script" ]; then exec bash --noprofile --norc "$_dsh_script"; fi
exec bash --noprofile --norc -c "$_dsh_command"
"""

BOOT = BOOT.replace(
    "ALL_VARIABLES", " ".join(f"${{!{c}@}}" for c in "_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
)
