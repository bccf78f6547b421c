"""dsh-bash as an inspect_ai sandbox provider: ``sandbox=("dsh-bash", "config.toml")``.

inspect_ai finds the provider through the ``inspect_ai`` entry point of this distribution (installed
with ``pip install 'dsh-bash[inspect]'``); importing this package registers the sandbox type
``dsh-bash`` with inspect's registry. The config file is the one ``dsh-bash run --config`` takes.
"""

from __future__ import annotations

from ._commands import argv_to_command
from ._sandbox import SANDBOX_TYPE, DshBashSandboxEnvironment

__all__ = ["SANDBOX_TYPE", "DshBashSandboxEnvironment", "argv_to_command"]
