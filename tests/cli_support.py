"""What the command line's tests share: the installed ``dsh-bash`` console script."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def console_script() -> str:
    """The ``dsh-bash`` console script installed next to this Python (else on PATH): what users run."""
    candidate = Path(sys.executable).parent / "dsh-bash"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("dsh-bash")
    if found is None:
        pytest.fail("the dsh-bash console script is not installed next to this Python nor on PATH")
    return found
