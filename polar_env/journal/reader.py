"""A session's records together with the prompt references its v2 journal stores.

A v2 line says ``prompt = context(parent)[:keep] + suffix`` (exact by construction in
continuation mode), so a builder that knows the reference need not re-compare token lists to
learn that a record extends its parent. ``read_with_refs`` streams the journal exactly as
``CaptureStore.read`` does (same torn-tail and bad-line rules) and also returns ``{seq: (parent,
keep)}``; v1 lines and v2 lines stored whole have no entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polar_env.journal.format import VERSION, Decoder, apply_events
from polar_env.proxy.capture import iter_journal
from polar_env.records import CompletionRecord

PromptRefs = dict[int, tuple[int, int]]  # seq → (parent seq, tokens kept from the parent's context)


class _RefDecoder(Decoder):
    def __init__(self) -> None:
        super().__init__()
        self.refs: PromptRefs = {}

    def decode(self, raw: Mapping[str, Any]) -> CompletionRecord:
        record = super().decode(raw)
        stored = raw.get("prompt") if raw.get("v") == VERSION else None
        if isinstance(stored, Mapping) and "parent" in stored:
            self.refs[record.seq] = (int(stored["parent"]), int(stored["keep"]))
        return record


def read_with_refs(path: Path) -> tuple[list[CompletionRecord], PromptRefs]:
    """All complete records of one journal file (client-gone events folded into their notes) and
    their prompt references."""
    decoder = _RefDecoder()
    if not path.exists():
        return [], decoder.refs
    events: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        records = list(iter_journal(f, path, events=events, decoder=decoder))
    return apply_events(records, events), decoder.refs
