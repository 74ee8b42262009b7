"""BUILDERS: name → trajectory builder (records → Trajectory), a ``Registry``. Add one more with one
``BUILDERS.register`` line here (or, from outside the package, a ``pkg.module:function`` name).
``build`` is what POSTRUN calls: it also hands a builder that can use them the journal's prompt
references (``polar_env.journal.reader``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polar_env.errors import ConfigError
from polar_env.records import CompletionRecord, Trajectory
from polar_env.registry import Registry
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

Builder = Callable[[Sequence[CompletionRecord]], Trajectory]
PromptRefs = Mapping[int, tuple[int, int]]  # seq → (parent seq, kept tokens)


@dataclass(frozen=True, slots=True)
class BuilderEntry:
    """A builder, and (optionally) its form that takes the journal's prompt references."""

    build: Builder
    with_refs: Callable[[Sequence[CompletionRecord], PromptRefs], Trajectory] | None = None

    def __call__(self, records: Sequence[CompletionRecord]) -> Trajectory:
        return self.build(records)


def _load(obj: Any, ref: str) -> BuilderEntry:
    if isinstance(obj, BuilderEntry):
        return obj
    if not callable(obj):
        raise ConfigError(f"builder {ref!r} is a {type(obj).__name__}, not a function of the records")
    return BuilderEntry(obj)


BUILDERS: Registry[BuilderEntry] = Registry("builder", load=_load, coerce=_load)
BUILDERS.register("per_request", BuilderEntry(build_per_request,
                                              lambda records, refs: build_per_request(records, prompt_refs=refs)))
BUILDERS.register("prefix_merge", BuilderEntry(build_prefix_merged,
                                               lambda records, refs: build_prefix_merged(records, prompt_refs=refs)))
BUILDERS.register("prefix_merge_strict", BuilderEntry(
    lambda records: build_prefix_merged(records, strict=True),
    lambda records, refs: build_prefix_merged(records, strict=True, prompt_refs=refs)))


def build(name: str, records: Sequence[CompletionRecord], prompt_refs: PromptRefs | None = None) -> Trajectory:
    """Records → trajectory with the named builder (ConfigError for an unknown name)."""
    entry = BUILDERS.get(name)
    if prompt_refs and entry.with_refs is not None:
        return entry.with_refs(records, prompt_refs)
    return entry.build(records)
