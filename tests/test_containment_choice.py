"""How a backend's ``containment`` setting is applied (dsh_bash.backend.choose_containment), and the
local executor's ``containment`` property."""

from __future__ import annotations

import logging

import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import choose_containment
from dsh_bash.supervisor import supervisor_binary

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_a_usable_supervisor_is_used_unless_marker_is_asked(caplog: pytest.LogCaptureFixture) -> None:
    assert choose_containment("auto", "/x/dsh-supervise", "", "here") == "/x/dsh-supervise"
    assert choose_containment("subreaper", "/x/dsh-supervise", "", "here") == "/x/dsh-supervise"
    assert choose_containment("marker", "/x/dsh-supervise", "", "here") is None
    assert not caplog.records


def test_auto_falls_back_to_the_marker_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "dsh_bash")
    assert choose_containment("auto", None, "no binary for sparc", "box 7") is None
    [record] = caplog.records
    assert "box 7" in record.getMessage() and "no binary for sparc" in record.getMessage()
    assert "marker" in record.getMessage()


def test_subreaper_refuses_without_it() -> None:
    with pytest.raises(BashInfrastructureError, match="no binary for sparc") as raised:
        choose_containment("subreaper", None, "no binary for sparc", "box 7")
    assert raised.value.reason == "start_failed"


@pytest.mark.skipif(supervisor_binary() is None, reason="backend unavailable: dsh-supervise is not built")
async def test_the_local_executor_says_which_containment_is_active() -> None:
    async with LocalBashExecutor(LocalConfig()) as ex:
        assert ex.containment == "subreaper"
        result = await ex.exec("kill -TERM $$")
        assert result.signal == "SIGTERM"
    async with LocalBashExecutor(LocalConfig(containment="marker")) as ex:
        assert ex.containment == "marker"
