"""The conformance kit against the local backend: one test per check and anyio backend."""

from __future__ import annotations

import pytest
from dsh_bash_conformance import CHECKS, run_kit
from kit_targets import local_target

pytestmark = pytest.mark.kit


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(name: str, anyio_backend: str) -> None:
    report = run_kit(local_target(anyio_backend), only=[name])
    [result] = report.results
    assert result.outcome == "passed", f"{result.name} ({result.kind}) {result.outcome}: {result.message}"
