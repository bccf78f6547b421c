"""dsh_bash.backend.CoalescedRuns: callers meanwhile share one run; AtMostEvery: one run an interval
(pure helpers; no backend)."""

from __future__ import annotations

import anyio
import pytest

from dsh_bash.backend import AtMostEvery, CoalescedRuns

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class _Action:
    """Counts its runs; each run waits until its own release, so calls can pile up meanwhile."""

    def __init__(self) -> None:
        self.releases: list[anyio.Event] = []
        self.runners: list[int] = []  # the task each run ran in: the caller that began it
        self.ended = 0
        self.running = 0
        self.most_at_once = 0

    @property
    def began(self) -> int:
        return len(self.releases)

    async def __call__(self) -> None:
        release = anyio.Event()
        self.releases.append(release)
        self.runners.append(anyio.get_current_task().id)
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await release.wait()
        finally:
            self.running -= 1
        self.ended += 1


async def test_a_hundred_callers_during_a_run_share_one_more_run() -> None:
    action = _Action()
    runs = CoalescedRuns(action)
    returned: list[int] = []

    async def call(index: int) -> None:
        await runs.run()
        returned.append(index)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, -1)
        await anyio.wait_all_tasks_blocked()
        for index in range(100):
            tg.start_soon(call, index)
        await anyio.wait_all_tasks_blocked()
        assert (action.began, returned) == (1, [])  # nobody starts a second run beside the first
        action.releases[0].set()
        await anyio.wait_all_tasks_blocked()
        # The hundred asked after the first run began, so it cannot count for them: one more run does.
        assert (action.began, returned) == (2, [-1])
        action.releases[1].set()
    assert (action.ended, action.most_at_once) == (2, 1)
    assert sorted(returned) == [-1, *range(100)]


async def test_a_call_after_a_run_ended_starts_a_run_of_its_own() -> None:
    action = _Action()
    runs = CoalescedRuns(action)
    for expected in (1, 2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runs.run)
            await anyio.wait_all_tasks_blocked()
            assert action.began == expected
            action.releases[-1].set()
    assert action.ended == 2


async def test_a_run_cancelled_midway_counts_for_no_one() -> None:
    action = _Action()
    runs = CoalescedRuns(action)
    scopes: dict[int, anyio.CancelScope] = {}
    returned: list[int] = []

    async def caller(index: int) -> None:
        with anyio.CancelScope() as scope:
            scopes[anyio.get_current_task().id] = scope
            await runs.run()
            returned.append(index)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, 0)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(caller, 1)  # both ask during the first run
        tg.start_soon(caller, 2)
        await anyio.wait_all_tasks_blocked()
        action.releases[0].set()
        await anyio.wait_all_tasks_blocked()
        assert (action.began, returned) == (2, [0])
        scopes[action.runners[1]].cancel()  # the caller that began the second run gives up
        await anyio.wait_all_tasks_blocked()
        # The second run did not complete, so it serves no one: the other caller runs a third.
        assert action.began == 3 and returned == [0]
        action.releases[2].set()
    assert len(returned) == 2 and action.ended == 2


async def test_an_error_reaches_the_caller_whose_run_raised_and_the_next_run_goes_on() -> None:
    calls = 0

    async def failing_once() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("refused")

    runs = CoalescedRuns(failing_once)
    with pytest.raises(OSError, match="refused"):
        await runs.run()
    await runs.run()
    assert calls == 2


async def test_a_stale_run_no_longer_holds_the_others_back() -> None:
    # The first run never ends (its process was stopped); a caller after it waits the stale bound,
    # then a run of its own serves it.
    action = _Action()
    runs = CoalescedRuns(action, stale_after_s=0.2)
    returned = anyio.Event()

    async def late() -> None:
        await runs.run()
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(runs.run)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(late)
        await anyio.wait_all_tasks_blocked()
        assert action.began == 1
        with anyio.fail_after(5):
            while action.began < 2:  # noqa: ASYNC110 - the stale bound passes on the clock
                await anyio.sleep(0.01)
        action.releases[1].set()
        with anyio.fail_after(5):
            await returned.wait()
        assert action.ended == 1  # the first is still stuck: the second served the late caller
        action.releases[0].set()
    assert action.ended == 2


async def test_at_most_every_runs_once_an_interval_and_one_at_a_time() -> None:
    """The thaws of the Docker and SSH backends: every stalled call asks, one run serves them all for
    the interval, and no two runs overlap."""
    runs: list[float] = []
    running = 0
    overlapped = False

    async def action() -> None:
        nonlocal running, overlapped
        running += 1
        overlapped = overlapped or running > 1
        runs.append(anyio.current_time())
        await anyio.sleep(0.05)
        running -= 1

    every = AtMostEvery(action, every_s=0.3)
    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(every)
    assert len(runs) == 1 and not overlapped
    await every()
    assert len(runs) == 1  # within the interval: nothing
    await anyio.sleep(0.3)
    await every()
    assert len(runs) == 2 and runs[1] - runs[0] >= 0.3
