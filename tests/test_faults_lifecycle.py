"""Faults from the caller's side: its task cancelled mid-run; ``aclose`` while 100 tasks run.

Runs on every backend (SSH last). See docs/faults.md for the outcome of each case.
"""

from __future__ import annotations

import signal
import time

import anyio
import pytest
from dsh_bash_conformance import find_host_processes
from fault_support import GRACE_MS, Backend, backend_params, eventually_gone, wait_for_processes

from dsh_bash import BashExecRequest, BashTask, ExecutorClosedError
from dsh_bash._protocol import kill_sequence

pytestmark = [pytest.mark.faults, pytest.mark.anyio]

ALL = backend_params()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ALL, indirect=True)
@pytest.mark.parametrize("trap_term", [False, True], ids=["plain", "trapping-term"])
async def test_cancelled_caller_kills_the_command_first(
    backend: Backend, marker: str, trap_term: bool
) -> None:
    trap = "trap '' TERM; " if trap_term else ""
    command = f'bash -c "{trap}echo started; while :; do sleep 0.1; done" {marker}'
    async with backend.make() as ex:
        with anyio.CancelScope() as scope:

            async def cancel_once_running() -> None:
                await wait_for_processes(marker)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_running)
                await ex.exec(command)
                pytest.fail("the run returned although its caller was cancelled")
        assert scope.cancelled_caught
        # The contract: the command's processes are killed before the cancellation propagates.
        assert find_host_processes(marker) == []
        # The executor is intact: the next command runs, and an empty stdout pipe was not leaked.
        assert (await ex.exec("echo next")).stdout.text == "next\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ALL, indirect=True)
async def test_cancelled_start_leaves_nothing(backend: Backend, marker: str) -> None:
    # Cancel while `start` itself is in flight, at several points: whatever got started is killed,
    # or it is a task the executor still owns (and kills at aclose).
    async with backend.make() as ex:
        for delay in (0.0, 0.005, 0.02, 0.05):
            with anyio.move_on_after(delay):
                await ex.start(ex.resolve(BashExecRequest(command=f"bash -c 'sleep 60; :' {marker}")))
        assert (await ex.exec("echo next")).stdout.text == "next\n"
    assert await eventually_gone(marker, 2) == []


#: aclose's own bound on kills (2 x grace + 0.5 s, the contract's "about twice grace_ms"), plus 4 s for
#: the backend's release (removing a container) on a loaded 2-CPU host. Before the fixes recorded in
#: docs/faults.md, Docker took 9-100 s here and left a SIGTERM-trapping process behind.
ACLOSE_BOUND_S = 2 * GRACE_MS / 1000 + 0.5 + 4.0
#: Docker: the same, plus the engine's own stalls. With 100 commands ending at once, Docker Engine
#: 20.10 sometimes answers no exec for seconds (the kill then goes out from the host after 1 s, see
#: ContainerMarked.signal_all), and removing the container (image mode, its answer waited for at
#: most 10 s: the engine's shim stalled it 30-60 s in about one run in six here) or the spill
#: directory (container mode, a detached exec) waits for it: measured 1.0-5 s typically. The
#: processes are gone when aclose returns either way (checked above); what this bound still catches
#: is a hang.
DOCKER_ACLOSE_BOUND_S = ACLOSE_BOUND_S + 1.0 + 60.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "backend",
    backend_params(),
    indirect=True,
)
async def test_aclose_with_a_hundred_tasks_running(backend: Backend, marker: str) -> None:
    # 40 plain, 30 that trap SIGTERM, 30 that left a daemon in a session of its own (setsid).
    # `; :` keeps each marked bash alive: a lone `sleep` would be exec'd in its place, marker and all.
    plain = f"bash -c 'sleep 300; :' {marker}-plain"
    trapping = f"bash -c \"trap '' TERM; while :; do sleep 1; done\" {marker}-trap"
    daemon = f"setsid bash -c 'sleep 300; :' {marker}-daemon > /dev/null 2>&1 < /dev/null & sleep 300"
    commands = [plain] * 40 + [trapping] * 30 + [daemon] * 30
    tasks: list[BashTask] = []
    notified: list[BashTask] = []
    ex = backend.make()
    async with ex:
        ex.on_task_done(notified.append)
        started = time.monotonic()
        for command in commands:
            with anyio.fail_after(10):
                tasks.append(await ex.start(ex.resolve(BashExecRequest(command=command))))
        print(f"{backend.name}: 100 tasks started in {time.monotonic() - started:.1f}s")
        await wait_for_processes(f"{marker}-plain", 40, within_s=30)
        await wait_for_processes(f"{marker}-trap", 30, within_s=30)
        await wait_for_processes(f"{marker}-daemon", 30, within_s=30)
        assert all(task.status == "running" for task in tasks)
        closing = time.monotonic()
        await ex.aclose()
        elapsed = time.monotonic() - closing
        print(f"{backend.name}: aclose with 100 tasks took {elapsed:.2f}s (grace 0.3s)")
        # That it ends at all is the pytest timeout's business; its bound is checked last, below.
        assert [task.status for task in tasks] == ["killed"] * 100
        assert {task.end_cause for task in tasks} == {"closed"}
        # Never a wrong claim about how each died, also where only 128+n is seen (Docker): the plain
        # ones died of SIGTERM, the trapping ones only of SIGKILL. (None, None) is honest only for a
        # command whose end aclose stopped waiting for (its bound expired: a loaded engine).
        plain_ends = {(task.signal, task.exit_code) for task in tasks[:40]}
        trap_ends = {(task.signal, task.exit_code) for task in tasks[40:70]}
        within_bound = elapsed < 2 * GRACE_MS / 1000 + 0.5
        # Past the bound, the SIGTERM pass itself was slow (100 supervisors on a loaded host): the
        # SIGKILL after the grace may reach a plain one before it acted on its SIGTERM, and then
        # SIGKILL is the truth.
        plain_allowed = {("SIGTERM", None), (None, None)} | (set() if within_bound else {("SIGKILL", None)})
        assert plain_ends <= plain_allowed, (plain_ends, f"aclose took {elapsed:.2f}s")
        assert trap_ends <= {("SIGKILL", None), (None, None)}, trap_ends
        if within_bound:  # within aclose's bound every end was seen
            assert (plain_ends, trap_ends) == ({("SIGTERM", None)}, {("SIGKILL", None)}), f"{elapsed:.2f}s"
        assert notified == []  # no listener once aclose has begun
        for task in tasks:
            with anyio.fail_after(1):
                await task.wait()
        with pytest.raises(ExecutorClosedError):
            await ex.exec("true")
        for kind in ("plain", "trap", "daemon"):
            assert find_host_processes(f"{marker}-{kind}") == [], kind
    assert elapsed < (DOCKER_ACLOSE_BOUND_S if backend.is_docker else ACLOSE_BOUND_S), elapsed


class _SlowTarget:
    """A Killable whose every look at its processes takes longer than the grace (a loaded host)."""

    def __init__(self, scan_s: float) -> None:
        self.scan_s = scan_s
        self.sent: list[int] = []

    async def signal_all(self, sig: int) -> None:
        await anyio.sleep(self.scan_s)  # the scan that finds the processes comes before the signal
        self.sent.append(sig)

    async def remaining(self) -> list[str]:
        await anyio.sleep(self.scan_s)
        return [] if signal.SIGKILL in self.sent else ["4242"]


@pytest.mark.timeout(10)
async def test_kill_sequence_sends_sigkill_even_when_scans_outlast_the_grace() -> None:
    # A process that ignores SIGTERM only ever ends by SIGKILL: the bound on waiting must not
    # also bound whether SIGKILL is sent at all.
    target = _SlowTarget(scan_s=0.2)
    survivors = await kill_sequence(target, 0.05, "slow target")  # type: ignore[arg-type]
    assert target.sent[:2] == [signal.SIGTERM, signal.SIGKILL]
    assert survivors  # no scan finished within the bound: nobody may claim that nothing is left
