"""The Debian test image: a real Debian userland, built without a registry.

``mmdebstrap`` makes a minbase Debian bookworm userland (coreutils, GNU grep, procps, util-linux,
passwd, python3, openssh-server) with a non-root user :data:`USER` (uid 1000, home
``/home/dshuser``, shell bash) added by a ``--customize-hook``, and ``docker import`` turns its
tarball into an image. The image has no init and no ``CMD``: whoever runs it gives the command
(``tests/sshd_container.py`` runs sshd; the Docker tests run it like the busybox image of
``tests/docker_support.py``, whose image mode and ``start_idle_container`` give ``--init`` and an
idle bash loop).

It serves the SSH tests' server that is really elsewhere (``tests/sshd_container.py``), the Docker
tests on a real userland (``tests/docker_support.py``: ``docker_debian_image``; the kit in
``tests/test_conformance_docker.py``, ``tests/test_docker_debian.py``) and inspect's self-check
(``tests/test_inspect_provider.py``).

The image is tagged by a hash of its recipe (:data:`MMDEBSTRAP_ARGS`, the hook included), so reruns
and CI reuse it and it is rebuilt only when the recipe changes; builds are serialised across
processes (two checkouts, two pytest runs) by an exclusive lock on :data:`BUILD_LOCK`. A build
took 28 s and 43 s here (a 2-core machine shared with other work; a 220 MB image); a present image
costs one ``docker image inspect`` (0.3 s for ``python3 tests/debian_image.py``). The hash covers
the recipe, not the mirror: a rebuilt image may carry newer bookworm point-release packages.

Standard library only, so that ``.ci/run`` can build the image before the test environment exists:
``python3 tests/debian_image.py`` (needs root, ``mmdebstrap`` and the ``docker`` CLI).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "BUILD_LOCK",
    "IMAGE_REPOSITORY",
    "MMDEBSTRAP_ARGS",
    "USER",
    "USER_UID",
    "build_image",
    "image_exists",
    "image_tag",
    "unavailable",
]

IMAGE_REPOSITORY = "dsh-bash-test-debian"
#: The image's non-root user (an entry of its /etc/passwd and /etc/group, with a home directory).
USER = "dshuser"
USER_UID = 1000
#: The image's recipe; its hash is the image's tag. ``-`` writes the tarball to stdout. The hook
#: runs after the packages are installed, with the root directory as ``$1``.
_ADD_USER = f"useradd --create-home --user-group --uid {USER_UID} --shell /bin/bash {USER}"
MMDEBSTRAP_ARGS = (
    "--variant=minbase",
    "--include=openssh-server,procps,python3,bash,coreutils,util-linux,passwd,libc-bin",
    f'--customize-hook=chroot "$1" {_ADD_USER}',
    "bookworm",
    "-",
)
BUILD_LOCK = Path(tempfile.gettempdir()) / "dsh-bash-test-debian-image.lock"
_BUILD_TIMEOUT_S = 900


def image_tag() -> str:
    """``dsh-bash-test-debian:<hash of the recipe>``."""
    digest = hashlib.sha256(json.dumps(["mmdebstrap", *MMDEBSTRAP_ARGS]).encode()).hexdigest()[:12]
    return f"{IMAGE_REPOSITORY}:{digest}"


def image_exists(tag: str | None = None) -> bool:
    """Whether the engine (the ``docker`` CLI's) holds the image already."""
    if shutil.which("docker") is None:
        return False
    found = subprocess.run(
        ["docker", "image", "inspect", tag or image_tag()], capture_output=True, check=False
    )
    return found.returncode == 0


def unavailable() -> str | None:
    """Why the image can be neither found nor built here, or None. A present image needs nothing more."""
    if shutil.which("docker") is None:
        return "the docker CLI is not found (it imports the Debian test image: apt-get install docker.io)"
    if image_exists():
        return None
    if shutil.which("mmdebstrap") is None:
        return (
            f"the Debian test image {image_tag()} is not built and mmdebstrap is not found "
            "(apt-get install mmdebstrap; or build it as root: python3 tests/debian_image.py)"
        )
    if os.geteuid() != 0:
        # mmdebstrap's unshare mode would need subordinate ids set up for this user; not attempted.
        return f"the Debian test image {image_tag()} is not built and building it with mmdebstrap needs root"
    return None


def build_image() -> str:
    """Build the image unless it exists (under the lock); return its tag. Raises when the build fails."""
    tag = image_tag()
    if image_exists(tag):
        return tag
    BUILD_LOCK.touch(exist_ok=True)
    with BUILD_LOCK.open("r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if image_exists(tag):
            return tag
        with tempfile.TemporaryFile() as log:
            mmdebstrap = subprocess.Popen(
                ["mmdebstrap", "--quiet", *MMDEBSTRAP_ARGS], stdout=subprocess.PIPE, stderr=log
            )
            assert mmdebstrap.stdout is not None
            try:
                imported = subprocess.run(
                    ["docker", "import", "-", tag],
                    stdin=mmdebstrap.stdout,
                    capture_output=True,
                    timeout=_BUILD_TIMEOUT_S,
                    check=False,
                )
            finally:
                mmdebstrap.stdout.close()
                code = mmdebstrap.wait(_BUILD_TIMEOUT_S)
            if code != 0 or imported.returncode != 0:
                with contextlib.suppress(subprocess.CalledProcessError):
                    subprocess.run(["docker", "image", "rm", tag], capture_output=True, check=True)
                log.seek(0)
                detail = log.read().decode("utf-8", "replace")[-2000:]
                refused = imported.stderr.decode("utf-8", "replace").strip()
                raise RuntimeError(
                    f"building {tag} failed: mmdebstrap exit {code}, docker import exit "
                    f"{imported.returncode} ({refused}); mmdebstrap said: {detail}"
                )
    return tag


if __name__ == "__main__":
    started = time.monotonic()
    try:
        tag = build_image()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        sys.exit(f"cannot build the Debian test image: {exc}")
    print(f"{tag} ready after {time.monotonic() - started:.0f} s")
