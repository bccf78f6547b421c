"""setuptools hooks: dsh-supervise built into the wheel, and wheel tags that say what it holds.

Everything else about the package is in pyproject.toml.

build_py builds dsh-supervise (native/build.py) straight into the build directory
(``<build_lib>/dsh_bash/supervisor/_native/``), never into the source tree: static binaries for
x86_64 and aarch64 when the ``ziglang`` package is importable in the build environment (a build
requirement in pyproject.toml, so every isolated build has it), else one for the host's architecture
built with the host's ``cc -static``. A build that ends with no binary at all fails, naming the
reason, unless DSH_BASH_ALLOW_NO_NATIVE=1: that wheel is then pure Python (``py3-none-any``), and at
run time dsh_bash.supervisor.supervisor_problem() says why there is no supervisor (the local backend
falls back to marker containment). DSH_BASH_REQUIRE_NATIVE=1 makes a build without every binary fail
(for release wheels). Editable installs skip the native build: bin/test and bin/dsh-bash build the
binaries of a source checkout into dsh_bash/supervisor/_native themselves whenever they are missing or
stale (native/build.py --if-stale).

bdist_wheel tags the wheel with the platforms of the binaries it holds, read from their ELF headers
(not from the build host): a static binary (no PT_INTERP) runs on every Linux of its architecture,
glibc or musl, so it adds ``manylinux_2_17_ARCH`` and ``musllinux_1_1_ARCH``; a dynamically linked one
(never built today) adds only ``linux_ARCH``, which promises nothing beyond a machine like the build
host. With zig that is one wheel for every Linux:
``py3-none-manylinux_2_17_aarch64.manylinux_2_17_x86_64.musllinux_1_1_aarch64.musllinux_1_1_x86_64``.
It carries both binaries on purpose: the host's serves the local backend, and both serve Docker
engines and SSH hosts of either architecture (those backends upload the remote machine's binary).
The Python code is the same everywhere, so the interpreter and ABI tags stay ``py3-none``.

Under a PEP 517 build (pip wheel ., pip install ., pip install -e ., python -m build) setuptools' own
``build/`` and ``*.egg-info`` go to a temporary directory, removed when the build step ends, instead of
the checkout: such a build writes nothing into the source tree (tests/test_wheel.py checks it). An
sdist then holds PKG-INFO but no ``dsh_bash.egg-info/`` (a wheel built from it is the same).
``python setup.py ...`` keeps setuptools' usual places.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1: the wheel package's command
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
#: Where the binaries go inside the build directory and the wheel (the package dsh_bash.supervisor._native).
NATIVE_PARTS = ("dsh_bash", "supervisor", "_native")
BINARY_PREFIX = "dsh-supervise-"

#: The platform tags of a static binary (no PT_INTERP: the kernel runs it without a loader, and it
#: links no libc at run time, so any glibc or musl version runs it). The versions are floors for the
#: installer's tag match, not requirements of the binary: pip installs a wheel when one of its tags is
#: among the host's supported tags, so these let every glibc Linux from 2.17 (2012) and every musl Linux
#: from 1.1 (2014) install it. manylinux_2_17 (manylinux2014) is the lowest glibc tag installers
#: define for aarch64 (packaging lists none below it for any architecture but x86_64 and i686); x86_64
#: gets the same floor, one rule for both, leaving out only x86_64 glibc older than 2.17 (pip there
#: would also take manylinux_2_5). musllinux_1_1 is the lowest musl tag auditwheel's policies define.
STATIC_TAGS = ("manylinux_2_17_{arch}", "musllinux_1_1_{arch}")
#: ELF e_machine values of the architectures dsh-supervise is built for.
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
PT_INTERP = 3


def _native_module() -> Any:
    """native/build.py, loaded without writing its bytecode into the checkout; None when it is missing."""
    script = HERE / "native" / "build.py"
    spec = importlib.util.spec_from_file_location("dsh_bash_native_build", script)
    if spec is None or spec.loader is None or not script.is_file():
        return None
    native = importlib.util.module_from_spec(spec)
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(native)
    finally:
        sys.dont_write_bytecode = dont_write
    return native


def build_native(out_dir: Path) -> list[Path]:
    """Builds dsh-supervise into OUT_DIR (emptied of earlier builds first); returns the binaries made."""
    native = _native_module()
    required = os.environ.get("DSH_BASH_REQUIRE_NATIVE") == "1"
    for stale in [*out_dir.glob(f"{BINARY_PREFIX}*"), *out_dir.glob(f".{BINARY_PREFIX}*")]:
        stale.unlink()
    if native is None:
        problems = [f"{HERE / 'native' / 'build.py'} is missing"]
    else:
        arches = native.ARCHITECTURES if required else native.default_arches()
        problems = native.build(arches, out_dir, log=print) if arches else ["no architecture to build for"]
    for stamp in out_dir.glob(f".{BINARY_PREFIX}*.stamp"):
        stamp.unlink()  # build.py's own bookkeeping, not package data
    for problem in problems:
        print(f"warning: dsh-supervise: {problem}")
    if required and problems:
        raise RuntimeError("dsh-supervise: not every binary was built (DSH_BASH_REQUIRE_NATIVE=1)")
    built = sorted(out_dir.glob(f"{BINARY_PREFIX}*"))
    if not built and os.environ.get("DSH_BASH_ALLOW_NO_NATIVE") != "1":
        raise RuntimeError(
            "dsh-supervise: no binary was built ("
            + "; ".join(problems)
            + "). Install the ziglang package in the build environment (or a C compiler for the host), "
            "or set DSH_BASH_ALLOW_NO_NATIVE=1 to build a pure-Python wheel without the supervisor"
        )
    return built


def elf_platform(path: Path) -> tuple[str, bool]:
    """(architecture, statically linked) of an ELF executable, from its header and program headers."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise RuntimeError(f"{path}: not an ELF file")
    order = "<" if data[5] == 1 else ">"
    (machine,) = struct.unpack_from(order + "H", data, 18)
    if data[4] == 2:  # 64-bit
        (phoff,) = struct.unpack_from(order + "Q", data, 32)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 54)
    else:
        (phoff,) = struct.unpack_from(order + "I", data, 28)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 42)
    arch = ELF_MACHINES.get(machine)
    if arch is None:
        raise RuntimeError(f"{path}: ELF machine {machine}, not one dsh-supervise is built for")
    types = [struct.unpack_from(order + "I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return arch, PT_INTERP not in types


def platform_tags(native_dir: Path) -> list[str]:
    """The wheel platform tags the binaries in NATIVE_DIR allow, sorted; empty when there are none."""
    found: set[str] = set()
    for path in sorted(native_dir.glob(f"{BINARY_PREFIX}*")):
        arch, static = elf_platform(path)
        if path.name != BINARY_PREFIX + arch:
            raise RuntimeError(f"{path}: holds an {arch} binary")
        if static:
            found.update(tag.format(arch=arch) for tag in STATIC_TAGS)
        else:
            found.add(f"linux_{arch}")
    return sorted(found)


class build_py_with_native(build_py):
    def initialize_options(self) -> None:
        super().initialize_options()
        self.native_outputs: list[Path] = []

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            self.native_outputs = build_native(Path(self.build_lib, *NATIVE_PARTS))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *map(str, self.native_outputs)]


class DistributionWithBinaries(Distribution):
    """Platform-specific content (the binaries) without extension modules: install and bdist_wheel
    then treat it as such (build and install into platlib, ``Root-Is-Purelib: false`` in the wheel)."""

    def has_ext_modules(self) -> bool:
        return True


class bdist_wheel_tagged(bdist_wheel):
    def finalize_options(self) -> None:
        super().finalize_options()
        # What has_ext_modules() already makes it; set here too, as the wheel's layout depends on it.
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        if "editable_wheel" in self.distribution.command_obj:
            # setuptools' editable_wheel writes its WHEEL file with this command's tags: pointers into
            # the checkout, no binary, the same Python everywhere.
            return (self.python_tag, "none", "any")
        tags = platform_tags(Path(self.bdist_dir, *NATIVE_PARTS))
        return (self.python_tag, "none", ".".join(tags) or "any")


def _outside_checkout() -> dict[str, dict[str, str]]:
    """Under a PEP 517 build, setuptools' build/ and *.egg-info in a temporary directory."""
    if "setuptools.build_meta" not in sys.modules:
        return {}  # python setup.py ...: setuptools' usual places
    scratch = tempfile.mkdtemp(prefix="dsh-bash-build-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return {"build": {"build_base": os.path.join(scratch, "build")}, "egg_info": {"egg_base": scratch}}


setup(
    distclass=DistributionWithBinaries,
    cmdclass={"build_py": build_py_with_native, "bdist_wheel": bdist_wheel_tagged},
    options=_outside_checkout(),
)
