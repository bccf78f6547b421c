"""The SSH backend's own scripts; the scripts shared with other remote backends live in dsh_bash.

Every script runs as ``exec bash --noprofile --norc -c SCRIPT dsh-bash ARGS...`` handed to the
login shell, whose rc files may print anything: each script marks where its own output begins.
"""

from __future__ import annotations

import functools
import shlex

from dsh_bash.backend import SESSION_FD
from dsh_bash.remote import (
    BOOT_FAIL,
    BOOT_OK,
    KILL,
    SPILL_DIR,
    SPILL_WRITER,
    ascii_quote,
)

__all__ = [
    "BOOT_FAIL",
    "BOOT_OK",
    "HELPER_SCRUB",
    "IDENTITY_FORMAT",
    "KILL",
    "READY",
    "SCRIPT_BEGIN",
    "SETUP",
    "SETUP_END",
    "SETUP_HOME",
    "SFTP_SERVER",
    "SIGNAL_SUPERVISORS",
    "SPILL_WRITER",
    "STDERR_OK",
    "WAITER",
    "boot_line",
    "boot_request",
    "boot_script",
    "cmdline",
]

#: Written to stderr by BOOT once the command is about to start: stderr before it is rc noise.
STDERR_OK = b"\0dsh-bash-stderr-ok\0"
#: Written to stdout by every helper script before its own output (see :func:`cmdline`).
SCRIPT_BEGIN = b"\0dsh-bash-begin\0"
SETUP_HOME = b"\0dsh-bash-home\0"
SETUP_END = b"\0dsh-bash-end\0"


def cmdline(script: str, *args: str, begin_marker: bool = True, keep: str | None = None) -> str:
    """The command line sent to the login shell: a clean bash (no rc file, no $BASH_ENV) runs ``script``.

    Only the script and its arguments appear here (``ps`` on the host shows them): never values.
    ``keep`` (the login's variable names the policy keeps, space-separated; None only for SETUP,
    which must see the whole login environment to report it): the script's bash then starts with
    the scrubbed environment (see HELPER_SCRUB), so no helper (spill writer, kill script) carries
    a value from sshd ``SetEnv``, ``~/.ssh/environment`` or an rc file.
    """
    if begin_marker:
        script = "printf '\\0dsh-bash-begin\\0'\n" + script
    if keep is None:
        words = ["bash", "--noprofile", "--norc", "-c", script, "dsh-bash", *args]
    else:
        words = ["bash", "--noprofile", "--norc", "-c", HELPER_SCRUB, script, keep, *args]
    return "BASH_ENV= ENV= exec " + " ".join(shlex.quote(word) for word in words)


# A helper's first bash: $0 is the helper script, $1 the names it keeps, the rest its arguments.
# It was started with the login's whole environment (sshd's SetEnv, ~/.ssh/environment, what rc
# files exported), which /proc/PID/environ shows for as long as the process lives, whatever bash
# un-exports: so it un-exports every variable and function, exports the kept names again, and
# `exec`s the bash that runs the script, whose environment is then the policy's (the kept names
# with the values the login gives them in this session, as for BOOT). Costs one bash exec.
HELPER_SCRUB = (
    "builtin declare +x -- ALL_VARIABLES 2>/dev/null\n"
    "if builtin compgen -A function >/dev/null 2>&1; then builtin mapfile -t _dsh_f < <(builtin compgen -A function);"
    ' builtin unset -f -- "${_dsh_f[@]}"; fi\n'
    "builtin export -- $1 >/dev/null 2>&1\n"
    'exec bash --noprofile --norc -c "$0" dsh-bash "${@:2}"\n'
)


# The host's sftp-server, for a server that offers no SFTP subsystem: run over an exec channel (with
# the helper's scrubbed environment), after the begin marker (rc noise before it is skipped). The
# usual places of OpenSSH's sftp-server (Debian, Red Hat, Arch and Alpine, BSDs), then PATH.
SFTP_SERVER = r"""
for p in /usr/lib/openssh/sftp-server /usr/libexec/openssh/sftp-server /usr/libexec/sftp-server \
    /usr/lib/ssh/sftp-server /usr/libexec/ssh/sftp-server /usr/lib/sftp-server "$(command -v sftp-server)"; do
  if [[ -n $p && -f $p && -x $p ]]; then printf '\0dsh-bash-begin\0'; exec "$p"; fi
done
echo "no sftp-server program found" >&2
exit 127
"""

# At connect: the login's environment (NUL-separated NAME=VALUE), its home (the directory sshd
# starts sessions in; $HOME may say otherwise), a new private spill directory, and the machine
# (`uname -m`: which dsh-supervise to install; empty when uname is missing).
SETUP = (
    r"""
for v in $(compgen -e); do printf '%s=%s\0' "$v" "${!v}"; done
printf '\0dsh-bash-home\0'; pwd -P; printf '\0'
dir=$("""
    + SPILL_DIR.strip()
    + r""") || exit 1
umask 077; compgen -e > "$dir/exported-names" || exit 1
printf '\0dsh-bash-end\0%s\0' "$dir"
uname -m 2>/dev/null
exit 0
"""
)

# BOOT's arguments: spill directory, nonce, mode ("fg", or "bg" for a detached task, see
# SUPERVISOR), the command text (empty when it is long and comes in the header; it then runs from a
# 0600 file: one execve argument is limited to 128 KiB), workdir, the command's marker, "1" when stdin data follows, "1" when a header comes on stdin,
# the names of the login's variables the command keeps as they are (space-separated), the sandbox
# policy's step as shell words (ASCII-quoted by the executor, empty without a policy: the supervisor
# execs them before the command's bash, see SshBashExecutor._confine_prefix), then
# NAME=VALUE entries whose values are the library's own constants (the model-friendly set, SHLVL).
# None of that is secret: the command's own `bash -c COMMAND` shows its text to `ps` anyway.
#
# Values of the login's or the caller's environment never travel on a command line (`ps` shows it):
# when there are any, stdin starts with a header of NUL-terminated entries: their count, the long
# command (or nothing), then NAME=VALUE entries. Bash's `read` takes a pipe one byte at a time, so it
# never reads past the header: the command's own stdin follows intact (sshd gives the session
# pipes). Every variable loses its export attribute (see _ENVIRONMENT), then the kept names and the
# set entries are exported again, so the environment is the policy's, whatever the login's rc files
# added (readonly variables included).
#
# A failure before the command starts is reported as BOOT_FAIL, its kind (an infrastructure error
# reason, see dsh_bash.remote.boot_failure), optionally `:` and a detail, then NUL; exit 125.
#
# Then the script reports "started" on both streams (whatever came before is rc noise) and becomes
# the command's shell (`exec`): the channel's process is a session leader under sshd, so the
# command's process group is the channel's, and the channel's exit-status or exit-signal is the
# command's. Only the command carries the marker, so kills by marker never hit this script.
#
# BOOT runs in the login shell itself when that is a bash with compgen whose rc files defined no
# function (so no builtin is shadowed), saving a bash start; otherwise in `bash --noprofile --norc` (see
# boot_line). Either way it resets what rc files may have changed for a script (options, traps,
# IFS) and calls builtins through `builtin`. Functions a fresh bash imported from the environment
# are exported functions, not part of the policy's environment: they are removed.
#
# BOOT is put together from sections for what each command needs (a header, a long command, stdin,
# a detached task): the login shell parses it cold for every command, and parsing is most of its cost.
_PRELUDE = r"""
builtin set +euvx +o pipefail +o noglob +o noclobber; builtin trap - DEBUG ERR RETURN; IFS=$' \t\n'
_dsh_spill=$1 _dsh_nonce=$2 _dsh_mode=$3 _dsh_command=$4 _dsh_workdir=$5 _dsh_mark=$6 _dsh_input=$7 _dsh_header=$8 _dsh_keep=$9
_dsh_c=()
[[ -n ${10} ]] && builtin eval "_dsh_c=(${10})"
builtin shift 10
_dsh_set=("$@") _dsh_script=
"""
_READ_HEADER = r"""
_dsh_n=0 _dsh_h=()
IFS= builtin read -r -d '' _dsh_n
for ((_dsh_i = 0; _dsh_i < _dsh_n; _dsh_i++)); do IFS= builtin read -r -d '' _dsh_e || break; _dsh_h+=("$_dsh_e"); done
if (( ${#_dsh_h[@]} < 1 || ${#_dsh_h[@]} != _dsh_n )); then builtin printf '\0dsh-bash-boot-fail:start_failed:incomplete header\0'; builtin exit 125; fi
_dsh_long=${_dsh_h[0]} _dsh_set+=("${_dsh_h[@]:1}")
"""
# The un-export: the names the login exported at connect (written by SETUP to a file in the private
# directory) lose the attribute, then `compgen -e` proves nothing is left exported (status 1: no
# match; `compgen -v` proves compgen itself is there, as status 1 also means "no such builtin"). When
# something is (an rc file exported a new name since) or the file is unusable (missing, not a
# regular file), every variable is swept by prefix: 53 scans of all variables, complete but
# about 0.4 ms slower, so it is a quoted string, parsed only when it runs.
_UNEXPORT = r"""
_dsh_x=()
[[ -f $_dsh_spill/exported-names && ! -L $_dsh_spill/exported-names ]] && builtin mapfile -t _dsh_x <"$_dsh_spill/exported-names"
{
  if builtin compgen -A function; then
    builtin mapfile -t _dsh_f < <(builtin compgen -A function)
    builtin unset -f -- "${_dsh_f[@]}"
  fi
  (( ${#_dsh_x[@]} )) && builtin declare +x -- "${_dsh_x[@]}"
  if builtin compgen -e || ! builtin compgen -v _dsh_spill; then
    builtin eval 'builtin declare +x -- ALL_VARIABLES'
  fi
} >/dev/null 2>&1
"""
_ENVIRONMENT = r"""
builtin export -- $_dsh_keep "${_dsh_set[@]}" >/dev/null 2>&1
if ! builtin cd -- "$_dsh_workdir" 2>/dev/null; then
  if [[ ! -e $_dsh_workdir ]]; then _dsh_e=workdir_missing; elif [[ ! -d $_dsh_workdir ]]; then _dsh_e=workdir_not_directory; else _dsh_e=workdir_not_accessible; fi
  builtin printf '\0dsh-bash-boot-fail:%s\0' "$_dsh_e"; builtin exit 125
fi
"""
_STORE_LONG_COMMAND = r"""
_dsh_script=$_dsh_spill/$_dsh_nonce.cmd
# Any existing path is refused (noclobber alone would open a planted link to a FIFO or device).
if [[ -e $_dsh_script || -L $_dsh_script ]] || ! (builtin umask 077; builtin set -C; builtin printf '%s' "$_dsh_long" > "$_dsh_script") 2>/dev/null; then
  builtin printf '\0dsh-bash-boot-fail:start_failed:cannot store the long command\0'; builtin exit 125
fi
"""
_DETACH = r"""
_dsh_base=$_dsh_spill/$_dsh_nonce _dsh_islong=0
[[ -n $_dsh_script ]] && _dsh_islong=1
# noclobber refuses existing regular files and dangling links, not a planted link to a FIFO or
# a device: any existing path is refused first (the directory is 0700, so only its owner can plant).
_dsh_files="stdout stderr in"
[[ -n $_dsh_script ]] || _dsh_files+=" cmd"  # a long command's script is BASE.cmd already
for _dsh_e in $_dsh_files; do
  if [[ -e $_dsh_base.$_dsh_e || -L $_dsh_base.$_dsh_e ]]; then
    builtin printf '\0dsh-bash-boot-fail:start_failed:cannot create the task files\0'; builtin exit 125
  fi
done
if ! (builtin umask 077; builtin set -C
      [[ -n $_dsh_script ]] || builtin printf '%s' "$_dsh_command" > "$_dsh_base.cmd" || builtin exit 1
      : > "$_dsh_base.stdout" && : > "$_dsh_base.stderr" || builtin exit 1
      if [[ $_dsh_input == 1 ]]; then exec cat > "$_dsh_base.in"; fi) 2>/dev/null; then
  builtin printf '\0dsh-bash-boot-fail:start_failed:cannot create the task files\0'; builtin exit 125
fi
_dsh_up=
builtin read -r _dsh_up _ 2>/dev/null </proc/uptime
if ! setsid -f bash --noprofile --norc -c SUPERVISOR_QUOTED dsh-bash-task "$_dsh_base" "$_dsh_mark" "$_dsh_input" "$_dsh_islong" </dev/null >/dev/null 2>&1; then
  builtin printf '\0dsh-bash-boot-fail:start_failed:cannot start the task supervisor (setsid -f)\0'; builtin exit 125
fi
builtin printf '\0dsh-bash-boot-at:%s:0\0\0dsh-bash-boot-ok\0' "$_dsh_up"
builtin printf '\0dsh-bash-stderr-ok\0' >&2
builtin exit 0
"""
# A detached task under dsh-supervise --detach (mode "bg:N" when the supervisor is installed; N: the
# bytes of the spill budget granted to each of its output files, which the supervisor's writer never
# exceeds, --cap-bytes; raised later through BASE.cap, --cap-file): its
# stdin goes to BASE.in (a long command is in BASE.cmd already), then this process
# becomes the supervisor, which creates BASE.status, BASE.stdout and BASE.stderr itself (O_EXCL: they
# must not exist), reads its key from the channel, detaches and exits. Its key follows on stdin
# right after what BOOT reads, so nothing here reads past its own input: the header and the stdin
# length are read by bash's `read` (a pipe one byte at a time), the stdin data by `head -c`, which
# asks for no more than is left. No shell keeps a copy of the channel: the supervisor is exec'd.
# A short command runs as `bash -c COMMAND`, as in the foreground (the supervisor clears its own
# arguments; the command's bash shows its text, as any `bash -c` does). The marker goes to the
# command only (`--setenv`), as in the foreground.
_DETACH_SUPERVISED = r"""
CHECKED_dsh_base=$_dsh_spill/$_dsh_nonce
for _dsh_e in stdout stderr status in; do
  if [[ -e $_dsh_base.$_dsh_e || -L $_dsh_base.$_dsh_e ]]; then
    builtin printf '\0dsh-bash-boot-fail:start_failed:cannot create the task files\0'; builtin exit 125
  fi
done
_dsh_in=() _dsh_run=(-c -- "$_dsh_command")
[[ -n $_dsh_script ]] && _dsh_run=("$_dsh_script")
if [[ $_dsh_input == 1 ]]; then
  _dsh_len=
  IFS= builtin read -r -d '' _dsh_len
  if [[ ! $_dsh_len =~ ^[0-9]+$ ]]; then
    builtin printf '\0dsh-bash-boot-fail:start_failed:incomplete stdin\0'; builtin exit 125
  fi
  _dsh_in=(--stdin-file "$_dsh_base.in")
fi
if [[ $_dsh_input == 1 ]] && ! (builtin umask 077; builtin set -C; head -c "$_dsh_len" > "$_dsh_base.in") 2>/dev/null; then
  builtin printf '\0dsh-bash-boot-fail:start_failed:cannot create the task files\0'; builtin exit 125
fi
_dsh_cap=()
[[ $_dsh_mode == bg:* ]] && _dsh_cap=(--cap-bytes "${_dsh_mode#bg:}" --cap-file "$_dsh_base.cap")
builtin printf '\0dsh-bash-boot-ok\0'
builtin printf '\0dsh-bash-stderr-ok\0' >&2
exec SUPERVISOR GRACE--detach --status-file "$_dsh_base.status" "${_dsh_in[@]}" --stdout-file "$_dsh_base.stdout" \
  --stderr-file "$_dsh_base.stderr" "${_dsh_cap[@]}" --setenv "DSH_BASH_MARK=$_dsh_mark" -- "${_dsh_c[@]}" bash --noprofile --norc "${_dsh_run[@]}"
"""
# Plain `exec` from here: no function is defined (see above), and `builtin exec <file` would undo
# its redirection once the builtin returned.
#
# BOOT_AT before BOOT_OK: when the command starts on the host's clock (/proc/uptime, by a builtin:
# no fork) and this process's pid, which becomes the command's shell by exec (so it started before;
# every other process of the command starts after): kills by the command's marker skip older
# processes unread (issue 15). Under the supervisor the pid is the supervisor's, which carries no
# marker: reading it costs one environment.
_STARTED = r"""
_dsh_up=
builtin read -r _dsh_up _ 2>/dev/null </proc/uptime
builtin printf '\0dsh-bash-boot-at:%s:%s\0\0dsh-bash-boot-ok\0' "$_dsh_up" "$$"
builtin printf '\0dsh-bash-stderr-ok\0' >&2
builtin export DSH_BASH_MARK=$_dsh_mark
"""
# Under dsh-supervise (a foreground command, when the supervisor is installed): the script so far
# ran in the login's process, reading the header and the warm request from the channel's stdin;
# now that process becomes the supervisor, which takes the channel alone (frames both ways, see
# _framed). The marker goes to the command only (`--setenv`: the supervisor's child sets it right
# before its exec, with no `env` exec in between), never to the supervisor, whose own environment and
# command line never show it: a kill by marker must not hit the process that holds everything else.
# The supervisor gives the command a stdin pipe of its own, closed when the harness says so: no
# /dev/null here.
# A terminal task's mode is "fg" and its terminal's size ("fg30x100"): the supervisor makes and owns
# that pty. A command in a session has "fgs" ("fgs30x100"): the supervisor hands it the capture
# descriptor (fd 19, its state at exit comes back as 'v' frames). A command that gets no input at all
# (BOOT's $7 "0": neither stdin data nor open input) reads /dev/null (--stdin-null), as without the
# supervisor, not an empty pipe.
_RUN_SUPERVISED = (
    "_dsh_tty=${_dsh_mode#fg} _dsh_sess=(); [[ $_dsh_tty == s* ]] && "
    "{ _dsh_tty=${_dsh_tty#s}; _dsh_sess=(--capture-fd CAPTURE_FD); }; "
    'exec SUPERVISOR GRACESTDIN--frame ${_dsh_tty:+--tty "$_dsh_tty"} "${_dsh_sess[@]}" '
    '--setenv "DSH_BASH_MARK=$_dsh_mark" -- "${_dsh_c[@]}" bash --noprofile --norc COMMAND\n'
).replace("CAPTURE_FD", str(SESSION_FD))
# Before the verdict, so that a supervisor removed or replaced since the executor installed it (by a
# command of the same user, issue 30) is told apart from a command that could not start: the executor
# installs it again. With a check (see _supervisor: the install's stat program and the file's
# identity, device:inode:size:ctime) the file must still be the one installed, right before the exec:
# a file written in place, renamed over, or removed and made again has another inode or ctime, and no
# process but root can set a ctime back. One fork and exec of stat per command (about 1 ms). A
# process of the login can still swap the file between this stat and the exec (a race it must win
# within that millisecond).
_CHECK_SUPERVISOR = r"""[[ -x SUPERVISOR ]] ||
  { builtin printf '\0dsh-bash-boot-fail:supervisor_missing\0'; builtin exit 125; }
"""
#: ``stat -c`` format of the supervisor file's identity: device, inode, size, change time (in UTC:
#: BOOT's environment is not the install's), which any write, rename, chmod or new link changes.
IDENTITY_FORMAT = "%d:%i:%s:%z"
_CHECK_SUPERVISOR_IDENTITY = r"""[[ -x SUPERVISOR && $(TZ=UTC0 LC_ALL=C STAT -c FORMAT -- SUPERVISOR 2>/dev/null) == IDENTITY ]] ||
  { builtin printf '\0dsh-bash-boot-fail:supervisor_missing\0'; builtin exit 125; }
"""


# A warm channel's BOOT runs in the bash `dsh-supervise --warm` exec'd, which left a sealed copy of
# itself on fd 4 (see native/warm.c): the command's supervisor is exec'd from that copy, which no
# process can write, so no stat of the cached file is needed (one fork and exec less per command)
# and no process of the login can swap the file between a check and the exec. `exec -a` keeps the
# supervisor's usual command line; `--self-fd 4` has it close fd 4 on the command's exec and take its
# usual name. Where the copy is missing (no memfds or seals) the file is checked as on a cold channel.
_PICK_SEALED_SUPERVISOR = r"""if [[ -x /proc/self/fd/4 ]]; then _dsh_sup=/proc/self/fd/4 _dsh_self=(--self-fd 4)
else
CHECK_dsh_sup=SUPERVISOR _dsh_self=()
fi
"""
#: What BOOT execs for ``SUPERVISOR`` after :data:`_PICK_SEALED_SUPERVISOR`.
_SEALED_SUPERVISOR = '-a SUPERVISOR "$_dsh_sup" "${_dsh_self[@]}"'


def _supervisor_exec(supervisor: str, check: tuple[str, str] | None, *, warm: bool) -> tuple[str, str]:
    """BOOT's look at the supervisor before its exec, and the words to exec it by."""
    quoted = ascii_quote(supervisor)
    if not warm:
        return _supervisor_check(supervisor, check), quoted
    picked = _PICK_SEALED_SUPERVISOR.replace("CHECK", _supervisor_check(supervisor, check))
    return picked.replace("SUPERVISOR", quoted), _SEALED_SUPERVISOR.replace("SUPERVISOR", quoted)


def _supervisor_check(supervisor: str, check: tuple[str, str] | None) -> str:
    """BOOT's look at the supervisor before its exec: it exists, and (``check``: the stat program,
    the identity it printed at install) is still the file installed."""
    if check is None:
        return _CHECK_SUPERVISOR.replace("SUPERVISOR", ascii_quote(supervisor))
    stat, identity = check
    return (
        _CHECK_SUPERVISOR_IDENTITY.replace("SUPERVISOR", ascii_quote(supervisor))
        .replace("STAT", ascii_quote(stat))
        .replace("FORMAT", ascii_quote(IDENTITY_FORMAT))
        .replace("IDENTITY", ascii_quote(identity))
    )


_NO_STDIN = "exec </dev/null\n"
_RUN_INLINE = 'exec bash --noprofile --norc -c -- "$_dsh_command"\n'
_RUN_STORED = 'exec bash --noprofile --norc "$_dsh_script"\n'

# A detached background task's supervisor, started by BOOT (mode "bg") with `setsid -f`, stdio on
# /dev/null, so it holds no channel. $1: the task's files' base path, $2: marker, $3: "1" when stdin
# data was stored in BASE.in, $4: "1" when BASE.cmd is a long command to run as a script. The command
# text comes from BASE.cmd, so no command line but the command's own shows it. The command runs in
# the foreground (background jobs of a non-interactive bash start with SIGINT and SIGQUIT ignored),
# in its own session, marked; the supervisor is unmarked and outside its group, so kills by marker
# never hit it. Output goes through two `cat` relays into BASE.stdout/BASE.stderr; BASE.exit-STATUS
# (128+n for a signal death) appears when the command's shell ended, BASE.eof once every holder of
# its output is gone.
SUPERVISOR = r"""
b=$1 mark=$2 input=$3 long=$4 in=/dev/null
[ "$input" = 1 ] && in=$b.in
# BOOT's bash and this one each raised SHLVL: the command sees its parent's level plus one.
case ${SHLVL-} in ''|*[!0-9]*) ;; *) SHLVL=$((SHLVL > 2 ? SHLVL - 2 : 0)) ;; esac
exec 5> >(exec cat >> "$b.stdout"); o=$!
exec 6> >(exec cat >> "$b.stderr"); e=$!
if [ "$long" = 1 ]; then
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc "$b.cmd" <"$in" >&5 2>&6 5>&- 6>&-
else
  IFS= read -r -d '' c < "$b.cmd"
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc -c "$c" <"$in" >&5 2>&6 5>&- 6>&-
fi
s=$?
exec 5>&- 6>&-
(umask 077; set -C; : > "$b.exit-$s")
wait "$o" "$e" 2>/dev/null || while kill -0 "$o" 2>/dev/null || kill -0 "$e" 2>/dev/null; do sleep 0.05; done
(umask 077; set -C; : > "$b.eof")
"""

# A detached task's dsh-supervise, signalled (or only looked at) over the kill channel. $1: its pid,
# $2: its start time (field 22 of /proc/PID/stat, from its verified `supervisor` record), $3: USR1
# (a TERM pass), USR2 (KILL passes) or 0 (look only). Prints "alive" when $1 is still that process,
# and then signals it; else "gone": a pid reused by another process is never signalled.
SIGNAL_SUPERVISORS = r"""
# $1: the request (USR1, USR2, or 0: look only); then a supervisor's pid and start time, per task.
# One word per task: alive (signalled), or gone (dead, a zombie, or its pid taken by another).
request=$1
shift
while (($# >= 2)); do
  word=gone
  if stat=$(< "/proc/$1/stat") 2>/dev/null; then
    read -r -a f <<< "${stat##*) }"
    # f[0] is field 3 (the state), so field 22 is f[19]; a zombie holds nothing any more.
    if [[ ${f[0]} != [ZX] && ${f[19]} == "$2" ]]; then
      # The request, then SIGCONT: the task may have stopped its supervisor (same user), which would
      # keep the request pending for ever; continued, it takes it at once.
      if [[ $request == 0 ]] || { kill -s "$request" "$1" 2>/dev/null && kill -s CONT "$1" 2>/dev/null; }; then word=alive; fi
    fi
  fi
  echo "$word"
  shift 2
done
"""

_DETACH = _DETACH.replace("SUPERVISOR_QUOTED", shlex.quote(SUPERVISOR))
# Every variable's name, by prefix: 53 scans, complete.
_ALL_VARIABLES = " ".join(f"${{!{c}@}}" for c in "_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_UNEXPORT = _UNEXPORT.replace("ALL_VARIABLES", _ALL_VARIABLES)
HELPER_SCRUB = HELPER_SCRUB.replace("ALL_VARIABLES", _ALL_VARIABLES)


@functools.cache
def boot_script(
    *,
    detached: bool,
    header: bool,
    long: bool,
    stdin: bool,
    warm: bool = False,
    supervisor: str | None = None,
    grace_ms: int | None = None,
    check: tuple[str, str] | None = None,
) -> str:
    """BOOT with just the sections a command of this shape runs; ``warm``: for a warm channel's
    WAITER, whose bash started with an empty environment (so there is nothing to un-export);
    ``supervisor``: the path of dsh-supervise on the host, for the command to run under (``--frame``
    in the foreground, ``--detach`` for a detached task); ``grace_ms``: its ``--grace-ms``, so that
    a SIGTERM request is followed by SIGKILL on the host's own clock (a request travels in a new
    session, which a loaded host may start seconds late); ``check``: the ``stat`` program and the
    identity the supervisor's file had at install, compared right before its exec (see
    ``_supervisor``; None: only that it is there)."""
    grace = "" if grace_ms is None else f"--grace-ms {int(grace_ms)} "
    parts = [_PRELUDE]
    if header:
        parts.append(_READ_HEADER)
    if not warm:
        parts.append(_UNEXPORT)
    parts.append(_ENVIRONMENT)
    if long:
        parts.append(_STORE_LONG_COMMAND)
    if detached and supervisor is not None:
        checked, executed = _supervisor_exec(supervisor, check, warm=warm)
        parts.append(
            _DETACH_SUPERVISED.replace("SUPERVISOR", executed)
            .replace("GRACE", grace)
            .replace("CHECKED", checked)
        )
    elif detached:
        parts.append(_DETACH)
    elif supervisor is not None:
        checked, executed = _supervisor_exec(supervisor, check, warm=warm)
        parts.append(checked)
        parts.append(_STARTED.replace("builtin export DSH_BASH_MARK=$_dsh_mark\n", ""))
        run = '"$_dsh_script"' if long else '-c -- "$_dsh_command"'
        # ASCII-quoted: a warm request is ASCII, and every shell that runs BOOT is a bash.
        parts.append(
            _RUN_SUPERVISED.replace("SUPERVISOR", executed)
            .replace("GRACESTDIN", grace + ("" if stdin else "--stdin-null "))
            .replace("COMMAND", run)
        )
    else:
        parts.append(_STARTED)
        if not stdin:
            parts.append(_NO_STDIN)
        parts.append(_RUN_STORED if long else _RUN_INLINE)
    return "".join(parts)


@functools.cache
def _quoted_boot(
    shape: tuple[bool, bool, bool, bool],
    supervisor: str | None,
    grace_ms: int | None,
    check: tuple[str, str] | None,
) -> str:
    detached, header, long, stdin = shape
    return shlex.quote(
        boot_script(
            detached=detached,
            header=header,
            long=long,
            stdin=stdin,
            supervisor=supervisor,
            grace_ms=grace_ms,
            check=check,
        )
    )


def boot_line(
    *args: str,
    supervisor: str | None = None,
    grace_ms: int | None = None,
    check: tuple[str, str] | None = None,
) -> str:
    """The command line running BOOT with ``args`` (see BOOT's arguments above). Any POSIX login
    shell parses it: BOOT runs in the login shell itself when that is a bash with compgen whose rc
    files defined no function, else in a clean bash. ``supervisor``: see :func:`boot_script`."""
    quoted = " ".join(shlex.quote(arg) for arg in args)
    return (
        f"_dsh_b={_quoted_boot(_shape(args), supervisor, grace_ms, check)}; set -- {quoted}; "
        'if [ -n "${BASH_VERSION-}" ] && compgen -v BASH_VERSION >/dev/null 2>&1 '
        '&& ! compgen -A function >/dev/null 2>&1; then eval "$_dsh_b"; '
        'else BASH_ENV= ENV= exec bash --noprofile --norc -c "$_dsh_b" dsh-bash "$@"; fi'
    )


def _shape(args: tuple[str, ...]) -> tuple[bool, bool, bool, bool]:
    """(detached, header, long, stdin) of a command from BOOT's arguments."""
    return args[2].startswith("bg"), args[7] == "1", args[3] == "", args[6] == "1"


#: Written to stdout by WAITER once its login shell waits for a command.
READY = b"\0dsh-bash-ready\0"
#: A request's length: this many decimal digits.
_LENGTH_DIGITS = 10

# A warm channel: its login shell (rc files and all) starts ahead of the command and becomes a bash
# with an empty environment (`env -i`: no value of the login's environment stays in a process that
# waits), which waits on stdin for a request: the length of what follows (_LENGTH_DIGITS digits),
# then `builtin set -- ARGS`, the long command if any, and the BOOT for the command's shape. The
# request carries the command's whole environment as arguments (it is never on a command line).
# `read -N` takes a pipe in bulk and never past the count, so the command's stdin that follows stays
# for it. The request is ASCII (see boot_request), so characters are bytes in any locale. At EOF
# (the channel closed unused) it exits. Fd 4 is closed first: a warm BOOT execs the supervisor from
# the sealed copy `dsh-supervise --warm` leaves there, and a WAITER has none (an rc file of the login
# shell may have opened something there). A plain `exec` (no function can be defined in a bash
# started with an empty environment and no rc file): `builtin exec` would undo the close on return.
WAITER = r"""
exec 4<&-
builtin printf '\0dsh-bash-ready\0'
IFS= builtin read -r -N LENGTH_DIGITS _dsh_len || builtin exit 0
[[ $_dsh_len =~ ^[0-9]{LENGTH_DIGITS}$ ]] || builtin exit 0
IFS= builtin read -r -N "$((10#$_dsh_len))" _dsh_req || builtin exit 0
builtin eval "$_dsh_req"
""".replace("LENGTH_DIGITS", str(_LENGTH_DIGITS))


# Under the supervisor the waiting is dsh-supervise's (`--warm`, protocol 7): a bash waiting on the
# channel is any process of the login's to take over (its /proc/PID/fd/0 and fd/1 opened, or ptrace),
# which would read the next command's request, environment and all, and answer in its place; the
# supervisor is non-dumpable. It prints READY, reads the request as WAITER does and execs bash with it
# (from a memfd on fd 3, never on a command line). The file is checked first as BOOT checks it (its
# identity from install, with the install's stat): a replaced one never sees a request, the spare
# just ends (the command then takes a fresh channel, whose BOOT reports the supervisor missing). Any
# POSIX login shell runs the line; the supervisor starts with an empty environment (`env -i`), and so
# does the bash it execs.
_WARM_SUPERVISED = (
    "_dsh_sh=$(command -v bash) || _dsh_sh=/bin/bash; "
    'if [ "$(export TZ=UTC0 LC_ALL=C; exec STAT -c FORMAT -- SUPERVISOR 2>/dev/null)" = IDENTITY ]; then '
    'exec env -i SUPERVISOR --warm "$_dsh_sh"; fi; exit 0'
)


def warm_line(supervisor: str | None = None, check: tuple[str, str] | None = None) -> str:
    """The command line of a warm channel: any POSIX login shell runs it; no value on it. Under the
    supervisor (``supervisor`` and ``check``, see :func:`boot_script`), ``dsh-supervise --warm`` waits;
    else a bash: a bash login shell clears the environment itself (`exec -c`), others through
    `env -i`."""
    if supervisor is not None and check is not None:
        stat, identity = check
        return (
            _WARM_SUPERVISED.replace("SUPERVISOR", shlex.quote(supervisor))
            .replace("STAT", shlex.quote(stat))
            .replace("FORMAT", shlex.quote(IDENTITY_FORMAT))
            .replace("IDENTITY", shlex.quote(identity))
        )
    waiter = shlex.quote(WAITER)
    return (
        'if [ -n "${BASH_VERSION-}" ]; then '
        f"exec -c bash --noprofile --norc -c {waiter} dsh-bash; "
        f'else _dsh_sh=$(command -v bash) || _dsh_sh=bash; exec env -i "$_dsh_sh" --noprofile --norc -c {waiter} dsh-bash; fi'
    )


def boot_request(
    args: tuple[str, ...],
    long_command: str | None,
    supervisor: str | None = None,
    grace_ms: int | None = None,
    check: tuple[str, str] | None = None,
) -> bytes:
    """What a warm channel's WAITER reads to run BOOT with ``args`` (see BOOT's arguments above; the
    header flag "0", every variable of the command's environment as a NAME=VALUE entry) and the
    long command, when ``args`` has none. ``supervisor``: see :func:`boot_script`."""
    # fd 3: the memfd `dsh-supervise --warm` hands the request over in (closed at once; nothing else
    # is on fd 3 under WAITER). A plain `exec`, as in WAITER: `builtin exec 3<&-` closed nothing (the
    # redirection of a builtin lasts while it runs), and every command inherited the request.
    script = "exec 3<&-\nbuiltin set -- " + " ".join(ascii_quote(arg) for arg in args) + "\n"
    if long_command is not None:
        script += "_dsh_long=" + ascii_quote(long_command) + "\n"
    detached, header, long, stdin = _shape(args)
    assert not header and long == (long_command is not None)
    script += boot_script(
        detached=detached,
        header=False,
        long=long,
        stdin=stdin,
        warm=True,
        supervisor=supervisor,
        grace_ms=grace_ms,
        check=check,
    )
    body = script.encode("ascii")
    return b"%0*d" % (_LENGTH_DIGITS, len(body)) + body
