"""What a backend implements and builds on: the protocol between :class:`dsh_bash.BashExecutor` and
a backend's own process, kill and spill mechanics.

Callers use the flat :mod:`dsh_bash` namespace (requests, results, the abstract executor, errors,
``load_executor``). A backend subclasses :class:`dsh_bash.BashExecutor` and implements its
abstract methods with the pieces below; the kits beside this module hold the helpers for the two
ways a backend usually reaches its commands: :mod:`dsh_bash.host` (processes of this Linux host),
:mod:`dsh_bash.remote` (bash reached through an API or a channel) and :mod:`dsh_bash.supervisor`
(the native supervisor both of them can run commands under). ``docs/writing-a-backend.md`` walks
through writing one; ``docs/contract.md`` is what it must keep.

Launching and waiting:

- :class:`Launch`: one resolved command as the executor hands it to ``_spawn``: its spec, its
  marker, its two :class:`OutputStream` s and its environment, already filtered by the env policy.
- :class:`CommandProcess`: what ``_spawn`` returns, the running command: ``wait`` (an
  :class:`ExitStatus`), ``terminate``/``kill`` of everything it started, stdin, release.
- :class:`ExitStatus`: an exit code or a signal, as the backend observed it.
- :data:`MAX_INLINE_COMMAND`: the longest command text a backend may pass as one argument;
  longer ones go through a file (the contract's R-proc-any-command).
- :func:`refuse_other_user`: raise the contract's error for a ``spec.user`` the backend cannot
  switch to.

Killing (every kill reaches processes that left the command's group):

- :class:`Killable`: anything with ``terminate``/``kill``; :func:`kill_sequence` (TERM, grace,
  KILL until gone) and :func:`kill_abandoned_start` (a start that was cancelled) drive it;
  :func:`signal_name` names a signal number for messages; :func:`while_watching` waits for
  something while a watcher runs beside it (the continues and thaws of a helper the command may
  have stopped); :class:`CoalescedRuns` lets many callers at once share one run of an action that
  costs a process where the commands run (those continues, asked for by every kill at ``aclose``);
  :class:`AtMostEvery` runs such an action at most once in an interval (the thaws every stalled call
  asks for).
- :data:`MARKER_VAR`: the variable carrying the command's marker into its environment, by which
  the ``marker`` containment finds processes that escaped.
- :data:`Containment`, :data:`ContainmentSetting`, :class:`SupervisorInstall` and
  :func:`choose_containment`: which containment a backend runs with (the supervisor's
  ``subreaper``, or ``marker``), from its config and what it found where commands run.
- :class:`SupervisedCommand` and :class:`SupervisedLeftovers`: an executor's running supervisors,
  each able to kill its command's whole tree; what ``aclose`` kills when a command outlived it.

Sessions (``R-session``; the prologue, the capture and the state are the executor's):

- :data:`SESSION_FD`: the descriptor a session command's bash writes its state to at exit; a
  backend that says yes in ``_supports_sessions`` hands it over (a supervisor's ``--capture-fd``)
  and feeds what comes out of it to ``launch.session`` (a :class:`SessionCapture`), or names a file
  of the harness's host in ``_session_capture_file`` that the command opens as it.

Output:

- :class:`OutputStream`: one stream of a command (``launch.stdout``, ``launch.stderr``); the
  backend feeds it bytes and it does the accounting (window, spill, loss).
- :class:`SpillFile`: the file a stream spills to, for a backend whose spill files live elsewhere
  (its ``_open_spill``, which is told the :data:`StreamName`); :func:`prepay_spills` grants a
  budget up front to files a capped writer on the far side fills.

The environment policy (``docs/contract.md`` R-env):

- :func:`is_scrubbed` and :func:`dropped_names`: whether a name, and which names of an
  environment, the policy drops; :data:`MODEL_FRIENDLY_ENV` (what every command gets) and
  :data:`RC_FILE_VARIABLES` (names that make bash read a file at startup).

Files (``R-file-*``; the path checks and the error wrapping are the executor's):

- :func:`temporary_file_name`: the name a write puts its bytes under, beside the target, before the
  rename over it.

The sandbox policy (``R-policy-*``; the narrowing, the step's options and the refusals are the
executor's):

- :class:`ConfinementProbe`: what the policy's step can apply where commands run (the kernel's
  Landlock ABI; whether ``network = "loopback"`` can hold), which ``_probe_confinement`` returns
  (:func:`dsh_bash.supervisor.confinement_from_probe` reads it from ``dsh-supervise --confine
  --probe``).
- :class:`EgressProxy` and :data:`PROXY_PORT`: the HTTP proxy of ``network = "allow-list"``, and
  :class:`EgressProxies`, an executor's proxies by list (``EgressProxies(self._start_helper)``):
  ``abstract(allow_hosts)`` serves one on an abstract unix socket in the network namespace where
  commands start (the confinement step connects to it before it makes the command's own network,
  whose forwarder on ``127.0.0.1:PROXY_PORT`` hands it each connection); ``in_directory(allow_hosts,
  dir)`` serves one on a socket file, for commands on another machine or in a container (a file
  there that leads to it one connection at a time: the forwarder relays each), and returns the
  file's path with the proxy's key. Either goes in ``_egress_socket`` as an :class:`EgressRoute`
  (a socket file's route carries the key: the executor puts it in the command's environment as
  :data:`PROXY_KEY_VAR`, from which the step takes it out before the command runs, and the step's
  relays send it first, so no confined command uses another list's proxy by its file's name).

Errors and configuration:

- :data:`InfraReason`: the machine-readable reason a :class:`dsh_bash.BashInfrastructureError`
  carries; :data:`INFRA_REASONS` lists its values.
- :func:`config_error_from`: a pydantic ``ValidationError`` as a :class:`dsh_bash.ConfigError`
  naming the field (subclass :class:`dsh_bash.BudgetConfig` for the config model itself);
  :data:`BUDGET_FIELDS`: the fields of it ``reconfigure`` may change.

Composing backends:

- :class:`Dialer`: connections an outer backend makes for an inner one (the Ray backend relays the
  Docker backend's connections to a node's engine: the Docker config's ``engine_dialer``).

Telling the conformance kit where the commands run (all optional):

- :class:`ConformanceHooks`: the ``kit_*`` methods a backend may implement;
  :data:`FIND_PROCESSES` (a script printing the pids carrying a marker, for a backend to run where
  its commands run), :func:`parse_pids` (its output), :func:`run_in_fresh_loop` (an async hook
  called from the kit's synchronous side).

Names here are public and stable within a major version; modules whose names start with ``_`` are
not, and no code outside :mod:`dsh_bash` imports them.
"""

from __future__ import annotations

from ._config import BUDGET_FIELDS, config_error_from
from ._dialer import Dialer
from ._egress import PROXY_PORT, EgressProxies, EgressProxy
from ._env import MODEL_FRIENDLY_ENV, RC_FILE_VARIABLES, dropped_names, is_scrubbed
from ._errors import INFRA_REASONS, InfraReason
from ._kit_hooks import FIND_PROCESSES, ConformanceHooks, parse_pids, run_in_fresh_loop
from ._output import OutputStream, SpillFile, StreamName, prepay_spills
from ._policy import PROXY_KEY_VAR, ConfinementProbe, EgressRoute
from ._protocol import (
    MARKER_VAR,
    MAX_INLINE_COMMAND,
    AtMostEvery,
    CoalescedRuns,
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
    temporary_file_name,
    while_watching,
)
from ._session import SESSION_FD, SessionCapture

__all__ = [
    "BUDGET_FIELDS",
    "FIND_PROCESSES",
    "INFRA_REASONS",
    "MARKER_VAR",
    "MAX_INLINE_COMMAND",
    "MODEL_FRIENDLY_ENV",
    "PROXY_KEY_VAR",
    "PROXY_PORT",
    "RC_FILE_VARIABLES",
    "SESSION_FD",
    "AtMostEvery",
    "CoalescedRuns",
    "CommandProcess",
    "ConfinementProbe",
    "ConformanceHooks",
    "Containment",
    "ContainmentSetting",
    "Dialer",
    "EgressProxies",
    "EgressProxy",
    "EgressRoute",
    "ExitStatus",
    "InfraReason",
    "Killable",
    "Launch",
    "OutputStream",
    "SessionCapture",
    "SpillFile",
    "StreamName",
    "SupervisedCommand",
    "SupervisedLeftovers",
    "SupervisorInstall",
    "choose_containment",
    "config_error_from",
    "dropped_names",
    "is_scrubbed",
    "kill_abandoned_start",
    "kill_sequence",
    "parse_pids",
    "prepay_spills",
    "refuse_other_user",
    "run_in_fresh_loop",
    "signal_name",
    "temporary_file_name",
    "while_watching",
]
