"""The MCP server of the tools, as a public module (needs the ``mcp`` extra: the official SDK).

``dsh-bash mcp --config FILE`` runs :func:`run_server`; to serve the tools over an executor you
opened yourself, use :class:`BashMcpServer` (``serve_stdio`` or ``serve_http``). Importing this
module imports the MCP SDK; ``import dsh_tool_bash`` alone does not.
"""

from ._mcp import DATA_META_KEY, BashMcpServer, parse_http_address, run_server

__all__ = ["DATA_META_KEY", "BashMcpServer", "parse_http_address", "run_server"]
