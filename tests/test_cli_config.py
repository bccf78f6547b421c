"""``dsh-bash run --config``, ``dsh-bash conformance`` and ``dsh-bash doctor``, through the console script.

Backends named ``module:attr`` live in ``tests/cli_config_backends.py`` and ``tests/broken_backends.py``;
the CLI runs in a subprocess with ``tests/`` on ``PYTHONPATH`` so it can import them.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from cli_support import console_script
from dsh_bash_conformance import CHECKS
from dsh_bash_docker import DockerBashExecutor
from ssh_support import TEST_USER, SshServer

from dsh_bash import BashInfrastructureError

TESTS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


def dsh(
    *args: str, cwd: Path | None = None, timeout: float = 120, environment: dict[str, str] | None = None
) -> Outcome:
    """Run ``dsh-bash ARGS...`` with ``tests/`` importable and no ``DSH_BASH_*`` overrides around but
    ``environment``'s."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("DSH_BASH_")}
    env.update(environment or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [console_script(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env=env,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


def config(tmp_path: Path, text: str, name: str = "backend.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def local_toml(tmp_path: Path) -> str:
    workdir = tmp_path / "work"
    workdir.mkdir()
    return config(tmp_path, f'backend = "local"\ncwd = "{workdir}"\ngrace_ms = 500\n')


# -- run --config -----------------------------------------------------------------------------------


def test_run_config_uses_the_configured_backend(local_toml: str, tmp_path: Path) -> None:
    result = dsh("run", "--config", local_toml, "--", "echo hi; pwd")
    assert result == Outcome(0, f"hi\n{tmp_path / 'work'}\n", "")


def test_run_config_cwd_and_timeout_override(local_toml: str, tmp_path: Path) -> None:
    result = dsh("run", "--config", local_toml, "--cwd", str(tmp_path), "--", "pwd")
    assert result == Outcome(0, f"{tmp_path}\n", "")
    # Above the configured (default) max_timeout_ms: raised, not clamped; and it applies.
    result = dsh("run", "--config", local_toml, "--timeout-ms", "700000", "--", "echo ok")
    assert result == Outcome(0, "ok\n", "")
    result = dsh("run", "--config", local_toml, "--timeout-ms", "300", "--", "sleep 5")
    assert result.code == 124
    assert "dsh-bash: timed out after 300ms" in result.err


def test_run_config_keeps_a_local_spill_file(tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "local"\nmax_output_bytes = 100\n')
    result = dsh("run", "--config", toml, "--", "printf '%500s' x")
    # Passed through whole; the kept tail (100 bytes) only decides that a spill file is named.
    assert result.code == 0 and result.out == " " * 499 + "x"
    kept = result.err.split("full output: ", 1)[1].strip()
    assert Path(kept).read_text() == " " * 499 + "x"


def test_run_config_missing_workdir_is_an_error(local_toml: str) -> None:
    result = dsh("run", "--config", local_toml, "--cwd", "/nonexistent-dir", "--", "true")
    assert result.code == 2
    assert "dsh-bash: error:" in result.err and "/nonexistent-dir" in result.err


@pytest.mark.docker
def test_run_config_docker_image(docker_test_image: str, tmp_path: Path) -> None:
    toml = config(tmp_path, f'backend = "docker"\nimage = "{docker_test_image}"\n')
    result = dsh("run", "--config", toml, "--", "echo hi; pwd; echo oops >&2; exit 3")
    assert result == Outcome(3, "hi\n/\n", "oops\n")


@pytest.mark.ssh
def test_run_config_ssh(ssh_server: SshServer, tmp_path: Path) -> None:
    # The same command as the local and Docker cases: only the config file differs.
    fields = ssh_server.config()
    lines = ['backend = "ssh"', f'host = "{fields["host"]}"', f"port = {fields['port']}"]
    lines += [f'username = "{fields["username"]}"', f'known_hosts = "{fields["known_hosts"]}"']
    lines += [f'client_keys = ["{fields["client_keys"][0]}"]']
    toml = config(tmp_path, "\n".join(lines) + "\n")
    result = dsh("run", "--config", toml, "--", "echo hi; whoami; echo oops >&2; exit 3")
    assert result == Outcome(3, f"hi\n{TEST_USER}\n", "oops\n")


# -- bad configurations -----------------------------------------------------------------------------


@pytest.mark.parametrize("subcommand", ["run", "conformance", "doctor"])
def test_bad_value_names_the_field(subcommand: str, tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "local"\nmax_output_bytes = -1\n')
    args = ["--", "true"] if subcommand == "run" else []
    result = dsh(subcommand, "--config", toml, *args)
    assert result.code == 2
    text = result.out + result.err
    assert "max_output_bytes" in text and "backend.toml" in text


def test_unknown_backend_is_a_config_error(tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "no-such-backend"\n')
    result = dsh("run", "--config", toml, "--", "true")
    assert result.code == 2 and "no-such-backend" in result.err and "registered" in result.err


# -- conformance ------------------------------------------------------------------------------------


def _lines(outcome: Outcome) -> list[str]:
    return outcome.out.splitlines()


def test_conformance_local_by_name(local_toml: str) -> None:
    checks = ["timeout-classified", "env-ambient-passes-through", "escapee-killed-on-kill"]
    result = dsh("conformance", "--config", local_toml, "--check", *checks)
    assert result.code == 0, result
    lines = _lines(result)
    assert [line.split()[:3] for line in lines[:3]] == [
        ["PASS", "contract", "timeout-classified"],
        ["PASS", "contract", "env-ambient-passes-through"],
        ["PASS", "beyond", "escapee-killed-on-kill"],
    ]
    assert lines[-1].endswith(
        "contract 2/2 passed (0 failed, 0 error, 0 hung); beyond 1/1 passed "
        "(0 failed, 0 error, 0 hung): contract OK"
    )
    assert "note:" not in result.err  # the local backend needs no caveat


def test_conformance_module_attr_factory_passes(tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "cli_config_backends:local_factory"\n')
    result = dsh("conformance", "--config", toml, "--check", "exit-code-reported", "env-default-scrub")
    assert result.code == 0, result
    assert _lines(result)[-1].endswith("contract OK")


def test_conformance_json(local_toml: str) -> None:
    result = dsh("conformance", "--config", local_toml, "--check", "exec-convenience", "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["contract_ok"] is True
    assert [(r["name"], r["outcome"]) for r in report["results"]] == [("exec-convenience", "passed")]


@pytest.mark.parametrize(
    ("backend", "check"),
    [
        ("TimeoutReportedAsPlainKill", "timeout-classified"),
        ("NoNewSession", "own-session-and-group"),
        ("PassesBashEnv", "no-rc-files"),
    ],
)
def test_conformance_broken_backend_fails_its_check(backend: str, check: str, tmp_path: Path) -> None:
    toml = config(tmp_path, f'backend = "broken_backends:{backend}.from_fields"\n')
    result = dsh("conformance", "--config", toml, "--check", check, "exit-code-reported")
    assert result.code == 1, result
    lines = _lines(result)
    assert lines[0].split()[:3] == ["FAIL", "contract", check]
    assert lines[1].split()[:3] == ["PASS", "contract", "exit-code-reported"]
    assert lines[-1].endswith("contract FAILED")
    report = json.loads(dsh("conformance", "--config", toml, "--check", check, "--json").out)
    assert report["contract_ok"] is False and report["results"][0]["outcome"] == "failed"


def test_conformance_beyond_failure_does_not_fail_the_run(tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "broken_backends:GroupOnlyTracking.from_fields"\n')
    result = dsh("conformance", "--config", toml, "--check", "escapee-killed-on-kill", "exit-code-reported")
    assert result.code == 0, result
    assert _lines(result)[0].split()[:3] == ["FAIL", "beyond", "escapee-killed-on-kill"]
    assert _lines(result)[-1].endswith("contract OK")


def test_conformance_check_timeout_reports_hung(tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "broken_backends:BlocksEventLoop.from_fields"\n')
    result = dsh("conformance", "--config", toml, "--check", "timeout-classified", "--check-timeout", "2")
    assert result.code == 1, result
    assert _lines(result)[0].split()[:3] == ["HUNG", "contract", "timeout-classified"]
    assert "did not finish within 2 s" in result.out


def test_conformance_ambient_hook(tmp_path: Path) -> None:
    """A backend whose ambient environment is not this process's passes the env checks only via its hook."""
    checks = ["env-ambient-passes-through", "env-default-scrub", "env-model-friendly"]
    with_hook = config(tmp_path, 'backend = "cli_config_backends:planting"\n', "hook.toml")
    result = dsh("conformance", "--config", with_hook, "--check", *checks)
    assert result.code == 0, result
    assert "note:" not in result.err
    without = config(tmp_path, 'backend = "cli_config_backends:fixed_ambient"\n', "nohook.toml")
    result = dsh("conformance", "--config", without, "--check", *checks)
    assert result.code == 1, result
    assert _lines(result)[0].split()[:3] == ["FAIL", "contract", "env-ambient-passes-through"]
    assert "FixedAmbientExecutor defines no kit_plant_ambient hook" in result.err


@pytest.mark.docker
def test_conformance_docker_image_plants_in_environment(docker_test_image: str, tmp_path: Path) -> None:
    toml = config(tmp_path, f'backend = "docker"\nimage = "{docker_test_image}"\n')
    result = dsh("conformance", "--config", toml, "--check", "env-ambient-passes-through", "no-rc-files")
    assert result.code == 0, result
    assert "note:" not in result.err


def test_conformance_unknown_check(local_toml: str) -> None:
    result = dsh(
        "conformance", "--config", local_toml, "--check", "timeout-classified", "nope", "--check", "nah"
    )
    assert result.code == 2
    assert "unknown check name(s): nope, nah" in result.err


def test_conformance_needs_a_config() -> None:
    result = dsh("conformance")
    assert result.code == 2 and "--config" in result.err


def test_conformance_list() -> None:
    result = dsh("conformance", "--list")
    assert result.code == 0
    rows = [line.split(maxsplit=3) for line in _lines(result)]
    assert [(name, kind, clause, rule) for name, kind, clause, rule in rows] == [
        (c.name, c.kind, c.clause, c.rule) for c in CHECKS.values()
    ]
    listed = json.loads(dsh("conformance", "--list", "--json").out)
    assert listed == [
        {"name": c.name, "kind": c.kind, "clause": c.clause, "rule": c.rule} for c in CHECKS.values()
    ]


# -- doctor -----------------------------------------------------------------------------------------


def test_without_a_file_dsh_bash_variables_still_apply() -> None:
    """Issue 29: ``DSH_BASH_TIMEOUT_MS=300 dsh-bash run 'sleep 2'`` ignored the variable without --config."""
    result = dsh("run", "sleep 2", environment={"DSH_BASH_TIMEOUT_MS": "300"})
    assert (result.code, result.out) == (124, ""), result
    assert "timed out after 300ms" in result.err
    bad = dsh("run", "true", environment={"DSH_BASH_GRACE_MS": "0"})
    assert bad.code == 2 and "grace_ms" in bad.err and "DSH_BASH_GRACE_MS" in bad.err, bad


def test_doctor_without_a_file_checks_the_local_backend() -> None:
    result = dsh("doctor")
    assert result.code == 0, result
    assert _lines(result)[0].split()[:2] == ["ok", "config"] and "LocalBashExecutor" in _lines(result)[0]
    assert result.out.endswith("dsh-bash doctor: all ok\n")


def test_doctor_local_ok(local_toml: str, tmp_path: Path) -> None:
    result = dsh("doctor", "--config", local_toml)
    assert result.code == 0, result
    lines = _lines(result)
    assert [line.split()[:2] for line in lines[:-1]] == [
        ["ok", step]
        for step in ("config", "open", "containment", "bash", "workdir", "spill", "setsid", "policy", "close")
    ]
    assert "subreaper" in lines[2]
    assert str(tmp_path / "work") in lines[4]
    # Every rule can hold on this host (Landlock, seccomp, user namespaces: MECHANICS.md).
    assert lines[7].split(None, 2)[2] == (
        "configured: unrestricted; can hold here: workspace-write: yes, network none: yes, "
        "network loopback: yes, network allow-list: yes, processes: yes"
    )
    assert lines[-1] == "dsh-bash doctor: all ok"


def test_doctor_tries_a_configured_allow_list_with_its_own_hosts(tmp_path: Path) -> None:
    table = '[policy]\nnetwork = "allow-list"\nallow_hosts = ["a.example"]\n'
    result = dsh("doctor", "--config", config(tmp_path, f'backend = "local"\n{table}'))
    [line] = [each for each in _lines(result) if each.split()[1:2] == ["policy"]]
    assert "network allow-list: yes" in line and "network loopback: yes" in line, line
    assert result.code == 0, result


def test_doctor_fails_a_policy_that_does_not_hold_where_commands_run(tmp_path: Path) -> None:
    """best_effort opens without what cannot hold: the doctor says so (the scripted backend has no
    confinement step); a required policy that cannot hold fails at open, with the hint."""
    scripted = 'backend = "dsh_bash.testing:ScriptedExecutor.from_fields"\n'
    table = '[policy]\npreset = "workspace-write"\nnetwork = "none"\n'
    gap = dsh("doctor", "--config", config(tmp_path, f'{scripted}{table}enforcement = "best_effort"\n'))
    [line] = [each for each in _lines(gap) if each.split()[1:2] == ["policy"]]
    assert line.startswith(
        "FAIL  policy   configured: workspace-write, 5 path(s) unreadable, network none, "
        "enforcement best_effort; it does not hold here and commands run without it: "
    ), line
    assert "has no confinement step" in line and gap.code == 1
    refused = dsh("doctor", "--config", config(tmp_path, f"{scripted}{table}"))
    assert [each.split()[:2] for each in _lines(refused)][1] == ["FAIL", "open"], refused
    assert "policy_unenforceable" in refused.out or "sandbox policy" in refused.out


def _docker_open_reason(socket: Path) -> str:
    async def open_it() -> str:
        try:
            async with DockerBashExecutor.from_fields(image="x:1", docker_host=f"unix://{socket}"):
                return "opened"
        except BashInfrastructureError as exc:
            return exc.reason

    return anyio.run(open_it)


def test_doctor_unreachable_docker_engine(tmp_path: Path) -> None:
    socket = tmp_path / "no-engine.sock"
    toml = config(tmp_path, f'backend = "docker"\nimage = "x:1"\ndocker_host = "unix://{socket}"\n')
    result = dsh("doctor", "--config", toml)
    assert result.code == 1, result
    lines = _lines(result)
    assert lines[0].split()[:2] == ["ok", "config"]
    assert lines[1].split()[:2] == ["FAIL", "open"] and "unreachable" in lines[1] and str(socket) in lines[1]
    assert _docker_open_reason(socket) == "engine_unreachable"
    assert f"fix: {DockerBashExecutor.infra_hints['engine_unreachable']}" == lines[2].strip()
    assert "start the Docker engine" in lines[2] and "docker_host" in lines[2]
    assert lines[-1] == "dsh-bash doctor: 1 step(s) failed"


def test_doctor_workdir_missing(tmp_path: Path) -> None:
    toml = config(tmp_path, 'backend = "local"\ncwd = "/nonexistent-dir"\n')
    result = dsh("doctor", "--config", toml)
    assert result.code == 1, result
    failed = [line for line in _lines(result) if line.startswith("FAIL")]
    assert [line.split()[1] for line in failed] == ["bash", "workdir", "spill", "setsid"]
    assert "fix: set cwd" in result.out
