"""The Python packages' import graph (docs/architecture.md, "Packages"): no module imports
itself through others, outside TYPE_CHECKING blocks. import-linter's contracts
(pyproject.toml, `make lint`) hold which package and role may import which; a circle
inside one role is what they cannot see, and what this test does."""

from __future__ import annotations

import grimp

PACKAGES = ("gpushare", "nodemgr", "client_plugin")


def circles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Each import ``a -> b`` that ``b`` leads back from, with the way back."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.append((importer, *back))
    return found


def test_no_import_circles() -> None:
    # The installed copy, as every test uses (make installs it from the sources first).
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    assert {m.split(".")[0] for m in graph.modules} == set(PACKAGES)
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    assert circles(graph) == []
    graph.add_import(importer="p.c", imported="p.a")
    assert ("p.a", "p.b", "p.c", "p.a") in circles(graph)
