"""The layer order of docs/architecture.md, enforced over polar_env's import graph: no circle
between modules, no import of a package on the importer's own layer or above, and every package
placed on a layer. Every import counts (module level, inside a function, under TYPE_CHECKING).
The graph is scripts/import_graph.py's (``python scripts/import_graph.py`` prints the same)."""

from __future__ import annotations

from pathlib import Path

from scripts import import_graph as graph
from tests.conftest import REPO_ROOT


def test_no_import_circle() -> None:
    found = graph.circles(graph.build(REPO_ROOT))
    assert not found, f"import circle: {' ↔ '.join(found[0])}; move what both need below both (docs/architecture.md)"


def test_no_import_runs_up_the_layers() -> None:
    bad = graph.upward(graph.build(REPO_ROOT))
    lines = [f"{e.source}:{e.line} imports {e.target} ({e.kind})" for e in bad]
    assert not lines, (f"{lines[0]}{f' (and {len(lines) - 1} more)' if len(lines) > 1 else ''}: a package imports only "
                       "packages of lower layers (scripts/import_graph.py LAYERS, docs/architecture.md)")


def test_every_package_has_a_layer_and_the_docs_list_them() -> None:
    missing = graph.unlayered(graph.build(REPO_ROOT))
    assert not missing, f"package {missing[0]} has no layer: add it to LAYERS in scripts/import_graph.py and docs/architecture.md"
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    for packages in graph.LAYERS:
        for package in packages:
            assert f"`{package}`" in doc, f"docs/architecture.md does not place `{package}` on its layer"


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A circle through a lazy import and one through TYPE_CHECKING are both found; an upward
    import is named with its line."""
    pkg = tmp_path / "polar_env"
    (pkg / "errors").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors" / "__init__.py").write_text("def f() -> None:\n    from polar_env.cli import main\n")
    (pkg / "cli.py").write_text("from polar_env.errors import f\n\ndef main() -> None: ...\n")
    (pkg / "registry.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from polar_env import records\n")
    (pkg / "records.py").write_text("import polar_env.registry\n")
    built = graph.build(tmp_path)
    assert graph.circles(built) == [["polar_env.cli", "polar_env.errors"], ["polar_env.records", "polar_env.registry"]]
    up = {(e.source, e.target, e.kind, e.line) for e in graph.upward(built)}
    assert ("polar_env.errors", "polar_env.cli", "lazy", 2) in up
    assert ("polar_env.registry", "polar_env.records", "typing", 3) in up  # one layer: neither may import the other
