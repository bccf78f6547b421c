"""SSH: a command that stops (SIGSTOP) every process its login may signal (issue 30).

``kill -STOP -1`` stops the connection's own ``sshd`` session process too (``sshd: USER@notty`` runs
as the login user), and then no channel of the connection moves: before, a run with a 2 s timeout
raised ``command_lost`` after 24 s and the next run did not return within 50 s, cancelled or not.
The executor now continues the login's stopped ``sshd`` session processes and supervisors from a
second connection when a helper script stalls (``ChannelPool.thaw``).

The test logs in as a user of its own: ``kill -STOP -1`` would stop every process of the shared test
login, other tests' among them.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import anyio
import pytest
from dsh_bash_ssh import SshBashExecutor, SshConfig
from ssh_support import SshServer, ensure_user

from dsh_bash import BashExecRequest, BashInfrastructureError

pytestmark = [pytest.mark.faults, pytest.mark.ssh, pytest.mark.anyio]

FROZEN_USER = "dshfrozen"
GRACE_MS = 500


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def frozen_login(ssh_server: SshServer) -> Iterator[dict[str, object]]:
    """The session server's config for a login of this test's own, and nothing of it left after."""
    ensure_user(FROZEN_USER)
    keys = ssh_server.directory / f"authorized_keys.{FROZEN_USER}"
    keys.write_text((ssh_server.directory / "userkey.pub").read_text())
    keys.chmod(0o644)
    try:
        yield ssh_server.config(username=FROZEN_USER, grace_ms=GRACE_MS)
    finally:
        # Whatever a failure left stopped: continued first, or SIGKILL would wait for them.
        subprocess.run(["pkill", "-CONT", "-u", FROZEN_USER], check=False)
        subprocess.run(["pkill", "-KILL", "-u", FROZEN_USER], check=False)


def _left(user: str) -> list[str]:
    argv = ["ps", "-u", user, "-o", "pid=,stat=,args="]
    ps = subprocess.run(argv, check=False, capture_output=True, text=True)
    return [line for line in ps.stdout.splitlines() if " Z" not in line and line.strip()]


@pytest.mark.timeout(90)
async def test_a_command_that_stops_every_process_of_its_login_hangs_nothing(
    frozen_login: dict[str, object],
) -> None:
    executor = SshBashExecutor(SshConfig(**frozen_login))
    began = time.monotonic()
    async with executor as ex:
        assert (await ex.exec("echo warm")).stdout.text == "warm\n"
        started = time.monotonic()
        # The timeout, the grace twice, a stalled script (1 s) and a second connection: 9 s leaves
        # room for a loaded machine; before, 24 s.
        with anyio.fail_after(9):
            try:
                first = await ex.exec("kill -STOP -1; echo stopped", timeout_ms=2000)
            except BashInfrastructureError as exc:
                assert exc.reason == "command_lost", exc
            else:
                # Its end may come before the timeout (exit 0, once the stopped processes are
                # continued) or after it (timed out): either is the truth.
                assert first.timed_out or (first.exit_code, first.stdout.text) == (0, "stopped\n"), first
        took = time.monotonic() - started
        with anyio.fail_after(3):  # before: no answer in 50 s
            nxt = await ex.exec("echo next")
        assert nxt.stdout.text == "next\n", (nxt, took)
        with anyio.fail_after(3):
            task = await ex.start(ex.resolve(BashExecRequest(command="echo task")))
            await task.wait()
        assert (await ex.read_output(task.id)).delta == "task\n"
        closing = time.monotonic()
    closed = time.monotonic() - closing
    assert closed < 3, f"aclose took {closed:.1f} s"
    assert time.monotonic() - began < 20
    await anyio.sleep(0.5)
    assert _left(FROZEN_USER) == []
