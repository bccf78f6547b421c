"""The SSH backend's follower of detached tasks, where it needs no server: what it removes.

Pure: a stand-in SFTP client whose removal fails part-way, as a lost connection makes it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from dsh_bash_ssh._detached import Follower


class _SftpThatFailsAt:
    def __init__(self, failing: str) -> None:
        self.failing = failing
        self.removed: list[str] = []

    async def remove(self, path: str) -> None:
        if path == self.failing:
            raise OSError("connection lost")
        self.removed.append(path)


@pytest.mark.anyio
async def test_paths_a_failed_removal_left_are_removed_on_the_next_pass() -> None:
    follower = Follower(SimpleNamespace(where="host"), lambda *args: None)  # type: ignore[arg-type]
    removed_calls: list[str] = []
    follower._on_removed["b"] = lambda: removed_calls.append("b")
    follower._to_remove = ["a", "b", "c"]
    sftp: Any = _SftpThatFailsAt("b")
    with pytest.raises(OSError):
        await follower._tick(sftp)
    assert sftp.removed == ["a"]
    assert follower._to_remove == ["b", "c"]  # before: [] (b and c were never removed)
    sftp.failing = ""
    await follower._tick(sftp)
    assert sftp.removed == ["a", "b", "c"] and follower._to_remove == []
    assert removed_calls == ["b"]
