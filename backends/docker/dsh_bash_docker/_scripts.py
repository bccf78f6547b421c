"""The bash scripts the backend runs inside the container. They carry names, never secret values."""

from __future__ import annotations

#: Preamble markers written to stdout by the boot script before the command starts.
BOOT_OK = b"\0dsh-bash-boot-ok\0"
BOOT_FAIL = b"\0dsh-bash-boot-fail:"
#: The trailer the boot script writes once the command's shell exited: nonce and a 3-digit status.
EXIT_PREFIX = b"\0dsh-bash-exit:"

# $1: workdir, $2: script file or "" (then the command text is in DSH_BASH_COMMAND: kept out of this
# process's argv, which lives as long as the command's leftovers and would show the command again).
#
# The exec's own process (this boot script) never runs the command itself. Docker stalls the
# container's next exec for seconds when an exec's main process exits while a descendant still holds
# its output pipes (measured on Engine 20.10), which is exactly what a killed leader with a
# surviving child, or `server &`, would do. So the boot script relays the command's output through
# two `cat`s, reports the leader's exit in-band as a trailer carrying a per-command nonce, and exits
# only once every holder of the command's pipes is gone.
#
# Names the policy scrubbed arrive in DSH_BASH_UNSET (names only). The command alone gets the
# marker (from DSH_BASH_MARK_FOR), so kills by marker never hit the boot script or its relays.
# `setsid` from a background child (never a group leader) starts the new session without forking.
BOOT = r"""
unset -v $DSH_BASH_UNSET DSH_BASH_UNSET
nonce=$DSH_BASH_NONCE mark=$DSH_BASH_MARK_FOR command=$DSH_BASH_COMMAND
unset -v DSH_BASH_NONCE DSH_BASH_MARK_FOR DSH_BASH_COMMAND
if [ -n "${DSH_BASH_RC_BASH_ENV+x}" ]; then export BASH_ENV=$DSH_BASH_RC_BASH_ENV; unset -v DSH_BASH_RC_BASH_ENV; fi
if [ -n "${DSH_BASH_RC_ENV+x}" ]; then export ENV=$DSH_BASH_RC_ENV; unset -v DSH_BASH_RC_ENV; fi
if [ ! -e "$1" ]; then printf '\0dsh-bash-boot-fail:does not exist\0'; exit 125; fi
if [ ! -d "$1" ]; then printf '\0dsh-bash-boot-fail:is not a directory\0'; exit 125; fi
if ! cd -- "$1" 2>/dev/null; then printf '\0dsh-bash-boot-fail:cannot be entered\0'; exit 125; fi
if ! command -v setsid >/dev/null; then printf '\0dsh-bash-boot-fail:cannot start a session: no setsid\0'; exit 125; fi
printf '\0dsh-bash-boot-ok\0'
exec 5> >(exec cat); out=$!
exec 6> >(exec cat >&2); err=$!
# In the foreground, not with `&`: bash would start an async command with SIGINT and SIGQUIT ignored.
if [ -n "$2" ]; then
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc "$2" >&5 2>&6 5>&- 6>&-
else
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc -c "$command" >&5 2>&6 5>&- 6>&-
fi
status=$?
exec 5>&- 6>&- 0</dev/null
printf '\0dsh-bash-exit:%s:%03d\0' "$nonce" "$status"
# Bash 5.1+ waits for process substitutions by pid; older ones refuse, so poll them.
wait "$out" "$err" 2>/dev/null || while kill -0 "$out" 2>/dev/null || kill -0 "$err" 2>/dev/null; do sleep 0.05; done
"""

# $1: "signal" or "list", $2: signal name, $3: marker value or prefix, $4: 1 for an exact match.
# A process belongs when its initial environment carries the marker; a process group is signalled
# only while a marked process is in it (so a recycled group id is never signalled), which also
# reaches members that cleared their environment.
KILL = r"""
mode=$1 sig=$2 want=$3 exact=$4
declare -A groups=()
marked=() all_pid=() all_pgrp=()
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  read -r stat < "$d/stat" 2>/dev/null || continue
  rest=${stat##*) }
  read -r state _ppid pgrp _ <<< "$rest"
  [ "$state" = Z ] || [ "$state" = X ] && continue
  all_pid+=("$p"); all_pgrp+=("$pgrp")
  mapfile -d '' -t env < "$d/environ" 2>/dev/null || continue
  for e in "${env[@]}"; do
    case $e in
      DSH_BASH_MARK=*)
        v=${e#DSH_BASH_MARK=}
        if { [ "$exact" = 1 ] && [ "$v" = "$want" ]; } || { [ "$exact" != 1 ] && [ "${v#"$want"}" != "$v" ]; }; then
          marked+=("$p"); groups[$pgrp]=1
        fi
        break ;;
    esac
  done
done
if [ "$mode" = list ]; then
  for i in "${!all_pid[@]}"; do
    if [ -n "${groups[${all_pgrp[$i]}]+x}" ]; then echo "${all_pid[$i]}"; fi
  done
  for p in "${marked[@]}"; do echo "$p"; done
else
  for g in "${!groups[@]}"; do kill -s "$sig" -- "-$g" 2>/dev/null; done
  for p in "${marked[@]}"; do kill -s "$sig" "$p" 2>/dev/null; done
fi
exit 0
"""

# $1: path. noclobber makes the redirection fail on any existing path, links included.
SPILL_WRITER = r"""umask 077; set -C; exec cat > "$1" """

SPILL_DIR = r"""umask 077; mktemp -d "${TMPDIR:-/tmp}/dsh-bash-XXXXXX" """
