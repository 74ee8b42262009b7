"""Toy task ``toy__calc-1``: ``safe_div`` divides by zero instead of returning None."""

from __future__ import annotations

from polar_env.tasks.toy.build import ToySource

_CALC = '''"""Small arithmetic helpers."""


def add(a, b):
    """Return a + b."""
    return a + b


def safe_div(a, b):
    """Return a / b, or None when b is zero."""
    return a / b
'''

_CALC_FIXED = _CALC.replace("    return a / b\n", "    if b == 0:\n        return None\n    return a / b\n")

_TESTS = """from calc import add, safe_div


def test_add():
    assert add(2, 3) == 5
    assert add(0.5, 0.25) == 0.75


def test_div():
    assert safe_div(6, 3) == 2
"""

_TESTS_AFTER = (
    _TESTS
    + """

def test_div_zero():
    assert safe_div(1, 0) is None
"""
)

SOURCE = ToySource(
    instance_id="toy__calc-1",
    repo="toy/calc",
    problem_statement=(
        "safe_div raises ZeroDivisionError when the divisor is zero\n\n"
        "Its docstring promises `None` for a zero divisor, but `safe_div(1, 0)` raises "
        "`ZeroDivisionError: division by zero`. It should return `None` instead.\n"
    ),
    files={"calc.py": _CALC, "tests/test_calc.py": _TESTS},
    fix={"calc.py": _CALC_FIXED},
    tests={"tests/test_calc.py": _TESTS_AFTER},
    FAIL_TO_PASS=("tests/test_calc.py::test_div_zero",),
    PASS_TO_PASS=("tests/test_calc.py::test_add", "tests/test_calc.py::test_div"),
    # fixes the division but "tidies" add into integer arithmetic, breaking test_add
    variants={"breaks_pass_to_pass": {"calc.py": _CALC_FIXED.replace("return a + b", "return int(a) + int(b)")}},
)
