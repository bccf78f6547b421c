"""The conformance kit against the Docker backend: one test per check and target.

Targets: image mode (each executor creates its own container) on asyncio and trio, and container
mode (executors attach to an existing container) on asyncio, with the busybox test image
(``docker_test_image``); and image and container mode on asyncio again with the Debian test image
(``docker_debian_image``: coreutils, GNU grep, procps, python3; ``tests/debian_image.py``), whose
test ids start with ``debian-``: the whole kit on busybox in image mode and in container mode the
checks the mode can change (``kit_targets.CONTAINER_MODE_CHECKS``; ``DSH_TEST_CONTAINER_KIT=all``:
every one), on trio the checks of the
backend's own async I/O (``TRIO_CHECKS``), on Debian those the userland can change
(``kit_targets.DEBIAN_CHECKS`` in image mode, ``DEBIAN_CONTAINER_CHECKS`` of them in container mode;
``DSH_TEST_DEBIAN_KIT=all`` runs the whole kit there too). Without a
Docker engine every test skips with ``backend unavailable: ...`` (a failure in CI); so do the Debian
rows when the Debian image is missing and cannot be built here (no ``mmdebstrap``, not root).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import pytest
from docker_support import DockerMode, docker_target
from dsh_bash_conformance import CHECKS, run_kit
from kit_targets import (
    BUSYBOX_NOT_APPLICABLE,
    CONTAINER_MODE_CHECKS,
    DEBIAN_CHECKS,
    DEBIAN_CONTAINER_CHECKS,
    FILE_CHECKS,
    MARKER_CONTAINMENT_FAILS,
    MARKER_CONTAINMENT_RACES,
    POLICY_CHECKS,
    expected_outcome,
    reused_target,
)

pytestmark = [pytest.mark.kit, pytest.mark.docker]

# On trio, the checks that exercise the backend's own async I/O (streams, cancellation, kills and
# closing); the rest differ from asyncio only in the kit's harness, which the local targets cover.
TRIO_CHECKS = [
    "timeout-classified",
    "abort-classified",
    "cancel-kills-before-propagating",
    "cancel-at-any-moment-leaves-nothing",
    "aclose-during-run-raises-closed",
    "stdin-delivered",
    "stdin-empty-by-default",
    "kill-running-task",
    "kill-escalates-after-grace",
    "bounded-drain",
    "timeout-kills-children",
    "long-command-runs",
    "concurrent-runs",
    "read-consuming",
    "read-multibyte-split",
    "read-lossy-exact",
    "flood-bounded-and-timed-out",
    "spill-cap-inclusive",
    "end-cause-closed",
    "listener-called-once-per-task",
    "aclose-bounded",
    "escapee-killed-on-kill",
]
ImageKind = Literal["busybox", "debian"]
#: Which image's fixture each row uses (the container mode's session container is of that image).
_IMAGE_FIXTURE = {"busybox": "docker_test_image", "debian": "docker_debian_image"}
_CONTAINER_FIXTURE = {"busybox": "docker_session_container", "debian": "docker_debian_container"}
#: The Debian image builds once (28-43 s here) in the first test that needs it when
#: ``.ci/run`` has not built it beforehand: the Debian rows allow for that on top of the suite's 120 s.
_DEBIAN_TIMEOUT_S = 120 + 300
_DEBIAN_ALL = os.environ.get("DSH_TEST_DEBIAN_KIT") == "all"
_DEBIAN = list(CHECKS) if _DEBIAN_ALL else list(DEBIAN_CHECKS)
_DEBIAN_CONTAINER = list(CHECKS) if _DEBIAN_ALL else list(DEBIAN_CONTAINER_CHECKS)
_CONTAINER = (
    list(CHECKS) if os.environ.get("DSH_TEST_CONTAINER_KIT") == "all" else list(CONTAINER_MODE_CHECKS)
)
CASES: list[tuple[str, DockerMode, str, ImageKind]] = [
    *((name, "image", "asyncio", "busybox") for name in CHECKS),
    *((name, "container", "asyncio", "busybox") for name in _CONTAINER),
    *((name, "image", "trio", "busybox") for name in TRIO_CHECKS),
    # On a real Debian userland, the checks the userland can change (asyncio only: trio changes nothing
    # the image reaches), in container mode those of them the mode can change too;
    # DSH_TEST_DEBIAN_KIT=all runs the whole kit in both modes there.
    *((name, "image", "asyncio", "debian") for name in _DEBIAN),
    *((name, "container", "asyncio", "debian") for name in _DEBIAN_CONTAINER),
]


def _case_id(name: str, mode: str, backend: str, image: ImageKind) -> str:
    # The busybox rows keep the ids they had before the Debian rows came.
    return f"{mode}-{backend}-{name}" if image == "busybox" else f"{image}-{mode}-{backend}-{name}"


def test_subsets_name_real_checks() -> None:
    assert set(TRIO_CHECKS) <= set(CHECKS)
    assert set(DEBIAN_CHECKS) <= set(CHECKS)
    assert len(set(DEBIAN_CHECKS)) == len(DEBIAN_CHECKS)
    assert set(DEBIAN_CONTAINER_CHECKS) <= set(DEBIAN_CHECKS)
    assert len(set(DEBIAN_CONTAINER_CHECKS)) == len(DEBIAN_CONTAINER_CHECKS)


@pytest.mark.parametrize(
    ("name", "mode", "anyio_backend", "image"),
    [
        pytest.param(*case, marks=[pytest.mark.timeout(_DEBIAN_TIMEOUT_S)] if case[3] == "debian" else [])
        for case in CASES
    ],
    ids=[_case_id(*case) for case in CASES],
)
def test_check(
    name: str, mode: DockerMode, anyio_backend: str, image: ImageKind, request: pytest.FixtureRequest
) -> None:
    tag: str = request.getfixturevalue(_IMAGE_FIXTURE[image])
    container = request.getfixturevalue(_CONTAINER_FIXTURE[image]) if mode == "container" else None
    target = reused_target(
        ("docker", mode, anyio_backend, tag, container),
        lambda: docker_target(mode, anyio_backend, tag, container),
    )
    report = run_kit(target, only=[name])
    [result] = report.results
    print(f"{target.name} {result.name} ({result.kind}) {result.outcome} in {result.duration_s:.2f}s")
    if result.message:
        print(result.message)
    expected = expected_outcome("docker", name, "docker-container" if mode == "container" else "")
    if image == "busybox" and name in BUSYBOX_NOT_APPLICABLE:
        expected = "not_applicable"
    assert result.outcome == expected, f"{result.name} ({result.kind}) {result.outcome}: {result.message}"


#: Issue 30's kit checks as a non-root user in the container (uid 65534), image mode: a command that
#: cannot signal root's processes may still stop its own supervisor, spares and leftovers. The
#: terminal check needs perl or python3: on the Debian image only. And the file checks: files of a
#: user other than root move through the supervisor's file mode, exec'd as that user; the sandbox
#: policy's step confines a user other than root as it does root (the check that looks for other
#: lists' proxies needs python3: on the Debian image).
NOBODY_CASES = [
    ("stopped-supervisor-killed-on-time", "busybox"),
    ("stopped-spares-next-command-on-time", "busybox"),
    ("foreground-leftovers-killed", "busybox"),
    ("terminal-injection-refused", "debian"),
    *((name, "busybox") for name in sorted(FILE_CHECKS)),
    *((name, "debian" if name in BUSYBOX_NOT_APPLICABLE else "busybox") for name in sorted(POLICY_CHECKS)),
]


@pytest.mark.parametrize(("name", "image"), NOBODY_CASES, ids=[f"{n}-{i}" for n, i in NOBODY_CASES])
def test_check_as_nobody(name: str, image: ImageKind, request: pytest.FixtureRequest) -> None:
    tag: str = request.getfixturevalue(_IMAGE_FIXTURE[image])
    key = ("docker", "image", "asyncio", tag, None)  # test_check's image row: its measured latency
    base = reused_target(key, lambda: docker_target("image", "asyncio", tag))

    def make_executor(**overrides: Any) -> Any:
        return base.make_executor(**{"user": "65534", **overrides})

    target = dataclasses.replace(base, name=f"{base.name}-nobody", make_executor=make_executor)
    [result] = run_kit(target, only=[name]).results
    print(f"{target.name} {result.name} {result.outcome} in {result.duration_s:.2f}s {result.message or ''}")
    expected = expected_outcome("docker", name)
    assert result.outcome == expected, f"{result.name} ({result.kind}) {result.outcome}: {result.message}"


#: The checks on how commands are contained and how their outcome is known.
_CONTAINMENT_CLAUSES = ("R-contain-hiding", "R-outcome-unforgeable")
CONTAINMENT_CHECKS = [
    *sorted(name for name, check in CHECKS.items() if check.clause in _CONTAINMENT_CLAUSES),
    "self-kill-reported-as-signal",
]


@pytest.mark.parametrize("name", CONTAINMENT_CHECKS)
def test_marker_containment_fails(name: str, docker_test_image: str) -> None:
    """With ``containment = "marker"`` (the backend before dsh-supervise), the checks fail that the
    supervisor made pass: each of them was a real escape or forgery on this backend."""
    target = reused_target(
        ("docker-marker", docker_test_image),
        lambda: docker_target("image", "asyncio", docker_test_image, containment="marker"),
    )
    [result] = run_kit(target, only=[name]).results
    print(f"{target.name} {result.name} {result.outcome}: {result.message}")
    if name in MARKER_CONTAINMENT_RACES["docker"]:
        assert result.outcome in ("passed", "failed"), f"{result.name} {result.outcome}: {result.message}"
    else:
        assert name in MARKER_CONTAINMENT_FAILS["docker"]
        assert result.outcome == "failed", f"{result.name} {result.outcome} with the marker containment"
