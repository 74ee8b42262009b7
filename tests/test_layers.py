"""The layer order of docs/architecture.md, enforced over polar_env's import graph: no circle
between modules, no import of a package on the importer's own layer or above, and every package
placed on a layer. Every import counts (module level, inside a function, under TYPE_CHECKING).
The graph is scripts/import_graph.py's (``python scripts/import_graph.py`` prints the same)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]


def import_graph() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", REPO_ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", module)  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def test_no_import_circle() -> None:
    graph = import_graph()
    found = graph.circles(graph.build(REPO_ROOT))
    assert not found, f"import circle: {' ↔ '.join(found[0])}; move what both need below both (docs/architecture.md)"


def test_no_import_runs_up_the_layers() -> None:
    graph = import_graph()
    bad = graph.upward(graph.build(REPO_ROOT))
    lines = [f"{e.source}:{e.line} imports {e.target} ({e.kind})" for e in bad]
    assert not lines, (f"{lines[0]}{f' (and {len(lines) - 1} more)' if len(lines) > 1 else ''}: a package imports only "
                       "packages of lower layers (scripts/import_graph.py LAYERS, docs/architecture.md)")


def test_every_package_has_a_layer_and_the_docs_list_them() -> None:
    graph = import_graph()
    missing = graph.unlayered(graph.build(REPO_ROOT))
    assert not missing, f"package {missing[0]} has no layer: add it to LAYERS in scripts/import_graph.py and docs/architecture.md"
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    for packages in graph.LAYERS:
        for package in packages:
            assert f"`{package}`" in doc, f"docs/architecture.md does not place `{package}` on its layer"


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A circle through a lazy import and one through TYPE_CHECKING are both found; an upward
    import is named with its line."""
    graph = import_graph()
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
