"""``dsh-bash doctor``'s fixes: chosen by the error's reason, the backend's own hint before the generic one.

The doctor runs in-process (``run_doctor``) against tiny backends below, named ``test_doctor:NAME``;
the end-to-end runs through the console script are in ``tests/test_cli_config.py``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import dsh_bash_cli._doctor as doctor_module
import pytest
from cli_config_backends import FixedAmbientConfig, FixedAmbientExecutor
from dsh_bash_cli._doctor import GENERIC_HINTS, Finding, hint, run_doctor
from dsh_bash_local import LocalBashExecutor

from dsh_bash import BashExecutor, BashInfrastructureError, InfraReason
from dsh_bash._errors import INFRA_REASONS
from dsh_bash.backend import (
    CommandProcess,
    Launch,
)

OWN_HINT = "check endpoint in the config: the test backend's own words"


class _Unreachable(LocalBashExecutor):
    """Fails to open with the reason its ``reason`` class attribute names."""

    reason: InfraReason = "host_unreachable"

    async def _open(self) -> None:
        raise BashInfrastructureError("the test backend cannot reach its host", reason=self.reason)


class UnreachableWithHint(_Unreachable):
    infra_hints: ClassVar[Mapping[InfraReason, str]] = {"host_unreachable": OWN_HINT}


class UnreachableWithoutHint(_Unreachable):
    pass


class UnreachableUnclassified(_Unreachable):
    infra_hints: ClassVar[Mapping[InfraReason, str]] = {"host_unreachable": OWN_HINT}
    reason = "unclassified"


class WorkdirGone(LocalBashExecutor):
    """Opens, then refuses every command with ``workdir_missing``."""

    async def _spawn(self, launch: Launch) -> CommandProcess:
        raise BashInfrastructureError("the test workdir is gone", reason="workdir_missing")


class NeedsSetsid(FixedAmbientExecutor):
    needs_setsid = True


class DoesNotNeedSetsid(FixedAmbientExecutor):
    needs_setsid = False


def needs_setsid(**fields: Any) -> NeedsSetsid:
    return NeedsSetsid(FixedAmbientConfig(**fields))


def does_not_need_setsid(**fields: Any) -> DoesNotNeedSetsid:
    return DoesNotNeedSetsid(FixedAmbientConfig(**fields))


def doctor(backend: str, **fields: Any) -> list[Finding]:
    findings: list[Finding] = []
    run_doctor({"backend": f"{__name__}:{backend}", **fields}, timeout_s=10, report=findings.append)
    return findings


@pytest.mark.parametrize(
    ("backend", "fix"),
    [
        ("UnreachableWithHint.from_fields", OWN_HINT),
        ("UnreachableWithoutHint.from_fields", GENERIC_HINTS["host_unreachable"]),
        # No reason: the open step's own hint, never the backend's hint for some reason.
        ("UnreachableUnclassified.from_fields", hint(None, "open")),
    ],
)
def test_open_failure_fix_follows_the_reason(backend: str, fix: str) -> None:
    findings = doctor(backend)
    assert [(f.step, f.ok) for f in findings] == [("config", True), ("open", False)]
    assert findings[1].fix == fix
    assert "cannot reach its host" in findings[1].detail


def test_the_reason_beats_the_step() -> None:
    findings = doctor("WorkdirGone.from_fields")
    failed = {f.step: f.fix for f in findings if not f.ok}
    # The bash step alone would say "install bash"; the error's reason says the workdir is the problem.
    assert failed == dict.fromkeys(
        ["bash", "workdir", "spill", "setsid", "policy"], GENERIC_HINTS["workdir_missing"]
    )


def test_an_error_no_step_expects_is_that_steps_not_the_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that breaks in a way it does not expect (here a rule the policy model refuses, as a
    configured allow-list once made it) is reported as that step, not as the close."""
    monkeypatch.setattr(doctor_module, "_POLICY_RULES", (("bogus", {"network": "bogus"}),))
    findings = doctor("does_not_need_setsid")
    assert [(f.step, f.ok) for f in findings][-1:] == [("policy", False)], findings
    assert "network" in findings[-1].detail


@pytest.mark.parametrize(("backend", "ok"), [("needs_setsid", False), ("does_not_need_setsid", True)])
def test_setsid_step_follows_needs_setsid(backend: str, ok: bool, tmp_path: Path) -> None:
    # Commands see a PATH without setsid (bash's builtins still work).
    findings = {f.step: f for f in doctor(backend, ambient={"PATH": str(tmp_path)})}
    assert findings["bash"].ok and findings["spill"].ok
    assert findings["setsid"].ok is ok, findings["setsid"]
    if not ok:
        assert "NeedsSetsid needs it" in findings["setsid"].fix


def test_hint_lookup() -> None:
    class Own(LocalBashExecutor):
        infra_hints: ClassVar[Mapping[InfraReason, str]] = {"auth_failed": OWN_HINT}

    error = BashInfrastructureError("refused", reason="auth_failed")
    assert hint(Own, "open", error) == OWN_HINT
    assert hint(LocalBashExecutor, "open", error) == GENERIC_HINTS["auth_failed"]
    assert hint(None, "bash") == GENERIC_HINTS["shell_missing"]
    assert hint(LocalBashExecutor, "bash") == LocalBashExecutor.infra_hints["shell_missing"]
    assert hint(Own, "close") == "see the message above"


def test_every_reason_has_a_generic_hint() -> None:
    assert set(GENERIC_HINTS) == set(INFRA_REASONS) - {"unclassified"}


@pytest.mark.parametrize("module", ["dsh_bash_local", "dsh_bash_docker", "dsh_bash_ssh"])
def test_shipped_backends_give_their_own_hints(module: str) -> None:
    package = importlib.import_module(module)
    executor: type[BashExecutor] = next(
        value
        for value in vars(package).values()
        if isinstance(value, type) and issubclass(value, BashExecutor)
    )
    assert executor.infra_hints, f"{executor.__name__} gives the doctor no hints of its own"
    for reason, text in executor.infra_hints.items():
        assert text and text != GENERIC_HINTS[reason]


class BlocksOnOpen(LocalBashExecutor):
    """Blocks its event loop while opening: no cancel scope can end that, only the watchdog."""

    async def _open(self) -> None:
        time.sleep(10)


def test_a_backend_that_blocks_its_event_loop_is_abandoned() -> None:
    findings: list[Finding] = []
    started = time.monotonic()
    source = {"backend": f"{__name__}:BlocksOnOpen.from_fields"}
    ok = run_doctor(source, timeout_s=0.5, report=findings.append)
    assert not ok and time.monotonic() - started < 8
    assert [(f.step, f.ok) for f in findings] == [("config", True), ("open", False)]
    assert findings[1].detail.startswith("no answer within 5.5 s: the backend blocks its event loop")


class MarkerFallback(LocalBashExecutor):
    """Reports the marker containment as if the supervisor could not run here (config: ``auto``)."""

    @property
    def containment(self) -> str:
        return "marker"


def marker_fallback(**fields: Any) -> MarkerFallback:
    return MarkerFallback(MarkerFallback.config_class(**fields))


def _containment_finding(source: Any) -> Finding:
    findings: list[Finding] = []
    run_doctor(source, timeout_s=20, report=findings.append)
    [found] = [f for f in findings if f.step == "containment"]
    return found


def test_doctor_reports_the_containment(tmp_path: Path) -> None:
    """Doctor says which containment is active: the supervisor; the marker as configured; the marker
    as a fallback the config did not ask for (a finding to fix, naming the settings)."""
    active = _containment_finding({"backend": "local"})
    assert active.ok and active.detail.startswith("subreaper")
    chosen = _containment_finding({"backend": "local", "containment": "marker"})
    assert chosen.ok and "as configured" in chosen.detail
    fallback = _containment_finding({"backend": f"{__name__}:marker_fallback"})
    assert not fallback.ok and "marker" in fallback.detail
    assert "containment = 'marker'" in fallback.fix and "'subreaper'" in fallback.fix
