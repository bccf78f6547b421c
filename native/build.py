#!/usr/bin/env python3
"""Builds dsh-supervise (every native/*.c, with the headers beside them) into static binaries, package
data of dsh_bash.supervisor._native.

    python native/build.py                 # every architecture (x86_64, aarch64) with zig cc
    python native/build.py --if-stale      # only what is missing, or built another way or from other sources
    python native/build.py --arch x86_64   # one architecture
    python native/build.py --out DIR       # elsewhere than dsh_bash/supervisor/_native

With the ``ziglang`` package installed (PyPI; it is in the ``[test]`` extra) it cross-compiles static
musl binaries for every architecture: ``python -m ziglang cc -target ARCH-linux-musl -static -Os -s``.
zig keeps its cache (musl built once, about a minute) in ``$ZIG_GLOBAL_CACHE_DIR``, by default
``~/.cache/dsh-bash/zig``. Without ziglang it falls back to the host's ``cc -static -Os -s`` for the
host architecture only, and says so. Standard library only: setup.py imports it too.

Exit status: 0 when every requested binary is there and up to date, 1 when one could not be built,
2 for a usage error.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = ROOT / "dsh_bash" / "supervisor" / "_native"
ARCHITECTURES = ("x86_64", "aarch64")
NAME = "dsh-supervise"
CFLAGS = ("-std=gnu11", "-Wall", "-Wextra", "-static", "-Os", "-s")
_ALIASES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def sources() -> list[Path]:
    """The C files compiled into dsh-supervise: every one in native/, in one compiler run."""
    return sorted(HERE.glob("*.c"))


def inputs() -> list[Path]:
    """What a binary is built from: the C files, their headers and this script."""
    return [*sources(), *sorted(HERE.glob("*.h")), Path(__file__).resolve()]


def host_arch() -> str | None:
    """The host's architecture as named here, or None when dsh-supervise is not built for it."""
    return _ALIASES.get(platform.machine().lower())


def output_path(arch: str, out_dir: Path = DEFAULT_OUT) -> Path:
    return out_dir / f"{NAME}-{arch}"


def stamp_path(arch: str, out_dir: Path = DEFAULT_OUT) -> Path:
    """Beside the binary: how it was built (the toolchain and a digest of its inputs)."""
    return out_dir / f".{NAME}-{arch}.stamp"


def build_stamp(use_zig: bool) -> str:
    """The toolchain (zig, or the host compiler that the fallback runs) and the sha256 of every input:
    a binary built another way, or from other sources, does not match it, whatever the files' times."""
    digest = hashlib.sha256()
    for path in inputs():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    if use_zig:
        toolchain = "zig cc (ziglang), static musl"
    else:
        toolchain = f"host cc {os.environ.get('CC') or shutil.which('cc') or shutil.which('gcc')}"
    return f"{toolchain}\nsources sha256 {digest.hexdigest()}\n"


def is_stale(arch: str, out_dir: Path = DEFAULT_OUT) -> bool:
    """True when the binary for ARCH is missing, or was not built by this toolchain from these sources
    (its stamp differs: say the host's cc built it and ziglang was installed since)."""
    if not output_path(arch, out_dir).is_file():
        return True
    try:
        stamp = stamp_path(arch, out_dir).read_text()
    except OSError:
        return True
    return stamp != build_stamp(have_ziglang())


def have_ziglang() -> bool:
    return importlib.util.find_spec("ziglang") is not None


def zig_cache_dir() -> Path:
    configured = os.environ.get("ZIG_GLOBAL_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsh-bash" / "zig"


def compiler_command(arch: str, use_zig: bool) -> list[str] | None:
    """The compiler invocation (without -o/sources) for ARCH, or None when none can build it."""
    if use_zig:
        return [sys.executable, "-m", "ziglang", "cc", "-target", f"{arch}-linux-musl", *CFLAGS]
    if arch != host_arch():
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    return [cc, *CFLAGS]


def default_arches() -> tuple[str, ...]:
    """Every architecture with ziglang; without it the host's alone (none when unsupported)."""
    if have_ziglang():
        return ARCHITECTURES
    host = host_arch()
    return (host,) if host else ()


def build(
    arches: Sequence[str] = ARCHITECTURES,
    out_dir: Path = DEFAULT_OUT,
    *,
    if_stale: bool = False,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> list[str]:
    """Builds dsh-supervise for ARCHES into OUT_DIR; returns the problems (empty: all built)."""
    problems: list[str] = []
    use_zig = have_ziglang()
    if not use_zig:
        log(
            f"{NAME}: the ziglang package is not installed: falling back to the host C compiler, "
            f"which builds only for the host architecture ({host_arch() or platform.machine()}); "
            "`pip install ziglang` builds every architecture"
        )
    env = dict(os.environ)
    if use_zig:
        cache = zig_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        env.setdefault("ZIG_GLOBAL_CACHE_DIR", str(cache))
        env.setdefault("ZIG_LOCAL_CACHE_DIR", str(cache))
    out_dir.mkdir(parents=True, exist_ok=True)
    for arch in arches:
        target = output_path(arch, out_dir)
        if if_stale and not is_stale(arch, out_dir):
            continue
        command = compiler_command(arch, use_zig)
        if command is None:
            problems.append(
                f"{NAME}-{arch}: no compiler for it (needs the ziglang package; "
                f"the host fallback `cc` builds only {host_arch() or platform.machine()})"
            )
            continue
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        log(f"{NAME}: building {target} ({'zig cc' if use_zig else command[0]})")
        try:
            done = subprocess.run(
                [*command, "-o", str(partial), *(str(source) for source in sources())],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError as error:
            problems.append(f"{NAME}-{arch}: cannot run the compiler: {error}")
            continue
        if done.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            output = (done.stderr or done.stdout).strip()
            problems.append(f"{NAME}-{arch}: the compiler failed (exit status {done.returncode}): {output}")
            continue
        if done.stderr.strip():
            log(done.stderr.rstrip())  # warnings: the source is meant to have none
        partial.chmod(0o755)
        os.replace(partial, target)
        stamp_path(arch, out_dir).write_text(build_stamp(use_zig))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Build {NAME} into static binaries.")
    parser.add_argument(
        "--arch",
        action="append",
        choices=ARCHITECTURES,
        help="an architecture to build (repeatable; default: all with ziglang, the host's without)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory ({DEFAULT_OUT})")
    parser.add_argument(
        "--if-stale",
        action="store_true",
        help="build only binaries that are missing, or whose stamp names another toolchain or other sources",
    )
    args = parser.parse_args(argv)
    arches: Sequence[str] = args.arch or default_arches()
    if not arches:
        print(
            f"{NAME}: not built: no support for the host architecture {platform.machine()}", file=sys.stderr
        )
        return 1
    problems = build(arches, args.out, if_stale=args.if_stale)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
