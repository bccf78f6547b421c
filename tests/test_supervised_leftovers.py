"""dsh_bash.backend.SupervisedLeftovers: what aclose kills through the executor's supervisors (pure)."""

from __future__ import annotations

import signal

import anyio
import pytest

from dsh_bash.backend import SupervisedLeftovers

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class _SlowToAsk:
    """A supervised command whose request waits until every command of the executor was asked: the
    continue of a supervisor that may be stopped (an exec where the commands run, on a loaded
    engine a second or more) that all of them share."""

    def __init__(self, asked: list[_SlowToAsk], everyone_asked: anyio.Event, count: int) -> None:
        self._asked = asked
        self._everyone_asked = everyone_asked
        self._count = count
        self.signals: list[int] = []

    @property
    def ended(self) -> bool:
        return False

    async def signal_all(self, sig: int) -> None:
        self._asked.append(self)
        if len(self._asked) == self._count:
            self._everyone_asked.set()
        await self._everyone_asked.wait()
        self.signals.append(sig)

    async def remaining(self) -> list[str]:
        return []


class _NothingElse:
    async def signal_all(self, sig: int) -> None:
        pass

    async def remaining(self) -> list[str]:
        return []


async def test_every_supervisor_is_asked_before_any_request_is_waited_for() -> None:
    # One after another, the hundredth SIGKILL request went out only after 99 waits: past aclose's
    # bound on a loaded engine, and SIGTERM-trapping commands outlived the executor.
    asked: list[_SlowToAsk] = []
    everyone_asked = anyio.Event()
    commands = [_SlowToAsk(asked, everyone_asked, 100) for _ in range(100)]
    leftovers = SupervisedLeftovers(set(commands), _NothingElse())
    with anyio.fail_after(5):
        await leftovers.signal_all(signal.SIGKILL)
    assert all(command.signals == [signal.SIGKILL] for command in commands)


class _Unreachable(_NothingElse):
    @property
    def ended(self) -> bool:
        return False

    async def signal_all(self, sig: int) -> None:
        raise OSError("host unreachable")


async def test_one_command_that_cannot_be_asked_does_not_hold_back_the_others() -> None:
    asked: list[_SlowToAsk] = []
    everyone_asked = anyio.Event()
    commands = [_SlowToAsk(asked, everyone_asked, 3) for _ in range(3)]
    leftovers = SupervisedLeftovers({_Unreachable(), *commands}, _NothingElse())
    with anyio.fail_after(5), pytest.raises(OSError, match="host unreachable"):
        await leftovers.signal_all(signal.SIGKILL)
    assert all(command.signals == [signal.SIGKILL] for command in commands)
