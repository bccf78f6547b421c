"""The MCP server of the tools, as a public module (needs the ``mcp`` extra: the official SDK).

``dsh-bash mcp --config FILE`` runs :func:`run_server`; to serve the tools over an executor you
opened yourself, use :class:`BashMcpServer` (``serve_stdio`` or ``serve_http``). Importing this
module imports the MCP SDK; ``import dsh_tool_bash`` alone does not.
"""

from ._mcp_server import (
    DATA_META_KEY,
    DEFAULT_MAX_SESSIONS,
    TOKEN_ENV,
    BashMcpServer,
    parse_http_address,
    read_token_file,
    run_server,
    token_from_environment,
)

__all__ = [
    "DATA_META_KEY",
    "DEFAULT_MAX_SESSIONS",
    "TOKEN_ENV",
    "BashMcpServer",
    "parse_http_address",
    "read_token_file",
    "run_server",
    "token_from_environment",
]
