"""dsh_bash: the executor seam. One flat namespace for callers and backend authors."""

from ._abort import AbortController, AbortSignal
from ._backend import (
    MARKER_VAR,
    CommandProcess,
    ExitStatus,
    Killable,
    Launch,
    kill_abandoned_start,
    kill_sequence,
    signal_name,
)
from ._config import DEFAULT_ENV_SCRUB, BudgetConfig
from ._env import MODEL_FRIENDLY_ENV, build_command_env, is_scrubbed
from ._errors import (
    BashInfrastructureError,
    ConfigError,
    DshBashError,
    ExecutorClosedError,
    UnknownTaskError,
)
from ._executor import BashExecutor, TaskListener
from ._output import OutputStream, SpillBudget, SpillFile, merge_streams
from ._registry import ENTRY_POINT_GROUP, ExecutorFactory, backend_factory, load_executor, registered_backends
from ._types import (
    BashExecRequest,
    BashExecSpec,
    BashRunResult,
    BashTask,
    BashTaskId,
    BashTaskRead,
    BashTaskStatus,
    CollectedOutput,
    EndCause,
    OwnerToken,
)

__all__ = [
    "DEFAULT_ENV_SCRUB",
    "ENTRY_POINT_GROUP",
    "MARKER_VAR",
    "MODEL_FRIENDLY_ENV",
    "AbortController",
    "AbortSignal",
    "BashExecRequest",
    "BashExecSpec",
    "BashExecutor",
    "BashInfrastructureError",
    "BashRunResult",
    "BashTask",
    "BashTaskId",
    "BashTaskRead",
    "BashTaskStatus",
    "BudgetConfig",
    "CollectedOutput",
    "CommandProcess",
    "ConfigError",
    "DshBashError",
    "EndCause",
    "ExecutorClosedError",
    "ExecutorFactory",
    "ExitStatus",
    "Killable",
    "Launch",
    "OutputStream",
    "OwnerToken",
    "SpillBudget",
    "SpillFile",
    "TaskListener",
    "UnknownTaskError",
    "backend_factory",
    "build_command_env",
    "is_scrubbed",
    "kill_abandoned_start",
    "kill_sequence",
    "load_executor",
    "merge_streams",
    "registered_backends",
    "signal_name",
]
