"""Module boundaries that hold (issue 47, item 6): no private name (``_x``) is imported from another
module of polar_env, and no module imports a name back from its own package's ``__init__`` (a
package-level loop: the package imports the module, which imports the package). Found with ``ast``
over every module (relative imports resolved; imports in functions and under TYPE_CHECKING count).
A helper two modules share is public in the module that owns its concern.

``ALLOWED_*`` list what is left; they can only shrink: an entry that no longer occurs fails the test
too, so whoever fixes one deletes its line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "polar_env"

# (importing module, source module, name): none left (issue 47 made the runtimes' shared helpers public)
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()
# (importing module, its package): a ``__main__`` is the package's entry point and is left out
ALLOWED_PACKAGE_LOOPS: set[tuple[str, str]] = set()  # none left (engines/config.py read its URLs from there)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_from(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(source module, imported name, line) for every ``from X import name`` in the module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        found += [(source, alias.name, node.lineno) for alias in node.names]
    return found


def private_imports() -> set[tuple[str, str, str]]:
    mods = modules()
    return {(name, source, imported)
            for name, path in mods.items()
            for source, imported, _ in imports_from(name, path)
            if source.startswith("polar_env") and source != name and imported.startswith("_")
            and not imported.startswith("__") and f"{source}.{imported}" not in mods}


def package_loops() -> set[tuple[str, str]]:
    mods = modules()
    loops = set()
    for name, path in mods.items():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for source, imported, _ in imports_from(name, path):
            own_package = name.startswith(source + ".") and source != "polar_env"
            if own_package and mods.get(source, Path()).name == "__init__.py" and f"{source}.{imported}" not in mods:
                loops.add((name, source))
    return loops


def test_no_private_name_is_imported_across_modules() -> None:
    found = private_imports()
    new = sorted(found - ALLOWED_PRIVATE)
    assert not new, f"private names imported across modules (make them public where shared): {new}"
    assert ALLOWED_PRIVATE <= found, f"fixed, so delete from ALLOWED_PRIVATE: {sorted(ALLOWED_PRIVATE - found)}"


def test_no_module_imports_back_from_its_own_package() -> None:
    found = package_loops()
    new = sorted(found - ALLOWED_PACKAGE_LOOPS)
    assert not new, f"names imported back from the own package's __init__: {new}"
    assert ALLOWED_PACKAGE_LOOPS <= found, f"fixed, so delete from ALLOWED_PACKAGE_LOOPS: {sorted(ALLOWED_PACKAGE_LOOPS - found)}"


def test_the_scan_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The scan itself, on two lines it must flag: a private name, and a relative one."""
    module = tmp_path / "mod.py"
    module.write_text("from polar_env.runtimes.hostworkspace import _gone\nfrom .argv import _relay\n")
    assert imports_from("polar_env.runtimes.mod", module) == [
        ("polar_env.runtimes.hostworkspace", "_gone", 1), ("polar_env.runtimes.argv", "_relay", 2)]
