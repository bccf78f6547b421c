"""dsh_bash_cli: the ``dsh-bash`` command line (``run``, ``conformance``, ``doctor``, ``mcp``).

It sits on top of everything else: it may import :mod:`dsh_bash`, the backends, the conformance kit
and the tools, and nothing imports it. Each subcommand imports only what it needs, when it runs, so
``dsh-bash run`` starts quickly. :func:`main` runs the command line in-process and returns its exit
status; :func:`console` is the program itself. See ``README.md`` in this folder.
"""

from ._main import console, main

__all__ = ["console", "main"]
