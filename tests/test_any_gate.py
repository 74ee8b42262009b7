"""A ratchet on ``Any`` in polar_env's public signatures: per module, no more ``Any`` than
tests/any_baseline.json records (fewer passes silently). The counting is scripts/any_report.py's;
regenerate the baseline with ``python scripts/any_report.py --write-baseline``."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import any_report as report


def test_no_public_signature_gains_an_any() -> None:
    baseline: dict[str, int] = json.loads(report.BASELINE.read_text())
    now: dict[str, int] = report.signature_counts()
    over = [f"{module}: {count} Any in public signatures, baseline {baseline.get(module, 0)}"
            for module, count in sorted(now.items()) if count > baseline.get(module, 0)]
    assert not over, (f"{over[0]}{f' (and {len(over) - 1} more module(s))' if len(over) > 1 else ''}; "
                      f"type the new signature (a concrete class, a TypedDict, a Protocol, object), or if Any is "
                      f"truly needed change the baseline deliberately: {report.WRITE_BASELINE}")


def test_the_report_counts_public_signatures_only(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "_private").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_private" / "m.py").write_text("from typing import Any\ndef f(x: Any) -> Any: ...\n")
    (pkg / "m.py").write_text(
        "from typing import Any\n"
        "import typing\n"
        "def f(x: Any, *a: Any, **k: dict[str, Any]) -> Any: ...\n"  # 4 in one public signature, bare return
        "def g() -> list[typing.Any]: ...\n"  # a return containing Any
        "def _h(x: Any) -> None: ...\n"  # private
        "class C:\n"
        "    def m(self, x: Any) -> None:\n"
        "        def inner(y: Any) -> Any: ...\n"  # nested: not public
        "    def __init__(self, x: Any) -> None: ...\n"
        "class _P:\n"
        "    def m(self) -> Any: ...\n"
        "X: Any = None\n")
    counts = report.report(pkg)
    m = counts["pkg.m"]
    assert (m.any, m.returns, m.bare, m.signatures, m.in_signatures) == (12, 2, 1, 3, 6)
    assert m.public_returns == ["pkg.m.f", "pkg.m.g"]
    private = counts["pkg._private.m"]
    assert (private.any, private.signatures) == (2, 0)
    assert report.signature_counts(pkg) == {"pkg.m": 6}
