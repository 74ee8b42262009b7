"""BUILDERS: name → builder function (records → Trajectory). Add one more with one entry here.
``build`` is what POSTRUN calls: it also hands a builder that can use them the journal's prompt
references (``polar_env.journal.reader``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from polar_env.records import CompletionRecord, Trajectory
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

Builder = Callable[[Sequence[CompletionRecord]], Trajectory]

BUILDERS: dict[str, Builder] = {
    "per_request": build_per_request,
    "prefix_merge": build_prefix_merged,
    "prefix_merge_strict": lambda records: build_prefix_merged(records, strict=True),
}

# builders that take the journal's prompt references (seq → (parent seq, kept tokens))
WITH_REFS: dict[str, Callable[[Sequence[CompletionRecord], Mapping[int, tuple[int, int]]], Trajectory]] = {
    "prefix_merge": lambda records, refs: build_prefix_merged(records, prompt_refs=refs),
    "prefix_merge_strict": lambda records, refs: build_prefix_merged(records, strict=True, prompt_refs=refs),
}


def build(name: str, records: Sequence[CompletionRecord], prompt_refs: Mapping[int, tuple[int, int]] | None = None) -> Trajectory:
    """Records → trajectory with the named builder (KeyError for an unknown name)."""
    if prompt_refs and name in WITH_REFS:
        return WITH_REFS[name](records, prompt_refs)
    return BUILDERS[name](records)
