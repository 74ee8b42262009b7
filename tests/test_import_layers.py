"""The package's layers (bottom to top) and the rule between them: no module imports from a higher
layer, not lazily and not under TYPE_CHECKING, so a lower layer can be read, tested and reused
without the ones above it (issue 24: staging took ``PolarEnv`` from env, and env its config from
staging, in a circle). The import circles that remain must not reach the CLI, env or staging."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "polar_env"
# access_log, yaml_config and observe are not in the order: placed by what they import
LAYERS = (
    ("errors", "registry", "records", "access_log", "yaml_config"),
    ("qwen", "runtimes", "journal"),
    ("tasks", "engines"),
    ("proxy", "observe"),
    ("evaluators", "harnesses"),
    ("trajectory",),
    ("staging",),
    ("env",),
    ("train", "integrations", "dashboard", "demo", "preflight", "testing"),
    ("cli",),
)
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}
# Upward imports that predate this test, outside the CLI/env/staging (each is its area's to remove);
# the test fails on any other, and on one of these once it is gone (so the list only shrinks).
KNOWN = {
    ("polar_env.engines.config", "polar_env.harnesses.scripted"),
    ("polar_env.engines.config", "polar_env.testing.simulated_engine"),
    ("polar_env.journal.reader", "polar_env.proxy.capture"),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every polar_env module and the polar_env modules it imports anywhere in its file."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name, is_pkg = _module(path), path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                found.add(base)
        out[name] = {m for m in found if m.startswith("polar_env.")}
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None


def test_no_module_imports_from_a_higher_layer() -> None:
    imports = _imports()
    assert all(_layer(m) is not None for m in imports if m != "polar_env"), "a new top-level module needs a layer here"
    upward = {(m, t) for m, targets in imports.items() for t in targets
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)}  # type: ignore[operator]
    assert upward - KNOWN == set(), "these import from a higher layer: take what they need as an argument instead"
    assert KNOWN - upward == set(), "gone: remove them from KNOWN"


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_reaches_the_cli_env_or_staging() -> None:
    imports = _imports()
    graph = {m: {t for t in targets if t in imports} for m, targets in imports.items()}
    assert _strongly_connected({"a": {"b"}, "b": {"a"}}) == [{"a", "b"}]  # the check can fail
    ours = ("polar_env.cli", "polar_env.env", "polar_env.staging")
    # staging.lifecycle <-> staging.node (a TYPE_CHECKING import back) is the lifecycle refactor's
    circles = [c for c in _strongly_connected(graph) if c != {"polar_env.staging.lifecycle", "polar_env.staging.node"}]
    assert [c for c in circles if any(m.startswith(ours) for m in c)] == []
