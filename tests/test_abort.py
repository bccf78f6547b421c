"""Unit tests for AbortController / AbortSignal, under asyncio and trio."""

from __future__ import annotations

import anyio
import pytest

from dsh_bash import AbortController, AbortSignal


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_controller_created_outside_a_loop_starts_unaborted() -> None:
    controller = AbortController()
    assert isinstance(controller.signal, AbortSignal)
    assert controller.signal is controller.signal
    assert controller.signal.aborted is False
    assert controller.signal.reason is None


def test_abort_outside_a_loop_sets_aborted_and_reason() -> None:
    controller = AbortController()
    controller.abort("stop")
    assert controller.signal.aborted is True
    assert controller.signal.reason == "stop"


def test_abort_without_reason_leaves_reason_none() -> None:
    controller = AbortController()
    controller.abort()
    assert controller.signal.aborted is True
    assert controller.signal.reason is None


def test_abort_twice_is_a_no_op_and_keeps_the_first_reason() -> None:
    controller = AbortController()
    first = RuntimeError("first")
    controller.abort(first)
    controller.abort("second")
    controller.abort()
    assert controller.signal.aborted is True
    assert controller.signal.reason is first


def test_repr_shows_state() -> None:
    controller = AbortController()
    assert "aborted=False" in repr(controller.signal)
    controller.abort("why")
    assert "aborted=True" in repr(controller.signal)
    assert "why" in repr(controller.signal)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_signal_created_outside_a_loop_wakes_waiters_inside_one(backend: str) -> None:
    controller = AbortController()  # no loop running here
    woken: list[object] = []

    async def main() -> None:
        async def waiter() -> None:
            await controller.signal.wait()
            woken.append(controller.signal.reason)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert woken == []
                controller.abort("bye")

    anyio.run(main, backend=backend)
    assert woken == ["bye"]


def test_one_signal_serves_loops_of_both_backends_in_turn() -> None:
    controller = AbortController()

    async def wait_until_aborted() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(controller.signal.wait)
                await anyio.wait_all_tasks_blocked()
                controller.abort()

    async def wait_already_aborted() -> None:
        with anyio.fail_after(5):
            await controller.signal.wait()

    anyio.run(wait_until_aborted, backend="asyncio")
    anyio.run(wait_already_aborted, backend="trio")
    anyio.run(wait_already_aborted, backend="asyncio")


@pytest.mark.anyio
async def test_wait_returns_at_once_when_already_aborted() -> None:
    controller = AbortController()
    controller.abort("done")
    with anyio.fail_after(5):
        await controller.signal.wait()
        await controller.signal.wait()
    assert controller.signal.reason == "done"


@pytest.mark.anyio
async def test_wait_blocks_while_not_aborted() -> None:
    controller = AbortController()
    with anyio.move_on_after(0.05) as scope:
        await controller.signal.wait()
    assert scope.cancelled_caught
    assert controller.signal.aborted is False


@pytest.mark.anyio
async def test_abort_wakes_every_waiter() -> None:
    controller = AbortController()
    woken: list[int] = []

    async def waiter(number: int) -> None:
        await controller.signal.wait()
        woken.append(number)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for number in range(5):
                tg.start_soon(waiter, number)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            controller.abort("now")
    assert sorted(woken) == [0, 1, 2, 3, 4]


@pytest.mark.anyio
async def test_abort_from_another_task_wakes_waiter() -> None:
    controller = AbortController()

    async def aborter() -> None:
        await anyio.sleep(0.01)
        controller.abort("late")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(aborter)
            await controller.signal.wait()
    assert controller.signal.reason == "late"


@pytest.mark.anyio
async def test_cancelled_waiter_is_removed_and_later_abort_still_wakes_others() -> None:
    controller = AbortController()
    signal = controller.signal
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await signal.wait()
        woken.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as doomed:
                # A waiter in its own scope, cancelled before the abort.
                async with anyio.create_task_group() as inner:
                    inner.start_soon(waiter, "cancelled")
                    await anyio.wait_all_tasks_blocked()
                    doomed.cancel()
            # The cancelled waiter left nothing behind.
            assert signal._waiters == []
            tg.start_soon(waiter, "survivor")
            await anyio.wait_all_tasks_blocked()
            assert len(signal._waiters) == 1
            controller.abort("go")
    assert woken == ["survivor"]
    assert signal._waiters == []


@pytest.mark.anyio
async def test_many_cancelled_waiters_do_not_accumulate() -> None:
    controller = AbortController()
    for _ in range(50):
        with anyio.move_on_after(0):
            await controller.signal.wait()
    assert controller.signal._waiters == []
    controller.abort()
    with anyio.fail_after(5):
        await controller.signal.wait()


@pytest.mark.anyio
async def test_waiter_cancelled_in_the_same_step_as_abort_does_not_break_abort() -> None:
    controller = AbortController()
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await controller.signal.wait()
        woken.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as doomed:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(waiter, "doomed")
                    tg.start_soon(waiter, "other")
                    await anyio.wait_all_tasks_blocked()
                    controller.abort("both")
                    doomed.cancel()
    assert "other" in woken
    assert controller.signal._waiters == []
