"""`dsh-bash conformance --config FILE` fails every deliberately broken backend, named as module:attr.

The kit's own proof (tests/test_kit_catches_broken.py) goes through `run_kit`; this runs the same table
through the command a backend author runs (in-process, to spare an interpreter start per backend).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import broken_backends as bb
import pytest
from dsh_bash_cli import main
from dsh_bash_conformance import CHECKS
from test_kit_catches_broken import CAUGHT_BY

from dsh_bash import BashExecutor
from dsh_bash.host._proc_scan import scan

pytestmark = pytest.mark.kit

# Each broken backend with the checks it must fail (hang-by-design rows are the kit test's business).
CHECKS_BY_BACKEND: dict[str, list[str]] = defaultdict(list)
for row in CAUGHT_BY:
    if row.outcome == "failed":
        CHECKS_BY_BACKEND[row.backend.__name__].append(row.check)


# Tokens of the executors these tests made: only their processes are swept afterwards (other
# executors' processes, a container's among them, carry markers too and are none of our business).
_TOKENS: list[str] = []


def make_broken(*, broken: str, **fields: Any) -> BashExecutor:
    """The `module:attr` factory the configs name: the broken backend ``broken``, its token recorded."""
    executor: BashExecutor = getattr(bb, broken).from_fields(**fields)
    _TOKENS.append(executor._token)
    return executor


def _sweep() -> None:
    while _TOKENS:
        token = _TOKENS.pop()
        for entry in scan(f"{token}-".encode()):
            if entry.alive and entry.marker is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(entry.pid, signal.SIGKILL)
    # Spill directories the failed-open breakage left behind by design.
    while bb.LeaksOnFailedOpen.left_behind:
        shutil.rmtree(bb.LeaksOnFailedOpen.left_behind.pop(), ignore_errors=True)


@pytest.mark.parametrize("backend", sorted(CHECKS_BY_BACKEND))
def test_cli_fails_the_broken_backend(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checks = CHECKS_BY_BACKEND[backend]
    toml = tmp_path / "broken.toml"
    toml.write_text(f'backend = "{__name__}:make_broken"\nbroken = "{backend}"\n')
    try:
        code = main(["conformance", "--config", str(toml), "--json", "--check", *checks])
        report = json.loads(capsys.readouterr().out)
    finally:
        _sweep()  # a broken backend may leave processes behind
    outcomes = {result["name"]: result["outcome"] for result in report["results"]}
    assert outcomes == dict.fromkeys(checks, "failed"), report["results"]
    # Only contract checks fail the run; a backend that breaks only "beyond" checks passes it.
    breaks_contract = any(CHECKS[name].kind == "contract" for name in checks)
    assert (code, report["contract_ok"]) == ((1, False) if breaks_contract else (0, True))
