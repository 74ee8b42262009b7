"""Toy task ``toy__textkit-1``: ``slugify`` keeps runs of separators and separators at the ends.

Its test patch adds a new test file (with parametrized ids), so graders must cope with a test
file that does not exist at base_commit.
"""

from __future__ import annotations

from polar_env.tasks.toy.build import ToySource

_SLUG = '''"""URL slugs."""


def slugify(text, sep="-"):
    """Lower-case ``text``; every run of non-alphanumerics becomes one ``sep``, none at the ends."""
    return "".join(ch if ch.isalnum() else sep for ch in text.lower())
'''

_SLUG_FIXED = '''"""URL slugs."""

import re


def slugify(text, sep="-"):
    """Lower-case ``text``; every run of non-alphanumerics becomes one ``sep``, none at the ends."""
    words = re.split(r"[^0-9a-z]+", text.lower())
    return sep.join(word for word in words if word)
'''

_TESTS = """from textkit.slug import slugify


def test_simple():
    assert slugify("Hello") == "hello"
    assert slugify("hello world") == "hello-world"


def test_custom_sep():
    assert slugify("a b", sep="_") == "a_b"
"""

_EDGE_TESTS = """import pytest

from textkit.slug import slugify


@pytest.mark.parametrize(
    ("text", "expected"),
    [("Hello,  World", "hello-world"), ("a -- b", "a-b")],
    ids=["comma", "dashes"],
)
def test_collapse_runs(text, expected):
    assert slugify(text) == expected


def test_strip_ends():
    assert slugify("  Hello World! ") == "hello-world"
"""

SOURCE = ToySource(
    instance_id="toy__textkit-1",
    repo="toy/textkit",
    problem_statement=(
        "slugify leaves repeated and trailing separators\n\n"
        '`slugify("Hello,  World")` returns `"hello---world"` and `slugify("Hi! ")` returns '
        '`"hi--"`. A run of punctuation or spaces should become a single separator, and the slug '
        "should not start or end with one.\n"
    ),
    files={"textkit/__init__.py": "", "textkit/slug.py": _SLUG, "tests/test_slug.py": _TESTS},
    fix={"textkit/slug.py": _SLUG_FIXED},
    tests={"tests/test_slug_edges.py": _EDGE_TESTS},
    FAIL_TO_PASS=(
        "tests/test_slug_edges.py::test_collapse_runs[comma]",
        "tests/test_slug_edges.py::test_collapse_runs[dashes]",
        "tests/test_slug_edges.py::test_strip_ends",
    ),
    PASS_TO_PASS=("tests/test_slug.py::test_simple", "tests/test_slug.py::test_custom_sep"),
    # collapses runs but always joins with "-", ignoring sep
    variants={"breaks_pass_to_pass": {"textkit/slug.py": _SLUG_FIXED.replace("return sep.join(", 'return "-".join(')}},
)
