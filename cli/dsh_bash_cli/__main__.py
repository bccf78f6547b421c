"""``python -m dsh_bash_cli``: the dsh-bash command line."""

from . import console

console()
