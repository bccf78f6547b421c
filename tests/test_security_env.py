"""Security: ambient secrets never reach commands, and no value the executor passes is on a command line.

Ambient secrets are planted where each backend's ambient environment comes from: this process's
environment (local); the image's ``ENV`` and the container's ``Env`` (Docker); the SSH login's
environment from sshd ``SetEnv``, ``~/.ssh/environment`` (``PermitUserEnvironment``) and the user's
``.bashrc`` (SSH, on an sshd of its own). A control executor with ``env_scrub=[]`` sees every planted
value, so the planting is proven to work. While commands run, a thread scans every process's
``/proc/PID/cmdline`` on this host (container processes and SSH sessions are this host's processes)
for the secrets, the values of an explicit ``env={...}`` and the stdin data; a canary put on a
command line on purpose must be seen, so a blind watch fails.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import shlex
import shutil
import subprocess
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from security_support import CmdlineWatch, make_executor, scan_environs

from dsh_bash import BashExecutor

pytestmark = [pytest.mark.faults, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _value(label: str) -> str:
    return f"{label}-{secrets.token_hex(10)}"


@dataclass
class Planted:
    """Ambient secrets planted for one backend, and how to make executors that see them."""

    secrets: dict[str, str]
    make: Callable[..., BashExecutor]
    kind: str = ""
    #: A name only this test's own server puts in its sessions' environments (SSH: its ``SetEnv``),
    #: when other planted values come from files other servers read too (the test user's
    #: ``~/.ssh/environment`` and ``.bashrc``, shared with every SSH test running at the same time).
    witness: str | None = None


# -- planting, per backend --------------------------------------------------------------------------


@pytest.fixture
def local_planted(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Planted:
    planted = {
        "DSHSEC_API_TOKEN": _value("host-token"),
        "DSHSEC_DB_PASSWORD": _value("host-password"),
        "AWS_SECRET_ACCESS_KEY": _value("host-aws"),
    }
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    return Planted(planted, lambda **fields: make_executor(request, "local", **fields))


@pytest.fixture(scope="module")
def image_with_secret(docker_test_image: str) -> Iterator[tuple[str, str, str]]:
    """(tag, name, value): the test image plus an ``ENV`` line holding a secret."""
    import docker  # noqa: PLC0415

    name, value = "DSHSEC_IMAGE_TOKEN", _value("image-token")
    dockerfile = f"FROM {docker_test_image}\nENV {name}={value}\n"
    tag = f"dsh-bash-test-secret:{hashlib.sha256(dockerfile.encode()).hexdigest()[:12]}"
    client = docker.from_env()
    try:
        context = Path(f"/tmp/dshsec-image-{os.getpid()}")
        context.mkdir(exist_ok=True)
        (context / "Dockerfile").write_text(dockerfile)
        try:
            client.images.build(path=str(context), tag=tag, pull=False, rm=True)
        finally:
            shutil.rmtree(context, ignore_errors=True)
        yield tag, name, value
        try:
            client.images.remove(tag, force=True)
        except Exception as exc:
            # A loaded engine once took over 60 s to remove it (a rehearsal's only error): a slow
            # cleanup is no test's failure.
            warnings.warn(f"removing the test image {tag} failed: {exc}", stacklevel=1)
    finally:
        client.close()


@pytest.fixture
def docker_planted(request: pytest.FixtureRequest, image_with_secret: tuple[str, str, str]) -> Planted:
    tag, image_name, image_value = image_with_secret
    container_env = {"DSHSEC_CONTAINER_KEY": _value("container-key"), "GITHUB_TOKEN": _value("gh")}
    planted = {image_name: image_value, **container_env}

    def make(**fields: Any) -> BashExecutor:
        return make_executor(request, "docker", image=tag, environment=container_env, **fields)

    return Planted(planted, make)


@pytest.fixture
def docker_container_planted(
    request: pytest.FixtureRequest, image_with_secret: tuple[str, str, str]
) -> Iterator[Planted]:
    """Container mode: an existing container (not the executor's) whose ``Env`` holds secrets."""
    from docker_support import start_idle_container  # noqa: PLC0415

    tag, image_name, image_value = image_with_secret
    container_env = {"DSHSEC_EXISTING_SECRET": _value("existing-secret")}
    container = start_idle_container(tag, container_env)
    try:

        def make(**fields: Any) -> BashExecutor:
            from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

            fields.setdefault("grace_ms", 300)
            return DockerBashExecutor(DockerConfig(container=container.get_container_id(), **fields))

        yield Planted({image_name: image_value, **container_env}, make)
    finally:
        container.stop()


@pytest.fixture(scope="module")
def ssh_env_server() -> Iterator[Any]:
    """An sshd of its own with ``SetEnv``, plus ``~/.ssh/environment`` and ``.bashrc`` exports."""
    import ssh_support  # noqa: PLC0415

    reason = ssh_support._unavailable()
    if reason is not None:
        pytest.skip(f"{ssh_support.BACKEND_UNAVAILABLE} {reason}")
    setenv_name, setenv_value = "DSHSEC_SETENV_TOKEN", _value("setenv-token")
    server = ssh_support.start_server(extra_config=f"SetEnv {setenv_name}={setenv_value}\n")
    user = pwd.getpwnam(ssh_support.TEST_USER)
    ssh_dir = Path(user.pw_dir) / ".ssh"
    ssh_dir.mkdir(exist_ok=True)
    os.chown(ssh_dir, user.pw_uid, user.pw_gid)
    environment_file = ssh_dir / "environment"
    userenv_name, userenv_value = "DSHSEC_USERENV_PASSWORD", _value("userenv-password")
    environment_file.write_text(f"{userenv_name}={userenv_value}\n")
    os.chown(environment_file, user.pw_uid, user.pw_gid)
    environment_file.chmod(0o600)
    rc_name, rc_value = "DSHSEC_RC_SECRET", _value("rc-secret")
    try:
        with server.plant({rc_name: rc_value}):
            yield server, {setenv_name: setenv_value, userenv_name: userenv_value, rc_name: rc_value}
    finally:
        environment_file.unlink(missing_ok=True)
        # Not ssh_support.stop_server: it empties the .bashrc the session's server relies on.
        server.process.terminate()
        try:
            server.process.wait(5)
        except subprocess.TimeoutExpired:
            server.process.kill()
        shutil.rmtree(server.directory, ignore_errors=True)


@pytest.fixture
def ssh_planted(ssh_env_server: Any) -> Planted:
    server, planted = ssh_env_server

    def make(**fields: Any) -> BashExecutor:
        fields.setdefault("grace_ms", 300)
        return server.executor(**fields)  # type: ignore[no-any-return]

    return Planted(planted, make, witness=next(name for name in planted if "SETENV" in name))


@pytest.fixture(params=["local", "docker", "docker_container", "ssh"])
def planted(request: pytest.FixtureRequest) -> Planted:
    value = request.getfixturevalue(f"{request.param}_planted")
    assert isinstance(value, Planted)
    value.kind = request.param
    return value


# -- the cases --------------------------------------------------------------------------------------

SHOW_ENV = "env; echo; tr '\\0' '\\n' < /proc/self/environ; echo; declare -p; echo; set"


async def test_the_planted_secrets_reach_an_unscrubbed_login(planted: Planted) -> None:
    """Control: with the scrub emptied, every planted value is in the command's environment."""
    async with planted.make(env_scrub=[]) as ex:
        result = await ex.exec(SHOW_ENV, timeout_ms=20_000)
    assert result.exit_code == 0, result
    for name, value in planted.secrets.items():
        assert f"{name}={value}" in result.stdout.text, name


async def test_ambient_secrets_are_invisible_to_commands(planted: Planted) -> None:
    async with planted.make() as ex:
        result = await ex.exec(SHOW_ENV, timeout_ms=20_000)
        background = await ex.start(_spec(ex, SHOW_ENV))
        with anyio.fail_after(20):
            await background.wait()
        read = await ex.read_output(background.id)
    assert result.exit_code == 0, result
    assert background.exit_code == 0, background
    for name, value in planted.secrets.items():
        for where, text in (("foreground", result.stdout.text), ("background", read.delta)):
            assert value not in text, f"{name} visible to a {where} command"
            assert f"{name}=" not in text, f"{name} visible to a {where} command"


def _spec(ex: BashExecutor, command: str, **fields: Any) -> Any:
    from dsh_bash import BashExecRequest  # noqa: PLC0415

    return ex.resolve(BashExecRequest(command=command, **fields))


@asynccontextmanager
async def _watching(values: list[str], canary: str) -> AsyncIterator[CmdlineWatch]:
    watch = CmdlineWatch(secrets=values, canary=canary)
    with watch.running():
        yield watch


async def test_no_secret_or_explicit_value_is_ever_on_a_command_line(planted: Planted) -> None:
    explicit = {"DSHSEC_EXPLICIT": _value("explicit"), "PLAIN_SETTING": _value("plain")}
    stdin_data = _value("stdin-data")
    canary = _value("canary")
    watched = [*planted.secrets.values(), *explicit.values(), stdin_data]
    async with _watching(watched, canary) as watch, planted.make(max_output_bytes=1000) as ex:
        with anyio.fail_after(90):
            # The canary: a process whose argv holds it, alive long enough for several scans.
            canary_run = await ex.exec(f"bash -c 'sleep 0.5; true' {canary}", timeout_ms=20_000)
            assert canary_run.exit_code == 0, canary_run
            # Explicit values arrive (the command may print them; output is no command line).
            shown = await ex.exec(
                'printf "%s|%s" "$DSHSEC_EXPLICIT" "$PLAIN_SETTING"', env=explicit, timeout_ms=20_000
            )
            assert shown.stdout.text == f"{explicit['DSHSEC_EXPLICIT']}|{explicit['PLAIN_SETTING']}"
            # stdin data
            fed = await ex.exec("cat; sleep 0.2", stdin=stdin_data, env=explicit, timeout_ms=20_000)
            assert fed.stdout.text == stdin_data
            # Spill writers: both streams outgrow the tail.
            spilled = await ex.exec(
                'for i in $(seq 300); do echo "$DSHSEC_EXPLICIT"; echo "$PLAIN_SETTING" >&2; done',
                env=explicit,
                timeout_ms=20_000,
            )
            assert spilled.stdout.spill_path is not None and spilled.stderr.spill_path is not None
            # A long command (run from a file), with the explicit env.
            long_run = await ex.exec(
                "# " + "y" * 110_000 + '\nprintf %s "$PLAIN_SETTING"', env=explicit, timeout_ms=20_000
            )
            assert long_run.stdout.text == explicit["PLAIN_SETTING"]
            # The timeout's kill sequence, against a process that traps SIGTERM.
            timed = await ex.exec("trap '' TERM; sleep 30", env=explicit, timeout_ms=800)
            assert timed.timed_out
            # A background task with an escaped (setsid) child: kill and leftover sweeps.
            task = await ex.start(_spec(ex, "setsid sleep 30 & sleep 30", env=explicit))
            await anyio.sleep(0.3)
            # Control for the orphan check below: the task's processes are found by their env.
            assert len(scan_environs(explicit["PLAIN_SETTING"].encode())) >= 2
            assert await ex.kill(task.id)
            await task.wait()
            assert task.status == "killed"
    # No orphan: every process that got the explicit env (the setsid child included) is gone.
    with anyio.fail_after(10):
        while True:
            survivors = scan_environs(explicit["PLAIN_SETTING"].encode())
            if not survivors:
                break
            await anyio.sleep(0.1)
    assert watch.scans > 50, watch.scans
    assert watch.canary_seen > 0, "the watch never saw the canary: it would not see a leak either"
    assert watch.leaks == [], watch.leaks


async def test_the_watch_catches_a_value_put_on_a_command_line(local_planted: Planted) -> None:
    """The scan above can fail: a value deliberately passed as an argument is reported."""
    leaked = _value("deliberate")
    canary = _value("canary")
    async with _watching([leaked], canary) as watch, local_planted.make() as ex:
        result = await ex.exec(f"bash -c 'sleep 0.5; true' {canary} {leaked}", timeout_ms=20_000)
    assert result.exit_code == 0
    assert watch.canary_seen > 0
    assert any(value == leaked for _, value, _ in watch.leaks), watch.leaks


async def test_docker_inspect_shows_no_explicit_value(request: pytest.FixtureRequest) -> None:
    """``docker inspect`` of the container and ``exec inspect`` of every exec show no explicit value."""
    import json  # noqa: PLC0415

    import docker  # noqa: PLC0415
    from dsh_bash_docker import DockerBashExecutor  # noqa: PLC0415

    explicit = {"DSHSEC_EXPLICIT_TOKEN": _value("explicit"), "PLAIN": _value("plain")}
    client = docker.from_env()
    try:
        async with make_executor(request, "docker", max_output_bytes=100) as ex:
            assert isinstance(ex, DockerBashExecutor)
            task = await ex.start(_spec(ex, 'yes "$PLAIN" | head -c 5000; sleep 30', env=explicit))
            await anyio.sleep(0.5)
            container = client.containers.get(ex.container_id)
            exec_ids = container.attrs.get("ExecIDs") or []
            assert exec_ids, "no exec is running: nothing was inspected"
            shown = [json.dumps(container.attrs.get(key)) for key in ("Path", "Args", "Config")]
            shown += [json.dumps(client.api.exec_inspect(exec_id)) for exec_id in exec_ids]
            await ex.kill(task.id)
            await task.wait()
    finally:
        client.close()
    # Control: the inspected exec's arguments are there (the boot script's name argument).
    assert any('"dsh-bash"' in text for text in shown[3:]), shown
    for value in explicit.values():
        assert not [text for text in shown if value in text], value


# -- the executor's own helpers ---------------------------------------------------------------------


def _scan_command(values: dict[str, str], seconds: float, witness: str | None = None) -> str:
    """A command that, for ``seconds``, lists every process whose environment it can read and that
    holds one of ``values`` (as ``NAME=VALUE``), with that process's command line.

    The entries are matched in ``/proc/PID/environ``, the environment each process was started
    with: what another process of the same user reads. Whole entries, anchored at the name: the
    command's own text (which the Docker boot script gets in DSH_BASH_COMMAND) never matches, nor
    does another test session's executor (same login, same names, other values). The command line
    is read before and after the environment and a hit counts only when both agree: an ``exec`` in
    between changes both, and the hit would be put on the wrong program. ``witness``: a hit counts
    only when the process holds that entry too (see :attr:`Planted.witness`).
    """
    for value in values.values():
        assert value.replace("-", "").isalnum(), value  # regex-safe as it is
    pattern = shlex.quote("^(" + "|".join(f"{name}={value}" for name, value in values.items()) + ")$")
    check_witness = ""
    if witness is not None:
        entry = shlex.quote(f"{witness}={values[witness]}")
        check_witness = f"    grep -q -a -z -x {entry} /proc/$p/environ 2>/dev/null || continue\n"
    return (
        "export LC_ALL=C\n"
        f"end=$((SECONDS + {int(seconds)}))\n"
        "while (( SECONDS < end )); do\n"
        # -z: entries are NUL-separated, so ^ anchors at each entry's start.
        f"  for f in $(grep -l -a -z -E {pattern} /proc/[0-9]*/environ 2>/dev/null); do\n"
        "    p=${f#/proc/}; p=${p%/environ}\n"
        "    c1=$(tr '\\0\\n' '  ' < /proc/$p/cmdline 2>/dev/null | head -c 200)\n"
        f"    grep -q -a -z -E {pattern} /proc/$p/environ 2>/dev/null || continue\n"
        "    c2=$(tr '\\0\\n' '  ' < /proc/$p/cmdline 2>/dev/null | head -c 200)\n"
        f"{check_witness}"
        '    [ -n "$c1" ] && [ "$c1" = "$c2" ] && echo "pid $p: $c1"\n'
        "  done\n"
        "  sleep 0.05\n"
        "done | sort -u\n"
        "echo scanned\n"
    )


#: The first process of an SSH session is the login shell sshd starts with ``SetEnv`` and
#: ``~/.ssh/environment`` values, ``bash -c LINE`` (LINE: what the executor sent); a helper's first
#: bash (HELPER_SCRUB) inherits what rc files exported. Each holds them only until its ``exec``
#: (a few ms): sshd makes that environment, no client can. A Docker exec starts with the
#: container's Env: the wrapper that unsets the scrubbed names holds them until its ``exec``.
_BEFORE_EXEC = (
    "bash -c ",
    "bash --noprofile --norc -c builtin declare +x ",
    "bash --noprofile --norc -c unset -v $0;",
)


async def _exercise_helpers(ex: BashExecutor, values: dict[str, str], witness: str | None) -> str:
    """Run a scan (a background task) while every helper the executor has exists: spill writers
    (both streams past max_output_bytes, the writers kept alive while the command sleeps), a
    background task and its kill, a foreground timeout and its kill sequence. The scan's report."""
    scan = await ex.start(_spec(ex, _scan_command(values, 4, witness)))
    await anyio.sleep(0.3)
    flood = (
        "head -c 70000 /dev/zero | tr '\\0' x; head -c 70000 /dev/zero | tr '\\0' y >&2; sleep 1.5; echo done"
    )
    async with anyio.create_task_group() as group:
        results: list[Any] = []

        async def run_flood() -> None:
            results.append(await ex.exec(flood, timeout_ms=20_000))

        group.start_soon(run_flood)
        task = await ex.start(_spec(ex, "sleep 30 & sleep 30"))
        await anyio.sleep(0.5)
        assert await ex.kill(task.id)
        await task.wait()
        timed = await ex.exec("trap '' TERM; sleep 30", timeout_ms=800)
        assert timed.timed_out
    flooded = results[0]
    assert flooded.exit_code == 0, flooded
    # Control: both streams spilled, so both spill writers ran while the scan did.
    assert flooded.stdout.spill_path is not None and flooded.stderr.spill_path is not None, flooded
    with anyio.fail_after(20):
        await scan.wait()
    read = await ex.read_output(scan.id)
    assert scan.exit_code == 0 and "scanned" in read.delta, (scan, read)
    return read.delta


@pytest.fixture
def docker_nobody_planted(docker_planted: Planted) -> Planted:
    """Image mode with commands (and so every exec) as uid 65534: the helpers are that user's too."""
    return Planted(docker_planted.secrets, lambda **fields: docker_planted.make(user="65534", **fields))


@pytest.fixture(params=["local", "docker", "docker_nobody", "docker_container", "ssh"])
def helper_planted(request: pytest.FixtureRequest) -> Planted:
    value = request.getfixturevalue(f"{request.param}_planted")
    assert isinstance(value, Planted)
    value.kind = request.param
    return value


async def test_no_helper_process_carries_an_ambient_secret(helper_planted: Planted) -> None:
    """Issue 15: spill writers, boot wrappers, relays, supervisors and kill scripts start with the
    scrubbed environment, so no process a command can read holds a scrubbed value (SSH: sshd
    ``SetEnv``, ``~/.ssh/environment``, ``.bashrc``; Docker: the container's ``environment`` and
    the image's ``ENV``). Container mode cannot change PID 1's environment: that one is expected."""
    async with helper_planted.make(max_output_bytes=1000) as ex:
        report = await _exercise_helpers(ex, helper_planted.secrets, helper_planted.witness)
        expected: list[str] = []
        if helper_planted.kind == "docker_container":
            # The existing container's PID 1 was started with its Env: the executor cannot change
            # that (documented). Control: the scan sees it, so it would see a helper too.
            # Neither can it change the processes of the container's own command (its idle loop).
            expected = [line for line in report.splitlines() if "sleep 3600" in line]
            assert [line for line in expected if line.startswith("pid 1:")], report
    hits = [line for line in report.splitlines() if line.startswith("pid ") and line not in expected]
    leaks = [line for line in hits if not line.split(": ", 1)[1].startswith(_BEFORE_EXEC)]
    assert leaks == [], report


async def test_helpers_follow_a_reconfigured_scrub(helper_planted: Planted) -> None:
    """Opened with ``env_scrub=[]``, then ``reconfigure`` to the default scrub: from then on the
    helpers drop the planted values too. A container the executor made while nothing was scrubbed
    got its ``environment`` whole (that is decided when it is created): its PID 1 and idle loop keep
    the values, as an existing container's do."""
    from dsh_bash import DEFAULT_ENV_SCRUB  # noqa: PLC0415

    async with helper_planted.make(max_output_bytes=1000, env_scrub=[]) as ex:
        ex.reconfigure(env_scrub=DEFAULT_ENV_SCRUB)
        report = await _exercise_helpers(ex, helper_planted.secrets, helper_planted.witness)
    expected: list[str] = []
    if helper_planted.kind.startswith("docker"):
        # PID 1 and its idle loop: the test's own container's (``sleep``), or one the executor made
        # (reading its stdin, its tie to the executor, to the end).
        idle = ("sleep 3600", "while read -r _")
        expected = [line for line in report.splitlines() if any(each in line for each in idle)]
        assert [line for line in expected if line.startswith("pid 1:")], report
    hits = [line for line in report.splitlines() if line.startswith("pid ") and line not in expected]
    leaks = [line for line in hits if not line.split(": ", 1)[1].startswith(_BEFORE_EXEC)]
    assert leaks == [], report


async def test_the_helper_scan_sees_an_unscrubbed_login(helper_planted: Planted) -> None:
    """Control for the case above: with the scrub emptied the commands themselves carry the
    values, and the same scan reports them."""
    async with helper_planted.make(max_output_bytes=1000, env_scrub=[]) as ex:
        report = await _exercise_helpers(ex, helper_planted.secrets, helper_planted.witness)
    assert [line for line in report.splitlines() if line.startswith("pid ")], report
