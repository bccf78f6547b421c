"""Docker: a command that stops (SIGSTOP) the container runtime's process entering its container.

Every exec enters the container through runc: its last stage (``runc:[2:INIT]``) joins the
container's pid namespace before it becomes the exec's process, so a command of the container's
user sees it (with parent 0, like every exec'd process) and may stop it. The engine then holds
every call about that container (exec create, inspect) until the stage goes on: before, the next
command, the kill script and ``aclose`` hung for good (a CI run: the kit's
``stopped-spares-next-command-on-time`` stopped a spare's replacement as it entered, and the
container took no exec for the rest of the run). The executor now continues such a stage from
the host when a call about its container, or an exec's first output, has waited a second.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import anyio
import pytest
from docker_support import SESSION_ID, SESSION_LABEL
from dsh_bash_docker import DockerBashExecutor, DockerConfig

from dsh_bash import BashExecRequest

pytestmark = [pytest.mark.faults, pytest.mark.docker, pytest.mark.anyio]

#: Stops the first runtime stage it sees in its container, and says which; "none" after 8 s.
STOP_ENTERING_RUNTIME = r"""
end=$((SECONDS+8))
while [ $SECONDS -lt $end ]; do
    for d in /proc/[0-9]*; do
        read -r s < $d/stat 2>/dev/null || continue
        c=${s#*(}
        c=${c%%)*}
        case $c in runc:*) kill -STOP ${d#/proc/} 2>/dev/null && { echo "stopped $c"; exit 0; } ;; esac
    done
done
echo none
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _continue_stopped_runtime_stages() -> None:
    """What a failure left stopped, continued (the engine holds the container, and its removal,
    until then)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                head, _, rest = stat.read().rpartition(b") ")
            if head.partition(b"(")[2].startswith(b"runc:") and rest.startswith(b"T"):
                os.kill(int(name), signal.SIGCONT)
        except OSError:
            continue


@pytest.fixture
def continue_runtime_after() -> Iterator[None]:
    try:
        yield
    finally:
        _continue_stopped_runtime_stages()


@pytest.mark.timeout(60)
async def test_a_stopped_runtime_stage_holds_the_container_a_second_at_most(
    docker_test_image: str, continue_runtime_after: None
) -> None:
    config = DockerConfig(image=docker_test_image, labels={SESSION_LABEL: SESSION_ID})
    async with DockerBashExecutor(config) as ex:
        try:
            assert (await ex.exec("echo warm")).stdout.text == "warm\n"
            stopper = await ex.start(ex.resolve(BashExecRequest(command=STOP_ENTERING_RUNTIME)))
            # Every exec enters through runc (a spare's replacement too), until one is stopped. Each
            # run waits a second for the stall to show, then for the thaw; before, the first run after
            # the stop never returned.
            runs = 0
            while stopper.status == "running":
                with anyio.fail_after(5):
                    assert (await ex.exec("echo run")).stdout.text == "run\n"
                runs += 1
            said = (await ex.read_output(stopper.id)).delta
            assert said.startswith("stopped runc:"), f"nothing entering was stopped in {runs} runs: {said!r}"
            started = time.monotonic()
            for attempt in ("first", "second"):
                with anyio.fail_after(5):
                    nxt = await ex.exec("echo next")
                assert nxt.stdout.text == "next\n", f"the {attempt} command after the stop: {nxt}"
            print(f"{runs} runs until the stop; then two commands in {time.monotonic() - started:.2f} s")
        finally:
            _continue_stopped_runtime_stages()  # on failure: else aclose would wait on the engine
