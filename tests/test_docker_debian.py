"""The Docker backend on a real Debian userland: what the busybox test image cannot show.

The image is the Debian test image of ``tests/debian_image.py`` (minbase bookworm from
``mmdebstrap``: coreutils, GNU grep, procps, python3, the non-root user ``dshuser`` in
``/etc/passwd``). Each test runs in image mode (the executor's own container) and container mode
(the session's container of that image). The conformance kit runs on it too
(``tests/test_conformance_docker.py``, the ``debian-`` rows). Skips with ``backend unavailable:``
(a failure when ``CI=true``) when no engine answers or the image is missing and cannot be built.

Timeouts: the first test to use the image may build it (28-43 s here when
``.ci/run`` has not), so each test's limit allows for that; the tests themselves take seconds.
"""

from __future__ import annotations

import pathlib
import re
import secrets
import shutil
from typing import Any

import anyio
import debian_image
import pytest
from debian_image import USER, USER_UID
from docker_support import BACKEND_UNAVAILABLE, SESSION_ID, SESSION_LABEL, DockerMode
from dsh_bash_docker import DockerBashExecutor, DockerConfig
from interactive_support import drive_python_repl

from dsh_bash import BashExecRequest

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.timeout(120 + 300)]

MODES: list[DockerMode] = ["image", "container"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _executor(mode: DockerMode, request: pytest.FixtureRequest, **fields: Any) -> DockerBashExecutor:
    """An executor on the Debian image (``image``) or the session's container of it (``container``)."""
    if mode == "image":
        image: str = request.getfixturevalue("docker_debian_image")
        labels = {SESSION_LABEL: SESSION_ID}  # removed at session end even if the test fails
        return DockerBashExecutor(DockerConfig(image=image, grace_ms=300, labels=labels, **fields))
    container: str = request.getfixturevalue("docker_debian_container")
    return DockerBashExecutor(DockerConfig(container=container, grace_ms=300, **fields))


async def _until(ex: DockerBashExecutor, command: str, text: str, exit_code: int = 0) -> None:
    """Run ``command`` until it prints ``text`` with ``exit_code`` (10 s at most)."""
    with anyio.fail_after(10):
        while True:
            result = await ex.exec(command)
            if (result.exit_code, result.stdout.text) == (exit_code, text):
                return
            await anyio.sleep(0.1)  # processes in a container: nothing notifies their start or end


@pytest.mark.parametrize("containment", ["auto", "marker"])
@pytest.mark.parametrize("mode", MODES)
async def test_procps_tools_work_and_kills_leave_nothing(
    mode: DockerMode, containment: str, request: pytest.FixtureRequest
) -> None:
    """procps' ``ps``, ``pgrep`` and ``pkill`` see the command's processes; a kill of a task with
    children (by the supervisor, or with ``marker`` by the kill script's ``/proc/*/environ`` scan,
    which takes GNU grep's ``-z -H -F`` pass here) leaves none of them, as ``pgrep`` shows."""
    seconds = 3000 + secrets.randbelow(1000)  # this test's own sleeps, in a container others share
    # A regex matching the sleeps' whole command line only: not the bash that started them, nor any
    # command line that contains the pattern itself.
    pattern = f"^sleep {seconds}[.]5$"
    async with _executor(mode, request, containment=containment) as ex:
        assert ex.containment == ("subreaper" if containment == "auto" else "marker")
        tools = await ex.exec("command -v ps pgrep pkill; ps --version; ps -o pid= -p $$; echo $$")
        assert tools.exit_code == 0, tools
        lines = tools.stdout.text.split("\n")
        assert lines[:3] == ["/usr/bin/ps", "/usr/bin/pgrep", "/usr/bin/pkill"]
        assert lines[3].startswith("ps from procps-ng")
        assert lines[4].strip() == lines[5]  # ps reports the command's own bash

        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"sleep {seconds}.5 & sleep {seconds}.5 & wait"))
        )
        await _until(ex, f"pgrep -c -f '{pattern}'", "2\n")
        assert await ex.kill(task.id)
        with anyio.fail_after(10):
            await task.wait()
        assert task.status == "killed"
        left = await ex.exec(f"pgrep -a -f '{pattern}'")
        assert (left.exit_code, left.stdout.text) == (1, ""), left

        # pkill from one command reaches what another left (a background task's: a foreground run's
        # leftovers are killed when it ends).
        leaver = await ex.start(ex.resolve(BashExecRequest(command=f"sleep {seconds}.5 > /dev/null 2>&1 &")))
        with anyio.fail_after(10):
            await leaver.wait()
        killed = await ex.exec(f"pkill -e -f '{pattern}'")
        assert killed.exit_code == 0, killed
        assert re.fullmatch(r"sleep killed \(pid \d+\)\n", killed.stdout.text), killed
        await _until(ex, f"pgrep -f '{pattern}'", "", exit_code=1)


@pytest.mark.parametrize("mode", MODES)
async def test_configured_user_from_etc_passwd(mode: DockerMode, request: pytest.FixtureRequest) -> None:
    """``DockerConfig(user=NAME)`` with a name from the image's /etc/passwd: commands, their home
    directory and the files they make are that user's; spill files work under it."""
    async with _executor(mode, request, user=USER, max_output_bytes=100) as ex:
        who = await ex.exec("id -un; id -u; echo $HOME; cd ~ && pwd && touch mine && stat -c %U mine")
        assert who.stdout.text == f"{USER}\n{USER_UID}\n/home/{USER}\n/home/{USER}\n{USER}\n", who
        assert (await ex.exec("rm ~/mine")).exit_code == 0
        spilled = await ex.exec("head -c 1000 /dev/zero | tr '\\0' x")
        assert spilled.stdout.spill_path is not None and spilled.stdout.total_bytes == 1000
        owner = await ex.exec(f"stat -c %U {spilled.stdout.spill_path}; wc -c < {spilled.stdout.spill_path}")
        assert owner.stdout.text == f"{USER}\n1000\n", owner
        denied = await ex.exec("touch /etc/not-mine")
        assert denied.exit_code == 1 and "Permission denied" in denied.stderr.text, denied


@pytest.mark.parametrize("mode", MODES)
async def test_per_command_user_from_etc_passwd(mode: DockerMode, request: pytest.FixtureRequest) -> None:
    """``BashExecRequest(user=NAME)`` runs that one command as the /etc/passwd user (foreground and
    background, and a kill of its task works); the next command is root's again."""
    seconds = 3000 + secrets.randbelow(1000)
    async with _executor(mode, request) as ex:
        as_user = await ex.exec("id -un; echo $HOME; ps -o user= -p $$", user=USER)
        assert as_user.stdout.text == f"{USER}\n/home/{USER}\n{USER}\n", as_user
        assert (await ex.exec("id -un")).stdout.text == "root\n"
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"sleep {seconds}.5 & sleep {seconds}.5 & wait", user=USER))
        )
        await _until(ex, f"pgrep -c -u {USER} -f '^sleep {seconds}[.]5$'", "2\n")
        assert await ex.kill(task.id)
        with anyio.fail_after(10):
            await task.wait()
        assert task.status == "killed"
        assert (await ex.exec(f"pgrep -f '^sleep {seconds}[.]5$'")).exit_code == 1


@pytest.mark.parametrize("mode", MODES)
async def test_python3_round_trip(mode: DockerMode, request: pytest.FixtureRequest) -> None:
    """``python3 -c``: stdin in, text and raw bytes out on both streams, its exit status; output past
    the in-memory limit goes whole to the spill file."""
    script = (
        "import sys; text = sys.stdin.read(); sys.stdout.write(text[::-1]); "
        "sys.stderr.write(str(len(text)) + ' chars\\n'); sys.exit(7)"
    )
    async with _executor(mode, request, max_output_bytes=4096) as ex:
        text = await ex.exec(f'python3 -c "{script}"', stdin="héllo wörld ✓")
        assert (text.exit_code, text.stdout.text, text.stderr.text) == (7, "✓ dlröw olléh", "13 chars\n")
        raw = await ex.exec("python3 -c 'import sys; sys.stdout.buffer.write(bytes(range(256)))'")
        assert raw.exit_code == 0 and raw.stdout.data == bytes(range(256)), raw
        big = await ex.exec("python3 -c 'import sys; sys.stdout.write(\"0123456789\" * 100_000)'")
        assert big.stdout.truncated and big.stdout.total_bytes == 1_000_000
        assert big.stdout.spill_path is not None
        count = "import sys; print(len(open(sys.argv[1]).read()))"
        back = await ex.exec(f"python3 -c '{count}' {big.stdout.spill_path}")
        assert back.stdout.text == "1000000\n", back


@pytest.mark.parametrize("mode", MODES)
async def test_no_host_secret_in_env(
    mode: DockerMode, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of the harness's environment reaches the container: coreutils' ``env`` shows no host
    variable; in image mode a scrubbed ``environment`` entry is in no process of the container
    (every ``/proc/*/environ``, read by python3 as root), while a plain one is in ``env``."""
    host_secret = f"host-secret-{secrets.token_hex(8)}"
    config_secret = f"config-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("DSH_TEST_HOST_SECRET", host_secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", host_secret)
    fields: dict[str, Any] = (
        {"environment": {"API_TOKEN": config_secret, "PLAIN_SETTING": "visible"}} if mode == "image" else {}
    )
    async with _executor(mode, request, **fields) as ex:
        shown = await ex.exec("env; echo; /usr/bin/env -0 | tr '\\0' '\\n'")
        assert shown.exit_code == 0, shown
        assert host_secret not in shown.stdout.text
        assert "DSH_TEST_HOST_SECRET" not in shown.stdout.text
        assert "AWS_SECRET_ACCESS_KEY" not in shown.stdout.text
        if mode == "image":
            assert "PLAIN_SETTING=visible\n" in shown.stdout.text
            assert config_secret not in shown.stdout.text
            scan = (
                "import glob\n"
                "for path in glob.glob('/proc/[0-9]*/environ'):\n"
                "    try:\n"
                "        data = open(path, 'rb').read()\n"
                "    except OSError:\n"
                "        continue\n"
                # The secrets reversed: this script's own environment (SCAN) must not hold them.
                f"    if b'{config_secret[::-1]}'[::-1] in data or b'{host_secret[::-1]}'[::-1] in data:\n"
                "        print(path)\n"
                "print('scanned')\n"
            )
            found = await ex.exec('python3 -c "$SCAN"', env={"SCAN": scan})
            assert found.stdout.text == "scanned\n", found


def test_missing_image_without_mmdebstrap_names_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """On a machine with a docker CLI but no mmdebstrap, and no image of the current recipe, the
    reason (the fixtures' skip, ``backend unavailable: ...``, a failure when ``CI=true``) says what
    is missing and how to get it; a present image needs no mmdebstrap."""
    docker_cli = shutil.which("docker")
    if docker_cli is None:
        pytest.skip(f"{BACKEND_UNAVAILABLE} the docker CLI is not installed")
    (tmp_path / "docker").symlink_to(docker_cli)
    monkeypatch.setenv("PATH", str(tmp_path))  # docker, and nothing else: no mmdebstrap
    if debian_image.image_exists():
        assert debian_image.unavailable() is None
    absent = f"dsh-bash-test-debian-absent-{secrets.token_hex(4)}"
    monkeypatch.setattr(debian_image, "IMAGE_REPOSITORY", absent)  # the tag of a recipe never built
    reason = debian_image.unavailable()
    assert reason is not None
    assert reason.startswith(f"the Debian test image {absent}:")
    assert "is not built and mmdebstrap is not found (apt-get install mmdebstrap" in reason


@pytest.mark.parametrize("mode", MODES)
async def test_python_repl_through_a_terminal(mode: DockerMode, request: pytest.FixtureRequest) -> None:
    """Issue 17's drive: `python3 -i` on a terminal task: an expression in, its value out, Ctrl-D ends it."""
    async with _executor(mode, request) as ex:
        await drive_python_repl(ex)
