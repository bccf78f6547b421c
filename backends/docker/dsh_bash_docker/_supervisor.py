"""Putting dsh-supervise into the container, by the Engine API, once per executor open.

The binary goes to ``/.dsh-bash/dsh-supervise-<digest>``: a directory in ``/``, which only root can
create, holding a root-owned file of mode 0755. A command that runs as another user can neither
replace it nor plant a directory of its own there first. The archive upload (``PUT .../archive``)
writes it as root whatever the exec user; a container with a read-only root filesystem refuses
that upload, so there (image mode gives such a container a small tmpfs at ``/.dsh-bash``) it is
written by a ``cat`` exec'd as root instead. Each open checks that the binary runs and speaks this
version's protocol before any command relies on it.
"""

from __future__ import annotations

import io
import logging
import tarfile
from urllib.parse import quote

from dsh_bash.backend import SupervisorInstall
from dsh_bash.supervisor import (
    SUPERVISOR_PROTOCOL,
    supervisor_payload,
)

from ._engine import EngineClient, EngineError
from ._process import run_script

__all__ = ["INSTALL_DIR", "install_supervisor"]

log = logging.getLogger("dsh_bash.docker")

#: Where the supervisor goes in the container (image mode mounts a tmpfs here when read-only).
INSTALL_DIR = "/.dsh-bash"

# $1: the target path. Written under a temporary name first, so that a command never runs a half
# written binary.
_WRITE_AS_ROOT = r"""umask 022
mkdir -p -- "${1%/*}" && cat > "$1.part" && chmod 0755 -- "$1.part" && mv -f -- "$1.part" "$1" """


def _archive(name: str, data: bytes) -> bytes:
    """A tar holding ``.dsh-bash/NAME``: the directory 0755 and the file 0755, both owned by root."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        directory = tarfile.TarInfo(INSTALL_DIR.lstrip("/"))
        directory.type = tarfile.DIRTYPE
        directory.mode = 0o755
        archive.addfile(directory)
        member = tarfile.TarInfo(f"{INSTALL_DIR.lstrip('/')}/{name}")
        member.size = len(data)
        member.mode = 0o755
        archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


async def install_supervisor(engine: EngineClient, container: str, user: str | None) -> SupervisorInstall:
    """Install the engine's architecture's dsh-supervise into ``container`` and check it runs as ``user``."""
    info = await engine.request("GET", "/info")
    machine = str(info.get("Architecture", "")) if isinstance(info, dict) else ""
    payload = supervisor_payload(machine)
    if isinstance(payload, str):
        return SupervisorInstall(None, payload)
    name, data = payload.name, payload.data
    path = f"{INSTALL_DIR}/{name}"
    status, body = await engine.request_raw(
        "PUT", f"/containers/{quote(container, safe='')}/archive?path=%2F", _archive(name, data)
    )
    if status != 200:
        refusal = body.decode("utf-8", "replace").strip()
        try:
            code, _, err = await run_script(engine, container, "0", _WRITE_AS_ROOT, path, stdin=data)
        except EngineError as exc:
            return SupervisorInstall(None, f"the engine refused the upload ({refusal}) and {exc}")
        if code != 0:
            detail = err.decode("utf-8", "replace").strip()
            return SupervisorInstall(
                None, f"the engine refused the upload ({refusal}), and writing it as root failed: {detail}"
            )
    code, out, err = await run_script(engine, container, user, '"$1" --version 2>&1', path)
    expected = f"dsh-supervise {SUPERVISOR_PROTOCOL}"
    if code != 0 or out.decode("utf-8", "replace").strip() != expected:
        said = (out + err).decode("utf-8", "replace").strip() or f"exit status {code}"
        return SupervisorInstall(None, f"{path} does not run in the container: {said}")
    return SupervisorInstall(path)
