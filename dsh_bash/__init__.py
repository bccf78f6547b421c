"""dsh_bash: the executor seam, as callers use it.

Requests, specs and results, the abstract :class:`BashExecutor`, abort signals, errors, the shared
budget config and :func:`load_executor`. What a backend author needs beyond that is public in
:mod:`dsh_bash.backend`; fakes for testing a tool loop without processes are in
:mod:`dsh_bash.testing`.
"""

from ._abort import (
    AbortController,
    AbortSignal,
)
from ._bash_executor import (
    BashExecutor,
    TaskListener,
)
from ._config import (
    DEFAULT_ENV_SCRUB,
    BudgetConfig,
    default_task_cap,
)
from ._errors import (
    FILE_REFUSALS,
    INFRA_REASONS,
    INPUT_REFUSALS,
    BashInfrastructureError,
    ConfigError,
    DshBashError,
    ExecutorClosedError,
    FileOperationError,
    FileRefusal,
    InfraReason,
    InputRefusal,
    TaskInputError,
    UnknownTaskError,
)
from ._policy import CommandLimits, PolicyWidened, SandboxPolicy
from ._registry import (
    ENTRY_POINT_GROUP,
    ExecutorFactory,
    backend_factory,
    load_executor,
    registered_backends,
)
from ._task_input import MAX_INPUT_BYTES, MAX_PENDING_INPUT
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
    OutputTap,
    OwnerToken,
    SessionId,
    SessionReport,
    TerminalSize,
)

#: The release (the package's version: pyproject.toml reads it from here).
__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ENV_SCRUB",
    "ENTRY_POINT_GROUP",
    "FILE_REFUSALS",
    "INFRA_REASONS",
    "INPUT_REFUSALS",
    "MAX_INPUT_BYTES",
    "MAX_PENDING_INPUT",
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
    "CommandLimits",
    "ConfigError",
    "DshBashError",
    "EndCause",
    "ExecutorClosedError",
    "ExecutorFactory",
    "FileOperationError",
    "FileRefusal",
    "InfraReason",
    "InputRefusal",
    "OutputTap",
    "OwnerToken",
    "PolicyWidened",
    "SandboxPolicy",
    "SessionId",
    "SessionReport",
    "TaskInputError",
    "TaskListener",
    "TerminalSize",
    "UnknownTaskError",
    "__version__",
    "backend_factory",
    "default_task_cap",
    "load_executor",
    "registered_backends",
]
