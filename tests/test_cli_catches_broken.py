"""`dsh-bash conformance --config FILE` fails deliberately broken backends, named as module:attr.

The kit's own proof (tests/test_kit_catches_broken.py) runs the whole table through `run_kit`: that
every check fails the backend meant for it is proven there. What only the command adds is the door: a
`module:attr` factory loaded from a config file, `--check` selecting several checks, `--json`, and the
exit status (1 when a contract check failed, 0 when only "beyond" checks did). So this runs a sample of
the table through it (in-process, to spare an interpreter start per backend): until 2026-12-06 it ran
all of it again, 131 rows and about 170 s of test time that proved nothing `run_kit` had not.
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

#: The rows run through the command, one for each thing the door must get right: two contract checks
#: failed at once (exit 1), only "beyond" checks failed (exit 0), a breakage that leaves processes
#: behind (the command's own event loop still closes), and a backend broken after its close.
CLI_SAMPLE = ["AbortReportedAsTimeout", "GroupOnlyTracking", "KillsOnlyLeader", "UsableAfterClose"]


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


def test_the_sample_covers_both_exit_statuses() -> None:
    kinds = [{CHECKS[name].kind for name in CHECKS_BY_BACKEND[backend]} for backend in CLI_SAMPLE]
    assert all(CHECKS_BY_BACKEND[backend] for backend in CLI_SAMPLE), "a sampled backend is gone"
    assert {"contract"} in kinds and any("contract" not in kind for kind in kinds), kinds
    assert any(len(CHECKS_BY_BACKEND[backend]) > 1 for backend in CLI_SAMPLE)


@pytest.mark.parametrize("backend", CLI_SAMPLE)
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
