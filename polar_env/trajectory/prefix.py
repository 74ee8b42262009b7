"""Token-prefix tests between captured calls: does a prompt continue an earlier call's context?

Sampled ids are never compared for grouping; only engine-side prompt tokenizations are. A record
continues an earlier one when the earlier prompt is a token prefix of its own and the earlier
turn is closed inside it (an end-of-turn token follows); or, failing that, when the earlier
prompt *up to its last turn start* (``<|im_start|>``: the generation prompt) is a prefix — the
previous assistant turn was re-rendered differently from the way it was sampled.

Cost: "is a token prefix" is a byte-prefix test on the prompts' compact JSON texts (orjson, ~3 ns
per id, serialised once, on first need) after an O(1) probe per candidate; comparing Python int
lists element by element costs several times more on records loaded from JSON. A v2 journal's
prompt references (``prompt_refs``: seq → (parent seq, tokens kept from the parent's context);
``polar_env.journal.reader``) answer the test for a record and its parent without looking at the
tokens: the journal stores the record's prompt as exactly those kept tokens plus a suffix. Where
the reference does not decide it (v1 journals, records stored whole, another chain's tip) the
comparison runs, so both paths give the same answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import orjson

from polar_env.records import CompletionRecord

_TURNS_READ = 4  # closed turns read per prompt to find the turn-start token


def detect_eot_ids(records: Sequence[CompletionRecord]) -> frozenset[int]:
    """End-of-turn ids: the last sampled token of calls that stopped on their own (not on a stop
    string). Read off the records, so any model family's builds the same way; empty when no call
    ended on its own and no later prompt shows what closed a cut one."""
    found = frozenset(
        r.response_ids[-1]
        for r in records
        if r.response_ids and r.finish_reason in ("stop", "tool_calls") and not isinstance(r.stop_reason, str)
    )
    return found or _closing_ids(records)


def _closing_ids(records: Sequence[CompletionRecord]) -> frozenset[int]:
    """When every call was cut short (a random model at its token cap): the token a later prompt
    put right after an earlier call's sampled ids (the template's or the continuation's close)."""
    counts: dict[int, int] = {}
    for prev, record in zip(records, records[1:], strict=False):
        k = len(prev.prompt_ids) + len(prev.response_ids)
        if not prev.response_ids or len(record.prompt_ids) <= k:
            continue
        if record.prompt_ids[k - 1] == prev.response_ids[-1] and record.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids:
            counts[record.prompt_ids[k]] = counts.get(record.prompt_ids[k], 0) + 1
    return frozenset((max(counts, key=counts.__getitem__),)) if counts else frozenset()


def detect_turn_start_ids(records: Sequence[CompletionRecord], eot: Collection[int]) -> frozenset[int]:
    """The token that opens a turn, read off the prompts: the one at a fixed distance (1 or 2)
    after every end-of-turn token (``<|im_end|>`` "\n" ``<|im_start|>`` for ChatML and Qwen3.5,
    ``<|eot_id|>`` ``<|start_header_id|>`` for Llama 3), the farther when both are fixed (the
    nearer is the template's glue). Reads the last few closed turns of each prompt; falls back
    to the first prompt's first token."""
    after: list[set[int]] = [set(), set()]
    for record in records:
        ids, seen, i = record.prompt_ids, 0, len(record.prompt_ids) - 3
        while i >= 0 and seen < _TURNS_READ:
            if ids[i] in eot:
                after[0].add(ids[i + 1])
                after[1].add(ids[i + 2])
                seen += 1
            i -= 1
    for found in (after[1], after[0]):
        if len(found) == 1:
            return frozenset(found)
    first = next((r.prompt_ids[0] for r in records if r.prompt_ids), None)
    return frozenset(() if first is None else (first,))


@dataclass(slots=True)
class Prompt:
    """A prompt's ids plus (serialised on first need) their compact JSON text, for memcmp prefix
    tests; ``ref`` is the journal's (parent seq, kept tokens) for it, when it has one."""

    ids: list[int]
    ref: tuple[int, int] | None = None
    seq: int = -1
    _packed: bytes | None = None

    @classmethod
    def of(cls, ids: list[int], ref: tuple[int, int] | None = None, seq: int = -1) -> Prompt:
        return cls(ids, ref, seq)

    @property
    def packed(self) -> bytes:  # b"[1,2,3]"
        if self._packed is None:
            self._packed = orjson.dumps(self.ids)
        return self._packed

    def kept_from(self, prev: Prompt) -> int:
        """Leading tokens known (from the journal's reference) to equal ``prev``'s context; 0 if unknown."""
        return self.ref[1] if self.ref is not None and self.ref[0] == prev.seq >= 0 else 0


def extends(prompt: Prompt, tip: Prompt, n: int | None = None) -> bool:
    """Is ``tip.ids[:n]`` a prefix of ``prompt.ids``? An O(1) probe rejects most non-matches first."""
    p, t = prompt.ids, tip.ids
    n = len(t) if n is None else n
    if 0 < n <= prompt.kept_from(tip):  # the journal stored prompt[:kept] as tip's context[:kept]
        return True
    if n == 0 or n > len(p) or p[n - 1] != t[n - 1] or p[0] != t[0] or p[n // 2] != t[n // 2]:
        return False
    head = memoryview(tip.packed)[:-1] if n == len(t) else orjson.dumps(t[:n])[:-1]  # without "]"
    return prompt.packed.startswith(head) and prompt.packed[len(head)] in b",]"


def first_eot(ids: list[int], start: int, eot: Collection[int]) -> int:
    for i in range(start, len(ids)):
        if ids[i] in eot:
            return i
    return -1


def anchor(prompt: list[int], turn_start: Collection[int]) -> int:
    """Index of the last turn-start token (where the generation prompt begins), or -1."""
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] in turn_start:
            return i
    return -1


def boundary(prev: Prompt, prompt: Prompt, eot: Collection[int], turn_start: Collection[int]) -> int | None:
    """Where ``prompt`` stops repeating ``prev`` (the previous prompt) if it continues its turn:
    ``len(prev)`` for an exact extension, the generation-prompt anchor for a re-rendered last
    turn, None if ``prompt`` does not continue ``prev`` (no closed turn after the shared part).
    A re-rendered turn must open with the same role token as the generation prompt: a user turn
    where the assistant turn was (a summary replacing the history) continues nothing."""
    if extends(prompt, prev):
        cut = len(prev.ids)
    else:
        cut = anchor(prev.ids, turn_start)
        if (cut <= 0 or cut + 1 >= len(prev.ids) or len(prompt.ids) <= cut + 1
                or prompt.ids[cut + 1] != prev.ids[cut + 1] or not extends(prompt, prev, cut)):
            return None
    return cut if first_eot(prompt.ids, cut, eot) >= 0 else None


def turn_end(prev: CompletionRecord, record: CompletionRecord, cut: int, eot: Collection[int]) -> int:
    """Where the template's copy of ``prev``'s turn ends in ``record``'s prompt (after ``cut``):
    past its first end-of-turn token if ``prev``'s sampled ids ended the turn, before it if they
    were cut short. What follows it is what the harness and template inserted."""
    e = first_eot(record.prompt_ids, cut, eot)
    ended = bool(prev.response_ids) and prev.response_ids[-1] in eot
    return e + 1 if ended else e


def continues_sampled(prev: CompletionRecord, record: CompletionRecord, cut: int, eot: Collection[int]) -> bool:
    """Does ``record``'s prompt hold, after ``cut``, exactly what ``prev``'s model saw and sampled
    (its generation prompt tail and its raw sampled ids)? Tells a retry's survivor from its sibling."""
    return record.prompt_ids[cut: turn_end(prev, record, cut, eot)] == prev.prompt_ids[cut:] + prev.response_ids


def prompts_of(records: Sequence[CompletionRecord], refs: Mapping[int, tuple[int, int]] | None) -> dict[int, Prompt]:
    refs = refs or {}
    return {r.seq: Prompt.of(r.prompt_ids, refs.get(r.seq), r.seq) for r in records}
