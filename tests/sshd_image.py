"""The Debian image of the test SSH server (``tests/sshd_container.py``), built without a registry.

``mmdebstrap`` makes a minbase Debian userland with openssh-server, procps and the tools the SSH
backend's scripts use, and ``docker import`` turns its tarball into an image. The image is tagged by
a hash of its recipe (:data:`MMDEBSTRAP_ARGS`), so reruns and CI reuse it and it is rebuilt only when
the recipe changes; builds are serialised across processes (two checkouts, two pytest runs) by an
exclusive lock on :data:`BUILD_LOCK`. A build takes about a minute and a half here.

Standard library only, so that ``.ci/run`` can build the image before the test environment exists:
``python3 tests/sshd_image.py`` (needs root, ``mmdebstrap`` and the ``docker`` CLI).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["BUILD_LOCK", "IMAGE_REPOSITORY", "MMDEBSTRAP_ARGS", "build_image", "image_tag"]

IMAGE_REPOSITORY = "dsh-bash-test-sshd"
#: The image's recipe; its hash is the image's tag. ``-`` writes the tarball to stdout.
MMDEBSTRAP_ARGS = (
    "--variant=minbase",
    "--include=openssh-server,procps,bash,coreutils,util-linux,passwd,libc-bin",
    "bookworm",
    "-",
)
BUILD_LOCK = Path(tempfile.gettempdir()) / "dsh-bash-test-sshd-image.lock"
_BUILD_TIMEOUT_S = 900


def image_tag() -> str:
    """``dsh-bash-test-sshd:<hash of the recipe>``."""
    digest = hashlib.sha256(json.dumps(["mmdebstrap", *MMDEBSTRAP_ARGS]).encode()).hexdigest()[:12]
    return f"{IMAGE_REPOSITORY}:{digest}"


def _image_exists(tag: str) -> bool:
    found = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False)
    return found.returncode == 0


def build_image() -> str:
    """Build the image unless it exists (under the lock); return its tag. Raises when the build fails."""
    tag = image_tag()
    if _image_exists(tag):
        return tag
    BUILD_LOCK.touch(exist_ok=True)
    with BUILD_LOCK.open("r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if _image_exists(tag):
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
        sys.exit(f"cannot build the sshd test image: {exc}")
    print(f"{tag} ready after {time.monotonic() - started:.0f} s")
