"""Abuse through output: huge, one long line, binary, split characters, a stdout closed early.

Every case runs on every backend (SSH last) and checks what the caller was told (text, counts,
truncation, the spill file's exact bytes), and that nothing is left running. See docs/faults.md.
"""

from __future__ import annotations

import hashlib
import time

import anyio
import pytest
from fault_support import Backend, backend_params, eventually_gone, wait_for_processes

from dsh_bash import BashExecRequest, BashExecutor

pytestmark = [pytest.mark.faults, pytest.mark.anyio]

ALL = backend_params()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _sha256_of(ex: BashExecutor, path: str) -> str:
    """The sha256 of a spill file, computed where the backend's commands run (it lives there)."""
    result = await ex.exec(f"sha256sum < '{path}'", timeout_ms=60_000)
    assert result.exit_code == 0, result
    return result.stdout.text.split()[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", backend_params("local"), indirect=True)
async def test_one_gigabyte_of_output(backend: Backend) -> None:
    # 1 GiB of zeros: memory keeps the tail, the spill file is given up past max_spill_bytes (64 MiB),
    # every byte is still counted, and the command's exit code comes through.
    gib = 1 << 30
    async with backend.make() as ex:
        started = time.monotonic()
        result = await ex.exec("head -c 1073741824 /dev/zero; echo done >&2", timeout_ms=200_000)
        elapsed = time.monotonic() - started
        print(f"1 GiB through {backend.name}: {elapsed:.1f}s ({gib / elapsed / 1e6:.0f} MB/s)")
        assert (result.exit_code, result.timed_out) == (0, False), result
        assert result.stdout.total_bytes == gib
        assert result.stdout.truncated
        assert result.stdout.spill_path is None  # past max_spill_bytes: the spill file was given up
        assert result.stdout.text == "\0" * ex.config.max_output_bytes
        assert result.stderr.text == "done\n"
        assert (await ex.exec("echo still here")).stdout.text == "still here\n"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ALL, indirect=True)
async def test_large_output_is_whole_in_the_spill_file(backend: Backend) -> None:
    # 40 MB of numbered lines (under max_spill_bytes): the spill file holds every byte, in order.
    count = 5_000_000
    expected = "".join(f"{i}\n" for i in range(1, count + 1)).encode()
    async with backend.make() as ex:
        started = time.monotonic()
        result = await ex.exec(f"seq 1 {count}", timeout_ms=60_000)
        print(f"{len(expected) / 1e6:.0f} MB through {backend.name}: {time.monotonic() - started:.1f}s")
        assert result.exit_code == 0, result
        assert result.stdout.total_bytes == len(expected)
        assert result.stdout.truncated
        assert result.stdout.text.encode() == expected[-ex.config.max_output_bytes :]
        assert result.stdout.spill_path is not None
        assert await _sha256_of(ex, result.stdout.spill_path) == hashlib.sha256(expected).hexdigest()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ALL, indirect=True)
async def test_one_megabyte_single_line(backend: Backend) -> None:
    size = 1 << 20
    async with backend.make() as ex:
        command = f"head -c {size} /dev/zero | tr '\\0' a"
        result = await ex.exec(command, timeout_ms=30_000)
        assert result.exit_code == 0, result
        assert result.stdout.total_bytes == size
        assert result.stdout.truncated
        assert result.stdout.text == "a" * ex.config.max_output_bytes
        assert result.stdout.spill_path is not None
        assert await _sha256_of(ex, result.stdout.spill_path) == hashlib.sha256(b"a" * size).hexdigest()
        # The same line through a background task: every byte is delivered once, in order.
        task = await ex.start(ex.resolve(BashExecRequest(command=command)))
        with anyio.fail_after(30):
            await task.wait()
        read = await ex.read_output(task.id)
        assert (task.status, task.exit_code) == ("completed", 0)
        assert read.delta.rstrip("\n") == "a" * len(read.delta.rstrip("\n"))
        if read.lossy:
            assert len(read.delta) + read.dropped_bytes == size
            assert read.stdout_spill_path is not None
        else:
            assert read.delta == "a" * size


#: Every byte value once, then every byte value again: binary output with NULs and invalid UTF-8.
BINARY_COMMAND = 'for round in 1 2; do for i in $(seq 0 255); do printf "\\\\$(printf %03o $i)"; done; done'
BINARY = bytes(range(256)) * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ALL, indirect=True)
async def test_binary_output(backend: Backend) -> None:
    async with backend.make() as ex:
        result = await ex.exec(BINARY_COMMAND)
        assert result.exit_code == 0, result
        assert result.stdout.total_bytes == len(BINARY)
        assert not result.stdout.truncated
        assert result.stdout.text == BINARY.decode("utf-8", errors="replace")
        # Truncated: the tail is decoded the same way and the spill file holds the exact bytes.
        ex.reconfigure(max_output_bytes=100)
        result = await ex.exec(BINARY_COMMAND)
        assert result.stdout.truncated
        assert result.stdout.total_bytes == len(BINARY)
        assert result.stdout.spill_path is not None
        assert await _sha256_of(ex, result.stdout.spill_path) == hashlib.sha256(BINARY).hexdigest()
        assert "\ufffd" in result.stdout.text  # the tail (bytes 156..255) is not valid UTF-8
        assert result.stdout.text.endswith(BINARY[156:].decode("utf-8", errors="replace")[-50:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ALL, indirect=True)
async def test_multibyte_character_split_across_chunks_and_reads(backend: Backend) -> None:
    # The euro sign is three bytes; the command writes them in separate writes, with pauses between.
    split = "printf '\\342'; sleep 0.4; printf '\\202'; sleep 0.4; printf '\\254'"
    async with backend.make() as ex:
        result = await ex.exec(f"{split}; echo; {{ {split}; }} >&2")
        assert (result.stdout.text, result.stderr.text) == ("\u20ac\n", "\u20ac")
        # In the background, a read between the bytes returns nothing of the character, not a U+FFFD.
        task = await ex.start(ex.resolve(BashExecRequest(command=f"{split}; sleep 0.4; printf x")))
        deltas = []
        with anyio.fail_after(20):
            while task.status == "running":
                deltas.append((await ex.read_output(task.id)).delta)
                await anyio.sleep(0.1)
            await task.wait()
        deltas.append((await ex.read_output(task.id)).delta)
        assert "".join(deltas) == "\u20acx", deltas
        assert all("\ufffd" not in delta for delta in deltas)
        # A tail cut inside a character keeps whole characters only.
        ex.reconfigure(max_output_bytes=7)
        result = await ex.exec("printf '\\342\\202\\254%.0s' 1 2 3 4")  # four euro signs, 12 bytes
        assert result.stdout.truncated
        assert result.stdout.total_bytes == 12
        assert result.stdout.text in ("\u20ac\u20ac", "\ufffd\u20ac\u20ac"), result.stdout.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ALL, indirect=True)
async def test_command_that_closes_stdout_early(backend: Backend, marker: str) -> None:
    async with backend.make() as ex:
        # The shell closes its stdout, keeps running, then reports on stderr and exits non-zero.
        started = time.monotonic()
        result = await ex.exec(
            f"echo before; exec >&-; sleep 1; echo after >&2; bash -c 'exit 3' {marker}", timeout_ms=20_000
        )
        assert time.monotonic() - started >= 1.0  # the result waited for the shell, not for stdout
        assert (result.exit_code, result.signal, result.timed_out) == (3, None, False), result
        assert (result.stdout.text, result.stderr.text) == ("before\n", "after\n")
        # Both streams closed while the command runs on: the result still comes at the exit.
        result = await ex.exec(f"exec >&- 2>&-; bash -c 'sleep 1' {marker}; exit 4", timeout_ms=20_000)
        assert (result.exit_code, result.stdout.text, result.stderr.text) == (4, "", "")
        # A reader that closes early: the writer gets SIGPIPE, the pipeline reports the reader.
        result = await ex.exec('yes | head -n 3; echo "${PIPESTATUS[*]}"')
        assert result.stdout.text == "y\ny\ny\n141 0\n"
        # In the background, a task that closed its stdout still ends and reports its exit.
        task = await ex.start(
            ex.resolve(BashExecRequest(command=f"echo early; exec >&-; bash -c 'sleep 0.5' {marker}; exit 5"))
        )
        await wait_for_processes(marker)
        with anyio.fail_after(20):
            await task.wait()
        assert (task.status, task.end_cause, task.exit_code) == ("completed", "exited", 5)
        assert (await ex.read_output(task.id)).delta == "early\n"
    assert await eventually_gone(marker, 2) == []
