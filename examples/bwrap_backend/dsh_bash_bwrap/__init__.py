"""dsh_bash_bwrap: an example third-party dsh-bash backend, local commands confined by bubblewrap."""

from ._bwrap_executor import BwrapBashExecutor, BwrapConfig

__all__ = ["BwrapBashExecutor", "BwrapConfig"]
