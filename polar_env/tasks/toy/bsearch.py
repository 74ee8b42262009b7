"""Toy task ``toy__bsearch-1``: ``find`` loops forever when the target is absent and larger than an
item it compares against. With the bug present its FAIL_TO_PASS test hangs: the timeout case."""

from __future__ import annotations

from polar_env.tasks.toy.build import ToySource

_BSEARCH = '''"""Binary search over a sorted list."""


def find(items, target):
    """Index of ``target`` in the sorted list ``items``, or -1 when it is absent."""
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid
        elif items[mid] > target:
            hi = mid
        else:
            return mid
    return -1
'''

_BSEARCH_FIXED = _BSEARCH.replace("            lo = mid\n", "            lo = mid + 1\n")

_TESTS = """from bsearch import find

ITEMS = [1, 3, 5, 7, 9]


def test_find_each():
    for index, item in enumerate(ITEMS):
        assert find(ITEMS, item) == index


def test_missing_below():
    assert find(ITEMS, 0) == -1
    assert find([], 4) == -1
"""

_TESTS_AFTER = (
    _TESTS
    + """

def test_missing_above():
    assert find(ITEMS, 4) == -1
    assert find(ITEMS, 10) == -1
"""
)

SOURCE = ToySource(
    instance_id="toy__bsearch-1",
    repo="toy/bsearch",
    problem_statement=(
        "find() never returns for some missing values\n\n"
        "`find([1, 3, 5, 7, 9], 4)` and `find([1, 3, 5, 7, 9], 10)` hang instead of returning -1. "
        "Values below the first item are fine.\n"
    ),
    files={"bsearch.py": _BSEARCH, "tests/test_bsearch.py": _TESTS},
    fix={"bsearch.py": _BSEARCH_FIXED},
    tests={"tests/test_bsearch.py": _TESTS_AFTER},
    FAIL_TO_PASS=("tests/test_bsearch.py::test_missing_above",),
    PASS_TO_PASS=("tests/test_bsearch.py::test_find_each", "tests/test_bsearch.py::test_missing_below"),
    # terminates, but searches one slot short and so never finds the last item
    variants={
        "breaks_pass_to_pass": {
            "bsearch.py": _BSEARCH_FIXED.replace("lo, hi = 0, len(items)", "lo, hi = 0, len(items) - 1")
        }
    },
)
