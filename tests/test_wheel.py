"""The wheel, as a user installs it (issue 29): built from the tracked files as CI's clone has them,
tagged with what it holds, both dsh-supervise binaries inside, nothing written into the sources, and
working from a fresh virtualenv: a terminal task under the wheel's own supervisor, and the CLI.

One wheel build and one venv, in one test (tests/README.md: about 10 s here; marker ``wheel``, not in
the quick check). The build is ``pip wheel --no-build-isolation`` with this venv's setuptools and
ziglang (the [test] extra), so it needs no index; the zig cache (~/.cache/dsh-bash/zig) is the one
bin/test warms. The fresh venv reaches anyio and pydantic through a ``.pth`` line naming this venv's
site-packages (a plain path: this venv's editable install, a finder that its own ``.pth`` file
installs, is not processed there), so dsh_bash itself must come from the wheel, and the test says so.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.wheel, pytest.mark.timeout(600)]  # a cold zig cache builds musl: minutes

ROOT = Path(__file__).resolve().parent.parent
NATIVE = "dsh_bash/supervisor/_native"
#: The platform tags of a wheel holding static binaries for both architectures (setup.py says why).
PLATFORM_TAGS = [
    "manylinux_2_17_aarch64",
    "manylinux_2_17_x86_64",
    "musllinux_1_1_aarch64",
    "musllinux_1_1_x86_64",
]
ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
PT_INTERP = 3


def _elf(data: bytes) -> tuple[int, list[int]]:
    """(e_machine, the p_type of every program header) of a 64-bit little-endian ELF file."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    assert data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF file"
    (machine,) = struct.unpack_from("<H", data, 18)
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    return machine, [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]


def _copy_tracked_files(destination: Path) -> None:
    """The files git tracks, as they are in the working tree: what CI's clone of a commit of them holds
    (a clone of HEAD would miss uncommitted changes to the build itself)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.is_file():  # deleted in the working tree and not yet committed
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _listing(tree: Path) -> set[str]:
    return {str(path.relative_to(tree)) for path in tree.rglob("*")}


def _environment() -> dict[str, str]:
    """Without the bytecode settings bin/test and this machine use, so that a .pyc written into the
    sources shows; without PYTHONPATH, so that nothing but the venv's own paths is imported."""
    env = dict(os.environ)
    for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    return env


TERMINAL_TASK = textwrap.dedent(
    """
    import json

    import anyio

    import dsh_bash
    from dsh_bash import BashExecRequest, TerminalSize
    from dsh_bash.supervisor import supervisor_problem
    from dsh_bash_local import LocalBashExecutor, LocalConfig


    async def main() -> None:
        async with LocalBashExecutor(LocalConfig()) as ex:
            request = BashExecRequest(command="tty; echo done", terminal=TerminalSize(rows=24, cols=80))
            task = await ex.start(ex.resolve(request))
            await task.wait()
            read = await ex.read_output(task.id)
            print(json.dumps({
                "dsh_bash": dsh_bash.__file__,
                "problem": supervisor_problem(),
                "containment": ex.containment,
                "supervisor": ex.supervisor_path,
                "exit_code": task.exit_code,
                "output": read.delta,
            }))


    anyio.run(main)
    """
)


def test_wheel_says_what_it_holds_and_runs_from_a_fresh_venv(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _copy_tracked_files(source)
    before = _listing(source)
    out = tmp_path / "wheels"
    env = _environment()

    # At the lowest priority: the build (zig compiling for both architectures) would otherwise take
    # both CPUs from the tests beside it, whose bounds are for hangs, not for a starved machine; it
    # runs first in a whole run (conftest.LONG_FIRST), beside the other workers' first tests.
    pip = [shutil.which("nice") or "nice", "-n", "19", sys.executable, "-m", "pip"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(source)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert _listing(source) == before, "the build wrote into the sources"

    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    # name-version-python-abi-platforms.whl, the platforms a compressed tag set joined by dots
    python_tag, abi_tag, platforms = wheel.name.removesuffix(".whl").split("-")[2:]
    assert (python_tag, abi_tag) == ("py3", "none"), wheel.name
    assert platforms.split(".") == PLATFORM_TAGS, wheel.name

    with zipfile.ZipFile(wheel) as archive:
        wheel_file = next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))
        metadata = archive.read(wheel_file).decode()
        assert "Root-Is-Purelib: false" in metadata, metadata
        assert sorted(line for line in metadata.splitlines() if line.startswith("Tag: ")) == [
            f"Tag: py3-none-{tag}" for tag in PLATFORM_TAGS
        ], metadata
        binaries = sorted(n for n in archive.namelist() if "dsh-supervise" in n)
        assert binaries == [f"{NATIVE}/dsh-supervise-aarch64", f"{NATIVE}/dsh-supervise-x86_64"], binaries
        for arch, machine in ELF_MACHINE.items():
            info = archive.getinfo(f"{NATIVE}/dsh-supervise-{arch}")
            assert (info.external_attr >> 16) & 0o111 == 0o111, f"{arch}: mode {info.external_attr >> 16:o}"
            found_machine, program_headers = _elf(archive.read(info))
            assert found_machine == machine, f"{arch}: e_machine {found_machine}"
            assert PT_INTERP not in program_headers, f"{arch}: dynamically linked (has PT_INTERP)"

    # A fresh venv: the wheel installed (pip checks its tags against this host's), the dependencies
    # from this venv's site-packages.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "dsh_bash_test_dependencies.pth").write_text("".join(f"{d}\n" for d in dependencies))

    script = tmp_path / "terminal_task.py"
    script.write_text(TERMINAL_TASK)
    run = subprocess.run(
        [str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    seen = json.loads(run.stdout.splitlines()[-1])
    assert Path(seen["dsh_bash"]).is_relative_to(venv), f"dsh_bash imported from {seen['dsh_bash']}"
    assert seen["problem"] is None, seen
    assert seen["containment"] == "subreaper", seen
    assert Path(seen["supervisor"]).is_relative_to(venv), seen
    assert seen["exit_code"] == 0, seen
    assert "/dev/pts/" in seen["output"], seen
    assert "done" in seen["output"], seen

    cli = subprocess.run(
        [str(venv / "bin" / "dsh-bash"), "run", "echo hi"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert (cli.returncode, cli.stdout) == (0, "hi\n"), cli.stdout + cli.stderr
