"""The host-process kit: commands as processes of this Linux host.

The local backend is :class:`HostBashExecutor` with no changes; a sandboxing backend (the bwrap
example in ``examples/bwrap_backend``) subclasses it and puts its launcher in front of each
command's argv. A backend whose commands run elsewhere, but on this host's kernel (a Docker engine
on this machine), uses the process scanning alone. Imports the seam (:mod:`dsh_bash`,
:mod:`dsh_bash.backend`) and the supervisor kit; see ``README.md`` beside this file.

- :class:`HostBashExecutor` and :class:`HostConfig`: the executor and the config model to
  subclass; a subclass may override ``_wrap_command`` (a :data:`WrapCommand`: argv and launch in,
  argv and the name of what runs it out) and receives the :data:`StartHelper` its launcher needs.
- Finding a command's processes by marker in ``/proc``: :func:`scan_processes` (every process,
  :class:`ProcEntry` rows), :func:`read_proc_stat` (one process's :class:`ProcStat`),
  :func:`signal_marked` (signal a pid through a pidfd only while it still carries the marker),
  :func:`boot_ticks` (now, on the clock of a process's start time: a scan for one command skips
  what started before it), :func:`input_waiters` (which of some pids block reading the input
  an :class:`InputIdentity` names: the look behind ``sample_input_waiting``).
- ``R-file-*`` on this host: :func:`read_host_file` and :func:`write_host_file` (blocking system
  calls as this process's user, refusals as :class:`dsh_bash.FileOperationError`; run them in a
  worker thread).
- :func:`workdir_problem`: why a directory of this host cannot be a command's working directory
  (what, and the contract's reason), for a backend that starts commands here by other means (the
  Ray backend's node host).
- The conformance kit's view of this host: :func:`find_host_processes` (pids whose command line
  carries a marker) and :func:`plant_in_os_environ` (a variable in this process's environment for a
  block), the fallbacks the kit uses and the hooks of a backend whose commands inherit this
  process's environment.
"""

from __future__ import annotations

from ._files import read_host_file, write_host_file
from ._host_executor import HostBashExecutor, HostConfig
from ._host_process import StartHelper, WrapCommand, workdir_problem
from ._kit_finders import find_host_processes, plant_in_os_environ
from ._proc_scan import (
    InputIdentity,
    ProcEntry,
    ProcStat,
    boot_ticks,
    input_waiters,
    read_proc_stat,
    signal_marked,
)
from ._proc_scan import scan as scan_processes

__all__ = [
    "HostBashExecutor",
    "HostConfig",
    "InputIdentity",
    "ProcEntry",
    "ProcStat",
    "StartHelper",
    "WrapCommand",
    "boot_ticks",
    "find_host_processes",
    "input_waiters",
    "plant_in_os_environ",
    "read_host_file",
    "read_proc_stat",
    "scan_processes",
    "signal_marked",
    "workdir_problem",
    "write_host_file",
]
