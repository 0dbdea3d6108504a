"""The module map in docs/architecture.md ("Packages"), made from the modules' own
docstrings: each Python module of the five packages (but the generated protocol
modules, kube/proto/*_pb2*.py), by folder, with the first sentence
of its docstring. `python docs/module_map.py` prints it; `--write` puts it into the
document between its marks. tests/unit/test_docs.py checks the document holds what this
makes, so a module added, moved or described anew shows there in the same change."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gpushare", "nodemgr", "client_plugin", "placement", "kube")
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- module map: made by docs/module_map.py; do not edit by hand -->"
END = "<!-- end of module map -->"
# The end of a docstring's first sentence: a full stop before white space and a capital
# or a backquote, or the end of its first paragraph.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`])")


def summary(path: Path) -> str:
    """The first sentence of the module's docstring, on one line; a module without a
    docstring is an error, named."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    if not doc:
        raise SystemExit(f"{path.relative_to(ROOT)}: no module docstring to describe it by")
    first = " ".join(doc.split("\n\n")[0].split())
    return _SENTENCE_END.split(first, maxsplit=1)[0].replace("|", "\\|")


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


def table() -> str:
    rows = ["| module | what it is |", "|---|---|"]
    for path in modules():
        rel = path.relative_to(ROOT)
        if rel.name == "__main__.py":
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        rows.append(f"| `{name}` | {summary(path)} |")
    return "\n".join(rows) + "\n"


def block() -> str:
    return f"{BEGIN}\n\n{table()}\n{END}"


def current(text: str) -> str:
    """The block as the document holds it now."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        text = DOC.read_text()
        DOC.write_text(text.replace(current(text), block()))
        return 0
    if argv:
        print("usage: python docs/module_map.py [--write]", file=sys.stderr)
        return 2
    print(table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
