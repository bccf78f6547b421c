"""The sandbox policy's model (dsh_bash._policy): presets, the config's spellings, narrowing, and the
options of the supervisor's --confine step; pure but for the executor's warning about a writable /.
The step itself is tested in test_supervise_confine.py, the policy held by every backend in the
kit's policy-* checks."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from dsh_bash_local import LocalBashExecutor, LocalConfig

from dsh_bash import CommandLimits, ConfigError, PolicyWidened, SandboxPolicy
from dsh_bash._policy import (
    DEFAULT_DENY_READ,
    PROXY_KEY_VAR,
    EgressRoute,
    confine_options,
    host_allowed,
    narrowed,
    step_variables,
)

WORKSPACE = SandboxPolicy.workspace_write()


def test_the_default_confines_nothing_and_costs_no_step() -> None:
    assert not SandboxPolicy().active
    assert confine_options(SandboxPolicy(), "/w") is None
    assert LocalConfig().policy == SandboxPolicy()


def test_the_workspace_preset_writes_the_workspace_tmp_and_dev_and_denies_credentials() -> None:
    assert WORKSPACE.filesystem == "workspace-write" and WORKSPACE.active
    assert WORKSPACE.writable == ("/tmp", "/dev")
    assert WORKSPACE.deny_read == DEFAULT_DENY_READ and "~/.ssh" in WORKSPACE.deny_read
    options = confine_options(WORKSPACE, "/w", also_writable=("/spill/capture",))
    assert options is not None
    assert options[:8] == ("--write", "/w", "--write", "/tmp", "--write", "/dev", "--write", "/spill/capture")
    assert options[8:10] == ("--deny-read", "~/.ssh")


def test_a_config_names_the_policy_by_preset_or_table() -> None:
    assert LocalConfig(policy="workspace-write").policy == WORKSPACE  # type: ignore[arg-type]
    assert LocalConfig(policy="unrestricted").policy == SandboxPolicy()  # type: ignore[arg-type]
    table = {"preset": "workspace-write", "writable": ["/srv/cache"], "limits": {"cpu_seconds": 60}}
    made = LocalConfig(policy=table).policy  # type: ignore[arg-type]
    assert made.writable == ("/srv/cache",) and made.deny_read == DEFAULT_DENY_READ
    assert made.limits == CommandLimits(cpu_seconds=60)
    for bad, said in (
        ("read-only", "not a preset"),
        ({"writable": ["relative"]}, "neither absolute"),
        ({"limits": {"open_files": 0}}, "open_files"),
        ({"preset": "nothing"}, "preset"),
        ({"filesystem": "workspace-write", "network": "proxy"}, "network"),
        ({"network": "none", "allow_hosts": ["example.com"]}, "allow_hosts"),  # not a field (yet)
    ):
        with pytest.raises(ConfigError, match=said):
            LocalConfig(policy=bad)  # type: ignore[arg-type]


def test_limits_alone_make_a_policy_active_and_go_to_the_step_as_numbers() -> None:
    policy = SandboxPolicy(limits=CommandLimits(file_bytes=10, open_files=64, processes=32))
    assert policy.active
    assert confine_options(policy, "/w") == (
        "--write", "/", "--file-bytes", "10", "--open-files", "64", "--processes", "32"
    )  # fmt: skip


def test_a_request_narrows_the_policy() -> None:
    base = SandboxPolicy.workspace_write(limits=CommandLimits(cpu_seconds=60))
    asked = SandboxPolicy(
        filesystem="workspace-write",
        writable=("/tmp/sub",),
        deny_read=("/srv/secret",),
        limits=CommandLimits(cpu_seconds=5, file_bytes=100),
    )
    got = narrowed(base, asked)
    assert got.writable == ("/tmp/sub",)
    assert got.deny_read == (*DEFAULT_DENY_READ, "/srv/secret")  # the executor's denials stay
    assert got.limits == CommandLimits(cpu_seconds=5, file_bytes=100)
    # A limit the request leaves out is the executor's, not none.
    assert narrowed(base, SandboxPolicy.workspace_write()).limits.cpu_seconds == 60
    assert narrowed(base, None) is base
    # An unrestricted executor: any request narrows it.
    assert narrowed(SandboxPolicy(), asked) == asked


def test_the_network_rule_goes_to_the_step_and_narrows_from_all_to_none() -> None:
    assert LocalConfig(policy={"network": "loopback"}).policy.network == "loopback"  # type: ignore[arg-type]
    alone = SandboxPolicy(network="none")
    assert alone.active
    assert confine_options(alone, "/w") == ("--write", "/", "--network", "none")
    assert confine_options(SandboxPolicy(), "/w") is None  # network "all" costs no step
    loopback = SandboxPolicy(network="loopback")
    assert narrowed(loopback, SandboxPolicy(network="none")).network == "none"
    # A request that leaves the network out keeps the executor's; one that names a wider rule is refused.
    assert narrowed(loopback, SandboxPolicy(limits=CommandLimits(cpu_seconds=5))).network == "loopback"
    assert narrowed(SandboxPolicy(), loopback).network == "loopback"
    for wider in ("all", "loopback"):
        with pytest.raises(PolicyWidened, match=f"policy.network: {wider} is wider than the executor's none"):
            narrowed(SandboxPolicy(network="none"), SandboxPolicy(network=wider))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("asked", "field"),
    [
        (SandboxPolicy(), "policy.filesystem"),
        (SandboxPolicy(filesystem="workspace-write", writable=("/etc",)), "policy.writable"),
        (SandboxPolicy(filesystem="workspace-write", writable=("/tmpfoo",)), "policy.writable"),
        (SandboxPolicy.workspace_write(limits=CommandLimits(cpu_seconds=61)), "policy.limits.cpu_seconds"),
        (SandboxPolicy.workspace_write(enforcement="best_effort"), "policy.enforcement"),
    ],
)
def test_a_request_never_widens_the_policy(asked: SandboxPolicy, field: str) -> None:
    base = SandboxPolicy.workspace_write(limits=CommandLimits(cpu_seconds=60))
    with pytest.raises(PolicyWidened, match=field):
        narrowed(base, asked)


def test_an_allow_list_names_hosts_ports_and_subdomains_and_narrows_to_fewer() -> None:
    policy = SandboxPolicy(network="allow-list", allow_hosts=("PyPI.org", "*.github.com", "10.0.0.5:8080"))
    assert policy.allow_hosts == ("pypi.org", "*.github.com", "10.0.0.5:8080")
    hosts = policy.allow_hosts
    assert host_allowed(hosts, "pypi.org", 443) and host_allowed(hosts, "PYPI.ORG.", 80)
    assert not host_allowed(hosts, "pypi.org", 22) and not host_allowed(hosts, "evilpypi.org", 443)
    assert host_allowed(hosts, "api.github.com", 443) and not host_allowed(hosts, "github.com", 443)
    assert host_allowed(hosts, "10.0.0.5", 8080) and not host_allowed(hosts, "10.0.0.5", 443)
    assert confine_options(policy, "/w", proxy=EgressRoute(socket="@p", key=None)) == (
        "--write", "/", "--network", "allow-list", "--proxy", "@p"
    )  # fmt: skip
    # A socket file's key: the step takes it from the command's environment, never an argument.
    keyed = EgressRoute(socket="/e/x.sock", key="ab" * 16)
    assert confine_options(policy, "/w", proxy=keyed) == (
        "--write", "/", "--network", "allow-list", "--proxy", "/e/x.sock",
        "--proxy-key-env", PROXY_KEY_VAR,
    )  # fmt: skip
    with pytest.raises(ValueError, match="egress proxy"):
        confine_options(policy, "/w")
    fewer = SandboxPolicy(network="allow-list", allow_hosts=("api.github.com", "*.x.github.com"))
    assert narrowed(policy, fewer).allow_hosts == fewer.allow_hosts
    assert narrowed(policy, SandboxPolicy(network="loopback")).network == "loopback"
    for wider in ("github.com", "pypi.org:22", "*.com", "example.org"):
        asked = SandboxPolicy(network="allow-list", allow_hosts=(wider,))
        with pytest.raises(PolicyWidened, match=f"policy.allow_hosts: {re.escape(wider)} is not within"):
            narrowed(policy, asked)
    for bad in ("http://x", "a b", "x:99999", "*", "-x.org"):
        with pytest.raises(ValueError, match="allow_hosts"):
            SandboxPolicy(network="allow-list", allow_hosts=(bad,))
    with pytest.raises(ValueError, match='only with network = "allow-list"'):
        SandboxPolicy(allow_hosts=("pypi.org",))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_workspace_write_with_root_writable_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, anyio_backend: str
) -> None:
    """A working directory of / (a container's, where its image names none) makes workspace-write
    write everywhere, as asked: the executor says so, once; in a working directory it says nothing."""
    async with LocalBashExecutor(LocalConfig(cwd=str(tmp_path), policy=WORKSPACE)) as ex:
        with caplog.at_level(logging.WARNING, logger="dsh_bash"):
            await ex.exec("true")
            quiet = [r.getMessage() for r in caplog.records if "confines no writes" in r.getMessage()]
            await ex.exec("true", workdir="/")
            await ex.exec("true", workdir="/")
    said = [r.getMessage() for r in caplog.records if "confines no writes" in r.getMessage()]
    assert quiet == [] and len(said) == 1, said
    assert "with / writable (the working directory)" in said[0]


def test_what_the_allow_list_step_sets_is_told_apart_from_a_commands_own_values() -> None:
    ended = {
        "HTTPS_PROXY": "http://127.0.0.1:3128",
        "http_proxy": "http://127.0.0.1:40211",
        "ALL_PROXY": "http://corp.example:8080",  # the command's own
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,example.org",  # the command's own
        "HTTP_PROXY": "http://127.0.0.1:3128/",  # not the step's form
    }
    assert step_variables(ended) == {
        "HTTPS_PROXY": "http://127.0.0.1:3128",
        "http_proxy": "http://127.0.0.1:40211",
        "NO_PROXY": "localhost,127.0.0.1,::1",
    }
    assert step_variables({}) == {}
