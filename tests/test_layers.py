"""The layering contracts (``[tool.importlinter]`` in ``pyproject.toml``, run by ``bin/test``) hold, and fail.

The real tree keeps them. A fake tree of empty packages with the same names, on ``PYTHONPATH`` ahead
of the installed ones, keeps them too until one forbidden import is added: then ``lint-imports``
exits non-zero and names the contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "dsh_bash",
    "dsh_bash_local",
    "dsh_bash_docker",
    "dsh_bash_ssh",
    "dsh_bash_ray",
    "dsh_bash_bwrap",
    "dsh_bash_conformance",
    "dsh_tool_bash",
    "dsh_bash_inspect",
    "dsh_bash_cli",
)
BACKENDS = ("dsh_bash_local", "dsh_bash_docker", "dsh_bash_ssh", "dsh_bash_ray", "dsh_bash_bwrap")

# dsh_bash's kits: subpackages on the seam (the host kit also on the supervisor kit).
KITS = ("dsh_bash.host", "dsh_bash.remote", "dsh_bash.supervisor")

# Imports every layer may make: each package its own private module and dsh_bash's public names; the
# CLI everything's public names.
ALLOWED = {
    "dsh_bash": ["from . import _inner"],
    **{name: ["from . import _inner", "import dsh_bash"] for name in PACKAGES[1:-1]},
    "dsh_bash_cli": ["from . import _inner", *(f"import {name}" for name in PACKAGES[:-1])],
    "dsh_bash.host": ["from . import _inner", "import dsh_bash", "import dsh_bash.supervisor"],
    "dsh_bash.remote": ["from . import _inner", "import dsh_bash"],
    "dsh_bash.supervisor": ["from . import _inner", "import dsh_bash"],
}


def lint_imports(config: Path, cwd: Path, pythonpath: str) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        [str(lint), "--no-cache", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
    )


def _contracts() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        section: dict[str, Any] = tomllib.load(file)["tool"]["importlinter"]
    return section


def _seam_modules() -> list[str]:
    [seam] = [c for c in _contracts()["contracts"] if c["id"] == "seam-alone"]
    modules: list[str] = seam["source_modules"]
    return modules


def fake_tree(tmp_path: Path, extra: tuple[str, str] | None = None) -> tuple[Path, Path]:
    """The packages (dsh_bash's kits and seam modules too), importing only what is allowed (plus
    ``extra``: module, import line); a config with the real contracts minus their ignore_imports
    (they name imports the fake tree lacks)."""
    tree = tmp_path / "tree"
    files: dict[str, list[str]] = {}
    for name in (*PACKAGES, *KITS):
        package = tree.joinpath(*name.split("."))
        package.mkdir(parents=True)
        files[name] = list(ALLOWED[name])
        (package / "_inner.py").write_text("")
    for name in _seam_modules():
        files.setdefault(name, [])
    if extra is not None:
        files[extra[0]].append(extra[1])
    for name, lines in files.items():
        path = tree.joinpath(*name.split("."))
        target = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        target.write_text("\n".join(lines) + "\n")
    section = _contracts()
    out = ["[tool.importlinter]"]
    out += [f"{key} = {json.dumps(value)}" for key, value in section.items() if key != "contracts"]
    for contract in section["contracts"]:
        out.append("[[tool.importlinter.contracts]]")
        out += [f"{key} = {json.dumps(value)}" for key, value in contract.items() if key != "ignore_imports"]
    config = tmp_path / "contracts.toml"
    config.write_text("\n".join(out) + "\n")
    return tree, config


def test_every_module_of_the_seam_is_held_to_it() -> None:
    """A module added to dsh_bash outside its kits falls under the seam's contract: it must be listed."""
    package = ROOT / "dsh_bash"
    found = {"dsh_bash"}
    for path in package.iterdir():
        name = path.stem if path.suffix == ".py" else path.name
        if (path.suffix == ".py" and name != "__init__") or (path / "__init__.py").is_file():
            found.add(f"dsh_bash.{name}")
    assert found - set(KITS) == set(_seam_modules())


def test_the_real_tree_keeps_the_contracts() -> None:
    done = lint_imports(ROOT / "pyproject.toml", ROOT, str(ROOT / "examples" / "bwrap_backend"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Contracts: {len(_contracts()['contracts'])} kept, 0 broken." in done.stdout


def test_the_fake_tree_keeps_them_too(tmp_path: Path) -> None:
    tree, config = fake_tree(tmp_path)
    done = lint_imports(config, tmp_path, str(tree))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("importer", "line", "contract"),
    [
        ("dsh_bash", "import dsh_bash_cli", "ground-floor"),
        ("dsh_bash", "import dsh_bash_local", "ground-floor"),
        ("dsh_bash", "import dsh_bash_inspect", "ground-floor"),
        ("dsh_bash_docker", "import dsh_bash_ssh", "backends-apart"),
        ("dsh_bash_bwrap", "import dsh_bash_local", "backends-apart"),
        ("dsh_bash_local", "import dsh_bash_conformance", "backends-below"),
        ("dsh_bash_ssh", "import dsh_bash_cli", "backends-below"),
        ("dsh_bash_docker", "import dsh_bash_inspect", "backends-below"),
        ("dsh_tool_bash", "import dsh_bash_inspect", "kit-and-tools-on-the-seam"),
        ("dsh_bash_conformance", "import dsh_bash_local", "kit-and-tools-on-the-seam"),
        ("dsh_tool_bash", "import dsh_bash_cli", "kit-and-tools-on-the-seam"),
        ("dsh_bash_cli", "from dsh_bash import _inner", "private-stays-inside"),
        ("dsh_bash_local", "import dsh_bash._inner", "private-stays-inside"),
        ("dsh_bash_cli", "import dsh_tool_bash._inner", "private-stays-inside"),
        ("dsh_bash_conformance", "from dsh_bash_local import _inner", "private-stays-inside"),
        ("dsh_bash._bash_executor", "import dsh_bash.host", "seam-alone"),
        ("dsh_bash", "from dsh_bash.supervisor import _inner", "seam-alone"),
        ("dsh_bash.backend", "import dsh_bash.remote", "seam-alone"),
        ("dsh_bash.supervisor", "import dsh_bash.host", "supervisor-kit-on-the-seam"),
        ("dsh_bash.supervisor", "import dsh_bash.remote", "supervisor-kit-on-the-seam"),
        ("dsh_bash.remote", "import dsh_bash.supervisor", "remote-kit-on-the-seam"),
        ("dsh_bash.remote", "import dsh_bash.host", "remote-kit-on-the-seam"),
        ("dsh_bash.host", "import dsh_bash.remote", "host-kit-on-the-seam"),
        ("dsh_bash_local", "import dsh_bash.host._inner", "private-stays-inside"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    importer: str, line: str, contract: str, tmp_path: Path
) -> None:
    names = {c["id"]: c["name"] for c in _contracts()["contracts"]}
    tree, config = fake_tree(tmp_path, (importer, line))
    done = lint_imports(config, tmp_path, str(tree))
    assert done.returncode != 0, done.stdout
    broken = [row.removesuffix(" BROKEN") for row in done.stdout.splitlines() if row.endswith(" BROKEN")]
    # Others may break as well (through dsh_bash, a backend reaches what dsh_bash imports).
    assert names[contract] in broken, done.stdout
