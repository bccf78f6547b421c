"""The sandbox policy (issue 33, ``docs/design/policy.md``): what a command may write and read and the
limits it runs under, the same words on every backend; applied where the command runs by the
supervisor's ``--confine`` step (:func:`confine_options`), never by the command's cooperation."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

__all__ = [
    "DEFAULT_DENY_READ",
    "PROXY_KEY_VAR",
    "WORKSPACE_WRITABLE",
    "CommandLimits",
    "ConfinementProbe",
    "EgressRoute",
    "NetworkRule",
    "PolicyWidened",
    "SandboxPolicy",
    "confine_options",
    "host_allowed",
    "narrowed",
    "step_variables",
]

#: Never readable under the ``workspace-write`` preset: the credentials a steered command would go
#: for first. ``~`` is the home of the command's user where it runs (its ``HOME``).
DEFAULT_DENY_READ: tuple[str, ...] = ("~/.ssh", "~/.aws", "~/.config/gcloud", "~/.docker", "~/.netrc")
#: Writable under the ``workspace-write`` preset, beside each command's working directory: programs
#: that cannot write a temporary file or ``/dev/null`` fail in ways a model cannot read.
WORKSPACE_WRITABLE: tuple[str, ...] = ("/tmp", "/dev")

_Count = Annotated[int, Strict(), Field(ge=1)]

#: What a command may reach: ``all`` (as its machine may), ``allow-list`` (a loopback network of its
#: own, and through an HTTP proxy there the hosts of ``allow_hosts`` only), ``loopback`` (a network of
#: its own with nothing in it but loopback), ``none`` (no socket at all). Widest first.
NetworkRule = Literal["all", "allow-list", "loopback", "none"]
_NETWORK_WIDTH: dict[str, int] = {"all": 3, "allow-list": 2, "loopback": 1, "none": 0}

#: ``host``, ``host:port``, ``*.domain`` (its subdomains), ``*.domain:port``, or an IPv4 address; a
#: name is matched without regard to case; no port: 80 and 443.
_HOST = re.compile(r"(\*\.)?[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*(:[0-9]{1,5})?")
DEFAULT_PORTS: tuple[int, ...] = (80, 443)


def _allowed_host(entry: str) -> str:
    entry = entry.strip().lower()
    port = entry.rpartition(":")[2] if ":" in entry else ""
    if not _HOST.fullmatch(entry) or (port and not 1 <= int(port) <= 65535):
        raise ValueError(
            f"allow_hosts: {entry!r} is not a host, host:port, *.domain or *.domain:port (ports 1-65535)"
        )
    return entry


def _entry(entry: str) -> tuple[str, tuple[int, ...]]:
    name, _, port = entry.partition(":")
    return name, (int(port),) if port else DEFAULT_PORTS


def host_allowed(allow_hosts: tuple[str, ...], host: str, port: int) -> bool:
    """Whether ``host:port`` is one of ``allow_hosts`` (see :data:`_HOST`): the egress proxy's rule."""
    host = host.lower().rstrip(".")
    for entry in allow_hosts:
        name, ports = _entry(entry)
        if port in ports and (host == name or (name.startswith("*.") and host.endswith(name[1:]))):
            return True
    return False


def _within_allowed(entry: str, base: tuple[str, ...]) -> bool:
    """Whether everything ``entry`` allows, ``base`` allows too."""
    name, ports = _entry(entry)
    for port in ports:
        if not name.startswith("*."):
            covered = host_allowed(base, name, port)
        else:  # a wildcard, within one of the same or a parent domain
            covered = any(
                port in each_ports and each.startswith("*.") and (name == each or name.endswith(each[1:]))
                for each, each_ports in map(_entry, base)
            )
        if not covered:
            return False
    return True


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


#: The variable of the command's environment that carries its proxy's key to the step (which takes
#: it out before the command runs: ``dsh-supervise --confine --proxy-key-env``).
PROXY_KEY_VAR = "DSH_BASH_PROXY_KEY"


#: What the allow-list's step sets in the command's environment (``dsh-supervise --confine``,
#: ``set_proxy_variables``): each of these names the forwarder on loopback...
_STEP_PROXY_NAMES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
_STEP_PROXY_URL = re.compile(r"http://127\.0\.0\.1:[0-9]{1,5}\Z")
#: ... and these leave the command's own loopback out of the proxy.
_STEP_NO_PROXY = {"NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1"}


def step_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` (a command's, as it ended) that hold what the allow-list's step set
    in them: a session does not take them for the command's own changes."""
    found = {name: env[name] for name in _STEP_PROXY_NAMES if _STEP_PROXY_URL.match(env.get(name, ""))}
    found.update({name: value for name, value in _STEP_NO_PROXY.items() if env.get(name) == value})
    return found


class EgressRoute(_Frozen):
    """How a command's step reaches the egress proxy of its allow-list, in the names of the place
    where commands run (a backend's ``_egress_socket``): ``socket``, an abstract unix socket
    (``@NAME``) or a socket file's absolute path; ``key``, for a socket file, the proxy's key
    (``EgressProxies.in_directory``), which the step takes from the command's environment
    (:data:`PROXY_KEY_VAR`) and its relays send first; None for an abstract socket, which needs none."""

    socket: str
    key: str | None


class PolicyWidened(ValueError):
    """A request asked for more than the executor's policy allows; nothing was started."""


class CommandLimits(_Frozen):
    """Per-command limits (``setrlimit`` in the command's process, soft and hard; ``processes``: a
    pids cgroup of the command's own, or ``RLIMIT_NPROC`` counted in a user namespace of its own,
    either counting every process it starts); None: no limit."""

    cpu_seconds: _Count | None = None
    file_bytes: _Count | None = None
    memory_bytes: _Count | None = None
    open_files: _Count | None = None
    processes: _Count | None = None


def _path(value: str, field: str) -> str:
    if not (value.startswith("/") or value == "~" or value.startswith("~/")) or "\0" in value:
        raise ValueError(f"{field}: {value!r} is neither absolute nor under ~/")
    return value if value.startswith("~") else posixpath.normpath(value)


class SandboxPolicy(_Frozen):
    """What a command may write and read, and its limits.

    ``filesystem``: ``unrestricted`` (wherever its user may write: the behaviour before policies) or
    ``workspace-write`` (its working directory and ``writable`` only, everything else read-only, for
    root too). ``deny_read``: never read nor written, whatever ``filesystem`` says (absolute, or under
    ``~/``: the command's home where it runs). ``network``: see :data:`NetworkRule`; ``allow_hosts``
    what ``allow-list`` lets through its proxy. ``enforcement``:
    ``required`` refuses to run where a rule cannot be applied (reason ``policy_unenforceable``);
    ``best_effort`` runs without it."""

    filesystem: Literal["unrestricted", "workspace-write"] = "unrestricted"
    writable: tuple[str, ...] = ()
    deny_read: tuple[str, ...] = ()
    network: NetworkRule = "all"
    allow_hosts: tuple[str, ...] = ()
    limits: CommandLimits = CommandLimits()
    enforcement: Literal["required", "best_effort"] = "required"

    @field_validator("writable", "deny_read", mode="after")
    @classmethod
    def _paths(cls, value: tuple[str, ...], info: object) -> tuple[str, ...]:
        field = getattr(info, "field_name", "path")
        return tuple(dict.fromkeys(_path(each, str(field)) for each in value))

    @field_validator("allow_hosts", mode="after")
    @classmethod
    def _hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(_allowed_host(each) for each in value))

    @model_validator(mode="after")
    def _hosts_need_the_allow_list(self) -> SandboxPolicy:
        if self.allow_hosts and self.network != "allow-list":
            raise ValueError(f'allow_hosts: only with network = "allow-list" (network is {self.network!r})')
        return self

    @classmethod
    def workspace_write(cls, **changes: object) -> SandboxPolicy:
        """The ``workspace-write`` preset: the working directory, ``/tmp`` and ``/dev`` writable, the
        credentials of :data:`DEFAULT_DENY_READ` unreadable."""
        fields: dict[str, object] = {
            "filesystem": "workspace-write",
            "writable": WORKSPACE_WRITABLE,
            "deny_read": DEFAULT_DENY_READ,
            **changes,
        }
        return cls.model_validate(fields)

    @property
    def active(self) -> bool:
        """Whether any rule confines a command (an inactive policy costs nothing: no step runs)."""
        limits = self.limits
        return (
            self.filesystem != "unrestricted"
            or bool(self.deny_read)
            or self.network != "all"
            or any(value is not None for value in limits.model_dump().values())
        )


def _within(path: str, directory: str) -> bool:
    return directory in ("/", path) or path.startswith(directory.rstrip("/") + "/")


def narrowed(base: SandboxPolicy, request: SandboxPolicy | None) -> SandboxPolicy:
    """``base`` as ``request`` narrows it: a request may make the filesystem read-only beyond its
    working directory, name fewer writable paths (each within one of ``base``'s), deny more reads,
    reach less of the network and lower limits, never the reverse (:class:`PolicyWidened`, naming the
    field). A network rule or limit the request leaves out is the executor's."""
    if request is None or request == base:
        return base
    if base.filesystem == "workspace-write" and request.filesystem == "unrestricted":
        raise PolicyWidened("policy.filesystem: the executor's policy is workspace-write, not unrestricted")
    if base.enforcement == "required" and request.enforcement == "best_effort":
        raise PolicyWidened("policy.enforcement: the executor's policy requires its rules to hold")
    writable = request.writable
    if base.filesystem == "workspace-write":
        for path in writable:
            if not any(_within(path, allowed) for allowed in base.writable):
                raise PolicyWidened(
                    f"policy.writable: {path} is not within the executor's writable paths "
                    f"({', '.join(base.writable) or 'its working directory only'})"
                )
    network, allow_hosts = request.network, request.allow_hosts
    if _NETWORK_WIDTH[network] > _NETWORK_WIDTH[base.network]:
        if "network" in request.model_fields_set:
            raise PolicyWidened(f"policy.network: {network} is wider than the executor's {base.network}")
        network, allow_hosts = base.network, base.allow_hosts
    elif network == "allow-list" and base.network == "allow-list":
        for entry in allow_hosts:
            if not _within_allowed(entry, base.allow_hosts):
                allowed = ", ".join(base.allow_hosts)
                raise PolicyWidened(f"policy.allow_hosts: {entry} is not within the executor's ({allowed})")
    limits: dict[str, int | None] = {}
    for name, ceiling in base.limits.model_dump().items():
        asked = getattr(request.limits, name)
        if ceiling is not None and (asked is None or asked > ceiling):
            if asked is not None:
                raise PolicyWidened(f"policy.limits.{name}: {asked} is above the executor's {ceiling}")
            asked = ceiling
        limits[name] = asked
    return SandboxPolicy(
        filesystem=request.filesystem,
        writable=writable,
        deny_read=tuple(dict.fromkeys((*base.deny_read, *request.deny_read))),
        network=network,
        allow_hosts=allow_hosts,
        limits=CommandLimits(**limits),
        enforcement=request.enforcement,
    )


def confine_options(
    policy: SandboxPolicy,
    workdir: str,
    *,
    also_writable: tuple[str, ...] = (),
    proxy: EgressRoute | None = None,
) -> tuple[str, ...] | None:
    """The options of ``dsh-supervise --confine`` that apply ``policy`` to a command that runs in
    ``workdir`` (before ``--``); None when the policy confines nothing. A ``~/`` path goes as it is:
    the step expands it with the command's ``HOME`` where it runs. ``also_writable``: files the
    backend's own machinery has the command write (a session's capture file). ``proxy``: the way to
    the egress proxy that serves ``allow-list`` (required for it; its key, when it has one, goes in
    the command's environment as :data:`PROXY_KEY_VAR`, which the executor adds)."""
    if not policy.active:
        return None
    options: list[str] = []
    writable = ("/",) if policy.filesystem == "unrestricted" else (workdir, *policy.writable, *also_writable)
    for path in writable:
        options += ["--write", path]
    for path in policy.deny_read:
        options += ["--deny-read", path]
    names = {"cpu_seconds": "--cpu-seconds", "file_bytes": "--file-bytes", "memory_bytes": "--memory-bytes",
             "open_files": "--open-files", "processes": "--processes"}  # fmt: skip
    for name, value in policy.limits.model_dump().items():
        if value is not None:
            options += [names[name], str(value)]
    if policy.network == "allow-list":
        if proxy is None:
            raise ValueError('network = "allow-list" needs the egress proxy\'s socket')
        options += ["--network", policy.network, "--proxy", proxy.socket]
        if proxy.key is not None:
            options += ["--proxy-key-env", PROXY_KEY_VAR]
    elif policy.network != "all":
        options += ["--network", policy.network]
    return tuple(options)


class ConfinementProbe(_Frozen):
    """What the policy's step can apply where commands run (``dsh-supervise --confine --probe``
    there): the kernel's Landlock ABI (0: none), whether ``network = "loopback"`` can hold (a
    network namespace can be made, or the one there has nothing but loopback already), and whether
    ``limits.processes`` can (a pids cgroup can be made, or for a user other than root a user
    namespace)."""

    landlock_abi: Annotated[int, Strict(), Field(ge=0)] = 0
    loopback: bool = False
    processes: bool = False

    def problem(self, policy: SandboxPolicy) -> str | None:
        """Why ``policy`` cannot be applied there (None: it can)."""
        if self.landlock_abi < 1:
            return "the kernel there has no Landlock (or it is disabled)"
        if policy.network in ("loopback", "allow-list") and not self.loopback:
            return (
                f'network = "{policy.network}": no network namespace can be made there (user namespaces are '
                "refused) and its network has interfaces besides loopback"
            )
        if policy.limits.processes is not None and not self.processes:
            return (
                "limits.processes: neither a pids cgroup nor (for a user other than root) a user "
                "namespace can be made there (cgroups are writable by root on a host, not inside a "
                "container)"
            )
        return None
