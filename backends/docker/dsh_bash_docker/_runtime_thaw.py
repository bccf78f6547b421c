"""Continuing the container runtime's processes that a command stopped, from the host.

runc enters a container through processes it names ``runc:[0:PARENT]``, ``runc:[1:CHILD]`` and
``runc:[2:INIT]``; the last joins the container's pid namespace before it becomes the exec's process.
A command of the container's user sees it there (parent 0, like every exec'd process) and may stop
it (``kill -STOP``). The engine then holds every call about that container, exec create, inspect and
remove among them, until the process goes on: one stopped stage takes every later exec with it.

None of these processes is ever meant to be stopped, so every stopped one in the container's pid
namespace is continued. A process that renames itself to look like one gains a SIGCONT, nothing
more. Only runc's names are known: another runtime (crun, a VM runtime) is not helped.
"""

from __future__ import annotations

import os
import signal

from dsh_bash.host import read_proc_stat

__all__ = ["continue_stopped_stages", "pid_namespace"]

#: How runc names the processes that enter a container (``/proc/PID/comm``).
_STAGE_PREFIX = b"runc:["


def pid_namespace(pid: int) -> str | None:
    """The pid namespace ``pid`` lives in (``pid:[INODE]``); None when it cannot be read (gone, or
    another user's process and this one not privileged)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _is_stage(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm", "rb") as comm:
            return comm.read().startswith(_STAGE_PREFIX)
    except OSError:
        return False


def continue_stopped_stages(namespace: str) -> int:
    """SIGCONT to every stopped runtime stage in pid namespace ``namespace``; how many were sent.

    Through a pidfd opened before the stage is checked again: a pid reused in between is never
    signalled."""
    continued = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or not _is_stage(int(name)):
            continue
        pid = int(name)
        try:
            before = read_proc_stat(pid)
            if before is None or before.state != "T" or pid_namespace(pid) != namespace:
                continue
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone, or the OS refused a read: nothing to do for it now
            continue
        try:
            after = read_proc_stat(pid)
            if after is None or after.starttime != before.starttime or not _is_stage(pid):
                continue
            signal.pidfd_send_signal(pidfd, signal.SIGCONT)
            continued += 1
        except OSError:
            continue
        finally:
            os.close(pidfd)
    return continued
