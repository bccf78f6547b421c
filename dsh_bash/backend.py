"""The public API for backend authors: everything a backend needs, and nothing a caller does.

Callers use the flat :mod:`dsh_bash` namespace (requests, results, the abstract executor, errors,
``load_executor``). A backend subclasses :class:`dsh_bash.BashExecutor` and brings only its own
process, kill and spill mechanics; this module holds the pieces it builds them from:

- the launch and process protocol: :class:`Launch`, :class:`CommandProcess`, :class:`ExitStatus`,
  :class:`Killable`, and an executor's leftovers under its supervisors
  (:class:`SupervisedLeftovers` of :class:`SupervisedCommand`);
- commands as processes of this Linux host (the local backend, and sandboxing backends that put a
  launcher in front of its argv): :class:`HostBashExecutor`, :class:`HostConfig`,
  :class:`HostProcess`, :func:`spawn_host_process`, :class:`HostSpillDir`, :data:`MAX_INLINE_COMMAND`;
- killing: :func:`kill_sequence`, :func:`kill_abandoned_start`, :func:`signal_name`;
- users: :func:`refuse_other_user` (for a backend that cannot switch users: ``spec.user`` refused);
- markers and process scanning on a Linux host: :data:`MARKER_VAR`, :class:`ProcScanner`,
  :class:`ProcScanError` (a /proc read that says nothing about the process), :class:`FdReserve`,
  :func:`scan_processes`, :class:`ProcEntry`, :func:`read_proc_stat`, :class:`ProcStat`,
  :func:`signal_marked` (pid-fd signalling), :func:`boot_ticks` and :func:`started_before` (a scan
  for one command skips processes that started before it);
- output accounting: :class:`OutputStream`, :class:`SpillFile`, :class:`SpillBudget`,
  :data:`StreamName`, :func:`merge_streams`, :func:`prepay_spills` (a budget granted up front to
  output files a capped writer on the far side fills);
- the environment policy: :func:`build_command_env`, :func:`is_scrubbed`, :func:`dropped_names`,
  :data:`MODEL_FRIENDLY_ENV`, :data:`RC_FILE_VARIABLES`;
- bash reached remotely (through an API or a channel): the boot markers :data:`BOOT_OK`,
  :data:`BOOT_FAIL` (:func:`boot_failure` reads its report), :data:`BOOT_AT` (the command's
  :class:`CommandStart` on its host's clock; :func:`find_boot_ok`, :func:`boot_ok_undecided`),
  :data:`EXIT_PREFIX`, the scripts
  :data:`KILL` (arguments from :func:`kill_args`), :data:`SPILL_DIR`, :data:`SPILL_WRITER`, and
  :class:`ExitTrailerFilter`, :class:`QueuedSpillFile`, :class:`SpillWriter`, :class:`CommandSpills`,
  :func:`spill_file_path`,
  :data:`SPILL_HIGH_WATER_BYTES`;
- the native supervisor ``dsh-supervise`` (a per-command subreaper, shipped as package data, see
  ``native/README.md``): :func:`supervisor_binary`, :func:`supervisor_problem`,
  :func:`supervisor_payload` (what to install on a machine, :class:`SupervisorPayload`),
  :func:`normalize_arch`, :data:`SUPERVISOR_PROTOCOL`; once a backend looked for it where its
  commands run (:class:`SupervisorInstall`), :func:`choose_containment` applies the config's
  setting; its framed channel for backends that reach a command through one stream pair:
  :class:`FrameDecoder`, :func:`encode_frame`, :class:`FrameError`, :data:`FRAME_HEADER`,
  :data:`MAX_FRAME_PAYLOAD`; its status records read by :class:`SupervisorRecords`; the signed
  status file of a detached one, verified by :class:`SignedRecords` (with
  :data:`SUPERVISOR_KEY_SIZE`); and :class:`FramedCommand`, the transport-independent half of a
  command under it (output, outcome, kills, and the side pipe that moves its output past a costly
  relay: :meth:`FramedCommand.request_side_pipe`), with :data:`STDIN_FRAME_BYTES`; a command for a
  supervisor that takes it from its input (``--fork-server``, ``--frame --spec``): :func:`command_payload`;
- configuration: :class:`dsh_bash.BudgetConfig` to subclass, :func:`config_error_from` to turn a
  pydantic ``ValidationError`` into a :class:`dsh_bash.ConfigError` that names the field;
- errors with a machine-readable reason: :data:`InfraReason`, :data:`INFRA_REASONS`;
- telling the conformance kit where the commands run: :class:`ConformanceHooks` (optional
  ``kit_*`` methods), :data:`FIND_PROCESSES`, :func:`parse_pids`, :func:`run_in_fresh_loop`,
  :func:`find_host_processes`, :func:`plant_in_os_environ`.

``docs/writing-a-backend.md`` walks through writing a backend with them; ``docs/contract.md`` is
what the backend must keep. Names here are public and stable within a major version; modules whose
names start with ``_`` are not, and no code outside :mod:`dsh_bash` may import them.
"""

from __future__ import annotations

from ._backend import (
    MARKER_VAR,
    MAX_INLINE_COMMAND,
    CommandProcess,
    Containment,
    ContainmentSetting,
    ExitStatus,
    Killable,
    Launch,
    SupervisedCommand,
    SupervisedLeftovers,
    SupervisorInstall,
    choose_containment,
    kill_abandoned_start,
    kill_sequence,
    refuse_other_user,
    signal_name,
)
from ._config import BUDGET_FIELDS, config_error_from
from ._env import MODEL_FRIENDLY_ENV, RC_FILE_VARIABLES, build_command_env, dropped_names, is_scrubbed
from ._errors import INFRA_REASONS, InfraReason
from ._forkserver import command_payload
from ._framed import STDIN_FRAME_BYTES, FramedCommand
from ._frames import (
    FRAME_HEADER,
    MAX_FRAME_PAYLOAD,
    FrameDecoder,
    FrameError,
    SupervisorRecords,
    encode_frame,
)
from ._hostexec import HostBashExecutor, HostConfig, host_support_problem
from ._hostproc import HostProcess, StartHelper, WrapCommand, spawn_host_process
from ._hostspill import HostSpillDir, HostSpillFile
from ._kit_hooks import (
    FIND_PROCESSES,
    ConformanceHooks,
    find_host_processes,
    parse_pids,
    plant_in_os_environ,
    run_in_fresh_loop,
)
from ._native import PROTOCOL_VERSION as SUPERVISOR_PROTOCOL
from ._native import (
    SupervisorPayload,
    normalize_arch,
    supervisor_binary,
    supervisor_payload,
    supervisor_problem,
)
from ._output import OutputStream, SpillBudget, SpillFile, StreamName, merge_streams, prepay_spills
from ._procscan import (
    FdReserve,
    InputIdentity,
    ProcEntry,
    ProcScanError,
    ProcScanner,
    ProcStat,
    boot_ticks,
    input_waiters,
    read_proc_stat,
    signal_marked,
    started_before,
)
from ._procscan import scan as scan_processes
from ._remote_bash import (
    BOOT_AT,
    BOOT_FAIL,
    BOOT_OK,
    EXIT_PREFIX,
    KILL,
    SPILL_DIR,
    SPILL_HIGH_WATER_BYTES,
    SPILL_WRITER,
    CommandSpills,
    CommandStart,
    ExitTrailerFilter,
    QueuedSpillFile,
    SpillWriter,
    boot_failure,
    boot_ok_undecided,
    find_boot_ok,
    kill_args,
    spill_file_path,
)
from ._signed import KEY_SIZE as SUPERVISOR_KEY_SIZE
from ._signed import SignedRecords

__all__ = [
    "BOOT_AT",
    "BOOT_FAIL",
    "BOOT_OK",
    "BUDGET_FIELDS",
    "EXIT_PREFIX",
    "FIND_PROCESSES",
    "FRAME_HEADER",
    "INFRA_REASONS",
    "KILL",
    "MARKER_VAR",
    "MAX_FRAME_PAYLOAD",
    "MAX_INLINE_COMMAND",
    "MODEL_FRIENDLY_ENV",
    "RC_FILE_VARIABLES",
    "SPILL_DIR",
    "SPILL_HIGH_WATER_BYTES",
    "SPILL_WRITER",
    "STDIN_FRAME_BYTES",
    "SUPERVISOR_KEY_SIZE",
    "SUPERVISOR_PROTOCOL",
    "CommandProcess",
    "CommandSpills",
    "CommandStart",
    "ConformanceHooks",
    "Containment",
    "ContainmentSetting",
    "ExitStatus",
    "ExitTrailerFilter",
    "FdReserve",
    "FrameDecoder",
    "FrameError",
    "FramedCommand",
    "HostBashExecutor",
    "HostConfig",
    "HostProcess",
    "HostSpillDir",
    "HostSpillFile",
    "InfraReason",
    "InputIdentity",
    "Killable",
    "Launch",
    "OutputStream",
    "ProcEntry",
    "ProcScanError",
    "ProcScanner",
    "ProcStat",
    "QueuedSpillFile",
    "SignedRecords",
    "SpillBudget",
    "SpillFile",
    "SpillWriter",
    "StartHelper",
    "StreamName",
    "SupervisedCommand",
    "SupervisedLeftovers",
    "SupervisorInstall",
    "SupervisorPayload",
    "SupervisorRecords",
    "WrapCommand",
    "boot_failure",
    "boot_ok_undecided",
    "boot_ticks",
    "build_command_env",
    "choose_containment",
    "command_payload",
    "config_error_from",
    "dropped_names",
    "encode_frame",
    "find_boot_ok",
    "find_host_processes",
    "host_support_problem",
    "input_waiters",
    "is_scrubbed",
    "kill_abandoned_start",
    "kill_args",
    "kill_sequence",
    "merge_streams",
    "normalize_arch",
    "parse_pids",
    "plant_in_os_environ",
    "prepay_spills",
    "read_proc_stat",
    "refuse_other_user",
    "run_in_fresh_loop",
    "scan_processes",
    "signal_marked",
    "signal_name",
    "spawn_host_process",
    "spill_file_path",
    "started_before",
    "supervisor_binary",
    "supervisor_payload",
    "supervisor_problem",
]
