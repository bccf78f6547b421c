"""Deliberately broken SSH backends, for proving the kit catches them on a host that is really elsewhere.

Like ``broken_backends`` (the local ones), each class breaks one rule in the smallest piece that
would realistically carry the bug; here that piece is what kills a command's processes on the SSH
host (:class:`dsh_bash_ssh._process.RemoteMarked`). Used by ``tests/test_conformance_ssh_container.py``
through ``dsh-bash conformance --config FILE`` with ``backend = "broken_ssh_backends:NAME.from_fields"``.
"""

from __future__ import annotations

from collections.abc import Callable

from dsh_bash_ssh import SshBashExecutor, SshConfig
from dsh_bash_ssh._connection import ChannelPool
from dsh_bash_ssh._process import RemoteMarked

from dsh_bash.backend import CommandProcess, Killable, Launch, signal_name

__all__ = ["GroupOnlyKillSsh"]

# $1: a marker value. Prints the process group of the oldest live process carrying it: right after
# the start, the group its command's shell leads.
_FIRST_GROUP = r"""
want=$1 oldest=
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  read -r stat 2>/dev/null < "$d/stat" || continue
  read -r -a f <<< "${stat##*) }"
  case ${f[0]} in Z|X|x) continue ;; esac
  mapfile -d '' -t env 2>/dev/null < "$d/environ" || continue
  for e in "${env[@]}"; do
    if [ "$e" = "DSH_BASH_MARK=$want" ]; then
      if [ -z "$oldest" ] || [ "${f[19]}" -lt "$oldest" ]; then oldest=${f[19]} group=${f[2]}; fi
      break
    fi
  done
done
[ -z "$oldest" ] || echo "$group"
"""

# $1: "signal" or "list", $2: signal name, then process group ids: signals them, or lists their
# live members.
_GROUPS = r"""
mode=$1 sig=$2; shift 2
declare -A wanted=()
for g in "$@"; do wanted[$g]=1; done
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  read -r stat 2>/dev/null < "$d/stat" || continue
  read -r -a f <<< "${stat##*) }"
  case ${f[0]} in Z|X|x) continue ;; esac
  [ -n "${wanted[${f[2]}]+x}" ] || continue
  if [ "$mode" = list ]; then echo "$p"; else kill -s "$sig" "$p" 2>/dev/null; fi
done
exit 0
"""


class _GroupsOnly(RemoteMarked):
    """Kills (and counts as remaining) the members of some process groups, nothing else."""

    def __init__(self, pool: ChannelPool, marker: str, groups: Callable[[], list[str]]) -> None:
        super().__init__(pool, marker=marker, exact=True)
        self._groups = groups

    async def signal_all(self, sig: int) -> None:
        groups = self._groups()
        if groups:
            name = signal_name(sig) if sig else "0"
            await self._pool.run_script(_GROUPS, "signal", name, *groups, kill=True)

    async def remaining(self) -> list[str]:
        groups = self._groups()
        if not groups:
            return []
        _, out, _ = await self._pool.run_script(_GROUPS, "list", "0", *groups, kill=True)
        return sorted(set(out.decode().split()))


class GroupOnlyKillSsh(SshBashExecutor):
    """Breaks (beyond): processes that left the group (setsid, double fork) are killed too.

    It records the process group each command's shell leads on the SSH host when the command
    starts, and its kills (kill, timeout, abort, aclose) send ``kill -- -PGID`` to those groups
    only: what left them is never reached.
    """

    def __init__(self, config: SshConfig) -> None:
        # The breakage is in the marker kill: under dsh-supervise, kills go through the supervisor.
        super().__init__(config.model_copy(update={"containment": "marker"}))
        self._groups: dict[str, str] = {}

    async def _spawn(self, launch: Launch) -> CommandProcess:
        process = await super()._spawn(launch)
        _, out, _ = await self._pool.run_script(_FIRST_GROUP, launch.marker, kill=True)
        for group in out.decode().split():
            self._groups[launch.marker] = group
        return process

    def _marked(self, marker: str) -> RemoteMarked:
        return _GroupsOnly(
            self._pool, marker, lambda: [self._groups[marker]] if marker in self._groups else []
        )

    def _leftovers(self) -> Killable:
        return _GroupsOnly(self._pool, self._token + "-", lambda: sorted(set(self._groups.values())))
