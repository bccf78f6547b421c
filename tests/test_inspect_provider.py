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

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
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
from inspect_ai.util import SandboxEnvironment

# The checks themselves, collected as this module's tests (inspect's documented way to reuse them).
from inspect_ai.util._sandbox.self_check import *  # noqa: F403
from ssh_support import BACKEND_UNAVAILABLE, SshServer

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
        "commands run as one non-root login, which cannot switch users (the executor has no "
        "per-command user; the provider switches with runuser only when commands run as root)"
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
    """The Debian test image (tests/sshd_image.py): a real userland with adduser, runuser, ps."""
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    from sshd_image import build_image  # noqa: PLC0415

    try:
        return build_image()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"{BACKEND_UNAVAILABLE} the Debian test image cannot be built: {exc}")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # inspect runs on asyncio, and the SSH backend needs it


@pytest.fixture(scope="module", params=["local", "docker-image", "docker-container", "ssh"])
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
            # modes hold and no user switch is possible.
            config = {
                "backend": "docker",
                "container": container.get_wrapped_container().id,
                "user": "nobody",
            }
            yield Backend(name, config, _NO_USER_SWITCH)
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
