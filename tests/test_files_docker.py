"""read_file/write_file on the Docker backend, beyond the kit's checks: a rewritten file keeps its mode
and the archive's temporary name leaves nothing behind, and a command user other than root is refused
until its own path exists (``files_unsupported``). The kit's `file-*` checks run in
test_conformance_docker."""

from __future__ import annotations

import pytest
from docker_support import SESSION_ID, SESSION_LABEL
from dsh_bash_docker import DockerBashExecutor, DockerConfig

from dsh_bash import BashInfrastructureError

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _config(image: str, **fields: object) -> DockerConfig:
    return DockerConfig(image=image, grace_ms=300, labels={SESSION_LABEL: SESSION_ID}, **fields)  # type: ignore[arg-type]


async def test_a_rewritten_file_keeps_its_mode_and_leaves_no_temporary_file(docker_test_image: str) -> None:
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        made = await ex.exec("printf old > /tmp/mine && chmod 640 /tmp/mine")
        assert made.exit_code == 0, made.stderr.text
        await ex.write_file("/tmp/mine", b"new")
        seen = await ex.exec(
            "stat -c %a /tmp/mine; cat /tmp/mine; ls -A /tmp | grep -c '^[.]dsh-bash-.*[.]tmp$'"
        )
        assert seen.stdout.text == "640\nnew0\n"


async def test_commands_of_another_user_than_root_move_no_files_yet(docker_test_image: str) -> None:
    async with DockerBashExecutor(_config(docker_test_image, user="65534")) as ex:
        with pytest.raises(BashInfrastructureError) as refused:
            await ex.read_file("/etc/passwd")
        assert refused.value.reason == "files_unsupported"
    async with DockerBashExecutor(_config(docker_test_image)) as ex:
        with pytest.raises(BashInfrastructureError) as refused:
            await ex.write_file("/tmp/x", b"x", user="65534")
        assert refused.value.reason == "files_unsupported"
