"""The import graph of ``polar_env/``: circles, imports that run up the layers, and the edges.

Every import counts, wherever it is written: at module level, inside a function (lazy) or under
``TYPE_CHECKING`` (a circle that only the type checker sees is still a circle a reader must hold
in their head). The layer order is ``LAYERS`` below; docs/architecture.md explains it, and
tests/test_layers.py fails on any circle, any upward import and any package without a layer.

    python scripts/import_graph.py            # circles, upward imports, package edges
    python scripts/import_graph.py --json     # the same as JSON (for before/after notes)
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "polar_env"

# Bottom to top. A module may import its own package and any package of a LOWER layer, never one of
# its own layer or above. "polar_env" is the root facade (lazy public names loaded from env).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "access_log", "safetext"),
    ("registry", "records", "eventloop", "weights", "stagecpu", "tokenids"),
    ("yaml_config", "chat", "runtimes", "journal", "observe"),
    ("tasks", "engines"),
    ("proxy", "evaluators", "harnesses"),
    ("trajectory",),
    ("staging",),
    ("env", PACKAGE),
    ("train", "integrations", "dashboard", "demo", "testing"),
    ("preflight",),
    ("cli",),
)


@dataclass(frozen=True, slots=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    kind: str  # "top", "lazy" (inside a function) or "typing" (under TYPE_CHECKING)
    line: int


@dataclass(slots=True)
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The top-level unit a module belongs to: ``polar_env.proxy.app`` → ``proxy``; the root → ``polar_env``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _typing_only(tree: ast.Module) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def build(root: Path = ROOT) -> Graph:
    graph = Graph()
    for path in sorted((root / PACKAGE).rglob("*.py")):
        graph.modules[module_name(path, root)] = path
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only, top = _typing_only(tree), {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in graph.modules else base for a in node.names]
            else:
                continue
            kind = "typing" if id(node) in typing_only else "top" if id(node) in top else "lazy"
            for target in targets:
                if target != PACKAGE and not target.startswith(PACKAGE + "."):
                    continue
                while target not in graph.modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    graph.edges.append(Edge(name, target, kind, node.lineno))
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    out_edges: dict[str, set[str]] = defaultdict(set)
    for e in graph.edges:
        out_edges[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph.modules:
        if start in index:
            continue
        work = [(start, iter(sorted(out_edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(out_edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_of() -> dict[str, int]:
    return {package: level for level, packages in enumerate(LAYERS) for package in packages}


def unlayered(graph: Graph) -> list[str]:
    known = layer_of()
    return sorted({package_of(m) for m in graph.modules} - set(known))


def upward(graph: Graph) -> list[Edge]:
    """Imports of a package on the importer's own layer or above (its own package excepted)."""
    level = layer_of()
    bad: dict[tuple[str, str, int], Edge] = {}
    for e in graph.edges:
        source, target = package_of(e.source), package_of(e.target)
        if source != target and source in level and target in level and level[target] >= level[source]:
            bad.setdefault((e.source, e.target, e.line), e)
    return list(bad.values())


def package_edges(graph: Graph) -> dict[str, list[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for e in graph.edges:
        if package_of(e.source) != package_of(e.target):
            out[package_of(e.source)].add(package_of(e.target))
    return {k: sorted(v) for k, v in sorted(out.items())}


def report(root: Path = ROOT) -> dict[str, object]:
    graph = build(root)
    return {
        "modules": len(graph.modules),
        "circles": circles(graph),
        "upward": [f"{e.source}:{e.line} imports {e.target} ({e.kind})" for e in upward(graph)],
        "unlayered": unlayered(graph),
        "package_edges": package_edges(graph),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository to read (default: this one)")
    args = parser.parse_args(argv)
    data = report(args.root)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    circles_found, up = data["circles"], data["upward"]
    assert isinstance(circles_found, list) and isinstance(up, list)
    print(f"{data['modules']} modules, {len(circles_found)} circle(s), {len(up)} upward import(s)")
    for component in circles_found:
        print("  circle:", " ↔ ".join(component))
    for line in up:
        print("  upward:", line)
    for package in data["unlayered"]:  # type: ignore[attr-defined]
        print("  no layer:", package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
