"""The Docker backend's archive helpers, without an engine: the tar a write sends (its parts, the data
never copied into one buffer) and the file a read takes out of the parts the engine's answer came in."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
from dsh_bash_docker._files import _first_member, _one_file_tar

from dsh_bash import BashInfrastructureError, FileOperationError


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


@pytest.mark.parametrize("name", ["f", "d" * 150 + "/" + "é" * 60])  # the long one needs PAX headers
def test_the_tar_sent_holds_the_parents_and_the_file_and_carries_the_data_as_it_is(name: str) -> None:
    data = os.urandom(70_001)
    parts = _one_file_tar(name, data, 0o640, ["a", "a/b"])
    assert any(part is data for part in parts), "the data was copied into another buffer"
    with tarfile.open(fileobj=io.BytesIO(b"".join(parts))) as archive:
        members = archive.getmembers()
        assert [(m.name, m.isdir()) for m in members] == [("a", True), ("a/b", True), (name, False)]
        assert members[2].mode == 0o640
        handle = archive.extractfile(members[2])
        assert handle is not None and handle.read() == data


@pytest.mark.parametrize("part_size", [1, 511, 512, 4096, 1 << 20])
@pytest.mark.parametrize("name", ["f", "x" * 300])
def test_the_file_read_comes_out_of_any_split_of_the_answer(part_size: int, name: str) -> None:
    data = os.urandom(100_000)
    whole = b"".join(_one_file_tar(name, data, 0o644, []))
    parts = _split(whole, part_size) if part_size > 1 else _split(whole, 997)  # 1: an odd size
    assert _first_member(parts, "/p", 1 << 30) == data
    assert _first_member(parts, "/p", 10) == data[:10]  # at most the limit: the caller refuses more


def test_an_answer_cut_short_or_not_a_tar_is_the_engines_failure_and_a_directory_is_refused() -> None:
    whole = b"".join(_one_file_tar("f", b"y" * 5000, 0o644, []))
    with pytest.raises(BashInfrastructureError, match="short"):
        _first_member([whole[:3000]], "/p", 1 << 20)
    with pytest.raises(BashInfrastructureError, match="not one"):
        _first_member([b"\x01" * 2048], "/p", 1 << 20)
    directory = tarfile.TarInfo("d")
    directory.type = tarfile.DIRTYPE
    with pytest.raises(FileOperationError) as refused:
        _first_member([directory.tobuf(format=tarfile.PAX_FORMAT) + bytes(1024)], "/p", 1 << 20)
    assert refused.value.reason == "not_a_regular_file"
