"""The soak plugin's list of issue 30's cases (tests/soak.py) names tests and checks that exist: a
renamed test would otherwise drop out of ``-m hostile`` without a word."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from dsh_bash_conformance import CHECKS
from soak import HOSTILE_CHECKS, HOSTILE_TESTS

TESTS = Path(__file__).parent


@pytest.mark.parametrize("module", sorted(HOSTILE_TESTS))
def test_every_listed_test_exists(module: str) -> None:
    tree = ast.parse((TESTS / module).read_text())
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }
    listed = set(HOSTILE_TESTS[module]) - {"*"}
    assert defined, f"{module} defines no test"
    assert listed <= defined, f"{module} has no {sorted(listed - defined)}"


def test_every_listed_check_is_a_kit_check() -> None:
    assert set(HOSTILE_CHECKS) <= set(CHECKS), sorted(set(HOSTILE_CHECKS) - set(CHECKS))
