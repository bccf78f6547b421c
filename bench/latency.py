"""Per-command latency of `true`, each backend side by side with what a user would use instead.

Runs alternate (executor, baseline, executor, ...) so drift hits both equally; medians of many runs;
the ratio is the figure that is compared, absolute times are context. Prints a markdown table.

    python bench/latency.py [--runs N] [--docker-image TAG] [--ssh]

``--ssh`` starts a throwaway sshd on a loopback port (needs root; tests/ssh_support.py) and measures
against asyncssh's ``conn.run`` on a connection to the same server and against the ``ssh`` CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dsh_bash_local import LocalBashExecutor, LocalConfig

#: tests/ssh_support.py starts the throwaway sshd.
_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")

Timed = Callable[[], Awaitable[None]]


async def _alternate(
    runs: int,
    subject: Timed,
    baselines: dict[str, Timed],
    *,
    settle: Callable[[], Awaitable[Any]] | None = None,
) -> dict[str, float]:
    """Medians (ms) of ``runs`` calls of each, alternating; ``settle`` is awaited (untimed) after
    every call, so that no work a call left in the background (an executor logging in its next
    channel) overlaps the next call, whichever is timed next."""
    samples: dict[str, list[float]] = {"subject": [], **{name: [] for name in baselines}}
    for _ in range(3):  # warm-up
        await subject()
        for baseline in baselines.values():
            await baseline()
    for _ in range(runs):
        for name, call in [("subject", subject), *baselines.items()]:
            started = time.perf_counter()
            await call()
            samples[name].append(time.perf_counter() - started)
            if settle is not None:
                await settle()
    return {name: statistics.median(values) * 1000 for name, values in samples.items()}


async def _server_quiet() -> None:
    await asyncio.sleep(0.01)


async def _back_to_back(runs: int, subject: Timed, baseline: Timed, block: int = 10) -> dict[str, float]:
    """Medians (ms) of calls made back to back, in alternating blocks of ``block`` calls each (a
    pause between blocks keeps one side's background work out of the other's block)."""
    samples: dict[str, list[float]] = {"subject": [], "baseline": []}
    for _ in range(max(1, runs // block)):
        for name, call in (("subject", subject), ("baseline", baseline)):
            await asyncio.sleep(0.05)
            for _ in range(block):
                started = time.perf_counter()
                await call()
                samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) * 1000 for name, values in samples.items()}


#: The row of the interactive round trip, beside each backend's plain `true`.
ROUND_TRIP = "interactive round trip (a line to `cat` on a terminal, read back) vs `true`"


#: The row of a command in a shell session (issue 31), beside the same executor's plain `true`.
SESSION = (
    "`true` in a shell session (a directory, 3 variables, a function) vs the same executor's plain `true`"
)
#: The row of a session command that may change the state, so that its capture runs (`cd .`, a
#: builtin that costs what `true` does in a plain bash), beside the same executor's plain `true`.
#: `true` itself cannot change the state and runs without the capture (docs/design/sessions.md).
SESSION_CAPTURED = (
    "`cd .` in a session (a command that may change the state: its capture runs) vs the same "
    "executor's plain `true`"
)
#: What the session holds when it is timed: what an agent's session typically does hold.
_SESSION_SETUP = "cd /tmp && export SESSION_A=1 SESSION_B=two PATH=$PATH:/opt/bench/bin && f() { echo f; }"


async def in_session(ex: Any, command: str = "true") -> Timed:
    """A call of ``command`` in a session of ``ex`` that holds what :data:`_SESSION_SETUP` leaves."""
    from dsh_bash import BashExecRequest  # noqa: PLC0415

    session = ex.session()
    result = await ex.run(ex.resolve(BashExecRequest(command=_SESSION_SETUP, session=session)))
    assert result.session is not None and result.session.kept_previous is None, result

    async def call() -> None:
        await ex.run(ex.resolve(BashExecRequest(command=command, session=session)))

    return call


#: The row of a command under the sandbox policy (issue 33), beside the same executor's plain `true`.
POLICY = "`true` under the workspace-write policy (a request's) vs the same executor's plain `true`"


#: Rows of the other rules (informational, no target), each beside the plain `true`.
RULE = "`true` under {rule} (a request's) vs the same executor's plain `true`"


def other_rules(*, processes: bool = True) -> dict[str, Any]:
    """The rules beyond the preset, by the words of their row: each one alone (``processes``:
    with the processes limit, which Docker refuses)."""
    from dsh_bash import CommandLimits, SandboxPolicy  # noqa: PLC0415

    rules = {
        'network = "none"': SandboxPolicy(network="none"),
        'network = "loopback"': SandboxPolicy(network="loopback"),
        'network = "allow-list"': SandboxPolicy(network="allow-list", allow_hosts=("example.com",)),
    }
    if processes:
        rules["limits.processes"] = SandboxPolicy(limits=CommandLimits(processes=256))
    return rules


def under_policy(ex: Any, policy: Any = None) -> Timed:
    """A call of `true` under ``policy`` (default: the ``workspace-write`` preset), asked by the
    request (the same executor, the same container: only the policy's step differs)."""
    from dsh_bash import BashExecRequest, SandboxPolicy  # noqa: PLC0415

    policy = SandboxPolicy.workspace_write() if policy is None else policy

    async def call() -> None:
        await ex.run(ex.resolve(BashExecRequest(command="true", policy=policy)))

    return call


async def round_trip(ex: Any, runs: int) -> float:
    """Median ms of one interactive round trip: a line written to ``cat`` running on a terminal task,
    until a read shows it twice (the terminal's echo, then cat's copy); reads as a tool loop polls."""
    from dsh_bash import BashExecRequest, TerminalSize  # noqa: PLC0415

    task = await ex.start(ex.resolve(BashExecRequest(command="cat", terminal=TerminalSize(rows=24, cols=80))))
    samples = []
    try:
        for i in range(runs + 3):
            line = f"ping{i}"
            started = time.perf_counter()
            await ex.write_input(task.id, line + "\n", owner=None)
            seen = ""
            while seen.count(line + "\r\n") < 2:
                seen += (await ex.read_output(task.id)).delta
                await asyncio.sleep(0.0005)
            if i >= 3:  # warm-up
                samples.append(time.perf_counter() - started)
    finally:
        await ex.kill(task.id)
    return statistics.median(samples) * 1000


async def bench_local(runs: int) -> list[tuple[str, str, float, float]]:
    async def raw() -> None:
        process = await asyncio.create_subprocess_exec("bash", "-c", "true")
        await process.wait()

    async with (
        LocalBashExecutor(LocalConfig()) as ex,
        LocalBashExecutor(LocalConfig(containment="marker")) as marker_ex,
    ):

        async def subject() -> None:
            await ex.exec("true")

        async def marker_only() -> None:
            await marker_ex.exec("true")

        session = await in_session(ex)
        baselines = {
            "raw": raw,
            "marker": marker_only,
            "session": session,
            "captured": await in_session(ex, "cd ."),
            "policy": under_policy(ex),
        }
        rules = other_rules()
        baselines.update({rule: under_policy(ex, policy) for rule, policy in rules.items()})
        medians = await _alternate(runs, subject, baselines)
        interactive = await round_trip(ex, runs)
    return [
        ("local", 'asyncio.create_subprocess_exec("bash","-c","true")', medians["subject"], medians["raw"]),
        # The cost of the containment: the same executor without dsh-supervise (marker only).
        ("local", "the local executor with containment = marker", medians["subject"], medians["marker"]),
        ("local", ROUND_TRIP, interactive, medians["subject"]),
        ("local", SESSION, medians["session"], medians["subject"]),
        ("local", SESSION_CAPTURED, medians["captured"], medians["subject"]),
        ("local", POLICY, medians["policy"], medians["subject"]),
        *(("local", RULE.format(rule=rule), medians[rule], medians["subject"]) for rule in rules),
    ]


async def bench_docker(runs: int, image: str) -> list[tuple[str, str, float, float]]:
    import docker  # noqa: PLC0415
    from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

    client = docker.from_env()
    async with (
        DockerBashExecutor(DockerConfig(image=image)) as ex,
        DockerBashExecutor(DockerConfig(image=image, containment="marker")) as marker_ex,
    ):
        container_id = ex.container_id
        container = client.containers.get(container_id)

        async def subject() -> None:
            await ex.exec("true")

        async def marker_only() -> None:
            await marker_ex.exec("true")

        async def cli() -> None:
            process = await asyncio.create_subprocess_exec("docker", "exec", container_id, "true")
            await process.wait()

        async def sdk() -> None:
            await asyncio.to_thread(container.exec_run, ["true"])

        async def settle() -> None:
            await ex.warm_up()
            await marker_ex.warm_up()

        # The executor starts the next command's exec ahead of it (a warm exec, see
        # dsh_bash_docker._warm) while a command runs; waiting for it, untimed, keeps that work
        # out of the baselines' timing. An agent's commands come seconds apart: warm is the usual
        # case. Back to back, and 50 at once, most commands find no spare and pay a fresh exec.
        baselines = {
            "cli": cli, "sdk": sdk, "marker": marker_only, "session": await in_session(ex),
            "captured": await in_session(ex, "cd ."), "policy": under_policy(ex),
        }  # fmt: skip
        rules = other_rules(processes=False)  # image mode's network: loopback only, as the rules need
        baselines.update({rule: under_policy(ex, policy) for rule, policy in rules.items()})
        medians = await _alternate(runs, subject, baselines, settle=settle)
        burst = await _back_to_back(runs, subject, cli)
        await settle()

        async def fifty(call: Timed) -> float:
            started = time.perf_counter()
            await asyncio.gather(*(call() for _ in range(50)))
            return (time.perf_counter() - started) * 1000

        at_once: dict[str, list[float]] = {"subject": [], "cli": []}
        for _ in range(3):
            at_once["subject"].append(await fifty(subject))
            await settle()
            at_once["cli"].append(await fifty(cli))
        await settle()
        interactive = await round_trip(ex, runs)
    client.close()
    wall = {name: statistics.median(values) for name, values in at_once.items()}
    return [
        ("docker", "docker exec CONTAINER true (CLI)", medians["subject"], medians["cli"]),
        ("docker", "docker exec CLI, calls back to back", burst["subject"], burst["baseline"]),
        ("docker", "docker exec CLI, 50 at once: wall ms of all 50", wall["subject"], wall["cli"]),
        ("docker", "docker-py container.exec_run(['true'])", medians["subject"], medians["sdk"]),
        # The cost of the containment: the same executor without dsh-supervise (marker only).
        ("docker", "the Docker executor with containment = marker", medians["subject"], medians["marker"]),
        ("docker", ROUND_TRIP, interactive, medians["subject"]),
        ("docker", SESSION, medians["session"], medians["subject"]),
        ("docker", SESSION_CAPTURED, medians["captured"], medians["subject"]),
        ("docker", POLICY, medians["policy"], medians["subject"]),
        *(("docker", RULE.format(rule=rule), medians[rule], medians["subject"]) for rule in rules),
    ]


async def bench_ssh(runs: int, server: Any = None) -> list[tuple[str, str, float, float]]:
    """Against ``server`` (a running tests/ssh_support.SshServer), else a throwaway one started here."""
    import sys  # noqa: PLC0415

    import asyncssh  # noqa: PLC0415

    sys.path.insert(0, _TESTS)
    import ssh_support  # noqa: PLC0415

    own_server = server is None
    if own_server:
        server = ssh_support.start_server()
    try:
        options = server.config()
        cli = [
            "ssh", "-q", "-F", "/dev/null", "-p", str(server.port), "-i", server.user_key,
            "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "BatchMode=yes",
            f"{options['username']}@{server.host}", "true",
        ]  # fmt: skip
        async with (
            asyncssh.connect(
                server.host,
                port=server.port,
                username=options["username"],
                client_keys=options["client_keys"],
                known_hosts=server.known_hosts,
                config=None,
            ) as conn,
            server.executor() as ex,
            server.executor(containment="marker") as marker_ex,
        ):

            async def subject() -> None:
                await ex.exec("true")

            async def raw() -> None:
                await conn.run("true")

            async def marker_only() -> None:
                await marker_ex.exec("true")

            async def settle() -> None:
                await ex.warm_up()
                await marker_ex.warm_up()

            # The executor logs a channel in for the next command (a warm login shell, see
            # dsh_bash_ssh._warm) while a command runs; waiting for it, untimed, keeps that work
            # out of the baseline's timing. An agent's commands come seconds apart: warm is the
            # usual case. Back to back, the next command may wait for part of it.
            session = await in_session(ex)
            captured = await in_session(ex, "cd .")
            await settle()
            baselines = {
                "raw": raw,
                "marker": marker_only,
                "session": session,
                "captured": captured,
                "policy": under_policy(ex),
            }
            rules = other_rules()  # the login is not root: processes by a user namespace's count
            baselines.update({rule: under_policy(ex, policy) for rule, policy in rules.items()})
            medians = await _alternate(runs, subject, baselines, settle=settle)
            burst = await _back_to_back(runs, subject, raw)

            async def ssh_cli() -> None:
                process = await asyncio.create_subprocess_exec(
                    *cli, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
                await process.wait()

            # The CLI is timed in a block of its own, against the executor's figure above: each
            # CLI run is a whole SSH handshake (~200 ms of crypto on both ends on the same CPUs),
            # and interleaved with it the executor's next call runs on cold caches (1.2-1.6x its
            # usual time), which no user of the executor alone sees. A pause after each lets the
            # server tear the connection down (its sshd processes end) before the next.
            cli_samples = []
            for _ in range(max(5, runs // 10)):
                started = time.perf_counter()
                await ssh_cli()
                cli_samples.append(time.perf_counter() - started)
                await _server_quiet()
            cli_ms = statistics.median(cli_samples) * 1000
            await settle()
            interactive = await round_trip(ex, runs)
    finally:
        if own_server:
            ssh_support.stop_server(server)
    return [
        ("ssh", 'asyncssh conn.run("true") on a reused connection', medians["subject"], medians["raw"]),
        ("ssh", 'asyncssh conn.run("true"), calls back to back', burst["subject"], burst["baseline"]),
        ("ssh", "ssh CLI (new connection each time)", medians["subject"], cli_ms),
        # The cost of the containment: the same executor without dsh-supervise (marker only).
        ("ssh", "the SSH executor with containment = marker", medians["subject"], medians["marker"]),
        ("ssh", ROUND_TRIP, interactive, medians["subject"]),
        ("ssh", SESSION, medians["session"], medians["subject"]),
        ("ssh", SESSION_CAPTURED, medians["captured"], medians["subject"]),
        ("ssh", POLICY, medians["policy"], medians["subject"]),
        *(("ssh", RULE.format(rule=rule), medians[rule], medians["subject"]) for rule in rules),
    ]


def _machine() -> str:
    cpus = subprocess.run(["nproc"], check=False, capture_output=True, text=True).stdout.strip()
    return f"{platform.system()} {platform.release()}, {cpus} CPUs, Python {platform.python_version()}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--docker-image", help="an image with bash; omit to skip Docker")
    parser.add_argument("--ssh", action="store_true", help="start a throwaway sshd (needs root)")
    args = parser.parse_args()
    rows = await bench_local(args.runs)
    if args.docker_image:
        rows += await bench_docker(max(20, args.runs // 3), args.docker_image)
    if args.ssh:
        rows += await bench_ssh(max(20, args.runs // 2))
    print(f"Median latency of `true`; {_machine()}\n")
    print("| backend | baseline | executor (ms) | baseline (ms) | ratio |")
    print("|---|---|---:|---:|---:|")
    for backend, baseline, subject_ms, baseline_ms in rows:
        ratio = subject_ms / baseline_ms
        print(f"| {backend} | {baseline} | {subject_ms:.2f} | {baseline_ms:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    asyncio.run(main())
