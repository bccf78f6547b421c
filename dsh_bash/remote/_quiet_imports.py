"""Warnings a backend's dependencies print when they are imported, kept off stderr."""

from __future__ import annotations

import warnings

__all__ = ["quiet_asyncssh_import"]


def quiet_asyncssh_import() -> None:
    """Ignore the warning asyncssh's import raises under cryptography 51 and later.

    asyncssh (2.24) names cryptography's DSA types at import, and cryptography 51 deprecates DSA
    with a warning on stderr: the stderr of ``dsh-bash run`` is the command's own, and a harness's
    logs are its operator's. Only that warning, only from asyncssh's modules; call it before the
    first import of asyncssh (a backend package's ``__init__``)."""
    warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")
