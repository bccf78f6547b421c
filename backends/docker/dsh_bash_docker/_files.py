"""``read_file`` and ``write_file`` through the Engine's archive API (``R-file-*``), never an exec's
output: ``HEAD`` (what the path is), ``GET`` (a tar of one file), ``PUT`` (a tar into a directory).

The engine reads and writes as root, inside the container's root (a link resolves there, never to
the host). So that nothing is written or read that the commands' user could not, the API is used only
when commands run as root; for another user the executor refuses (``files_unsupported``: the path as
that user, designed in ``docs/design/files.md``, is not built yet).

A write puts the bytes into a fresh file beside the target (the tar's one member), then renames it
over the target with one exec as root (``mv -f``, with the old file's owner): the engine's own
extraction removes an existing file before it writes the new one, which a command could see.
"""

from __future__ import annotations

import base64
import io
import json
import posixpath
import tarfile
from typing import Any
from urllib.parse import quote

from dsh_bash import BashInfrastructureError, FileOperationError, FileRefusal
from dsh_bash.backend import temporary_file_name

from ._engine import EngineClient
from ._process import run_script

__all__ = ["commands_run_as_root", "read_container_file", "write_container_file"]

#: Go's ``os.FileMode`` bits, as the path-stat header carries them.
_MODE_DIR = 1 << 31
_MODE_SYMLINK = 1 << 27
_MODE_NOT_REGULAR = (
    (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
)  # device, pipe, socket, char, irregular
#: The kernel's own bound on links in one lookup.
_MAX_LINKS = 40

#: Renames the fresh file ($1) over the target ($2), giving it the target's owner when that is a
#: plain file (a link or nothing: root's, as the engine wrote it).
_RENAME = r"""
if [ -f "$2" ] && [ ! -L "$2" ]; then
  owner=$(stat -c %u:%g -- "$2" 2>/dev/null) && chown -- "$owner" "$1" 2>/dev/null
fi
mv -f -- "$1" "$2"
"""


def commands_run_as_root(user: str | None, image_user: str) -> bool:
    """Whether a command of ``user`` (None: the container's configured ``image_user``) runs as root."""
    who = (user if user is not None else image_user) or "root"
    return who.split(":", 1)[0] in ("root", "0")


def _archive_path(container: str, path: str) -> str:
    return f"/containers/{quote(container, safe='')}/archive?path={quote(path, safe='')}"


async def _stat(engine: EngineClient, container: str, path: str) -> dict[str, Any] | None:
    status, headers, _ = await engine.request_with_headers("HEAD", _archive_path(container, path))
    if status == 404:
        return None
    encoded = headers.get("x-docker-container-path-stat")
    if status != 200 or encoded is None:
        raise BashInfrastructureError(
            f"the engine could not stat {path}: status {status}", reason="unclassified"
        )
    found: dict[str, Any] = json.loads(base64.b64decode(encoded))
    return found


def _refuse_kind(mode: int, path: str) -> None:
    if mode & _MODE_DIR:
        raise FileOperationError(f"{path} is a directory", reason="is_a_directory")
    if mode & _MODE_NOT_REGULAR:
        raise FileOperationError(
            f"{path} is not a regular file (a device, FIFO or socket)", reason="not_a_regular_file"
        )


async def _followed(engine: EngineClient, container: str, path: str) -> tuple[str, dict[str, Any]]:
    """``path`` after its links (the engine resolves a link's target inside the container), with its
    stat; ``file_not_found`` for a missing path or a loop."""
    for _ in range(_MAX_LINKS):
        found = await _stat(engine, container, path)
        if found is None:
            raise FileOperationError(
                f"cannot read {path}: No such file or directory", reason="file_not_found"
            )
        if not int(found.get("mode", 0)) & _MODE_SYMLINK:
            return path, found
        target = str(found.get("linkTarget") or "")
        if not target:
            raise FileOperationError(f"cannot read {path}: a link to nothing", reason="file_not_found")
        path = target if target.startswith("/") else posixpath.join(posixpath.dirname(path), target)
    raise FileOperationError(f"cannot read {path}: too many levels of links", reason="file_not_found")


async def read_container_file(engine: EngineClient, container: str, path: str, max_bytes: int) -> bytes:
    where, found = await _followed(engine, container, path)
    _refuse_kind(int(found.get("mode", 0)), path)
    size = int(found.get("size", 0))
    if size > max_bytes:
        raise FileOperationError(
            f"{path} holds {size} bytes, more than max_file_bytes ({max_bytes})", reason="file_too_large"
        )
    status, _, parts = await engine.request_parts("GET", _archive_path(container, where))
    if status == 404:
        raise FileOperationError(f"cannot read {path}: No such file or directory", reason="file_not_found")
    if status != 200:
        raise BashInfrastructureError(
            f"the engine could not read {path}: status {status}", reason="unclassified"
        )
    content = _first_member(parts, path, max_bytes + 1)
    if len(content) > max_bytes:
        raise FileOperationError(
            f"{path} grew past max_file_bytes ({max_bytes}) while it was read", reason="file_too_large"
        )
    return content


def _first_member(parts: list[bytes], path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the archive's first member, a regular file, joined once from the
    parts the body came in (50 MiB copied twice more through ``tarfile`` costs more than the
    engine's transfer). ``tarfile`` reads the headers (PAX and GNU ones included) from a prefix."""
    total = sum(len(part) for part in parts)
    want = 4096
    while True:
        prefix = _slice(parts, 0, min(want, total))
        try:
            with tarfile.open(fileobj=io.BytesIO(prefix), mode="r:") as archive:
                member = archive.next()
        except tarfile.TarError as exc:
            if want < total:  # the headers go on past the prefix
                want *= 4
                continue
            raise BashInfrastructureError(
                f"the engine's archive of {path} is not one: {exc}", reason="unclassified"
            ) from exc
        break
    if member is None or not member.isfile():
        raise FileOperationError(f"{path} is not a regular file", reason="not_a_regular_file")
    end = member.offset_data + min(member.size, limit)
    if end > total:
        raise BashInfrastructureError(
            f"the engine's archive of {path} ends {end - total} bytes short", reason="unclassified"
        )
    return _slice(parts, member.offset_data, end)


def _slice(parts: list[bytes], start: int, end: int) -> bytes:
    """Bytes ``start:end`` of the concatenation of ``parts``, copied once."""
    pieces: list[memoryview] = []
    offset = 0
    for part in parts:
        following = offset + len(part)
        if following > start and offset < end:
            view = memoryview(part)[max(start - offset, 0) : min(end, following) - offset]
            pieces.append(view)
        offset = following
        if offset >= end:
            break
    return b"".join(pieces)


def _one_file_tar(name: str, data: bytes, mode: int, parents: list[str]) -> list[bytes]:
    """A tar of ``parents`` (directories) and one file ``name`` holding ``data``, as parts to send
    one after the other: ``data`` itself is one of them, never copied."""
    headers = bytearray()
    for directory in parents:
        entry = tarfile.TarInfo(directory)
        entry.type = tarfile.DIRTYPE
        entry.mode = 0o755
        headers += entry.tobuf(format=tarfile.PAX_FORMAT)
    member = tarfile.TarInfo(name)
    member.size = len(data)
    member.mode = mode
    headers += member.tobuf(format=tarfile.PAX_FORMAT)
    padding = -len(data) % tarfile.BLOCKSIZE
    return [bytes(headers), data, bytes(padding + 2 * tarfile.BLOCKSIZE)]  # two zero blocks: the end


async def write_container_file(
    engine: EngineClient, container: str, path: str, data: bytes, *, make_parents: bool
) -> None:
    directory = posixpath.dirname(path)  # the executor refused a path that names a directory
    existing = await _stat(engine, container, path)
    mode = 0o644
    if existing is not None:
        kind = int(existing.get("mode", 0))
        if not kind & _MODE_SYMLINK:
            _refuse_kind(kind, path)
            mode = kind & 0o7777
    # The tar goes to the nearest directory that exists; the missing ones (make_parents) are its
    # entries, and nothing that exists is extracted again (its mode would change).
    base = directory or "/"
    missing: list[str] = []
    while base not in ("/", "") and await _stat(engine, container, base) is None:
        if not make_parents:
            raise FileOperationError(f"cannot write {path}: no directory {base}", reason="file_not_found")
        missing.insert(0, posixpath.basename(base))
        base = posixpath.dirname(base)
    parents = ["/".join(missing[: index + 1]) for index in range(len(missing))]
    temp_name = temporary_file_name()
    inside = "/".join([*missing, temp_name])
    body = _one_file_tar(inside, data, mode, parents)
    status, answer = await engine.request_raw("PUT", _archive_path(container, base), body)
    if status == 404:
        raise FileOperationError(f"cannot write {path}: no directory {base}", reason="file_not_found")
    if status != 200:
        text = answer.decode("utf-8", "replace").strip()
        refusal: FileRefusal | None = None
        if "no space" in text.lower():
            refusal = "no_space"
        elif status == 403:
            refusal = "permission_denied"
        if refusal is not None:
            raise FileOperationError(f"cannot write {path}: {text}", reason=refusal)
        raise BashInfrastructureError(
            f"the engine could not write {path}: {status} {text}", reason="unclassified"
        )
    temp = posixpath.join(directory, temp_name)
    code, _, err = await run_script(engine, container, "0", _RENAME, temp, path)
    if code != 0:
        await run_script(engine, container, "0", 'rm -f -- "$1"', temp)
        raise BashInfrastructureError(
            f"cannot put the written file in place as {path}: {err.decode('utf-8', 'replace').strip()}",
            reason="unclassified",
        )
