"""read_file/write_file on the Docker backend, beyond the kit's checks: a rewritten file keeps its mode
and the archive's temporary name leaves nothing behind; a command user other than root moves files
with that user's permissions (the supervisor's file mode), or not at all without the supervisor
(``files_unsupported``). The kit's `file-*` checks run in test_conformance_docker (as root, and as
uid 65534)."""

from __future__ import annotations

from functools import partial

import pytest
from docker_support import docker_config
from dsh_bash_docker import DockerBashExecutor

from dsh_bash import BashInfrastructureError, FileOperationError

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_rewritten_file_keeps_its_mode_and_leaves_no_temporary_file(docker_test_image: str) -> None:
    async with DockerBashExecutor(docker_config(docker_test_image)) as ex:
        made = await ex.exec("printf old > /tmp/mine && chmod 640 /tmp/mine")
        assert made.exit_code == 0, made.stderr.text
        await ex.write_file("/tmp/mine", b"new")
        seen = await ex.exec(
            "stat -c %a /tmp/mine; cat /tmp/mine; ls -A /tmp | grep -c '^[.]dsh-bash-.*[.]tmp$'"
        )
        assert seen.stdout.text == "640\nnew0\n"


async def test_files_of_another_user_than_root_move_with_its_permissions(docker_test_image: str) -> None:
    """Through the supervisor's file mode, exec'd as the user: what the user may not read or write
    stays unread and unwritten, though the engine (root) could; root's requests use the archive API."""
    async with DockerBashExecutor(docker_config(docker_test_image, user="65534")) as ex:
        made = await ex.exec(
            "printf secret > /tmp/root-only && chmod 600 /tmp/root-only && mkdir -m 755 /tmp/roots"
            " && printf open > /tmp/roots/readable",
            user="0",
        )
        assert made.exit_code == 0, made.stderr.text
        for call in (
            partial(ex.read_file, "/tmp/root-only"),
            partial(ex.write_file, "/tmp/root-only", b"x"),
            partial(ex.write_file, "/tmp/roots/new", b"x"),
        ):
            with pytest.raises(FileOperationError) as refused:
                await call()
            assert refused.value.reason == "permission_denied"
        assert await ex.read_file("/tmp/roots/readable") == b"open"
        assert await ex.read_file("/tmp/root-only", user="0") == b"secret"
        await ex.write_file("/tmp/mine/deep", b"\x00mine\xff", make_parents=True)
        seen = await ex.exec("stat -c %u /tmp/mine /tmp/mine/deep; cat /tmp/root-only")
        assert seen.stdout.text == "65534\n65534\n" and "Permission denied" in seen.stderr.text
        assert await ex.read_file("/tmp/mine/deep") == b"\x00mine\xff"


async def test_without_the_supervisor_files_of_another_user_than_root_are_refused(
    docker_test_image: str,
) -> None:
    async with DockerBashExecutor(docker_config(docker_test_image, user="65534", containment="marker")) as ex:
        with pytest.raises(BashInfrastructureError) as refused:
            await ex.read_file("/tmp/anything")
        assert refused.value.reason == "files_unsupported"
        await ex.write_file("/tmp/roots", b"root's", user="0")  # root's: the archive API
        assert await ex.read_file("/tmp/roots", user="0") == b"root's"
