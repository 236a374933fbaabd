"""Every relative link in the documentation resolves: the file exists, and an anchor names a heading.

Pure Python (no torch, no build): it reads README.md, docs/*.md and benchmarks/results/*.md, finds every
inline link or image ``[text](target)`` outside code, and for each relative target checks that the path
exists (relative to the linking file) and, for ``path.md#anchor`` or ``#anchor``, that a heading of that
file produces the anchor as GitHub makes it: lower case, punctuation dropped (letters, digits, spaces,
``-`` and ``_`` kept), spaces to ``-``, a repeated heading's anchor suffixed ``-1``, ``-2``, ...
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from models import ROOT

ROOT = ROOT
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks" / "results").glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their 1-based numbers."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _ (Unicode too)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of ``path`` produce, repeated ones suffixed as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.add(anchor if count == 0 else f"{anchor}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link or image in ``path``'s prose (not in code)."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub("", line)
        found.extend((number, m.group(1)) for m in _LINK.finditer(line))
    return found


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if not target or _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(ROOT)}:{number}: ({target})"
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor on something that is not a markdown file")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: no heading of {dest.relative_to(ROOT)} makes #{anchor}")
    return problems


def test_the_documents_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/ARCHITECTURE.md", "docs/performance.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path):
    assert broken_links(path) == []


def test_github_anchors():
    assert github_anchor("Overlapped pairs (DualPipeV's OVERLAP_F_B)") == "overlapped-pairs-dualpipevs-overlap_f_b"
    assert github_anchor("Where a step's time goes") == "where-a-steps-time-goes"
    assert github_anchor("Against torch.distributed.pipelining") == "against-torchdistributedpipelining"
    assert github_anchor("Tensor parallel and FSDP stages (pp x dp_shard x tp)") == (
        "tensor-parallel-and-fsdp-stages-pp-x-dp_shard-x-tp")
    assert github_anchor("Single process: `Pipe`") == "single-process-pipe"


def test_the_checker_sees_a_broken_link(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## Part two\n\n[ok](#part-two) [ok](b.md#b) [no](#part-three)\n"
                                   "[no](c.md) `[code](c.md)`\n\n```\n[code](c.md)\n```\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    problems = broken_links(tmp_path / "a.md")
    assert len(problems) == 2, problems
    assert "#part-three" in problems[0] and "c.md does not exist" in problems[1]
