"""Putting dsh-supervise on the SSH host, once per executor open, in a per-user cache.

The binary goes to ``~/.cache/dsh-bash/dsh-supervise-<first 16 hex digits of its sha256>`` (the
directory 0700): named by its content, so executors of different versions share the cache without
replacing each other's binary. A file found there is trusted only once its content's hash checks
(``sha256sum`` on the host, else read back over SFTP): anything else the login can write may have
put it there. A new one is written under a temporary name and renamed into place, so a command
never runs a half-written binary. Each open checks that it runs there and speaks this version's
protocol before any command relies on it; where it cannot (no binary for the host's architecture,
a home mounted noexec, no SFTP), the caller falls back to the environment marker.

The cache is the login's own file, so a command can replace it after that check (issue 30). So the
install also records the file's identity, ``stat``'s device, inode, size and change time (ctime,
which no process but root can set back), taken before and after the hash, and every BOOT compares
it right before it execs the supervisor (see ``_scripts.boot_script``): a file written in place,
renamed over, removed and created again, chmod'ed or linked elsewhere no longer matches, the start
reports ``supervisor_missing`` and the executor installs it again. ``stat`` and ``sha256sum`` are
taken from fixed system paths (never ``PATH``, which the login's rc files set) and must not be
writable by the login.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import asyncssh

from dsh_bash import BashInfrastructureError
from dsh_bash.backend import SupervisorInstall
from dsh_bash.supervisor import (
    SUPERVISOR_PROTOCOL,
    supervisor_payload,
)

from ._connection import ChannelPool
from ._scripts import IDENTITY_FORMAT

__all__ = ["CACHE_DIR", "Installed", "install_supervisor"]

log = logging.getLogger("dsh_bash.ssh")

#: The cache under the login's home.
CACHE_DIR = ".cache/dsh-bash"

# $1: the binary's path, $2: its sha256, $3: "put" right after the caller put it there.
# Line 1: "current" when the file there is the expected one; "stale" when it is missing or differs
# (or changed while it was hashed); "unchecked" without sha256sum (the caller then compares over
# SFTP). Line 2: the stat program BOOT is to use (empty: none). Line 3: the file's identity (empty:
# none), taken before and after the hash. Then, when current (or unchecked right after the put),
# the binary's --version. A symbolic link is never trusted: its target may change. Programs come
# from fixed paths that the login cannot write, never from PATH: a login whose rc files put a
# `sha256sum` or `stat` of theirs first would answer for the file.
_CHECK = r"""
f=$1 want=$2 sum= st=
for p in /usr/bin/sha256sum /bin/sha256sum; do [[ -f $p && -x $p && ! -w $p ]] && { sum=$p; break; }; done
for p in /usr/bin/stat /bin/stat; do [[ -f $p && -x $p && ! -w $p ]] && { st=$p; break; }; done
ident() { [[ -n $st && -f $f && ! -L $f ]] && TZ=UTC0 LC_ALL=C "$st" -c 'FORMAT' -- "$f" 2>/dev/null; }
before=$(ident) got=
if [[ -n $sum && -f $f && ! -L $f ]]; then got=$("$sum" < "$f" 2>/dev/null); fi
after=$(ident)
[[ $before == "$after" ]] || before=
if [[ -z $sum ]]; then verdict=unchecked
elif [[ ${got%% *} != "$want" || ( -n $st && -z $before ) ]]; then verdict=stale
else verdict=current; fi
printf '%s\n%s\n%s\n' "$verdict" "$st" "$before"
[[ $verdict == current || ( $verdict == unchecked && $3 == put ) ]] && "$f" --version 2>&1
""".replace("FORMAT", IDENTITY_FORMAT)


@dataclass(frozen=True)
class Installed:
    """What :func:`install_supervisor` found: the install, and how BOOT checks the file before each
    exec of it (``stat`` and the identity it must print), None when the host has no usable ``stat``."""

    install: SupervisorInstall
    check: tuple[str, str] | None = None


def _parse(out: bytes) -> tuple[str, str, str, str]:
    verdict, _, rest = out.decode("utf-8", "replace").partition("\n")
    stat, _, rest = rest.partition("\n")
    identity, _, said = rest.partition("\n")
    return verdict, stat, identity, said


async def install_supervisor(pool: ChannelPool, home: str, machine: str) -> Installed:
    """Install dsh-supervise for ``machine`` (``uname -m``) under ``home`` and check that it runs."""
    payload = supervisor_payload(machine)
    if isinstance(payload, str):
        return Installed(SupervisorInstall(None, payload))
    data, digest = payload.data, payload.sha256
    directory = f"{home.rstrip('/')}/{CACHE_DIR}"
    path = f"{directory}/{payload.name}"
    _, out, _ = await pool.run_script(_CHECK, path, digest)
    verdict, stat, identity, said = _parse(out)
    if verdict != "current":
        try:
            await _put(pool, directory, path, data, compare=verdict == "unchecked")
        except (asyncssh.Error, OSError) as exc:
            reason = getattr(exc, "reason", "") or str(exc) or type(exc).__name__
            return Installed(
                SupervisorInstall(None, f"cannot put dsh-supervise at {path} over SFTP: {reason}")
            )
        except BashInfrastructureError as exc:  # SFTP refused (no subsystem), or the channel failed
            return Installed(SupervisorInstall(None, f"cannot put dsh-supervise at {path} over SFTP: {exc}"))
        # Again, for the identity of what is there now (and its hash, with sha256sum): a file
        # replaced between the put and this look is refused here, not run by the next command.
        code, out, _ = await pool.run_script(_CHECK, path, digest, "put")
        verdict, stat, identity, said = _parse(out)
        if verdict == "stale":
            return Installed(
                SupervisorInstall(None, f"{path} changed on {pool.where} right after it was put there")
            )
        # Its stderr is in its stdout (see _CHECK): the channel's stderr holds the rc files' noise.
        if not said.strip():
            said = f"exit status {code}"
    expected = f"dsh-supervise {SUPERVISOR_PROTOCOL}"
    if said.strip() != expected:
        return Installed(
            SupervisorInstall(None, f"{path} does not run on {pool.where}: {said.strip()[:200]}")
        )
    if not (stat and identity):
        log.warning(
            "%s has no stat program at /usr/bin/stat or /bin/stat (or the login can write it): "
            "dsh-supervise at %s is checked at open only, not before each command runs under it",
            pool.where,
            path,
        )
        return Installed(SupervisorInstall(path))
    return Installed(SupervisorInstall(path), (stat, identity))


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
