"""inspect_ai's own sandbox self-check, unmodified, against the ``dsh-bash`` provider on every backend.

inspect ships the checks in ``inspect_ai.util._sandbox.self_check`` for third-party providers: a
module imports them and defines a function-scoped ``sandbox_env`` fixture. Here one sandbox (one
sample: ``sample_init`` .. ``sample_cleanup``) per backend serves all checks, and the checks a
backend cannot pass are marked expected-to-fail (strict) with the reason, as inspect does for its
own providers; integrations/inspect_ai/README.md lists them.

Without inspect-ai installed the module skips (``pip install 'dsh-bash[inspect]'``), except in CI
(``CI=true``), where ``.ci/run`` installs the extra and a missing inspect-ai fails the run.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

try:
    import inspect_ai  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(
        "inspect-ai is not installed (pip install 'dsh-bash[inspect]'); CI installs it",
        allow_module_level=True,
    )

from docker_support import SESSION_ID, SESSION_LABEL, docker_available, start_idle_container
from dsh_bash_inspect import DshBashSandboxEnvironment
from inspect_ai.util import SandboxEnvironment, SandboxEnvironmentLimits

# The checks themselves, collected as this module's tests (inspect's documented way to reuse them).
from inspect_ai.util._sandbox.self_check import *  # noqa: F403
from ssh_support import BACKEND_UNAVAILABLE, SshServer

from dsh_bash import ConfigError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

#: Root reads and writes files whatever their mode (CAP_DAC_OVERRIDE), as inspect notes for its own
#: docker-as-root provider.
_ROOT_IGNORES_MODES = {
    "test_read_file_not_allowed": "root (with CAP_DAC_OVERRIDE) reads a file without read permission",
    "test_write_text_file_without_permissions": "root (with CAP_DAC_OVERRIDE) overwrites a read-only file",
    "test_write_binary_file_without_permissions": "root (with CAP_DAC_OVERRIDE) overwrites a read-only file",
}
_NO_USER_SWITCH = {
    "test_exec_as_user": (
        "commands run as one non-root login, which cannot switch users (the backend refuses a "
        "per-command user, user_unsupported; the provider switches with runuser only as root)"
    ),
}

#: The image-mode container gets back the capabilities adduser and runuser need (the Docker backend
#: drops all by default). adduser needs CAP_DAC_OVERRIDE too (it writes into the home it has just
#: given away), so root there ignores file modes.
_IMAGE_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID"]


@dataclass
class Backend:
    name: str
    config: dict[str, Any]
    xfails: dict[str, str] = field(default_factory=dict)


def _toml(fields: dict[str, Any]) -> str:
    def value(item: Any) -> str:
        if isinstance(item, str):
            return '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(item, list):
            return "[" + ", ".join(value(x) for x in item) + "]"
        if isinstance(item, dict):
            return "{" + ", ".join(f"{value(k)} = {value(v)}" for k, v in item.items()) + "}"
        return str(item).lower() if isinstance(item, bool) else str(item)

    return "".join(f"{name} = {value(item)}\n" for name, item in fields.items())


def _debian_image() -> str:
    """The Debian test image (tests/debian_image.py): a real userland with adduser, runuser, ps."""
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    from debian_image import build_image  # noqa: PLC0415

    try:
        return build_image()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"{BACKEND_UNAVAILABLE} the Debian test image cannot be built: {exc}")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # inspect runs on asyncio, and the SSH backend needs it


@pytest.fixture(
    scope="module",
    params=[
        "local",
        pytest.param("docker-image", marks=pytest.mark.docker),
        pytest.param("docker-container", marks=pytest.mark.docker),
        pytest.param("ssh", marks=pytest.mark.ssh),
    ],
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name: str = request.param
    if name == "local":
        root = os.geteuid() == 0
        yield Backend("local", {"backend": "local"}, dict(_ROOT_IGNORES_MODES if root else _NO_USER_SWITCH))
    elif name == "docker-image":
        image = _debian_image()
        config = {
            "backend": "docker",
            "image": image,
            "cap_add": _IMAGE_CAPS,
            "labels": {SESSION_LABEL: SESSION_ID},
        }
        yield Backend(name, config, _ROOT_IGNORES_MODES)
    elif name == "docker-container":
        image = _debian_image()
        container = start_idle_container(image)
        try:
            # Commands run as a non-root user of the image here (image mode runs as root), so file
            # modes hold; another user (root, to add one) is the exec's (the per-command user).
            config = {
                "backend": "docker",
                "container": container.get_wrapped_container().id,
                "user": "nobody",
            }
            yield Backend(name, config)
        finally:
            container.stop()
    else:
        server: SshServer = request.getfixturevalue("ssh_server")
        yield Backend(name, {"backend": "ssh", **server.config()}, _NO_USER_SWITCH)


@pytest.fixture(scope="module")
async def sample(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxEnvironment]:
    """One sample's sandbox, made from a config file exactly as ``sandbox=("dsh-bash", FILE)`` would."""
    config = tmp_path_factory.mktemp(f"inspect-{backend.name}") / "sandbox.toml"
    config.write_text(_toml(backend.config))
    task = f"self-check-{backend.name}"
    await DshBashSandboxEnvironment.task_init(task, str(config))
    environments = await DshBashSandboxEnvironment.sample_init(task, str(config), {})
    try:
        yield environments["default"]
    finally:
        await DshBashSandboxEnvironment.sample_cleanup(task, str(config), environments, False)
        await DshBashSandboxEnvironment.task_cleanup(task, str(config), True)


@pytest.fixture
def sandbox_env(
    request: pytest.FixtureRequest, backend: Backend, sample: SandboxEnvironment
) -> SandboxEnvironment:
    reason = backend.xfails.get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    return sample


# -- the provider's own translations (local backend; beyond what the self-check asks) ----------------


@pytest.fixture
async def local_sandbox(tmp_path: Path) -> AsyncIterator[DshBashSandboxEnvironment]:
    config = tmp_path / "local.toml"
    config.write_text('backend = "local"\ntimeout_ms = 3000\n')
    environments = await DshBashSandboxEnvironment.sample_init("translations", str(config), {})
    env = environments["default"]
    assert isinstance(env, DshBashSandboxEnvironment)
    try:
        yield env
    finally:
        await DshBashSandboxEnvironment.sample_cleanup("translations", str(config), environments, False)


async def test_signal_death_is_128_plus_n(local_sandbox: DshBashSandboxEnvironment) -> None:
    result = await local_sandbox.exec(["bash", "-c", "kill -KILL $$"])
    assert (result.returncode, result.success) == (137, False)


async def test_configured_timeout_raises_timeout_error(local_sandbox: DshBashSandboxEnvironment) -> None:
    # No timeout given: the config's timeout_ms (3 s here) applies, and inspect's TimeoutError says so.
    with pytest.raises(TimeoutError):
        await local_sandbox.exec(["sleep", "30"])


async def test_timeout_above_the_configured_cap_is_honoured(local_sandbox: DshBashSandboxEnvironment) -> None:
    local_sandbox.executor.reconfigure(max_timeout_ms=3000)
    result = await local_sandbox.exec(["sh", "-c", "sleep 4; echo done"], timeout=10)
    assert result.stdout == "done\n"


async def test_missing_cwd_is_file_not_found(local_sandbox: DshBashSandboxEnvironment) -> None:
    with pytest.raises(FileNotFoundError):
        await local_sandbox.exec(["true"], cwd="/nonexistent/dsh-bash-inspect")


async def test_arguments_reach_the_command_verbatim(local_sandbox: DshBashSandboxEnvironment) -> None:
    words = ["$HOME", "`id`", "'quoted'", '"double"', "a b", "new\nline", "*", ""]
    result = await local_sandbox.exec(["printf", "%s\\0", *words])
    assert result.stdout.split("\0")[:-1] == words


async def test_output_beyond_inspects_limit_keeps_the_tail(local_sandbox: DshBashSandboxEnvironment) -> None:
    # inspect's exec limit per stream (10 MiB by default); the executor keeps that much, then the tail.
    limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
    result = await local_sandbox.exec(["sh", "-c", f"head -c {limit} /dev/zero | tr '\\0' a; echo END"])
    assert len(result.stdout) == limit
    assert result.stdout.endswith("aEND\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs commands that run as root")
async def test_user_switch_keeps_path_and_env(local_sandbox: DshBashSandboxEnvironment) -> None:
    result = await local_sandbox.exec(
        ["sh", "-c", 'echo "$(id -un) $GREETING $PATH"'],
        user="nobody",
        env={"GREETING": "hi", "PATH": "/opt/dsh-bash-inspect-test:/usr/bin:/bin"},
        cwd="/",
    )
    assert result.stdout == "nobody hi /opt/dsh-bash-inspect-test:/usr/bin:/bin\n", result.stderr


async def test_sample_directory_is_private_and_removed(tmp_path: Path) -> None:
    config = tmp_path / "local.toml"
    config.write_text('backend = "local"\n')
    environments = await DshBashSandboxEnvironment.sample_init("private", str(config), {})
    env = environments["default"]
    assert isinstance(env, DshBashSandboxEnvironment)
    await env.write_file("left-behind", "x")
    workdir = Path(env.workdir)
    assert (workdir / "left-behind").is_file()
    assert workdir.stat().st_mode & 0o777 == 0o700
    await DshBashSandboxEnvironment.sample_cleanup("private", str(config), environments, True)
    assert not workdir.exists()


# -- found through inspect's entry point; the example; a cancelled eval ------------------------------

_REPO = Path(__file__).resolve().parent.parent


def _inspect_env() -> dict[str, str]:
    """The environment of an inspect subprocess: offline, no log viewer, this checkout's packages."""
    env = dict(os.environ)
    env["INSPECT_DISPLAY"] = "plain"
    env.pop("DSH_BASH_MARK", None)
    return env


@pytest.mark.timeout(60)
def test_entry_point_finds_the_provider() -> None:
    # A fresh interpreter that imports nothing of ours: inspect's registry finds "dsh-bash" by itself.
    code = (
        "import sys\n"
        "from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
        "cls = registry_find_sandboxenv('dsh-bash')\n"
        "print(cls.__module__, cls.__name__)\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert found.stdout.strip() == "dsh_bash_inspect._sandbox DshBashSandboxEnvironment", found.stderr


@pytest.mark.timeout(120)
def test_example_eval_runs_offline() -> None:
    ran = subprocess.run(
        [sys.executable, str(_REPO / "examples" / "inspect_eval" / "run.py")],
        capture_output=True,
        text=True,
        timeout=110,
        env=_inspect_env(),
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "sandbox output: '1\\nHELLO FROM THE SANDBOX\\n'" in ran.stdout
    assert "score: C" in ran.stdout


_CANCEL_TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.solver import Generate, Solver, TaskState, solver
from inspect_ai.util import sandbox


@solver
def hang() -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        # A command that leaves its process group (setsid) and one that waits: both must die.
        await sandbox().exec(["bash", "-c", "setsid sleep {escapee} & sleep {waiter}"], timeout=600)
        return state

    return solve


@task
def cancel_me() -> Task:
    return Task(dataset=[Sample(input="x")], solver=hang(), sandbox=("dsh-bash", "sandbox.toml"))
"""


# `inspect eval` run through this: SIGINT at its default (see below); SIGUSR2 prints every thread's
# stack and SIGUSR1 every asyncio task's await chain (what a hung eval would wait for).
_DUMPING_INSPECT = """
import asyncio, faulthandler, runpy, signal, sys

def dump_tasks(signum, frame):
    # Who handles SIGINT now (asyncio's runner, uvicorn's, ignored?), and the kernel's view of it.
    print(f"--- SIGINT handler: {signal.getsignal(signal.SIGINT)!r}", file=sys.stderr)
    with open("/proc/self/status") as status:
        print("".join(l for l in status if l.startswith(("SigBlk", "SigIgn", "SigCgt"))), file=sys.stderr)
    loop = asyncio._get_running_loop()
    for task in asyncio.all_tasks(loop) if loop is not None else ():
        # Each task's whole await chain (print_stack shows only its outermost coroutine).
        chain, coro = [], task.get_coro()
        while coro is not None:
            code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
            frame_ = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if code is not None:
                line = frame_.f_lineno if frame_ is not None else "?"
                chain.append(f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{line} {code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        print(f"--- {task.get_name()}: " + " > ".join(chain), file=sys.stderr)
    sys.stderr.flush()

faulthandler.register(signal.SIGUSR2, all_threads=True)
signal.signal(signal.SIGUSR1, dump_tasks)
# The eval stands for a user's foreground command, which Ctrl-C interrupts. A harness started in the
# background by a non-interactive shell (`nohup .ci/run &`) passes SIGINT on ignored, Python keeps it
# ignored, and the SIGINT below would then do nothing (the "hang" this test once met in such runs).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv = ["inspect", *sys.argv[1:]]
runpy.run_module("inspect_ai", run_name="__main__")
"""


def _host_processes(needle: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(entry.name)
    return found


def _container_processes(label: str, needle: str) -> list[str] | None:
    """Processes of the labelled container whose command line holds ``needle``; None: no container."""
    import docker  # noqa: PLC0415

    client = docker.from_env()
    try:
        # docker-py lists the ids, then inspects each: one removed in between (the executor removes
        # its container when the eval is cancelled) is gone, as if it had not been listed.
        containers = client.containers.list(all=True, filters={"label": label})
        if not containers:
            return None
        top = containers[0].top(ps_args="-eo pid,args") if containers[0].status == "running" else {}
        return [row[0] for row in top.get("Processes") or [] if needle in row[-1]]
    except docker.errors.NotFound:
        return None
    except docker.errors.APIError as exc:
        if exc.status_code != 409:  # 409: it stopped between the look at its status and `top`
            raise
        return []
    finally:
        client.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["local", pytest.param("docker-image", marks=pytest.mark.docker)])
def test_cancelled_eval_leaves_nothing(where: str, tmp_path: Path) -> None:
    """SIGINT to `inspect eval` mid-command: the command, its escapee, the sample's directory and (image
    mode) the container are gone when inspect exits."""
    token = secrets.token_hex(4)
    seconds = 4000 + int(token, 16) % 1000
    escapee, waiter = f"{seconds}.17", f"{seconds}.18"
    (tmp_path / "cancel_task.py").write_text(_CANCEL_TASK.format(escapee=escapee, waiter=waiter))
    label = f"dsh-bash-test.inspect-cancel={token}"
    if where == "local":
        fields: dict[str, Any] = {"backend": "local"}
    else:
        fields = {
            "backend": "docker",
            "image": _debian_image(),
            "labels": {SESSION_LABEL: SESSION_ID, "dsh-bash-test.inspect-cancel": token},
        }
    (tmp_path / "sandbox.toml").write_text(_toml(fields))
    before = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("dsh-bash-inspect.")}

    def running() -> list[str]:
        if where == "local":
            return _host_processes(f"sleep {waiter}") + _host_processes(f"sleep {escapee}")
        return _container_processes(label, "sleep ") or []

    command = [sys.executable, "-c", _DUMPING_INSPECT, "eval", "cancel_task.py", "--model", "mockllm/model"]
    command += ["--log-dir", str(tmp_path / "logs")]
    inspect_run = subprocess.Popen(
        command, cwd=tmp_path, env=_inspect_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 90
        while len(running()) < 2:
            assert inspect_run.poll() is None, inspect_run.communicate()[0].decode(errors="replace")
            assert time.monotonic() < deadline, "the sample's command did not start within 90 s"
            time.sleep(0.2)
        inspect_run.send_signal(signal.SIGINT)
        try:
            output = inspect_run.communicate(timeout=45)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            # Where it hangs: shown in pytest's warnings summary, then the test fails.
            inspect_run.send_signal(signal.SIGUSR2)
            inspect_run.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                inspect_run.communicate(timeout=5)
            inspect_run.kill()
            dump = inspect_run.communicate()[0].decode(errors="replace")
            warnings.warn(f"inspect eval hung after SIGINT; its stacks:\n{dump[-30000:]}", stacklevel=1)
            raise
    finally:
        if inspect_run.poll() is None:
            inspect_run.kill()
            inspect_run.wait()
    assert "interrupted" in output.lower(), output
    assert running() == []
    if where == "local":
        assert _host_processes(f"sleep {escapee}") == []
        after = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("dsh-bash-inspect.")}
        assert after - before == set()
    else:
        assert _container_processes(label, "sleep") is None, "the sample's container is still there"


async def test_connection_where_the_backend_has_one(backend: Backend, sample: SandboxEnvironment) -> None:
    """Docker: a docker exec into the sample's container; SSH: an ssh to the host; local: none."""
    assert isinstance(sample, DshBashSandboxEnvironment)
    if backend.name == "local":
        with pytest.raises(NotImplementedError):
            await sample.connection()
        return
    connection = await sample.connection()
    assert connection.type == "dsh-bash"
    if backend.name.startswith("docker"):
        container_id = getattr(sample.executor, "container_id", None)
        assert connection.container == container_id
        assert connection.command.startswith("docker exec -it ")
        assert f"{container_id} bash" in connection.command
    else:
        config = backend.config
        assert connection.command.startswith(f"ssh -t -p {config['port']} -i ")
        assert f"{config['username']}@{config['host']}" in connection.command


async def test_task_init_refuses_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('backend = "local"\ntimeout_ms = -1\n')
    with pytest.raises(ConfigError, match="timeout_ms"):
        await DshBashSandboxEnvironment.task_init("bad", str(config))


@pytest.mark.docker
@pytest.mark.timeout(60)
async def test_a_uid_without_a_name(tmp_path: Path) -> None:
    """Docker's user may be a bare uid with no passwd entry: GNU `id -un` prints the uid and fails."""
    container = start_idle_container(_debian_image())
    try:
        config = tmp_path / "uid.toml"
        config.write_text(
            _toml({"backend": "docker", "container": container.get_wrapped_container().id, "user": "4242"})
        )
        environments = await DshBashSandboxEnvironment.sample_init("uid", str(config), {})
        try:
            env = environments["default"]
            assert isinstance(env, DshBashSandboxEnvironment)
            assert (env.uid, env.user_name) == (4242, "4242")
            assert env.workdir.startswith("/tmp/dsh-bash-inspect.")
            await env.write_file("bytes", b"\x00\xff")
            assert await env.read_file("bytes", text=False) == b"\x00\xff"
            assert (await env.exec(["id", "-u"], user="4242")).stdout == "4242\n"
        finally:
            await DshBashSandboxEnvironment.sample_cleanup("uid", str(config), environments, False)
    finally:
        container.stop()
