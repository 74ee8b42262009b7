"""BUILDERS: name → builder function (records → Trajectory). Add one more with one entry here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polar_env.records import CompletionRecord, Trajectory
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

Builder = Callable[[Sequence[CompletionRecord]], Trajectory]

BUILDERS: dict[str, Builder] = {
    "per_request": build_per_request,
    "prefix_merge": build_prefix_merged,
    "prefix_merge_strict": lambda records: build_prefix_merged(records, strict=True),
}

