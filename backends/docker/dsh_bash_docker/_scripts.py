"""The Docker backend's boot script; the scripts shared with other remote backends live in dsh_bash."""

from __future__ import annotations

from dsh_bash.remote import (
    BOOT_FAIL,
    BOOT_OK,
    EXIT_PREFIX,
    KILL,
    SPILL_DIR,
    SPILL_WRITER,
)

__all__ = [
    "BOOT",
    "BOOT_FAIL",
    "BOOT_OK",
    "BOOT_SUPERVISED",
    "EXIT_PREFIX",
    "KILL",
    "SPILL_DIR",
    "SPILL_WRITER",
]

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
# A failure before the command starts is reported as BOOT_FAIL, its kind (an infrastructure error
# reason, see dsh_bash.remote.boot_failure) and NUL.
#
# Names the policy scrubbed arrive in DSH_BASH_UNSET (names only). The command alone gets the
# marker (from DSH_BASH_MARK_FOR), so kills by marker never hit the boot script or its relays.
# `setsid` from a background child (never a group leader) starts the new session without forking.
BOOT_CHECKS = r"""
unset -v $DSH_BASH_UNSET DSH_BASH_UNSET
nonce=$DSH_BASH_NONCE mark=$DSH_BASH_MARK_FOR command=$DSH_BASH_COMMAND stdin=$DSH_BASH_STDIN
unset -v DSH_BASH_NONCE DSH_BASH_MARK_FOR DSH_BASH_COMMAND DSH_BASH_STDIN
if [ -n "${DSH_BASH_RC_BASH_ENV+x}" ]; then export BASH_ENV=$DSH_BASH_RC_BASH_ENV; unset -v DSH_BASH_RC_BASH_ENV; fi
if [ -n "${DSH_BASH_RC_ENV+x}" ]; then export ENV=$DSH_BASH_RC_ENV; unset -v DSH_BASH_RC_ENV; fi
if [ ! -e "$1" ]; then printf '\0dsh-bash-boot-fail:workdir_missing\0'; exit 125; fi
if [ ! -d "$1" ]; then printf '\0dsh-bash-boot-fail:workdir_not_directory\0'; exit 125; fi
if ! cd -- "$1" 2>/dev/null; then printf '\0dsh-bash-boot-fail:workdir_not_accessible\0'; exit 125; fi
"""

BOOT = (
    BOOT_CHECKS
    + r"""
if ! command -v setsid >/dev/null; then printf '\0dsh-bash-boot-fail:start_failed:cannot start a session: no setsid\0'; exit 125; fi
# Under a full pids limit, bash retries each fork below for about 15 s (1, 2, 4, 8 s apart) while
# nothing can kill the command (it has not started) and then gives up without a report. So the
# container's limit is read first (builtins: no fork): fewer than 4 free slots (two relays,
# setsid, the command's bash) refuse the start at once. A slot taken right after this look still
# stalls the start (docs/faults.md).
pids=/sys/fs/cgroup/pids; [ -r $pids/pids.max ] || pids=/sys/fs/cgroup
if read -r pmax <$pids/pids.max 2>/dev/null && [ "$pmax" != max ] && read -r pnow <$pids/pids.current 2>/dev/null &&
  [ $((pmax - pnow)) -lt 4 ]; then
  printf '\0dsh-bash-boot-fail:start_failed:the pids limit of the container is full (%s of %s)\0' "$pnow" "$pmax"; exit 125
fi
# When the command starts on the container's clock (BOOT_AT: /proc/uptime, read by a builtin), before
# its shell is forked: kills by its marker skip older processes unread. Empty when unreadable.
read -r up _ 2>/dev/null </proc/uptime || up=
printf '\0dsh-bash-boot-at:%s:0\0\0dsh-bash-boot-ok\0' "$up"
exec 5> >(exec cat); out=$!
exec 6> >(exec cat >&2); err=$!
# From here this shell's own notices ("Terminated" when the command dies of a signal) must not
# reach the command's stderr: the relay above holds the real one.
exec 2>/dev/null
# In the foreground, not with `&`: bash would start an async command with SIGINT and SIGQUIT ignored.
if [ -n "$2" ]; then
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc "$2" >&5 2>&6 5>&- 6>&-
else
  DSH_BASH_MARK=$mark setsid bash --noprofile --norc -c -- "$command" >&5 2>&6 5>&- 6>&-
fi
status=$?
exec 5>&- 6>&- 0</dev/null
printf '\0dsh-bash-exit:%s:%03d\0' "$nonce" "$status"
# Bash 5.1+ waits for process substitutions by pid; older ones refuse, so poll them.
wait "$out" "$err" 2>/dev/null || while kill -0 "$out" 2>/dev/null || kill -0 "$err" 2>/dev/null; do sleep 0.05; done
"""
)

# Under dsh-supervise --frame ($1, $2 and the environment as for BOOT): the supervisor already made
# the new session, relays the command's output in frames only it can write, and reports the wait
# status it observed, so the boot script checks, reports "started", and becomes the command's bash.
# The supervisor gives every command a stdin pipe (input may come in frames); one given no stdin gets
# /dev/null instead, as the contract says (DSH_BASH_STDIN=none).
BOOT_SUPERVISED = (
    BOOT_CHECKS
    + r"""printf '\0dsh-bash-boot-ok\0'
if [ "$stdin" = none ]; then exec </dev/null; fi
if [ -n "$2" ]; then
  DSH_BASH_MARK=$mark exec bash --noprofile --norc "$2"
else
  DSH_BASH_MARK=$mark exec bash --noprofile --norc -c -- "$command"
fi
"""
)
