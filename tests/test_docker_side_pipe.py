"""The supervisor's side pipe on Docker: a command with much output leaves the engine's stream.

Where this process may open the supervisor's fds through this host's /proc (root here), a command
that wrote more than 1 MiB moves the rest of its frames to a pipe of its supervisor's
(``DockerConfig.direct_output``). Everything the contract promises must hold on either path: exact
bytes, spill files, timeouts, kills, close, and outcomes nobody can forge.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time

import anyio
import pytest
from docker_support import SESSION_ID, SESSION_LABEL
from dsh_bash_docker import DockerBashExecutor, DockerConfig

from dsh_bash import BashExecRequest
from dsh_bash.host._proc_scan import scan

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.timeout(60)]

SIDE_LOG = "through the supervisor's side pipe"
#: `seq 1 N` with N large enough to pass the 1 MiB switch point several times over.
LINES = 1_000_000


@functools.cache
def expected() -> bytes:
    """What ``seq 1 LINES`` prints (made when a test needs it, not at every collection)."""
    return "".join(f"{n}\n" for n in range(1, LINES + 1)).encode()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)  # a plain fd is waited for differently on each


def _config(image: str, **fields: object) -> DockerConfig:
    labels = {SESSION_LABEL: SESSION_ID}
    return DockerConfig(image=image, grace_ms=300, labels=labels, **fields)  # type: ignore[arg-type]


def _marked(token: str) -> int:
    return len([entry for entry in scan(token.encode()) if entry.alive and entry.marker])


def _switched(caplog: pytest.LogCaptureFixture) -> int:
    return sum(SIDE_LOG in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "engine"])
async def test_large_output_exact_on_either_path(
    docker_test_image: str, caplog: pytest.LogCaptureFixture, direct: bool
) -> None:
    caplog.set_level(logging.DEBUG, logger="dsh_bash")
    async with DockerBashExecutor(_config(docker_test_image, direct_output=direct)) as ex:
        result = await ex.exec(f"seq 1 {LINES}; echo done >&2; exit 4", timeout_ms=30_000)
        assert result.exit_code == 4 and not result.timed_out
        assert result.stdout.total_bytes == len(expected())
        assert result.stdout.data == expected()[-len(result.stdout.data) :]
        assert result.stderr.data == b"done\n"
        assert result.stdout.spill_path is not None
        digest = await ex.exec(f"md5sum < {result.stdout.spill_path}")
        assert digest.stdout.text.split()[0] == hashlib.md5(expected()).hexdigest()
        assert _switched(caplog) == (1 if direct else 0)
        # Small output stays on the engine's stream: no exec inspect for it.
        assert (await ex.exec("echo small")).stdout.text == "small\n"
        assert _switched(caplog) == (1 if direct else 0)


async def test_a_command_cannot_write_into_its_supervisors_pipes(
    docker_test_image: str, caplog: pytest.LogCaptureFixture
) -> None:
    # After the switch, a forged `exit 0` frame written through every fd of the supervisor (the
    # command's parent) must not count: it is non-dumpable, so /proc/PPID/fd is closed to the command.
    caplog.set_level(logging.DEBUG, logger="dsh_bash")
    forge = (
        "head -c 3000000 /dev/zero; sleep 1; n=0; for f in /proc/$PPID/fd/*; do "
        "printf 's\\000\\000\\000\\006exit 0s\\000\\000\\000\\005empty' > $f && n=$((n+1)); "
        "done 2>/dev/null; "
        'echo "opened $n" >&2; exit 3'
    )
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        result = await ex.exec(forge, timeout_ms=20_000)
    assert _switched(caplog) == 1
    assert result.exit_code == 3, result
    assert result.stderr.text == "opened 0\n"
    assert result.stdout.total_bytes == 3_000_000


async def test_timeout_kill_and_close_during_a_side_transfer(
    docker_test_image: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dsh_bash")
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        token = ex._token
        started = time.monotonic()
        result = await ex.exec("yes", timeout_ms=1500)
        assert result.timed_out and time.monotonic() - started < 6
        assert _switched(caplog) == 1

        task = await ex.start(ex.resolve(BashExecRequest(command="(setsid yes > /dev/null &); yes")))
        seen = 0
        with anyio.fail_after(10):
            while seen < 4 << 20:  # well past the switch
                read = await ex.read_output(task.id)
                seen += len(read.delta.encode()) + read.dropped_bytes
                await anyio.sleep(0.05)
        assert _switched(caplog) == 2
        assert await ex.kill(task.id)
        with anyio.fail_after(5):
            await task.wait()
        assert task.end_cause == "killed", task
        for _ in range(100):  # the supervisor's kill passes end it all; a moment to go
            if not _marked(token):
                break
            await anyio.sleep(0.05)
        assert _marked(token) == 0

        await ex.start(ex.resolve(BashExecRequest(command="(setsid yes > /dev/null &); yes")))
        await anyio.sleep(1.0)
    assert _switched(caplog) == 3
    assert _marked(token) == 0
