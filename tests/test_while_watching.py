"""dsh_bash.backend.while_watching: a wait with a watcher beside it (a pure helper; no backend)."""

from __future__ import annotations

import anyio
import pytest

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import while_watching

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_the_watcher_runs_while_the_body_waits_and_stops_with_it() -> None:
    ticks: list[int] = []
    stopped = anyio.Event()

    async def watcher() -> None:
        try:
            while True:
                await anyio.sleep(0.01)
                ticks.append(1)
        finally:
            stopped.set()

    async def body() -> str:
        await anyio.sleep(0.1)
        return "done"

    assert await while_watching(body, watcher) == "done"
    assert stopped.is_set()
    assert len(ticks) >= 3


async def test_the_bodys_error_comes_out_as_it_is() -> None:
    async def watcher() -> None:
        await anyio.sleep_forever()

    async def body() -> None:
        await anyio.sleep(0.001)
        raise BashInfrastructureError("gone", reason="command_lost")

    # Not an exception group: callers catch BashInfrastructureError by its type and reason.
    with pytest.raises(BashInfrastructureError) as raised:
        await while_watching(body, watcher)
    assert raised.value.reason == "command_lost"


async def test_a_cancelled_caller_cancels_both() -> None:
    stopped = anyio.Event()

    async def watcher() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopped.set()

    async def body() -> None:
        await anyio.sleep_forever()

    with anyio.move_on_after(0.05):
        await while_watching(body, watcher)
    assert stopped.is_set()
