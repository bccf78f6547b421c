"""The conformance kit against the local backend: one test per check and anyio backend."""

from __future__ import annotations

import json
import shutil
import sysconfig
import tempfile
from pathlib import Path

import pytest
from dsh_bash_conformance import CHECKS, run_kit
from kit_targets import POLICY_CHECKS, local_target
from security_support import as_other_user, ensure_other_user

pytestmark = pytest.mark.kit


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(name: str, anyio_backend: str) -> None:
    report = run_kit(local_target(anyio_backend), only=[name])
    [result] = report.results
    assert result.outcome == "passed", f"{result.name} ({result.kind}) {result.outcome}: {result.message}"


#: The harness itself as a user other than root (no capabilities: Landlock, seccomp and the user
#: namespace of network = "loopback" need none), through the command line a user runs. The interpreter
#: is the system's: this venv's lives under /root, which that user cannot enter; the venv's packages
#: are the same build (CPython 3.11 both).
_AS_OTHER_USER = """
import site, sys
site.addsitedir(sys.argv.pop(1))
from dsh_bash_cli import main
sys.exit(main())
"""


def test_policy_checks_pass_with_the_harness_running_as_a_user_other_than_root() -> None:
    ensure_other_user()
    system_python = shutil.which("python3", path="/usr/bin")
    assert system_python, "the policy checks as another user need /usr/bin/python3 (CPython 3.11)"
    work = Path(tempfile.mkdtemp(prefix="dsh-policy-other-"))  # pytest's own tmp is root's alone
    try:
        work.chmod(0o777)
        toml = work / "local.toml"
        toml.write_text(f'backend = "local"\ncwd = "{work}"\n')
        site_packages = sysconfig.get_paths()["purelib"]
        done = as_other_user(
            system_python, "-c", _AS_OTHER_USER, site_packages,
            "conformance", "--config", str(toml), "--json", "--check", *sorted(POLICY_CHECKS),
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    report = json.loads(done.stdout)
    # A pids cgroup is root's to make: the processes limit holds by a user namespace's own count.
    outcomes = {r["name"]: r["outcome"] for r in report["results"]}
    assert outcomes == dict.fromkeys(POLICY_CHECKS, "passed")
