"""A slime checkout named by POLAR_SLIME_SRC is importable in these tests (slime is not on PyPI):
its folder goes on sys.path, so slime's own modules import without installing it or its GPU
dependencies (sglang, Megatron: the modules the tests use import neither). ``.ci/run`` unpacks the
vendored source (``../shared/vendor``) and sets it; under CI a missing slime fails its tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import unavailable

_SLIME = os.environ.get("POLAR_SLIME_SRC")
if _SLIME and (Path(_SLIME) / "slime").is_dir() and _SLIME not in sys.path:
    sys.path.insert(0, _SLIME)

SLIME_FIX = ("THUDM/slime is not importable (it is not on PyPI): unpack ../shared/vendor/slime-*.tar.gz into DIR and "
             "set POLAR_SLIME_SRC=DIR/slime (.ci/run does), or git clone https://github.com/THUDM/slime; its rollout "
             "modules need torch, ray, httpx and pylatexenc")


@pytest.fixture
def slime_src() -> None:
    """slime's real code, or a skip (locally) / a failure (under CI) that says how to get it."""
    if importlib.util.find_spec("slime") is None or importlib.util.find_spec("slime.utils") is None:
        unavailable(SLIME_FIX)
    try:
        import slime.rollout.sglang_rollout  # noqa: F401 - what the rollout tests drive
    except ImportError as exc:
        unavailable(f"slime at {os.environ.get('POLAR_SLIME_SRC')} does not import: {exc!r}; {SLIME_FIX}")
