"""Kit targets for the backends this repository tests."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from dsh_bash_conformance import CHECKS, CheckOutcome, KitTarget
from dsh_bash_local import LocalBashExecutor, LocalConfig

#: The checks a backend fails when it finds a command's processes by their environment marker and
#: takes its outcome from in-band reports (Docker with ``containment = "marker"``, as it was before;
#: issue "containment that holds against hostile commands"). Their tests expect exactly these to
#: fail, so one that starts passing is noticed. SSH runs every command under dsh-supervise
#: (foreground ones under ``--frame``, detached background tasks under ``--detach``): it fails none.
MARKER_CONTAINMENT_FAILS: dict[str, frozenset[str]] = {
    "docker": frozenset(
        {
            "escapee-without-environment-killed",
            "escapee-rewriting-environment-killed",
            # Root in the container without CAP_SYS_PTRACE (image mode drops all capabilities)
            # cannot read a non-dumpable process's environment.
            "non-dumpable-escapee-killed",
            # The boot wrapper's nonce is in its initial environment, which the command reads.
            "forged-outcome-ignored",
            # The engine sees a signal death as exit status 128+n only, and nobody here sent it.
            "self-kill-reported-as-signal",
            "self-signal-reports-neither",
            "end-cause-signaled",
        }
    ),
    "ssh": frozenset(),
}
#: Checks whose escapee these backends kill or miss by chance: a setsid fork chain races each
#: kill-script scan (its newest generation is born after the scan). Either outcome is accepted there,
#: but never an error or a hang. A supervisor's kill passes repeat until none is left: no race.
MARKER_CONTAINMENT_RACES: dict[str, frozenset[str]] = {
    "docker": frozenset({"setsid-chain-killed"}),
    "ssh": frozenset(),
}


#: The checks of input to a running task (R-input-*) that use open input
#: (``input-off-by-default`` starts no task with it: it passes everywhere), and of terminals (R-term-*).
INPUT_CHECKS = frozenset(
    name
    for name, each in CHECKS.items()
    if each.clause.startswith("R-input-") and name != "input-off-by-default"
)
TERMINAL_CHECKS = frozenset(name for name, each in CHECKS.items() if each.clause.startswith("R-term-"))
#: Where the kit reports them ``not_applicable`` (the backend refuses ``open_stdin`` or ``terminal``,
#: reason ``interactive_unsupported``, or its reads say ``waiting_for_input=None``); tests expect
#: exactly that, so a backend that starts taking them is noticed. The bwrap example refuses open input
#: for good: bwrap's own process holds the shell's stdin, so a command that closed its stdin could not
#: be told (see its README).
INPUT_NOT_YET: dict[str, frozenset[str]] = {
    "docker": frozenset(),
    "ssh": frozenset(),
    "ray": frozenset(),
    "bwrap": INPUT_CHECKS | TERMINAL_CHECKS,
}


#: The checks of files moved without a shell (R-file-*), and where the kit reports them
#: ``not_applicable`` (reason ``files_unsupported``): the bwrap example's commands see a sandbox, not
#: the host's files (its README). Docker moves them for commands that run as root (every kit row).
FILE_CHECKS = frozenset(name for name, each in CHECKS.items() if each.clause.startswith("R-file-"))
FILES_NOT_YET: dict[str, frozenset[str]] = {
    "docker": frozenset(),
    "ssh": frozenset(),
    "ray": frozenset(),
    "bwrap": FILE_CHECKS,
}


#: The checks of the sandbox policy (R-policy-*), and where the kit reports them ``not_applicable``
#: (the executor refuses an active policy, reason ``policy_unenforceable``): the bwrap example keeps its
#: own sandbox, whose view of the host the policy's paths do not describe. A processes limit needs a
#: pids cgroup the command's user can make (root on a host: local), or for another user a user
#: namespace (the SSH login, the harness as another user); root inside a container (Docker) has
#: neither, nor has the containerized sshd's login.
POLICY_CHECKS = frozenset(name for name, each in CHECKS.items() if each.clause.startswith("R-policy-"))
CGROUP_CHECKS = frozenset({"policy-processes"})
#: The network allow-list's proxy runs in the harness: local serves it in its own network namespace,
#: SSH through a socket file its server forwards, Docker through a socket file in a directory that
#: the container has mounted (image mode: one of the executor's own; an attached container: the
#: config's ``egress_directory``, which the test containers have), on an engine on this host; a
#: remote engine's are refused (REFUSED_BY_TARGET).
EGRESS_CHECKS = frozenset({"policy-network-allow-list", "policy-allow-list-not-borrowed"})
POLICY_NOT_YET: dict[str, frozenset[str]] = {
    "docker": CGROUP_CHECKS,
    "ssh": frozenset(),
    "ray": frozenset(),
    "bwrap": POLICY_CHECKS,
}


#: Contract checks a backend of this repository is known to fail, now and then, each with why: the
#: test then takes "failed" as well as "passed" (and nothing else). The bwrap example: a command that
#: stops the supervisor inside the sandbox and then exits is reported about 11 s later in some runs
#: (timed out; about 1 s in others, and when the command still runs at its timeout). Not understood
#: yet; continuing every stopped supervisor under the fork server did not change it (issue 30).
KNOWN_RACING: dict[str, frozenset[str]] = {
    "docker": frozenset(),
    "ssh": frozenset(),
    "ray": frozenset(),
    "bwrap": frozenset({"stopped-spares-next-command-on-time"}),
}


#: Checks a test target cannot hold, by target: the executor refuses them (fail closed,
#: ``policy_unenforceable``) and the kit reports ``not_applicable``. The containerized sshd
#: (``tests/sshd_container.py``) runs under Docker's default seccomp profile with the host's network:
#: no user namespace can be made there (the network rules and, for its login, the processes limit), and
#: its network is not loopback only. A remote engine's container has no mount of this host's
#: directory of the egress proxies.
REFUSED_BY_TARGET: dict[str, frozenset[str]] = {
    "ssh-container": frozenset({"policy-network-loopback", "policy-processes"}) | EGRESS_CHECKS,
    "docker-remote": EGRESS_CHECKS,
}


def expected_outcome(backend: str, name: str, target: str = "") -> CheckOutcome:
    """What check ``name`` must report against this repository's ``backend`` (``docker``, ``ssh``,
    ``ray``, ``bwrap``), on the test ``target`` (a key of :data:`REFUSED_BY_TARGET`, or none)."""
    not_yet = INPUT_NOT_YET[backend] | FILES_NOT_YET[backend] | POLICY_NOT_YET[backend]
    not_yet |= REFUSED_BY_TARGET.get(target, frozenset())
    return "not_applicable" if name in not_yet else "passed"


_TARGETS: dict[tuple[Hashable, ...], KitTarget] = {}


def reused_target(key: tuple[Hashable, ...], make: Callable[[], KitTarget]) -> KitTarget:
    """The target made for ``key`` earlier in this process, else ``make()``'s.

    The test modules run one check per :func:`run_kit` call; one target per backend and mode lets the
    latency the kit measured before a check (``KitTarget.latency``) serve the checks after it for as
    long as it is fresh, instead of five round trips through a fresh executor before every check.
    """
    target = _TARGETS.get(key)
    if target is None:
        target = _TARGETS[key] = make()
    return target


def local_target(anyio_backend: str) -> KitTarget:
    """The local backend: commands are subprocesses of this process; ambient env is ``os.environ``."""

    def make_executor(**overrides: Any) -> LocalBashExecutor:
        return LocalBashExecutor(LocalConfig(**overrides))

    def make() -> KitTarget:
        return KitTarget(
            name=f"local[{anyio_backend}]", make_executor=make_executor, anyio_backend=anyio_backend
        )

    return reused_target(("local", anyio_backend), make)


# -- which checks run where -----------------------------------------------------------------------
#
# Every backend runs the whole kit once in CI (local on asyncio and trio, Docker image mode on the
# busybox image, SSH on this host, Ray with the local backend and with Docker inside). The rows that
# repeat a backend with one thing changed (its mode, the place of its commands, the userland, the
# transport, the event loop) run the checks that thing can break, and no others: tests/README.md,
# "The kit matrix", says what each row costs and why these.

#: Docker on an engine "on another machine" (``tcp://`` with TLS, ``ssh://`` through ``docker system
#: dial-stdio``): what changes is the transport to the engine. That nothing of the engine's host is
#: read (no side pipe for output, no signal from this host's ``/proc``: every kill goes through the
#: engine) the Ray row with Docker inside holds to the whole kit (a dialed engine is another host's
#: too); until 2026-12-06 these rows ran 35 checks each for it, now the 22 a transport can break.
REMOTE_ENGINE_CHECKS: tuple[str, ...] = (
    # outcomes come back as the supervisor's frames over the transport's stream
    "exit-code-reported",
    "forged-outcome-ignored",
    # bytes both ways over the engine's stream: stdin, its end (a TLS or SSH half-close), all output
    "stdin-delivered",
    "stdin-empty-by-default",
    "output-bytes-exact",
    "streams-separate-exact",
    "flood-bounded-and-timed-out",
    "read-lossy-exact",
    "long-command-runs",
    "bounded-drain",
    "input-reaches-task",
    "input-eof-after-close",
    # a kill through the engine alone, once
    "kill-running-task",
    "kill-ended-task-kills-leftovers",
    # connections: many at once, cancelled mid-request, an engine that refuses, closing under commands
    "concurrent-runs",
    "cancel-at-any-moment-leaves-nothing",
    "cancel-kills-before-propagating",
    "infra-error-reasons",
    "nothing-left-by-failed-open",
    "aclose-bounded",
    "aclose-during-run-raises-closed",
    "aclose-kills-leftovers",
)

#: Docker on the Debian image (GNU coreutils, util-linux, procps, a real ``/etc/passwd``) after the
#: busybox one: what changes is the userland the backend's scripts and the kit's commands meet.
#: Checks that need a tool the busybox test image lacks (perl or python3): ``not_applicable`` there,
#: run on the Debian image instead (they are in DEBIAN_CHECKS).
BUSYBOX_NOT_APPLICABLE = frozenset({"terminal-injection-refused", "policy-allow-list-not-borrowed"})

DEBIAN_CHECKS: tuple[str, ...] = (
    # a terminal's input, pushed with perl's ioctl (TIOCSTI): refused by the supervisor's filter
    "terminal-injection-refused",
    # another list's proxy, found and asked with python3: refused without its key
    "policy-allow-list-not-borrowed",
    # the container's users, environment, rc files and directories
    "command-user",
    "env-default-scrub",
    "env-ambient-passes-through",
    "env-allow-readmits",
    "env-spec-wins",
    "no-rc-files",
    "workdir-and-cwd-used",
    "unusable-workdir-refused",
    "infra-error-reasons",
    "nothing-left-by-failed-open",
    # spill files made, written and removed by the container's own tools
    "spill-cap-inclusive",
    "spill-total-cap",
    "spill-file-private",
    "spill-names-unpredictable",
    "aclose-removes-spill-files",
    "truncation-keeps-tail",
    # terminals and input under GNU stty, tty and a glibc reader
    "terminal-size",
    "terminal-resize",
    "terminal-ctrl-c",
    "terminal-output-incremental",
    "terminal-kill-leaves-nothing",
    "waiting-reported",
    "waiting-not-reported",
    "input-eof-after-close",
    # processes that util-linux's setsid and GNU tools make, and the kills that must find them
    "own-session-and-group",
    "kill-kills-whole-group",
    "timeout-kills-children",
    "escapee-killed-on-kill",
    "escapee-killed-on-aclose",
    "setsid-chain-killed",
    "non-dumpable-escapee-killed",
    "escapee-rewriting-environment-killed",
    "escapee-without-environment-killed",
    # bytes and the command line through a real userland
    "invalid-utf8-replaced",
    "utf8-split-never-mangled",
    "long-command-runs",
)

#: Of DEBIAN_CHECKS, those the mode can change on that userland, run in container mode too (the image
#: mode row runs all of them): what comes from a running container the executor did not make (its
#: users and environment, its directories, its spill directory, an open that fails beside it, a close
#: that cannot remove it), and the hostile terminal. The rest (terminals, waiting, kills and the GNU
#: tools they meet, bytes) run the same scripts through the same exec in both modes: the busybox rows
#: run them in both modes, the Debian image mode row on this userland.
DEBIAN_CONTAINER_CHECKS: tuple[str, ...] = (
    "terminal-injection-refused",
    "policy-allow-list-not-borrowed",
    "command-user",
    "env-default-scrub",
    "env-ambient-passes-through",
    "env-allow-readmits",
    "env-spec-wins",
    "no-rc-files",
    "workdir-and-cwd-used",
    "unusable-workdir-refused",
    "infra-error-reasons",
    "nothing-left-by-failed-open",
    "spill-file-private",
    "aclose-removes-spill-files",
    "escapee-killed-on-aclose",
)


#: The harness's logic over a command's stream, the same wherever the command runs: the outcome,
#: read, output-accounting (spill files aside), listener, task, run and session checks.
_HARNESS_LOGIC = ("R-outcome-", "R-read-", "R-listen-", "R-task-", "R-run-", "R-session-")
#: The checks whose path depends on where and how commands run (70 of 126): life, errors,
#: processes and containment at close, environment, spill files, files, the policy, input and
#: terminals. A row that repeats a backend with only the place changed runs these; the row it
#: repeats runs the harness's logic whole.
PLACE_CHECKS: tuple[str, ...] = tuple(
    name
    for name, each in CHECKS.items()
    if not each.clause.startswith(_HARNESS_LOGIC)
    and not (each.clause.startswith("R-output-") and not each.clause.startswith("R-output-spill"))
)

#: Docker's container mode on busybox: how the container is reached and left (life, errors,
#: processes and containment at close, the environment it was created with, spill files in a
#: directory of the running container, files, the policy's mounts, input and terminals through its
#: execs); image mode runs the rest whole over the same exec stream (until 2026-12-06 all 126 ran
#: in both modes; ``DSH_TEST_CONTAINER_KIT=all`` runs them).
CONTAINER_MODE_CHECKS = PLACE_CHECKS

#: The bwrap example: the local backend's commands under ``bwrap``, which changes their place (a
#: PID namespace, mounts, the environment bwrap passes), not the harness's logic over their
#: stream, which the local rows run whole on asyncio and trio (until 2026-12-06 all 126: 4.8 min
#: of test time; ``DSH_TEST_BWRAP_KIT=all`` runs them).
BWRAP_CHECKS = PLACE_CHECKS

#: SSH to an sshd in a container (its own PID namespace, users and environment), through the CLI:
#: the place changes, the SSH code path does not, and SSH on this host runs the rest whole (until
#: 2026-12-06 all 126: 2.9 min of test time; ``DSH_TEST_SSH_CONTAINER_KIT=all`` runs them).
SSH_CONTAINER_CHECKS = PLACE_CHECKS
