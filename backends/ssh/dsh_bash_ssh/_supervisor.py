"""Putting dsh-supervise on the SSH host, once per executor open, in a per-user cache.

The binary goes to ``~/.cache/dsh-bash/dsh-supervise-<first 16 hex digits of its sha256>`` (the
directory 0700): named by its content, so executors of different versions share the cache without
replacing each other's binary. A file found there is trusted only once its content's hash checks
(``sha256sum`` on the host, else read back over SFTP): anything else the login can write may have
put it there. A new one is written under a temporary name and renamed into place, so a command
never runs a half-written binary. Each open checks that it runs there and speaks this version's
protocol before any command relies on it; where it cannot (no binary for the host's architecture,
a home mounted noexec, no SFTP), the caller falls back to the environment marker.
"""

from __future__ import annotations

import logging
import secrets

import asyncssh

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import SupervisorInstall
from dsh_bash.supervisor import (
    SUPERVISOR_PROTOCOL,
    supervisor_payload,
)

from ._connection import ChannelPool

__all__ = ["CACHE_DIR", "install_supervisor"]

log = logging.getLogger("dsh_bash.ssh")

#: The cache under the login's home.
CACHE_DIR = ".cache/dsh-bash"

# $1: the binary's path, $2: its sha256. "current" and the binary's --version when the file there
# is the expected one; "stale" when it is missing or differs; "unchecked" without sha256sum (the
# caller then compares over SFTP). A symbolic link is never trusted: its target may change.
_CHECK = r"""
f=$1 want=$2
if ! command -v sha256sum >/dev/null 2>&1; then echo unchecked; exit 0; fi
got=
if [ -f "$f" ] && [ ! -L "$f" ]; then got=$(sha256sum < "$f" 2>/dev/null); fi
if [ "${got%% *}" != "$want" ]; then echo stale; exit 0; fi
echo current
"$f" --version 2>&1
"""
_VERSION = '"$1" --version 2>&1'


async def install_supervisor(pool: ChannelPool, home: str, machine: str) -> SupervisorInstall:
    """Install dsh-supervise for ``machine`` (``uname -m``) under ``home`` and check that it runs."""
    payload = supervisor_payload(machine)
    if isinstance(payload, str):
        return SupervisorInstall(None, payload)
    data, digest = payload.data, payload.sha256
    directory = f"{home.rstrip('/')}/{CACHE_DIR}"
    path = f"{directory}/{payload.name}"
    _, out, _ = await pool.run_script(_CHECK, path, digest)
    verdict, _, said = out.decode("utf-8", "replace").partition("\n")
    if verdict != "current":
        try:
            await _put(pool, directory, path, data, compare=verdict == "unchecked")
        except (asyncssh.Error, OSError) as exc:
            reason = getattr(exc, "reason", "") or str(exc) or type(exc).__name__
            return SupervisorInstall(None, f"cannot put dsh-supervise at {path} over SFTP: {reason}")
        except BashInfrastructureError as exc:  # SFTP refused (no subsystem), or the channel failed
            return SupervisorInstall(None, f"cannot put dsh-supervise at {path} over SFTP: {exc}")
        # Its stderr is in its stdout (_VERSION): the channel's stderr holds the rc files' noise.
        code, out, _ = await pool.run_script(_VERSION, path)
        said = out.decode("utf-8", "replace")
        if not said.strip():
            said = f"exit status {code}"
    expected = f"dsh-supervise {SUPERVISOR_PROTOCOL}"
    if said.strip() != expected:
        return SupervisorInstall(None, f"{path} does not run on {pool.where}: {said.strip()[:200]}")
    return SupervisorInstall(path)


async def _put(pool: ChannelPool, directory: str, path: str, data: bytes, *, compare: bool) -> None:
    sftp = await pool.open_sftp()
    try:
        await sftp.makedirs(directory.rsplit("/", 1)[0], exist_ok=True)
        if not await sftp.isdir(directory):
            await sftp.mkdir(directory, asyncssh.SFTPAttrs(permissions=0o700))
        # Whatever mode it had: nobody else may put a binary of theirs into the cache.
        await sftp.chmod(directory, 0o700)
        if compare and await sftp.exists(path) and not await sftp.islink(path):
            async with sftp.open(path, "rb") as existing:
                content: object = await existing.read()  # bytes: opened in binary mode
                if content == data:
                    return
        partial = f"{path}.{secrets.token_hex(6)}.part"
        try:
            async with sftp.open(partial, "wb", asyncssh.SFTPAttrs(permissions=0o700)) as file:
                await file.write(data)
            await sftp.chmod(partial, 0o700)  # the umask may have taken bits off
            await sftp.posix_rename(partial, path)
        except BaseException:
            try:
                await sftp.remove(partial)
            except (asyncssh.Error, OSError) as exc:
                log.debug("removing %s failed: %s", partial, exc)
            raise
    finally:
        sftp.exit()
        await sftp.wait_closed()
