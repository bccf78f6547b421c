"""Checks of the sandbox policy (``R-policy-*``): what a command may write and read and its limits, applied
where it runs whatever the command does. A target that cannot apply a policy refuses it with reason
``policy_unenforceable`` (fail closed): N/A."""

from __future__ import annotations

import secrets
import shlex
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import anyio.abc

from dsh_bash import (
    BashExecRequest,
    BashExecutor,
    BashInfrastructureError,
    BashRunResult,
    CommandLimits,
    PolicyWidened,
    SandboxPolicy,
)

from ._harness import CheckContext, check
from ._support import SETUP_S, expect_raises, expect_raises_sync, show, show_task

#: Nothing writable but the working directory (and what a request adds): not /tmp, where the kit's
#: trees are.
_WORKSPACE_ONLY = SandboxPolicy(filesystem="workspace-write", writable=("/dev",))


_MAKE_TREE = (
    'd=$(mktemp -d) && chmod 755 "$d" && mkdir "$d/work" "$d/other" "$d/secret" && '
    'printf present > "$d/other/present" && printf %s "$1" > "$d/secret/key" && printf %s "$d"'
)


@asynccontextmanager
async def _tree(ctx: CheckContext, **config: Any) -> AsyncIterator[tuple[BashExecutor, str]]:
    """An executor (of ``config``'s fields; N/A where it refuses its policy, ``policy_unenforceable``)
    and a fresh tree made by its commands: work/ and other/ (a file ``present``), secret/ (a file
    ``key`` holding a token); removed afterwards. One executor: on a backend whose every executor has
    a machine of its own (Docker's image mode), a tree made by another would not be there."""
    try:
        async with ctx.executor(**config) as ex:
            token = secrets.token_hex(8)
            made = await ex.exec(f"set -- {token}\n{_MAKE_TREE}")
            ctx.expect(made.exit_code == 0, f"making the tree failed: {made.stderr.text!r}")
            where = made.stdout.text
            try:
                yield ex, where
            finally:
                with anyio.CancelScope(shield=True):
                    await ex.exec(f"rm -rf -- '{where}'")
    except BashInfrastructureError as exc:
        if exc.reason == "policy_unenforceable":
            ctx.not_applicable(f"the target applies no sandbox policy: {exc}")
        raise


async def _confined(
    ctx: CheckContext, ex: BashExecutor, command: str, policy: SandboxPolicy, **fields: Any
) -> BashRunResult:
    """``command`` under the request's ``policy``; N/A where the target refuses to apply one."""
    try:
        return await ex.exec(command, policy=policy, **fields)
    except BashInfrastructureError as exc:
        if exc.reason == "policy_unenforceable":
            ctx.not_applicable(f"the target applies no sandbox policy: {exc}")
        raise


def _lines(result: BashRunResult) -> list[str]:
    return result.stdout.text.split()


@check(
    "policy-write-confined",
    kind="contract",
    clause="R-policy-write",
    rule="Under `workspace-write` a command writes beneath its working directory and the writable paths "
    "only: a new file, an append, a rename in or out, a hard link, a removal or a directory elsewhere "
    "fail, for the command's children too.",
)
async def policy_write_confined(ctx: CheckContext) -> None:
    async with _tree(ctx) as (ex, where):
        script = (
            f"cd '{where}'; echo in > work/new && echo wrote-inside; "
            "echo out > other/new || echo refused-new; echo out >> other/present || echo refused-append; "
            "mv work/new other/moved || echo refused-move-out; mv other/present work/taken || echo "
            "refused-move-in; ln other/present work/hard || echo refused-link; rm other/present || echo "
            "refused-remove; mkdir other/d || echo refused-mkdir; "
            "bash -c 'echo child > other/child' || echo refused-child"
        )
        done = await _confined(ctx, ex, script, _WORKSPACE_ONLY, workdir=f"{where}/work")
        expected = [
            "wrote-inside", "refused-new", "refused-append", "refused-move-out", "refused-move-in",
            "refused-link", "refused-remove", "refused-mkdir", "refused-child",
        ]  # fmt: skip
        said = f"under workspace-write: {_lines(done)}, stderr {done.stderr.text!r}"
        ctx.expect(_lines(done) == expected, said)
        left = await ex.exec(f"ls -A '{where}/other'; cat '{where}/other/present'")
        ctx.expect(
            left.stdout.text == "present\npresent",
            f"outside the workspace after the command: {left.stdout.text!r}",
        )


@check(
    "policy-deny-read",
    kind="contract",
    clause="R-policy-deny-read",
    rule="A path of `deny_read` can be neither read nor written: not directly, not through a symlink, "
    "`..` or `/proc/self/root`, not by a hard link made to it; the rest of the tree reads as before.",
)
async def policy_deny_read(ctx: CheckContext) -> None:
    async with _tree(ctx) as (ex, where):
        token = (await ex.exec(f"cat '{where}/secret/key'")).stdout.text
        linked = await ex.exec(f"ln -s '{where}/secret/key' '{where}/work/link'")
        ctx.expect(linked.exit_code == 0, f"planting the link failed: {linked.stderr.text!r}")
        policy = _WORKSPACE_ONLY.model_copy(update={"deny_read": (f"{where}/secret",)})
        script = (
            f"cat '{where}/secret/key' || echo refused-direct; cat link || echo refused-link; "
            f"cat '{where}/work/../secret/key' || echo refused-dotdot; "
            f"cat '/proc/self/root{where}/secret/key' || echo refused-proc-root; "
            f"ln '{where}/secret/key' hard || echo refused-hard-link; "
            f"echo planted > '{where}/secret/new' || echo refused-write; "
            f"cat '{where}/other/present'"
        )
        done = await _confined(ctx, ex, script, policy, workdir=f"{where}/work")
        expected = [
            "refused-direct", "refused-link", "refused-dotdot", "refused-proc-root", "refused-hard-link",
            "refused-write", "present",
        ]  # fmt: skip
        ctx.expect(token not in done.stdout.text + done.stderr.text, "the command read the denied file")
        ctx.expect(_lines(done) == expected, f"with {where}/secret denied: {_lines(done)}")


@check(
    "policy-limits",
    kind="contract",
    clause="R-policy-limits",
    rule="`limits` hold in the command's process and its children: past `file_bytes` a write fails "
    "(SIGXFSZ), past `cpu_seconds` the command gets SIGXCPU, `open_files` is its descriptor limit, "
    "`memory_bytes` its address space.",
)
async def policy_limits(ctx: CheckContext) -> None:
    limits = CommandLimits(file_bytes=4096, cpu_seconds=1, open_files=64, memory_bytes=1 << 31)
    policy = SandboxPolicy(limits=limits)
    async with _tree(ctx) as (ex, where):
        shown = await _confined(ctx, ex, "ulimit -n; ulimit -v; bash -c 'ulimit -f'", policy)
        ctx.expect(
            _lines(shown) == ["64", str((1 << 31) // 1024), "4"],
            f"ulimit -n, -v, -f in the command: {_lines(shown)}",
        )
        big = await _confined(ctx, ex, f"exec head -c 8192 /dev/zero > '{where}/work/big'", policy)
        said = f"a write past file_bytes: exit {big.exit_code}, signal {big.signal}"
        ctx.expect(big.signal == "SIGXFSZ", said)
        spin = await _confined(ctx, ex, "while :; do :; done", policy)
        ctx.expect(
            spin.signal == "SIGXCPU" and not spin.timed_out,
            f"a busy loop past cpu_seconds: signal {spin.signal}, timed out {spin.timed_out}",
        )


#: Forks one subshell at a time (each sleeps, holding no output pipe) and counts aloud; sh gives up at
#: the first fork that fails, where bash would retry for seconds.
_FORKS = "n=0; while [ $n -lt 40 ]; do (sleep 5) >/dev/null 2>&1 & n=$((n+1)); echo $n; done; echo all"


@check(
    "policy-processes",
    kind="contract",
    clause="R-policy-limits",
    rule="`limits.processes` bounds how many processes a command and everything it starts have at once: "
    "a fork past it fails (`EAGAIN`).",
)
async def policy_processes(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        unconfined = await ex.exec(f"sh -c '{_FORKS}'")
        ctx.expect(
            unconfined.stdout.text.split()[-1:] == ["all"],
            f"without a policy 40 forks should succeed (else this proves nothing): {show(unconfined)}",
        )
        policy = SandboxPolicy(limits=CommandLimits(processes=12))
        done = await _confined(ctx, ex, f"sh -c '{_FORKS}'", policy)
        counted = [word for word in done.stdout.text.split() if word.isdigit()]
        ctx.expect(
            "all" not in done.stdout.text.split() and 1 <= len(counted) < 12,
            f"under processes = 12 a command forked {len(counted)} of 40 subshells: {show(done)}",
        )


#: What a command reaches: its loopback and (routable wherever the machine has a default route, a
#: TEST-NET-2 address no one answers: UDP needs no listener) the outside, from its shell and from a
#: child; then the network's interfaces as the command sees them.
_REACH = (
    "echo x > /dev/udp/127.0.0.1/9 && echo loopback; echo x > /dev/udp/198.51.100.1/9 && echo outside; "
    "bash -c 'echo x > /dev/udp/127.0.0.1/9' && echo child-loopback; "
    "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ' '"
)


async def _reach(ctx: CheckContext, ex: BashExecutor, policy: SandboxPolicy | None) -> tuple[list[str], str]:
    done = await (ex.exec(_REACH) if policy is None else _confined(ctx, ex, _REACH, policy))
    said = done.stdout.text.split("\n")
    return said[:-1], said[-1].strip()


@check(
    "policy-network-none",
    kind="contract",
    clause="R-policy-network",
    rule='Under `network = "none"` a command and its children can make no socket: nothing reaches '
    "even its own loopback.",
)
async def policy_network_none(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        unconfined, _ = await _reach(ctx, ex, None)
        ctx.expect(
            {"loopback", "child-loopback"} <= set(unconfined),
            f"without a policy a command should reach its loopback (else this proves nothing): {unconfined}",
        )
        confined, _ = await _reach(ctx, ex, SandboxPolicy(network="none"))
        ctx.expect(confined == [], f'under network = "none" the command still reached: {confined}')


@check(
    "policy-network-loopback",
    kind="contract",
    clause="R-policy-network",
    rule='Under `network = "loopback"` a command and its children reach their own loopback and nothing '
    "else: the network they see has no interface but `lo`.",
)
async def policy_network_loopback(ctx: CheckContext) -> None:
    async with ctx.executor() as ex:
        confined, interfaces = await _reach(ctx, ex, SandboxPolicy(network="loopback"))
        ctx.expect(
            confined == ["loopback", "child-loopback"],
            f'under network = "loopback": reached {confined} (expected its loopback only)',
        )
        ctx.expect(
            interfaces == "lo", f'under network = "loopback" the command sees interfaces {interfaces!r}'
        )


#: Through the proxy (whose port the step names in HTTPS_PROXY) a CONNECT to each host:port of the
#: arguments; then straight to the first, bypassing the proxy; then the outside.
_THROUGH_PROXY = """
proxy=${HTTPS_PROXY#http://}; proxy_host=${proxy%:*}; proxy_port=${proxy##*:}; proxy_port=${proxy_port%/}
ask() {  # ask HOST:PORT: the proxy's status line, then the first line the host sent
  exec 3<>"/dev/tcp/$proxy_host/$proxy_port" || { echo "no proxy at $HTTPS_PROXY"; return; }
  printf 'CONNECT %s HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n' "$1" "$1" >&3
  IFS= read -r status <&3; echo "status ${status%$'\\r'}"
  if [[ $status == *" 200 "* ]]; then IFS= read -r _ <&3; IFS= read -r line <&3; echo "said $line"; fi
  exec 3<&-
}
for each in "$@"; do ask "$each"; done
(exec 4<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null && echo direct-reached
echo x > /dev/udp/198.51.100.1/9 && echo outside
"""
_ALLOWED = ["status HTTP/1.1 200 Connection established", "said kit-allowed"]


def _ran_or_refused(
    ctx: CheckContext, done: list[BashRunResult] | BashInfrastructureError
) -> list[BashRunResult]:
    """The results; N/A where the target refused the allow-list (``policy_unenforceable``)."""
    if isinstance(done, BashInfrastructureError):
        if done.reason == "policy_unenforceable":
            ctx.not_applicable(f"the target cannot apply a network allow-list: {done}")
        raise done
    return done


@asynccontextmanager
async def _allowed_hosts() -> AsyncIterator[tuple[str, str]]:
    """The allowed hosts: two servers of the kit's on this machine (where a backend that can run the
    proxy here serves it) that say ``kit-allowed``, as ``host:port``; stopped afterwards. Port 1 is
    in no list. The body catches what it expects: an exception out of it would come wrapped in the
    servers' task group's exception group."""

    async def answer(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(b"kit-allowed\n")

    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as first,
        await anyio.create_tcp_listener(local_host="127.0.0.1") as second,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(first.serve, answer)
        tg.start_soon(second.serve, answer)
        ports = (each.extra(anyio.abc.SocketAttribute.local_port) for each in (first, second))
        a, b = (f"127.0.0.1:{port}" for port in ports)
        yield a, b
        tg.cancel_scope.cancel()


_REFUSED = ["status HTTP/1.1 403 Forbidden"]


@check(
    "policy-network-allow-list",
    kind="contract",
    clause="R-policy-network",
    rule='Under `network = "allow-list"` a command reaches the hosts of `allow_hosts` through the proxy '
    "that `HTTPS_PROXY` names, and nothing else: another host gets 403 from the proxy, and the allowed "
    "one cannot be reached past it; a request's narrower list holds as well.",
)
async def policy_network_allow_list(ctx: CheckContext) -> None:
    async with _allowed_hosts() as (a, b):
        policy = SandboxPolicy(network="allow-list", allow_hosts=(a, b))
        narrower = SandboxPolicy(network="allow-list", allow_hosts=(a,))
        try:  # a refusal is taken out of the servers' task group first
            async with ctx.executor(policy=policy) as ex:
                done: list[BashRunResult] | BashInfrastructureError = [
                    await ex.exec(f"set -- {a} 127.0.0.1:1 {b}\n{_THROUGH_PROXY}"),
                    await ex.exec(f"set -- {b}\n{_THROUGH_PROXY}", policy=narrower),
                ]
        except BashInfrastructureError as exc:
            done = exc
    done = _ran_or_refused(ctx, done)
    for result, expected, what in (
        (done[0], [*_ALLOWED, *_REFUSED, *_ALLOWED], f"the executor's list ({a}, {b}): to {a}, port 1, {b}"),
        (done[1], _REFUSED, f"a request's narrower list ({a}): to {b}"),
    ):
        lines = result.stdout.text.splitlines()
        said = f"{what}; then past the proxy: {lines}, stderr {result.stderr.text[-300:]!r}"
        ctx.expect(lines == expected, said)


#: Where a command looks for other lists' proxies: every ``--proxy`` in the command lines of the
#: processes it can see (a forwarder keeps its step's), every TCP listener on loopback in its network
#: (another command's forwarder, where commands share a network), and any key in an environment it
#: can read; it asks each way for its first argument through a CONNECT. Prints ``found N``, then
#: ``key-seen PID`` or ``reached WHERE`` for each way that worked.
_BORROW_PROXY = r"""
import os, socket, sys
target = sys.argv[1]
ways = set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    for flag, value in zip(args, args[1:]):
        if flag == b"--proxy":
            value = value.decode("utf-8", "replace")
            ways.add(("unix", "\0" + value[1:] if value.startswith("@") else value))
    try:
        if b"DSH_BASH_PROXY_KEY=" in open(f"/proc/{pid}/environ", "rb").read():
            print("key-seen", pid)
    except OSError:
        pass
try:
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        address, port = fields[1].split(":")
        if fields[3] == "0A" and address in ("0100007F", "00000000"):
            ways.add(("tcp", int(port, 16)))
except OSError:
    pass
print("found", len(ways))
for kind, where in sorted(ways, key=repr):
    s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET)
    s.settimeout(5)
    try:
        s.connect(where if kind == "unix" else ("127.0.0.1", where))
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        got = b""
        while b"kit-allowed" not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        if b"kit-allowed" in got:
            print("reached", kind, repr(where))
    except OSError:
        pass
    finally:
        s.close()
"""


@check(
    "policy-allow-list-not-borrowed",
    kind="contract",
    clause="R-policy-network",
    rule="A command under a narrower network rule than another command's (a request's shorter "
    "allow-list, or loopback) cannot use that command's allow-list, even when it finds the way to "
    "its proxy (a socket's name in a process's command line, another command's forwarder in a network "
    "they share): it reaches no host of the other list, and no process's environment it can read "
    "holds a proxy's key.",
)
async def policy_allow_list_not_borrowed(ctx: CheckContext) -> None:
    async with _allowed_hosts() as (a, b):
        policy = SandboxPolicy(network="allow-list", allow_hosts=(a, b))
        narrower = SandboxPolicy(network="allow-list", allow_hosts=(a,))
        loopback = SandboxPolicy(network="loopback")
        probe = (
            "command -v python3 >/dev/null || { echo no-python3; exit; }\n"
            f"exec python3 -c {shlex.quote(_BORROW_PROXY)} {b}"
        )
        try:
            async with ctx.executor(policy=policy) as ex:
                # A command of the whole list that stays: its forwarder, with its step's command
                # line, is there while the others look.
                holder = await ex.start(ex.resolve(BashExecRequest(command="echo up; exec sleep 60")))
                said = ""
                with anyio.move_on_after(SETUP_S):
                    while "up" not in said:
                        said += (await ex.read_output(holder.id)).delta
                        await anyio.sleep(0.05)
                held = f"said {said!r}, {show_task(holder)}"
                done: list[BashRunResult] | BashInfrastructureError = [
                    await ex.exec(probe, policy=narrower),
                    await ex.exec(probe, policy=loopback),
                ]
                await ex.kill(holder.id)
        except BashInfrastructureError as exc:
            done = exc
    done = _ran_or_refused(ctx, done)
    if any(result.stdout.text.startswith("no-python3") for result in done):
        ctx.not_applicable("needs python3 where commands run, to look for and talk to the proxies")
    ctx.expect(
        "up" in held and "status='running'" in held, f"the command of the whole list was not up: {held}"
    )
    for result, what in ((done[0], f"under a request's narrower list ({a})"), (done[1], "under loopback")):
        lines = result.stdout.text.splitlines()
        borrowed = [line for line in lines if line.startswith(("reached ", "key-seen "))]
        said = f"{what}, asking for {b} of the executor's list: {lines}, stderr {result.stderr.text[-300:]!r}"
        ctx.expect(result.exit_code == 0 and lines[:1] != [] and lines[0].startswith("found "), said)
        ctx.expect(borrowed == [], said)


@check(
    "policy-not-liftable",
    kind="contract",
    clause="R-policy-lift",
    rule="A command cannot lift its policy for itself or its children: it cannot raise a hard limit, "
    "no setuid program sheds the rules (`no_new_privs`), and a child it starts under a new session "
    "is as confined.",
)
async def policy_not_liftable(ctx: CheckContext) -> None:
    policy = _WORKSPACE_ONLY.model_copy(update={"limits": CommandLimits(open_files=64)})
    async with _tree(ctx) as (ex, where):
        script = (
            "ulimit -Hn 4096 2>/dev/null && echo raised || echo refused-raise; "
            "grep -q '^NoNewPrivs:[[:space:]]*1' /proc/self/status && echo no-new-privs; "
            f"setsid bash -c 'echo x > {where}/other/escaped' 2>/dev/null; "
            f"[ -e '{where}/other/escaped' ] && echo escaped || echo refused-setsid"
        )
        done = await _confined(ctx, ex, script, policy, workdir=f"{where}/work")
        ctx.expect(
            _lines(done) == ["refused-raise", "no-new-privs", "refused-setsid"],
            f"lifting the policy from inside: {_lines(done)}",
        )


@check(
    "policy-narrowed",
    kind="contract",
    clause="R-policy-narrow",
    rule="A request's `policy` narrows the executor's (fewer writable paths, more denied reads, lower "
    "limits) and `resolve` refuses one that would widen it (`PolicyWidened`, naming the field); a spec "
    "made by hand cannot widen it either.",
)
async def policy_narrowed(ctx: CheckContext) -> None:
    # The executor's own policy this time (refused at open where it cannot hold): /tmp writable, where
    # the tree is made; each request below narrows it.
    base = SandboxPolicy(filesystem="workspace-write", writable=("/dev", "/tmp"))
    async with _tree(ctx, policy=base) as (ex, where):
        narrow = SandboxPolicy(filesystem="workspace-write", writable=("/dev",))
        script = "echo x > ../other/n || echo refused; echo y > here && echo wrote"
        done = await ex.exec(script, workdir=f"{where}/work", policy=narrow)
        ctx.expect(_lines(done) == ["refused", "wrote"], f"a narrowed request: {_lines(done)}")
        for wider, field in (
            (SandboxPolicy(), "policy.filesystem"),
            (SandboxPolicy(filesystem="workspace-write", writable=("/",)), "policy.writable"),
        ):
            error = expect_raises_sync(
                PolicyWidened,
                partial(ex.resolve, BashExecRequest(command="true", policy=wider)),
                f"a request widening {field}",
            )
            ctx.expect(field in str(error), f"the refusal names no field: {error}")
        spec = ex.resolve(BashExecRequest(command=f"echo x > '{where}/other/by-hand' || echo refused"))
        by_hand = spec.model_copy(update={"policy": SandboxPolicy()})
        await expect_raises(PolicyWidened, lambda: ex.run(by_hand), "a spec made by hand, wider")
        left = await ex.exec(f"ls -A '{where}/other'")
        ctx.expect(left.stdout.text == "present\n", f"the other directory now holds {left.stdout.text!r}")
