"""Every relative link in README.md and docs/*.md leads to a file that exists and, when it
names a section, to a heading of that file (anchors as GitHub makes them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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


def _linked(text: str, base: Path) -> set[Path]:
    """The files the markdown ``text`` (of a document in ``base``) links to."""
    return {
        (base / t.partition("#")[0]).resolve()
        for t in LINK.findall(CODE.sub("", text))
        if t.partition("#")[0] and not re.match(r"^[a-z][a-z0-9+.-]*:", t)
    }


def test_the_doc_maps_list_every_document() -> None:
    """docs/index.md and the README's Documentation section name every document."""
    docs = {p.resolve() for p in (ROOT / "docs").glob("*.md")} - {ROOT / "docs" / "index.md"}
    index = ROOT / "docs" / "index.md"
    assert docs - _linked(index.read_text(), index.parent) == set()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Documentation") :]
    assert docs - _linked(section, ROOT) == set()


def test_no_document_installs_another_project() -> None:
    """The project is not on PyPI, where `gpushare` names another one: installs are from
    this repository (`pip install .` or its wheel)."""
    files = [*DOCS, ROOT / "Makefile", *sorted((ROOT / "configs").rglob("*"))]
    for f in files:
        if f.is_file():
            found = re.findall(r"pip install (?:-\S+ )*gpushare(?![-\w*])", f.read_text())
            assert found == [], f.relative_to(ROOT)
    assert "pip install ." in (ROOT / "README.md").read_text()


def _synopsis(doc: Path, program: str) -> list[str]:
    """The synopsis lines of ``program`` in the first code block of ``doc`` that has any,
    an indented line joined to the one before it."""
    for block in re.findall(r"^```\n(.*?)^```", doc.read_text(), re.M | re.S):
        lines: list[str] = []
        for x in block.splitlines():
            if x.startswith(program + " "):
                lines.append(x)
            elif x[:1].isspace() and lines:
                lines[-1] += " " + x.strip()
        if lines:
            return lines
    return []


def _commands(group: Any, prefix: str) -> list[tuple[str, Any]]:
    import click

    out = []
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix} {name}")
        else:
            out.append((f"{prefix} {name}", cmd))
    return out


def test_every_option_is_in_its_synopsis() -> None:
    """docs/nodemgr.md's and docs/client.md's synopses show every command and option."""
    from client_plugin.run import main as gpushare_run
    from nodemgr.cli import cli

    cases = [(ROOT / "docs" / "nodemgr.md", name, cmd) for name, cmd in _commands(cli, "nodemgr")]
    cases.append((ROOT / "docs" / "client.md", "gpushare-run", gpushare_run))
    for doc, name, cmd in cases:
        program = name.split()[0]
        lines = [x for x in _synopsis(doc, program) if f"{name} " in x + " "]
        assert lines, f"{doc.name}: no synopsis of {name}"
        text = " ".join(lines)
        for param in cmd.params:
            opts = [o for o in param.opts + param.secondary_opts if o.startswith("-")]
            if not opts or "--config" in opts or "--help" in opts:
                continue
            assert any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in opts), (
                f"{doc.name}: {name}'s synopsis lacks {opts}"
            )
