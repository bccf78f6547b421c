"""dsh_tool_bash: the model-facing bash tools (``bash``, ``bash_output``, ``bash_input``,
``bash_kill``) over any executor.

``BashToolset`` renders executor results as text a model reads, with the same facts as structured data,
in the formats of the OpenAI and Anthropic APIs; ``dsh-bash mcp`` serves the same tools over the Model
Context Protocol (``mcp`` extra).
"""

from ._toolset import BashToolset, CompletionCallback, ToolDefinition, ToolResult

__all__ = ["BashToolset", "CompletionCallback", "ToolDefinition", "ToolResult"]
