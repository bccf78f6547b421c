"""Putting dsh-supervise into the container, by the Engine API, once per executor open.

The binary goes to ``/.dsh-bash/dsh-supervise-<digest>``.

In image mode that directory is a tmpfs the executor mounts when it creates the container, owned by
:data:`OWNER_UID`, a user no command runs as: the binary is written there by a ``cat`` exec'd as
that user, then the file and the directory are made read-only (0555). Commands run as root there
without capabilities (the container drops them all), and root without ``CAP_DAC_OVERRIDE`` and
``CAP_FOWNER`` may not write into another user's read-only directory nor change its mode, and
nobody may rename or remove a mount point in use: a command cannot replace the binary that the
next commands run under (issue 30). A ``cap_add`` that gives those capabilities back gives that
back too.

Attached to a container (container mode) the executor cannot mount anything: ``/.dsh-bash`` is a
directory in ``/``, which only root can create, holding a root-owned file of mode 0755. A command
that runs as another user can neither replace it nor plant a directory of its own there first; one
that runs as root there can. The archive upload (``PUT .../archive``) writes it as root whatever
the exec user; a container with a read-only root filesystem refuses that upload, and then it is
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

__all__ = ["INSTALL_DIR", "INSTALL_TMPFS", "install_supervisor"]

log = logging.getLogger("dsh_bash.docker")

#: Where the supervisor goes in the container (image mode mounts :data:`INSTALL_TMPFS` here).
INSTALL_DIR = "/.dsh-bash"
#: The owner of image mode's install directory and binary: no command's user (not root, below
#: 65536 for rootless engines' user namespaces, beside the customary 65534 of ``nobody``).
OWNER_UID = 65533
#: Image mode's mount options for :data:`INSTALL_DIR`.
INSTALL_TMPFS = f"rw,nosuid,nodev,exec,size=16m,mode=0755,uid={OWNER_UID},gid={OWNER_UID}"

# $1: the target path. Written under a temporary name first, so that a command never runs a half
# written binary.
_WRITE_AS_ROOT = r"""umask 022
mkdir -p -- "${1%/*}" && cat > "$1.part" && chmod 0755 -- "$1.part" && mv -f -- "$1.part" "$1" """


# $1: the target path, in the owner's tmpfs. The directory is writable by its owner only while this
# writes; then the file and the directory are read-only, for the owner too (no command runs as it).
_WRITE_AS_OWNER = r"""umask 022
dir=${1%/*}
chmod 0755 -- "$dir" && cat > "$1.part" && chmod 0555 -- "$1.part" && mv -f -- "$1.part" "$1" &&
chmod 0555 -- "$dir" """


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


async def install_supervisor(
    engine: EngineClient, container: str, user: str | None, *, owned_tmpfs: bool = False
) -> SupervisorInstall:
    """Install the engine's architecture's dsh-supervise into ``container`` and check it runs as ``user``.

    ``owned_tmpfs``: :data:`INSTALL_DIR` is a mount of :data:`INSTALL_TMPFS` (image mode), written
    as :data:`OWNER_UID`."""
    info = await engine.request("GET", "/info")
    machine = str(info.get("Architecture", "")) if isinstance(info, dict) else ""
    payload = supervisor_payload(machine)
    if isinstance(payload, str):
        return SupervisorInstall(None, payload)
    name, data = payload.name, payload.data
    path = f"{INSTALL_DIR}/{name}"
    if owned_tmpfs:
        owner = f"{OWNER_UID}:{OWNER_UID}"
        try:
            code, _, err = await run_script(engine, container, owner, _WRITE_AS_OWNER, path, stdin=data)
        except EngineError as exc:
            return SupervisorInstall(None, f"writing {path} as uid {OWNER_UID} failed: {exc}")
        if code != 0:
            detail = err.decode("utf-8", "replace").strip()
            return SupervisorInstall(None, f"writing {path} as uid {OWNER_UID} failed: {detail}")
        return await _checked(engine, container, user, path)
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
    return await _checked(engine, container, user, path)


async def _checked(engine: EngineClient, container: str, user: str | None, path: str) -> SupervisorInstall:
    """``path`` once it runs as ``user`` and speaks this version's protocol, or why not."""
    code, out, err = await run_script(engine, container, user, '"$1" --version 2>&1', path)
    expected = f"dsh-supervise {SUPERVISOR_PROTOCOL}"
    if code != 0 or out.decode("utf-8", "replace").strip() != expected:
        said = (out + err).decode("utf-8", "replace").strip() or f"exit status {code}"
        return SupervisorInstall(None, f"{path} does not run in the container: {said}")
    return SupervisorInstall(path)
