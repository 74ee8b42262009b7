"""Prefix-merging builder: one trace per chain of calls whose prompts extend each other.

Grouping. Records are taken in capture order. A record joins the chain whose tip prompt is a token
prefix of its own prompt and whose tip's turn is closed inside it (an end-of-turn token follows the
tip prompt); the longest such tip wins. Failing that, it joins a chain whose tip prompt *up to its
last turn start* (``<|im_start|>``: the generation prompt) is a prefix — the previous assistant
turn was re-rendered differently from the way it was sampled, e.g. with its reasoning dropped by a
harness that does not echo it, which also changes how the generation-prompt tokens merge. Otherwise
it starts a new chain — an interleaved sub-agent, a side request (title, memory), a retry of the
same prompt, a compaction, or a template that re-rendered older turns (Qwen3.5 strips reasoning
before a new user query). Sampled ids are never compared for grouping.

Merging a chain C1..Ck. The trace starts with C1's prompt and C1's raw sampled ids (mask 1, real
logprobs). For each next Ci, the tail ``Ci.prompt[len(prev.prompt):]`` holds the template's
canonical copy of the previous assistant turn, up to its first end-of-turn token, then the tokens
the harness and template inserted (newline, tool results, next generation prompt). Those inserted
tokens are appended with mask 0 and logprob 0.0, then Ci's raw sampled ids. When the previous
response was cut short (no end-of-turn), the end-of-turn token is inserted too.

Drift. Where the canonical copy differs from the raw sampled ids (reasoning stripped, arguments
re-rendered, whitespace trimmed), the merged sequence is not exactly what the model saw next; each
such boundary is counted with its token span. ``strict=True`` cuts the chain there instead, so every
merged trace is exactly a context the model saw.

Cost: "is a token prefix" is a byte-prefix test on the prompts' compact JSON texts (orjson, ~3 ns
per id, serialised once, on first need) after an O(1) probe per candidate chain; comparing Python
int lists element by element costs several times more on records loaded from JSON. A v2 journal's
prompt references (``prompt_refs``: seq → (parent seq, tokens kept from the parent's context);
``polar_env.journal.reader``) answer the test for a record and its parent without looking at the
tokens: the journal stores the record's prompt as exactly those kept tokens plus a suffix. Where
the reference does not decide it (v1 journals, records stored whole, another chain's tip) the
comparison runs, so both paths group and merge identically.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_env.qwen.tokenizer import EOS_IDS, IM_START_ID
from polar_env.records import CompletionRecord, Status, Trace, Trajectory
from polar_env.trajectory.checks import check_records, error_trajectory


def detect_eot_ids(records: Sequence[CompletionRecord]) -> frozenset[int]:
    """End-of-turn ids: the last sampled token of calls that stopped on their own (not on a stop
    string); falls back to Qwen3.5's ``<|im_end|>``/``<|endoftext|>`` when no call shows one."""
    found = {
        r.response_ids[-1]
        for r in records
        if r.response_ids and r.finish_reason in ("stop", "tool_calls") and not isinstance(r.stop_reason, str)
    }
    return frozenset(found or EOS_IDS)


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


def _extends(prompt: Prompt, tip: Prompt, n: int | None = None) -> bool:
    """Is ``tip.ids[:n]`` a prefix of ``prompt.ids``? An O(1) probe rejects most non-matches first."""
    p, t = prompt.ids, tip.ids
    n = len(t) if n is None else n
    if 0 < n <= prompt.kept_from(tip):  # the journal stored prompt[:kept] as tip's context[:kept]
        return True
    if n == 0 or n > len(p) or p[n - 1] != t[n - 1] or p[0] != t[0] or p[n // 2] != t[n // 2]:
        return False
    head = memoryview(tip.packed)[:-1] if n == len(t) else orjson.dumps(t[:n])[:-1]  # without "]"
    return prompt.packed.startswith(head) and prompt.packed[len(head)] in b",]"


def _first_eot(ids: list[int], start: int, eot: Collection[int]) -> int:
    for i in range(start, len(ids)):
        if ids[i] in eot:
            return i
    return -1


def _anchor(prompt: list[int], turn_start: Collection[int]) -> int:
    """Index of the last turn-start token (where the generation prompt begins), or -1."""
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] in turn_start:
            return i
    return -1


def boundary(prev: Prompt, prompt: Prompt, eot: Collection[int], turn_start: Collection[int]) -> int | None:
    """Where ``prompt`` stops repeating ``prev`` (the previous prompt) if it continues its turn:
    ``len(prev)`` for an exact extension, the generation-prompt anchor for a re-rendered last
    turn, None if ``prompt`` does not continue ``prev`` (no closed turn after the shared part)."""
    if _extends(prompt, prev):
        cut = len(prev.ids)
    else:
        cut = _anchor(prev.ids, turn_start)
        if cut <= 0 or not _extends(prompt, prev, cut):
            return None
    return cut if _first_eot(prompt.ids, cut, eot) >= 0 else None


def group_chains(
    records: Sequence[CompletionRecord],
    eot: Collection[int],
    turn_start: Collection[int] = (IM_START_ID,),
    prompts: Mapping[int, Prompt] | None = None,
) -> list[list[CompletionRecord]]:
    """Chains of records (see the module docstring); ``prompts`` maps seq → prompt."""
    packed = prompts if prompts is not None else _prompts(records, None)
    chains: list[list[CompletionRecord]] = []
    for record in records:
        prompt = packed[record.seq]
        best: list[CompletionRecord] | None = None
        best_key = (-1, -1)  # (exact extension?, shared length): exact beats re-rendered, longer wins
        for chain in chains:
            tip = packed[chain[-1].seq]
            cut = boundary(tip, prompt, eot, turn_start)
            if cut is not None and (key := (int(cut == len(tip.ids)), cut)) > best_key:
                best, best_key = chain, key
        if best is None:
            chains.append([record])
        else:
            best.append(record)
    return chains


def _prompts(records: Sequence[CompletionRecord], refs: Mapping[int, tuple[int, int]] | None) -> dict[int, Prompt]:
    refs = refs or {}
    return {r.seq: Prompt.of(r.prompt_ids, refs.get(r.seq), r.seq) for r in records}


def _span(a: list[int], b: list[int]) -> int:
    """Tokens in the differing middle of two sequences (after the common prefix and suffix)."""
    lo = 0
    while lo < len(a) and lo < len(b) and a[lo] == b[lo]:
        lo += 1
    hi = 0
    while hi < len(a) - lo and hi < len(b) - lo and a[-1 - hi] == b[-1 - hi]:
        hi += 1
    return max(len(a), len(b)) - lo - hi


@dataclass(slots=True)
class _Builder:
    """Accumulates one merged trace."""

    first: CompletionRecord
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    drift: list[dict[str, int]] = field(default_factory=list)
    last: CompletionRecord | None = None

    def sampled(self, record: CompletionRecord) -> None:
        self.response_ids += record.response_ids
        self.loss_mask += [1] * len(record.response_ids)
        self.logprobs += record.response_logprobs
        self.seqs.append(record.seq)
        self.last = record

    def inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def trace(self, cut: str | None) -> Trace:
        assert self.last is not None
        status = Status.TRUNCATED if (cut is not None or self.last.finish_reason == "length") else Status.COMPLETED
        return Trace(
            prompt_ids=self.first.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            response_logprobs=self.logprobs,
            status=status,
            metadata={
                "seqs": self.seqs,
                "finish_reason": self.last.finish_reason,
                "temperature": self.first.chat_request.temperature,
                "logprobs_mode": self.first.logprobs_mode,
                "drift": self.drift,
                "cut": cut,
            },
        )


def _merge_chain(
    chain: list[CompletionRecord], eot: Collection[int], turn_start: Collection[int], strict: bool, packed: Mapping[int, Prompt]
) -> list[Trace]:
    traces: list[Trace] = []
    builder = _Builder(chain[0])
    builder.sampled(chain[0])
    prev = chain[0]
    for record in chain[1:]:
        cut = boundary(packed[prev.seq], packed[record.seq], eot, turn_start)
        assert cut is not None  # grouping put it here
        # What the model saw and sampled after the shared part: the tail of the previous prompt
        # (its generation prompt, when the last turn was re-rendered) and the raw sampled ids.
        seen = prev.prompt_ids[cut:] + prev.response_ids
        e = _first_eot(record.prompt_ids, cut, eot)
        ended = bool(prev.response_ids) and prev.response_ids[-1] in eot
        canonical = record.prompt_ids[cut : e + 1] if ended else record.prompt_ids[cut:e]
        inserted = record.prompt_ids[e + 1 :] if ended else record.prompt_ids[e:]
        if canonical != seen:
            if strict:
                traces.append(builder.trace(cut="drift"))
                builder = _Builder(record)
                builder.sampled(record)
                prev = record
                continue
            at = len(builder.first.prompt_ids) + len(builder.response_ids) - len(seen)
            builder.drift.append({"seq": record.seq, "at": at, "span": _span(canonical, seen)})
        builder.inserted(inserted)
        builder.sampled(record)
        prev = record
    traces.append(builder.trace(cut=None))
    return traces


def build_prefix_merged(
    records: Sequence[CompletionRecord],
    session_id: str | None = None,
    *,
    eot_ids: Collection[int] | None = None,
    turn_start_ids: Collection[int] = (IM_START_ID,),
    strict: bool = False,
    prompt_refs: Mapping[int, tuple[int, int]] | None = None,
) -> Trajectory:
    """Merge a session's completions into one trace per prefix chain (see the module docstring).
    ``prompt_refs``: the journal's prompt references (seq → (parent, kept)), when known."""
    problem = check_records(records, session_id)
    if problem is not None:
        return error_trajectory(records, session_id, problem)
    ordered = sorted(records, key=lambda r: r.seq)
    eot = frozenset(eot_ids) if eot_ids is not None else detect_eot_ids(ordered)
    packed = _prompts(ordered, prompt_refs)
    chains = group_chains(ordered, eot, turn_start_ids, packed)
    traces = [t for chain in chains for t in _merge_chain(chain, eot, turn_start_ids, strict, packed)]
    drift = [d for t in traces for d in t.metadata["drift"]]
    stats: dict[str, Any] = {
        "completions": len(ordered),
        "chains": len(chains),
        "traces": len(traces),
        "completions_merged": len(ordered) - len(traces),
        "chains_cut": sum(1 for t in traces if t.metadata["cut"] is not None),
        "drift_boundaries": len(drift),
        "drift_tokens": sum(d["span"] for d in drift),
        "eot_ids": sorted(eot),
        "strict": strict,
    }
    return Trajectory(session_id=ordered[0].session_id, traces=traces, metadata={"builder": "prefix_merge", "stats": stats})
