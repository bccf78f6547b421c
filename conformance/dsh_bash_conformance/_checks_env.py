"""Checks of the command's environment: scrub, allow, the model-friendly set, spec.env, command lines."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from functools import partial

import anyio
import anyio.to_thread

from dsh_bash import BashExecRequest, BashExecutor, BashRunResult

from ._harness import CheckContext, check
from ._support import SETUP_S, Box, read_to_end, show, spawn, wait_task

# Every exported variable as NAME=VALUE, NUL-terminated (values may hold newlines), with builtins only.
_DUMP = 'for n in $(compgen -e); do printf "%s=%s\\0" "$n" "${!n}"; done'

MODEL_FRIENDLY = {
    "NO_COLOR": "1",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "MANPAGER": "cat",
    "GIT_EDITOR": "true",
    "GIT_TERMINAL_PROMPT": "0",
    "DEBIAN_FRONTEND": "noninteractive",
    "PYTHONUNBUFFERED": "1",
}


def _parse(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in text.split("\0"):
        if item:
            name, _, value = item.partition("=")
            env[name] = value
    return env


async def _envs(
    ctx: CheckContext, ex: BashExecutor, env: Mapping[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """The command's environment as a foreground run sees it and as a background task sees it."""
    explicit = dict(env) if env else None
    result = await ex.exec(_DUMP, env=explicit)
    ctx.expect(
        result.exit_code == 0 and result.stdout.text, f"dumping the environment failed: {show(result)}"
    )
    task = await ex.start(ex.resolve(BashExecRequest(command=_DUMP, env=explicit)))
    await wait_task(task, SETUP_S)
    background = await read_to_end(ctx, ex, task.id)
    return {"a foreground run": _parse(result.stdout.text), "a background task": _parse(background)}


def _token() -> str:
    return f"kitvalue-{secrets.token_hex(8)}"


_SECRET_NAMES = (
    "MY_API_KEY",
    "SOME_SECRET",
    "GH_TOKEN",
    "DB_PASSWORD",
    "X_PASSWD",
    "AWS_CREDENTIALS_FILE",
    "DSH_INTERNAL",
    "my_secret_thing",
    "ssh_keyfile",
    "Slack_Token_2",
)


@check(
    "env-default-scrub",
    kind="contract",
    clause="R-env-scrub",
    rule="The command's environment is the ambient one minus every variable whose name matches a scrub "
    "pattern (case-insensitive; by default *KEY*, *SECRET*, *TOKEN*, *PASSWORD*, *PASSWD*, *CREDENTIAL*, "
    "DSH_*).",
)
async def default_scrub(ctx: CheckContext) -> None:
    planted = {name: _token() for name in _SECRET_NAMES}
    with ctx.plant_ambient(planted):
        async with ctx.executor() as ex:
            envs = await _envs(ctx, ex)
    values = set(planted.values())
    for where, env in envs.items():
        leaked = sorted(name for name in planted if name in env)
        ctx.expect(not leaked, f"secret-looking ambient variables reached {where}: {leaked}")
        carriers = sorted(name for name, value in env.items() if any(v in value for v in values))
        ctx.expect(not carriers, f"secret values reached {where} under other names: {carriers}")


@check(
    "env-ambient-passes-through",
    kind="contract",
    clause="R-env-ambient",
    rule="The command's environment is the backend's ambient environment (minus the scrubbed names).",
)
async def ambient_passes(ctx: CheckContext) -> None:
    name = f"KIT_PLAIN_{secrets.token_hex(4).upper()}"
    value = f"plain value with spaces, = and\na newline {_token()}"
    with ctx.plant_ambient({name: value}):
        async with ctx.executor() as ex:
            envs = await _envs(ctx, ex)
    for where, env in envs.items():
        ctx.expect(
            env.get(name) == value,
            f"the ambient variable {name} reached {where} as {env.get(name)!r}, not {value!r}",
        )


@check(
    "env-model-friendly",
    kind="contract",
    clause="R-env-model-friendly",
    rule="The command's environment includes the model-friendly set NO_COLOR=1, TERM=dumb, PAGER=cat, "
    "GIT_PAGER=cat, MANPAGER=cat, GIT_EDITOR=true, GIT_TERMINAL_PROMPT=0, DEBIAN_FRONTEND=noninteractive, "
    "PYTHONUNBUFFERED=1, over the ambient values.",
)
async def model_friendly(ctx: CheckContext) -> None:
    ambient = {
        "NO_COLOR": "0",
        "TERM": "xterm-256color",
        "PAGER": "less",
        "GIT_PAGER": "less",
        "MANPAGER": "most",
        "GIT_EDITOR": "vim",
        "GIT_TERMINAL_PROMPT": "1",
        "DEBIAN_FRONTEND": "dialog",
        "PYTHONUNBUFFERED": "0",
    }
    with ctx.plant_ambient(ambient):
        async with ctx.executor() as ex:
            envs = await _envs(ctx, ex)
    for where, env in envs.items():
        wrong = {name: env.get(name) for name, value in MODEL_FRIENDLY.items() if env.get(name) != value}
        ctx.expect(
            not wrong,
            f"model-friendly variables wrong or missing in {where} (want {MODEL_FRIENDLY}): {wrong}",
        )


@check(
    "env-spec-wins",
    kind="contract",
    clause="R-env-spec-wins",
    rule="`spec.env` wins over both the ambient environment and the model-friendly set, and is not scrubbed.",
)
async def spec_wins(ctx: CheckContext) -> None:
    name = f"KIT_WIN_{secrets.token_hex(4).upper()}"
    explicit = {"TERM": "xterm", "PAGER": "more", "MY_TOKEN": _token(), name: "from spec: é = 'x'\n$HOME"}
    with ctx.plant_ambient({name: "from-ambient", "MY_TOKEN": "ambient-token"}):
        async with ctx.executor() as ex:
            envs = await _envs(ctx, ex, explicit)
    for where, env in envs.items():
        wrong = {key: env.get(key) for key, value in explicit.items() if env.get(key) != value}
        ctx.expect(not wrong, f"spec.env values did not win in {where} (want {explicit}): {wrong}")


@check(
    "env-allow-readmits",
    kind="contract",
    clause="R-env-allow",
    rule="A variable matching a scrub pattern is kept when its name matches a pattern in `env_allow`.",
)
async def allow_readmits(ctx: CheckContext) -> None:
    planted = {"GH_TOKEN": _token(), "MY_API_KEY": _token()}
    with ctx.plant_ambient(planted):
        async with ctx.executor(env_allow=["GH_*"]) as ex:
            envs = await _envs(ctx, ex)
    for where, env in envs.items():
        ctx.expect(
            env.get("GH_TOKEN") == planted["GH_TOKEN"],
            f"env_allow=['GH_*'] did not re-admit GH_TOKEN into {where}: {env.get('GH_TOKEN')!r}",
        )
        ctx.expect("MY_API_KEY" not in env, f"env_allow=['GH_*'] let MY_API_KEY into {where}")


@check(
    "env-scrub-replaces-defaults",
    kind="contract",
    clause="R-env-scrub-replaces",
    rule="Setting `env_scrub` replaces the default patterns; its globs match case-insensitively.",
)
async def scrub_replaces(ctx: CheckContext) -> None:
    planted = {"KIT_DROP_ME": _token(), "MY_API_KEY": _token(), "DSH_KIT_SETTING": _token()}
    with ctx.plant_ambient(planted):
        async with ctx.executor(env_scrub=["kit_drop_*"]) as ex:
            envs = await _envs(ctx, ex)
    for where, env in envs.items():
        ctx.expect(
            "KIT_DROP_ME" not in env, f"env_scrub=['kit_drop_*'] did not scrub KIT_DROP_ME from {where}"
        )
        for name in ("MY_API_KEY", "DSH_KIT_SETTING"):
            ctx.expect(
                env.get(name) == planted[name],
                f"with env_scrub replacing the defaults, {name} should reach {where}; got {env.get(name)!r}",
            )


@check(
    "env-values-not-on-command-line",
    kind="contract",
    clause="R-env-off-command-line",
    rule="No value the executor passes in the environment ever appears on a command line.",
)
async def values_not_on_command_line(ctx: CheckContext) -> None:
    # Every value shares a prefix unique to this check run: one scan looks for all of them.
    prefix = f"kitvalue-{secrets.token_hex(6)}"
    explicit_value, token_value, ambient_value = (f"{prefix}-{secrets.token_hex(4)}" for _ in range(3))
    values = (explicit_value, token_value, ambient_value)
    probe = 'printf "%s|%s|%s" "${#KIT_SPEC_VALUE}" "${#MY_TOKEN}" "${#KIT_AMBIENT_VALUE}"'
    expected = "|".join(str(len(v)) for v in values)
    explicit = {"KIT_SPEC_VALUE": explicit_value, "MY_TOKEN": token_value}
    found: list[int] = []
    stop = threading.Event()

    def scan() -> None:
        # As tight as the target allows: a wrapper that shows a value only until it execs is
        # caught with some luck per command, and the check starts many commands.
        while not stop.is_set():
            found.extend(ctx.target.find_processes(prefix))

    with ctx.plant_ambient({"KIT_AMBIENT_VALUE": ambient_value}):
        async with ctx.executor() as ex, anyio.create_task_group() as tg:
            tg.start_soon(partial(anyio.to_thread.run_sync, scan))
            try:
                slow: Box[BashRunResult] = spawn(tg, partial(ex.exec, f"sleep 0.4; {probe}", env=explicit))
                task = await ex.start(
                    ex.resolve(BashExecRequest(command=f"sleep 0.4; {probe}", env=explicit))
                )
                for i in range(20):
                    if i % 2:
                        quick = await ex.start(ex.resolve(BashExecRequest(command=probe, env=explicit)))
                        await wait_task(quick, SETUP_S)
                        delta = await read_to_end(ctx, ex, quick.id)
                    else:
                        delta = (await ex.exec(probe, env=explicit)).stdout.text
                    ctx.expect(delta == expected, f"a probe did not see the values: {delta!r}")
                await wait_task(task, 0.4 + ctx.allowance_s)
                with anyio.move_on_after(0.4 + ctx.allowance_s):
                    await slow.done.wait()
            finally:
                stop.set()
            ctx.expect(slow.value is not None, f"the foreground probe {slow.describe()}")
            assert slow.value is not None
            ctx.expect(
                slow.value.stdout.text == expected, f"the probe did not see the values: {show(slow.value)}"
            )
            delta = await read_to_end(ctx, ex, task.id)
            ctx.expect(delta == expected, f"the background probe did not see the values: {delta!r}")
    ctx.expect(
        not found, f"environment values appeared on the command lines of processes {sorted(set(found))}"
    )
