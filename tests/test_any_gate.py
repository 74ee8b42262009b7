"""A tight ratchet on ``Any`` in polar_env's public signatures: per module, exactly the count
tests/any_baseline.json records. A module over its number fails (type the new signature); a module
under it fails too, until the lower number is written into the baseline, so a removal can never be
spent again by a later addition. The counting is scripts/any_report.py's; record a lowering with
``python scripts/any_report.py --write-baseline``."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import any_report as report


def ratchet_errors(baseline: dict[str, int], now: dict[str, int]) -> tuple[list[str], list[str]]:
    """(modules over their baseline, modules the baseline credits with more than they have)."""
    over = [f"{module}: {count} Any in public signatures, baseline {baseline.get(module, 0)}"
            for module, count in sorted(now.items()) if count > baseline.get(module, 0)]
    slack = [f"{module}: baseline {count}, now {now.get(module, 0)}"
             for module, count in sorted(baseline.items()) if count > now.get(module, 0)]
    return over, slack


def _first(lines: list[str]) -> str:
    return f"{lines[0]}{f' (and {len(lines) - 1} more module(s))' if len(lines) > 1 else ''}"


def test_no_public_signature_gains_an_any() -> None:
    baseline: dict[str, int] = json.loads(report.BASELINE.read_text())
    over, _ = ratchet_errors(baseline, report.signature_counts())
    assert not over, (f"{_first(over)}; type the new signature (a concrete class, a TypedDict, a Protocol, object); "
                      f"the baseline only goes down")


def test_the_baseline_records_every_removal() -> None:
    baseline: dict[str, int] = json.loads(report.BASELINE.read_text())
    _, slack = ratchet_errors(baseline, report.signature_counts())
    assert not slack, f"{_first(slack)}: write the lower number into the baseline ({report.WRITE_BASELINE})"


def test_the_ratchet_is_tight_both_ways() -> None:
    assert ratchet_errors({"a": 2, "b": 1}, {"a": 2, "b": 1}) == ([], [])
    assert ratchet_errors({"a": 2}, {"a": 3}) == (["a: 3 Any in public signatures, baseline 2"], [])
    assert ratchet_errors({"a": 2}, {"a": 2, "new": 1}) == (["new: 1 Any in public signatures, baseline 0"], [])
    assert ratchet_errors({"a": 2}, {"a": 1}) == ([], ["a: baseline 2, now 1"])
    assert ratchet_errors({"a": 2, "gone": 1}, {"a": 2}) == ([], ["gone: baseline 1, now 0"])


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
