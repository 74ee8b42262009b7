"""How much ``Any`` polar_env's code and its public signatures carry, per package and module.

Counts, with ``ast`` over every module of ``polar_env/``:

- ``any``: uses of the name ``Any`` (``Any`` or ``typing.Any``; the import itself is not a use);
- ``returns``: public functions and methods whose return annotation contains ``Any``
  (``bare``: of those, the ones annotated ``-> Any`` itself);
- ``signatures``: public functions and methods with ``Any`` in a parameter or the return;
- ``in_signatures``: the ``Any`` uses inside those public signatures (what tests/test_any_gate.py ratchets).

Public: the function, method and each enclosing class have no leading underscore, it is not nested
in a function, and no part of the module's path starts with one (``__init__.py`` is public).

    python scripts/any_report.py                   # totals, per package
    python scripts/any_report.py --modules         # and per module
    python scripts/any_report.py --write-baseline  # rewrite tests/any_baseline.json from the tree
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "polar_env"
BASELINE = ROOT / "tests" / "any_baseline.json"
WRITE_BASELINE = "python scripts/any_report.py --write-baseline"

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Counts:
    any: int = 0
    returns: int = 0
    bare: int = 0
    signatures: int = 0
    in_signatures: int = 0
    public_returns: list[str] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        self.any += other.any
        self.returns += other.returns
        self.bare += other.bare
        self.signatures += other.signatures
        self.in_signatures += other.in_signatures
        self.public_returns.extend(other.public_returns)


def any_uses(node: ast.AST | None) -> int:
    """How many times ``Any`` is named under ``node``."""
    if node is None:
        return 0
    return sum(1 for n in ast.walk(node)
               if (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any"))


def public_module(path: Path, root: Path) -> bool:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return all(p == "__init__" or not p.startswith("_") for p in parts)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def public_functions(tree: ast.Module) -> Iterator[tuple[str, FunctionNode]]:
    """(qualified name, node) of the module's public functions and methods."""

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, FunctionNode]]:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and not stmt.name.startswith("_"):
                yield prefix + stmt.name, stmt
            elif isinstance(stmt, ast.ClassDef) and not stmt.name.startswith("_"):
                yield from walk(stmt.body, f"{prefix}{stmt.name}.")
            elif isinstance(stmt, ast.If | ast.Try):  # TYPE_CHECKING blocks, optional imports
                yield from walk(stmt.body, prefix)
                yield from walk(stmt.orelse, prefix)

    return walk(tree.body, "")


def parameter_annotations(fn: FunctionNode) -> list[ast.expr]:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    return [p.annotation for p in params if p.annotation is not None]


def module_counts(path: Path, root: Path = PACKAGE) -> Counts:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    counts = Counts(any=any_uses(tree))
    if not public_module(path, root):
        return counts
    for name, fn in public_functions(tree):
        in_return = any_uses(fn.returns)
        in_params = sum(any_uses(a) for a in parameter_annotations(fn))
        if in_return:
            counts.returns += 1
            counts.bare += int(isinstance(fn.returns, ast.Name | ast.Attribute))
            counts.public_returns.append(f"{module_name(path, root)}.{name}")
        if in_return or in_params:
            counts.signatures += 1
            counts.in_signatures += in_return + in_params
    return counts


def report(root: Path = PACKAGE) -> dict[str, Counts]:
    """Counts per module (dotted name), every module of ``root``."""
    return {module_name(p, root): module_counts(p, root) for p in sorted(root.rglob("*.py"))}


def signature_counts(root: Path = PACKAGE) -> dict[str, int]:
    """Per module, the ``Any`` uses in its public signatures (modules with none are left out):
    the figure tests/test_any_gate.py holds against tests/any_baseline.json."""
    return {m: c.in_signatures for m, c in report(root).items() if c.in_signatures}


def package_of(module: str) -> str:
    """``polar_env.engines`` for ``polar_env.engines.vllm``; top-level modules are ``polar_env``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else parts[0]


def by_package(modules: dict[str, Counts]) -> dict[str, Counts]:
    out: dict[str, Counts] = {}
    for module, counts in modules.items():
        out.setdefault(package_of(module), Counts()).add(counts)
    return dict(sorted(out.items()))


def write_baseline(path: Path = BASELINE, root: Path = PACKAGE) -> dict[str, int]:
    counts = signature_counts(root)
    path.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")
    return counts


def _row(name: str, c: Counts) -> str:
    return f"{name:36} {c.any:6} {c.returns:8} {c.bare:5} {c.signatures:11} {c.in_signatures:14}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--modules", action="store_true", help="also print every module with a nonzero count")
    parser.add_argument("--returns", action="store_true", help="also list the public functions returning Any")
    parser.add_argument("--json", action="store_true", help="print the per-package figures as JSON")
    parser.add_argument("--write-baseline", action="store_true", help=f"rewrite {BASELINE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.write_baseline:
        counts = write_baseline()
        print(f"wrote {BASELINE.relative_to(ROOT)}: {len(counts)} modules, {sum(counts.values())} Any in public signatures")
        return 0
    modules = report()
    packages = by_package(modules)
    total = Counts()
    for c in packages.values():
        total.add(c)
    if args.json:
        figures = {name: {"any": c.any, "returns": c.returns, "bare": c.bare, "signatures": c.signatures,
                          "in_signatures": c.in_signatures} for name, c in [*packages.items(), ("total", total)]}
        print(json.dumps(figures, indent=1))
        return 0
    header = f"{'package':36} {'Any':>6} {'returns':>8} {'bare':>5} {'signatures':>11} {'in_signatures':>14}"
    print(header)
    for name, c in packages.items():
        print(_row(name, c))
    print(_row("total", total))
    if args.modules:
        print(f"\n{header.replace('package', 'module ', 1)}")
        for name, c in modules.items():
            if c.any:
                print(_row(name, c))
    if args.returns:
        print("\npublic functions returning Any:")
        for name in total.public_returns:
            print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
