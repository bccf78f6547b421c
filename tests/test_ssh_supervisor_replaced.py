"""Issue 30, "A replaced supervisor binary": the cached ``~/.cache/dsh-bash/dsh-supervise-<sha>`` is
the login's own file, so a command can replace it; the next command, foreground or background, must
not run under what was put there.

The fake here is the worst kind: a wrapper that runs a copy of the genuine binary (which any process
of the login can read) with the command swapped for ``echo FORGED``, so its frames and signed
records are perfect and only the output and the outcome lie. Before the fix (the binary was
checked by hash only at open) the next command reported ``FORGED`` with exit 0.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from ssh_support import TEST_USER, SshServer

from dsh_bash import BashExecRequest
from dsh_bash.supervisor import supervisor_binary

pytestmark = [pytest.mark.anyio, pytest.mark.ssh]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _binary() -> bytes:
    path = supervisor_binary()
    if path is None:
        pytest.skip("no dsh-supervise for this machine (python native/build.py)")
    return path.read_bytes()


def _cached(server: SshServer) -> Path:
    return server.home / ".cache/dsh-bash" / f"dsh-supervise-{hashlib.sha256(_binary()).hexdigest()[:16]}"


@pytest.fixture
def fresh_cache(ssh_server: SshServer) -> Iterator[None]:
    shutil.rmtree(ssh_server.home / ".cache/dsh-bash", ignore_errors=True)
    yield
    shutil.rmtree(ssh_server.home / ".cache/dsh-bash", ignore_errors=True)
    (ssh_server.home / ".genuine-supervise").unlink(missing_ok=True)
    subprocess.run(["chown", "-R", f"{TEST_USER}:", str(ssh_server.home / ".cache")], check=False)


def _fake(genuine: str) -> str:
    """A dsh-supervise that runs the genuine one with the command replaced by ``echo FORGED``."""
    return (
        "#!/bin/bash\n"
        f"[[ $1 == --version ]] && exec {genuine} --version\n"
        'o=(); for a in "$@"; do [[ $a == -- ]] && break; o+=("$a"); done\n'
        f'exec {genuine} "${{o[@]}}" -- bash -c "echo FORGED"\n'
    )


def _replace_by_rename(path: Path) -> str:
    """A command that keeps a copy of the genuine binary and renames the fake over the cached one
    (in place it cannot: the supervisor running that very command makes the file busy)."""
    genuine = "$HOME/.genuine-supervise"
    cached = shlex.quote(str(path))
    new = f"{cached}.new"
    return (
        f"cp {cached} {genuine} && cat > {new} <<'EOF' && chmod 700 {new} && mv -f {new} {cached}\n"
        f"{_fake(genuine)}EOF\n"
    )


def _replace_in_place(server: SshServer, path: Path) -> None:
    """Another process of the login (nothing of the executor's runs it) writes the fake into the file."""
    genuine = server.home / ".genuine-supervise"
    shutil.copyfile(path, genuine)
    os.chmod(genuine, 0o700)
    subprocess.run(["chown", f"{TEST_USER}:", str(genuine)], check=True)
    with path.open("r+b") as file:  # the same inode: its name, owner and mode unchanged
        file.truncate(0)
        file.write(_fake(str(genuine)).encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("how", ["renamed", "in-place"])
async def test_a_replaced_supervisor_never_runs_the_next_command(
    ssh_server: SshServer, fresh_cache: None, warm: bool, how: str
) -> None:
    async with ssh_server.executor(warm_channel=warm) as ex:
        assert ex.containment == "subreaper"
        path = _cached(ssh_server)
        for kind in ("foreground", "background"):
            if how == "renamed":
                replaced = await ex.exec(_replace_by_rename(path))
                assert replaced.exit_code == 0, replaced
            else:
                _replace_in_place(ssh_server, path)
            assert b"FORGED" in path.read_bytes()
            if kind == "foreground":
                result = await ex.exec("echo mine; exit 3")
                assert (result.stdout.text, result.exit_code) == ("mine\n", 3), result
            else:
                task = await ex.start(ex.resolve(BashExecRequest(command="echo mine; exit 4")))
                with anyio.fail_after(15):
                    await task.wait()
                assert (task.exit_code, (await ex.read_output(task.id)).delta) == (4, "mine\n"), task
            # Put back: the next command's start found it replaced and installed it again. On a warm
            # channel the spares that waited already run their sealed copy (no check, and nothing
            # to find): a later spare's check finds the file replaced, and its command installs it.
            for _ in range(3 if warm else 0):
                if path.read_bytes() == _binary():
                    break
                assert (await ex.exec("echo again")).stdout.text == "again\n"
            assert path.read_bytes() == _binary()
