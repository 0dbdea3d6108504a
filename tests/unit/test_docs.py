"""Every relative link in README.md and docs/*.md leads to a file that exists and, when it
names a section, to a heading of that file (anchors as GitHub makes them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE = re.compile(r"`[^`]*`")  # inline code: `TABLE[N](...)` is no link


def prose(path: Path) -> list[tuple[int, str]]:
    """The file's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((n, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links() -> list[tuple[Path, int, str]]:
    found = []
    for doc in DOCS:
        for n, line in prose(doc):
            for target in LINK.findall(CODE.sub("", line)):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                    found.append((doc, n, target))
    return found


def test_the_documents_have_links() -> None:
    assert len(DOCS) > 2
    assert len(links()) > 20


@pytest.mark.parametrize(
    "doc,line,target",
    links(),
    ids=[f"{d.relative_to(ROOT)}:{n}" for d, n, _ in links()],
)
def test_relative_link_resolves(doc: Path, line: int, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    dest = (doc.parent / file_part).resolve() if file_part else doc
    assert dest.exists(), f"{doc.relative_to(ROOT)}:{line}: {target}: no such file"
    if anchor:
        assert dest.suffix == ".md", f"{doc.relative_to(ROOT)}:{line}: anchor into a non-doc"
        assert anchor in anchors(dest), (
            f"{doc.relative_to(ROOT)}:{line}: {target}: no heading with that anchor "
            f"in {dest.relative_to(ROOT)}"
        )
