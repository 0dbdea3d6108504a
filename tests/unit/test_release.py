"""The version's one home, the changelog and the licence (docs/development.md, "Versions
and releases"), checked against the installed package."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import gpushare

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (Unreleased|\d{4}-\d{2}-\d{2})$")


def _entries() -> list[tuple[tuple[int, int, int], str]]:
    out = []
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if line.startswith("## "):
            m = ENTRY.fullmatch(line)
            assert m, f"CHANGELOG.md: {line!r} is not '## [X.Y.Z] - Unreleased|YYYY-MM-DD'"
            out.append(((int(m[1]), int(m[2]), int(m[3])), m[4]))
    return out


def test_changelog_top_entry_is_the_version() -> None:
    entries = _entries()
    assert entries, "CHANGELOG.md has no version entry"
    top = ".".join(map(str, entries[0][0]))
    assert top == gpushare.__version__, (
        f"CHANGELOG.md's top entry is {top}, gpushare.__version__ {gpushare.__version__}: "
        "add the entry, or raise the version"
    )
    versions = [v for v, _ in entries]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    # Only the top entry may be unreleased.
    assert all(when != "Unreleased" for _, when in entries[1:])


def test_installed_package_says_its_version_and_licence() -> None:
    meta = metadata.metadata("gpushare")
    assert meta["Version"] == gpushare.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert "gpushare developers" in (meta["Author"] or "") + (meta["Author-email"] or "")
    files = [str(f) for f in metadata.files("gpushare") or []]
    assert any(f.endswith("licenses/LICENSE") for f in files), files
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[0]
