"""A slime checkout named by POLAR_SLIME_SRC is importable in these tests (slime is not on PyPI),
so the optional slime tests run against it without installing it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_SLIME = os.environ.get("POLAR_SLIME_SRC")
if _SLIME and (Path(_SLIME) / "slime").is_dir() and _SLIME not in sys.path:
    sys.path.insert(0, _SLIME)
