"""setuptools hook: build_py first builds dsh-supervise (native/build.py) into dsh_bash/supervisor/_native.

Everything else about the package is in pyproject.toml. A wheel or a regular install gets static
binaries for x86_64 and aarch64 when the ``ziglang`` package is importable in the build environment
(a build requirement in pyproject.toml, so every isolated build has it), else one for the host's
architecture built with the host's ``cc``, else none: dsh_bash.supervisor.supervisor_problem() then
says so at run time. Set DSH_BASH_REQUIRE_NATIVE=1 to make a build without every binary fail instead (for
release wheels). Editable installs skip this step: bin/test and bin/dsh-bash build the binaries of a
source checkout themselves whenever they are missing or stale (native/build.py --if-stale).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class build_py_with_native(build_py):
    def run(self) -> None:
        if not getattr(self, "editable_mode", False):
            self._build_native()
        super().run()

    def _build_native(self) -> None:
        script = HERE / "native" / "build.py"
        required = os.environ.get("DSH_BASH_REQUIRE_NATIVE") == "1"
        spec = importlib.util.spec_from_file_location("dsh_bash_native_build", script)
        if spec is None or spec.loader is None or not script.is_file():
            if required:
                raise RuntimeError(f"dsh-supervise: {script} is missing")
            print(f"warning: dsh-supervise not built: {script} is missing")
            return
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)
        arches = native.ARCHITECTURES if required else native.default_arches()
        problems = native.build(arches, if_stale=True, log=print)
        for problem in problems:
            print(f"warning: {problem}")
        if required and problems:
            raise RuntimeError("dsh-supervise: not every binary was built (DSH_BASH_REQUIRE_NATIVE=1)")


setup(cmdclass={"build_py": build_py_with_native})
