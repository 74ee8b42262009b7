"""Reading journals: records streamed line by line (v1 and v2; a torn last line skipped, any
other bad line an error naming file and line), and the prompt references a v2 journal stores.

A v2 line says ``prompt = context(parent)[:keep] + suffix`` (exact by construction in
continuation mode), so a builder that knows the reference need not re-compare token lists to
learn that a record extends its parent. ``read_with_refs`` streams the journal exactly as
``JournalStore.read`` does (same torn-tail and bad-line rules) and also returns ``{seq: (parent,
keep)}``; v1 lines and v2 lines stored whole have no entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from polar_env.errors import PolarError
from polar_env.journal.format import VERSION, Decoder, FormatError, apply_events
from polar_env.records import CompletionRecord


class JournalError(PolarError):
    """A journal line (not the torn last one) is not a valid record."""


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
    if not path.exists():
        return [], {}
    with open(path, "rb") as f:
        return read_lines_with_refs(f, path)


def read_lines_with_refs(lines: Iterable[bytes], path: Path) -> tuple[list[CompletionRecord], PromptRefs]:
    """``read_with_refs`` over journal lines from anywhere (a file, a list in memory); ``path``
    names them in errors."""
    decoder = _RefDecoder()
    events: list[dict[str, Any]] = []
    records = list(iter_journal(lines, path, events=events, decoder=decoder))
    return apply_events(records, events), decoder.refs


def iter_journal(f: Iterable[bytes], path: Path, start: int = 0, events: list[dict[str, Any]] | None = None,
                 decoder: Decoder | None = None) -> Iterator[CompletionRecord]:
    """Records from an open journal file, one line at a time (see ``JournalStore.read``); the
    ``start`` count and line numbers in errors are over record lines (event lines are skipped,
    or collected into ``events``). ``decoder``: one that also keeps what it saw (prompt refs)."""
    decoder = decoder or Decoder()
    number = 0  # records seen
    line_no = 0
    pending: bytes | None = None
    for raw in f:
        if pending is not None:
            line_no += 1
            record = _decode(decoder, pending, path, line_no, events)
            if record is not None:
                number += 1
                if number > start:
                    yield record
        pending = raw
    if pending is None:
        return
    line_no += 1
    if pending.endswith(b"\n"):
        record = _decode(decoder, pending, path, line_no, events)
    else:  # no trailing newline: the write was cut short (a torn tail) unless it parses whole
        try:
            record = _decode(decoder, pending, path, line_no, events)
        except JournalError:
            return
    if record is not None and number + 1 > start:
        yield record


def _decode(decoder: Decoder, line: bytes, path: Path, number: int,
            events: list[dict[str, Any]] | None = None) -> CompletionRecord | None:
    try:
        raw = orjson.loads(line)
        if isinstance(raw, dict) and "event" in raw:
            if events is not None:
                events.append(raw)
            return None
        return decoder.decode(raw)
    except (orjson.JSONDecodeError, ValidationError, ValueError, KeyError, TypeError, AttributeError, FormatError) as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise JournalError(f"{path} line {number} is not a valid record: {first}") from exc
