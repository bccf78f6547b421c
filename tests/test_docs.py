"""The documentation holds together.

- Every relative link in every git-tracked Markdown file resolves to a tracked file or directory inside the
  repository (and an ``#anchor`` to a heading of the Markdown file it names); no link leads outside.
- ``docs/contract.md`` and the conformance kit name each other: every check's clause is a rule id there,
  that rule names the check in its "Checked by", every "Checked by" names only existing checks, and every
  rule says how it is checked.

The checkers are plain functions over text, so the tests at the end prove each of them can fail.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest
from dsh_bash_conformance import CHECKS

from dsh_bash import INFRA_REASONS, load_executor

REPO = Path(__file__).resolve().parent.parent
CONTRACT = REPO / "docs" / "contract.md"

# -- links --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold code spans and brackets one level deep.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def tracked_files(root: Path = REPO) -> set[str]:
    """Paths (relative, with ``/``) of the files git tracks under ``root``."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True, text=True
    ).stdout
    return {path for path in out.split("\0") if path}


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked out."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            lines.append((number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    found: list[tuple[int, str]] = []
    for number, line in _prose_lines(text):
        found += [(number, m.group(1)) for m in _INLINE_LINK.finditer(line)]
        definition = _REFERENCE_DEF.match(line)
        if definition:
            found.append((number, definition.group(1)))
    return found


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: code marks and link targets dropped, lower case, punctuation
    removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text, duplicates numbered as GitHub does (``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    fence: str | None = None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if match:
            fence = match.group(1) if fence is None else (None if match.group(1) == fence else fence)
            continue
        heading = _HEADING.match(line) if fence is None else None
        if heading:
            slug = github_anchor(heading.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def link_problems(relpath: str, root: Path, tracked: set[str]) -> list[str]:
    """What is wrong with the links of the Markdown file ``relpath`` (relative to ``root``)."""
    text = (root / relpath).read_text(encoding="utf-8")
    directories = {str(Path(path).parent.as_posix()) for path in tracked}
    directories |= {parent.as_posix() for path in tracked for parent in Path(path).parents}
    problems: list[str] = []
    for number, target in links(text):
        where = f"{relpath}:{number}: {target!r}"
        if not target:
            problems.append(f"{where}: empty link")
            continue
        if target.startswith("file:"):
            problems.append(f"{where}: leads outside the repository (file: URL)")
            continue
        if _SCHEME.match(target):
            continue  # http(s), mailto: not a file of the repository
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if path_part.startswith("/"):
            problems.append(f"{where}: an absolute path leads outside the repository")
            continue
        if path_part:
            joined = os.path.normpath(os.path.join(os.path.dirname(relpath), path_part))
            if joined == ".." or joined.startswith("../") or os.path.isabs(joined):
                problems.append(f"{where}: leads outside the repository")
                continue
            resolved = "" if joined == "." else joined
            if resolved not in tracked and resolved not in directories:
                problems.append(f"{where}: no tracked file or directory {resolved or '.'!r}")
                continue
        else:
            resolved = relpath
        if (
            anchor
            and resolved.endswith(".md")
            and resolved in tracked
            and anchor not in anchors((root / resolved).read_text(encoding="utf-8"))
        ):
            problems.append(f"{where}: {resolved} has no heading with anchor #{anchor}")
    return problems


def _markdown_files() -> list[str]:
    return sorted(path for path in tracked_files() if path.endswith(".md"))


@pytest.mark.parametrize("relpath", _markdown_files())
def test_relative_links_resolve_inside_the_repository(relpath: str) -> None:
    assert link_problems(relpath, REPO, tracked_files()) == []


# -- the contract and the kit -------------------------------------------------------------------------

_RULE_START = re.compile(r"^- `(R-[^`]*)`")
_RULE_ID = re.compile(r"R-[a-z]+(?:-[a-z0-9]+)+")
_RULE_REFERENCE = re.compile(r"`(R-[A-Za-z0-9-]+)`")
_CHECKED_BY = "Checked by:"
_NOT_CHECKED = "Not checked by the kit:"


@dataclass(frozen=True)
class Rule:
    id: str
    line: int
    body: str


def parse_rules(text: str) -> list[Rule]:
    """Every rule: a list item starting with its id in backticks, with its indented continuation lines."""
    rules: list[Rule] = []
    current: tuple[str, int, list[str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if current is not None and line.startswith("  ") and line.strip():
            current[2].append(line.strip())
            continue
        if current is not None:
            rules.append(Rule(current[0], current[1], " ".join(current[2])))
            current = None
        match = _RULE_START.match(line)
        if match:
            current = (match.group(1), number, [line[match.end() :].strip()])
    if current is not None:
        rules.append(Rule(current[0], current[1], " ".join(current[2])))
    return rules


def checked_by(rule: Rule) -> list[str] | None:
    """The checks a rule's "Checked by:" names (``None`` when it has none); a malformed list raises."""
    if _CHECKED_BY not in rule.body:
        return None
    tail = rule.body.split(_CHECKED_BY, 1)[1].split("(", 1)[0]
    names = re.findall(r"`([^`]+)`", tail)
    residue = re.sub(r"`[^`]+`", "", tail)
    if not names or re.sub(r"\band\b|[\s,.]", "", residue):
        raise ValueError(f"{rule.id}: 'Checked by:' must list checks in backticks only, got {tail.strip()!r}")
    return names


def contract_problems(text: str, clauses: Mapping[str, str], references: Iterable[str] = ()) -> list[str]:
    """What keeps the contract ``text`` and the checks (``name -> clause``) from naming each other.

    ``references`` are further texts (other Markdown files) whose backticked rule ids must exist.
    """
    problems: list[str] = []
    rules = parse_rules(text)
    by_id: dict[str, Rule] = {}
    for rule in rules:
        if not _RULE_ID.fullmatch(rule.id):
            problems.append(f"line {rule.line}: {rule.id!r} is not a rule id (R-<section>-<short-name>)")
        if rule.id in by_id:
            first = by_id[rule.id].line
            problems.append(f"line {rule.line}: {rule.id} is defined twice (first on line {first})")
        by_id.setdefault(rule.id, rule)
    named: dict[str, list[str]] = {}
    for rule in rules:
        try:
            names = checked_by(rule)
        except ValueError as exc:
            problems.append(f"line {rule.line}: {exc}")
            continue
        says_not = _NOT_CHECKED in rule.body
        if (names is None) == (not says_not):
            problems.append(
                f"line {rule.line}: {rule.id} must say either '{_CHECKED_BY} ...' or '{_NOT_CHECKED} <why>'"
                " (exactly one)"
            )
        named[rule.id] = names or []
        problems += [
            f"line {rule.line}: {rule.id} names {name!r}, which is not a check"
            for name in names or []
            if name not in clauses
        ]
    for name, clause in clauses.items():
        if clause not in by_id:
            problems.append(f"check {name!r} names clause {clause}, which is not a rule of the contract")
        elif name not in named.get(clause, []):
            problems.append(f"check {name!r} names clause {clause}, but that rule does not name the check")
    for label, other in [("the contract", text), *((f"text {i}", t) for i, t in enumerate(references, 1))]:
        problems += [
            f"{label} refers to {ref}, which is not a rule of the contract"
            for ref in sorted(set(_RULE_REFERENCE.findall(other)))
            if ref not in by_id
        ]
    return problems


def test_contract_and_kit_name_each_other() -> None:
    # docs/design/ holds proposals: they name rules the contract does not have yet.
    others = [
        (REPO / path).read_text(encoding="utf-8")
        for path in _markdown_files()
        if (REPO / path) != CONTRACT and not path.startswith("docs/design/")
    ]
    clauses = {name: check.clause for name, check in CHECKS.items()}
    assert contract_problems(CONTRACT.read_text(encoding="utf-8"), clauses, others) == []


def test_contract_documents_every_infrastructure_reason() -> None:
    text = CONTRACT.read_text(encoding="utf-8")
    section = text.split("### Infrastructure error reasons", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)
    assert rows == list(INFRA_REASONS)


# -- the checkers can fail -----------------------------------------------------------------------------


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "guide.md").write_text("# Guide\n\n## Set up `it`\n\n## Set up `it`\n", encoding="utf-8")
    (root / "outside.md").write_text("x\n", encoding="utf-8")
    return root


_TRACKED = {"README.md", "docs/guide.md", "docs/page.md"}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("[gone](missing.md)", "no tracked file"),
        ("[up](../../outside.md)", "leads outside the repository"),
        ("[abs](/etc/passwd)", "absolute path"),
        ("[file](file:///etc/passwd)", "file: URL"),
        ("[anchor](guide.md#no-such-heading)", "no heading with anchor #no-such-heading"),
        ("[self](#nowhere)", "no heading with anchor #nowhere"),
        ("![img](pic.png)", "no tracked file"),
        ("[ref]: ../nothing.txt", "no tracked file"),
        ("[empty]()", "empty link"),
    ],
)
def test_link_checker_catches(tiny_repo: Path, line: str, problem: str) -> None:
    (tiny_repo / "docs" / "page.md").write_text(f"# Page\n\n{line}\n", encoding="utf-8")
    problems = link_problems("docs/page.md", tiny_repo, _TRACKED)
    assert len(problems) == 1 and problem in problems[0], problems


def test_link_checker_accepts_good_links(tiny_repo: Path) -> None:
    text = (
        "# Page\n\n"
        "[guide](guide.md), [its section](guide.md#set-up-it), [the second](guide.md#set-up-it-1), "
        "[here](#page), [readme](../README.md), [folder](./), [web](https://example.org/x.md)\n\n"
        "`[not a link](nowhere.md)`\n\n```\n[not a link either](nowhere.md)\n```\n"
    )
    (tiny_repo / "docs" / "page.md").write_text(text, encoding="utf-8")
    (tiny_repo / "README.md").write_text("# Readme\n", encoding="utf-8")
    assert link_problems("docs/page.md", tiny_repo, _TRACKED) == []


_GOOD_CONTRACT = """\
# Contract

- `R-a-one` A rule. Checked by: `check-one`, `check-two`.
- `R-a-two` Another rule, see `R-a-one`. Not checked by the kit: it cannot be.
"""
_GOOD_CLAUSES = {"check-one": "R-a-one", "check-two": "R-a-one"}


def test_contract_checker_accepts_a_consistent_pair() -> None:
    assert contract_problems(_GOOD_CONTRACT, _GOOD_CLAUSES, ["see `R-a-two`"]) == []


@pytest.mark.parametrize(
    ("contract", "clauses", "references", "problem"),
    [
        (_GOOD_CONTRACT, {**_GOOD_CLAUSES, "check-three": "R-a-three"}, [], "not a rule of the contract"),
        (_GOOD_CONTRACT, {**_GOOD_CLAUSES, "check-three": "R-a-two"}, [], "does not name the check"),
        (_GOOD_CONTRACT, {"check-one": "R-a-one"}, [], "'check-two', which is not a check"),
        (_GOOD_CONTRACT.replace("Not checked by the kit: it cannot be.", ""), _GOOD_CLAUSES, [], "one"),
        (_GOOD_CONTRACT + "- `R-a-one` Again. Not checked by the kit: no.\n", _GOOD_CLAUSES, [], "twice"),
        (_GOOD_CONTRACT.replace("`R-a-two`", "`R-Bad_id`"), _GOOD_CLAUSES, [], "is not a rule id"),
        (_GOOD_CONTRACT.replace("`check-two`.", "`check-two` and more."), _GOOD_CLAUSES, [], "backticks"),
        (_GOOD_CONTRACT, _GOOD_CLAUSES, ["see `R-a-gone`"], "refers to R-a-gone"),
    ],
)
def test_contract_checker_catches(
    contract: str, clauses: dict[str, str], references: list[str], problem: str
) -> None:
    problems = contract_problems(contract, clauses, references)
    assert any(problem in p for p in problems), problems


FACES = ("dsh_bash.backend", "dsh_bash.host", "dsh_bash.remote", "dsh_bash.supervisor")


def undocumented_names(module_name: str) -> list[str]:
    """The names in a module's ``__all__`` that its docstring never names (as ``:role:`Name``` or
    ````Name````)."""
    module = importlib.import_module(module_name)
    doc = module.__doc__ or ""
    return [name for name in module.__all__ if f"`{name}`" not in doc and f"`{name}``" not in doc]


@pytest.mark.parametrize("module_name", FACES)
def test_every_public_name_of_a_backend_face_is_documented_there(module_name: str) -> None:
    """A backend author reads one page per face: each public name is on it, with what it is for."""
    assert undocumented_names(module_name) == []


def test_the_documentation_check_catches_a_name_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("dsh_bash.remote")
    monkeypatch.setattr(module, "__all__", [*module.__all__, "UNDOCUMENTED_NAME"])
    assert undocumented_names("dsh_bash.remote") == ["UNDOCUMENTED_NAME"]


# -- the README's example configs ---------------------------------------------------------------------


def readme_configs(text: str) -> dict[str, str]:
    """The side-by-side TOML files of the README's block that starts ``# local.toml``, by file name:
    each column starts where its ``# NAME.toml`` heading does."""
    lines = text.split("```toml\n# local.toml", 1)[1].split("```", 1)[0].splitlines()
    header = "# local.toml" + lines[0]
    starts = [match.start() for match in re.finditer(r"# \S+\.toml", header)]
    names = [header[start + 2 :].split()[0] for start in starts]
    bounds = [*starts[1:], None]
    return {
        name: "\n".join(line[start:end].strip() for line in lines[1:] if line[start:end].strip())
        for name, start, end in zip(names, starts, bounds, strict=True)
    }


def test_the_readme_example_configs_load_and_confine() -> None:
    """What new configs start from: each loads as its backend's config, with workspace-write."""
    configs = readme_configs((REPO / "README.md").read_text(encoding="utf-8"))
    assert sorted(configs) == ["docker.toml", "local.toml", "ssh.toml"], configs
    for name, text in configs.items():
        executor = load_executor(tomllib.loads(text))
        assert executor.config.policy.filesystem == "workspace-write", (name, text)


def test_the_readme_config_reader_splits_columns() -> None:
    text = "```toml\n# local.toml   # b.toml\nbackend = 1    x = 2\n               y = 3\n```\n"
    assert readme_configs(text) == {"local.toml": "backend = 1", "b.toml": "x = 2\ny = 3"}
