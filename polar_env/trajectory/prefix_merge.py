"""Prefix-merging builder: one trace per chain of calls whose prompts extend each other.

Grouping. Records are taken in capture order. A record continues the call whose prompt is a token
prefix of its own and whose turn is closed inside it (an end-of-turn token follows the earlier
prompt); the longest such wins. Failing that, it continues a call whose prompt *up to its last
turn start* (``<|im_start|>``: the generation prompt) is a prefix — the previous assistant turn was
re-rendered differently from the way it was sampled, e.g. with its reasoning dropped by a harness
that does not echo it. Otherwise it starts a new chain — an interleaved sub-agent, a side request
(title, memory), a compaction, or a template that re-rendered older turns (Qwen3.5 strips
reasoning before a new user query). Sampled ids are never compared for grouping (``prefix.py``).
Which chains the harness actually continued — and so which may be trained with the task's reward
— is ``lineage.py``'s: side requests, calls whose client went away, retries and single calls off
to the side become traces of their own with ``trainable=False`` and a ``role``.

Merging a chain C1..Ck. The trace starts with C1's prompt and C1's raw sampled ids (mask 1, real
logprobs). For each next Ci, the tail ``Ci.prompt[len(prev.prompt):]`` holds the template's
canonical copy of the previous assistant turn, up to its first end-of-turn token, then the tokens
the harness and template inserted (newline, tool results, next generation prompt). Those inserted
tokens are appended with mask 0 and logprob 0.0, then Ci's raw sampled ids. When the previous
response was cut short (no end-of-turn), the end-of-turn token is inserted too.

Drift. Where the canonical copy differs from the raw sampled ids (reasoning stripped, arguments
re-rendered, whitespace trimmed), merging would train the next call's tokens after a context the
model never saw, so the chain is cut there (a new trace, ``start="drift"``), in every mode; each
such boundary is counted (``drift_boundaries``) with its token span (``drift_tokens``): what the
harness's re-render changed, never trained (a trace's own ``drift`` list is empty by construction).
``strict`` is kept for the ``prefix_merge_strict`` name (it now builds the same traces). Where a
continued conversation's history was rewritten (compaction, a truncated or edited earlier message),
lineage starts a new chain (``Chain.start``), recorded in the trace and in ``stats.chain_starts``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polar_env.records import CompletionRecord, Status, Trace, Trajectory
from polar_env.trajectory.checks import check_records, error_trajectory
from polar_env.trajectory.lineage import Chain, lineage
from polar_env.trajectory.prefix import detect_eot_ids, detect_turn_start_ids, prompts_of, turn_end

if TYPE_CHECKING:
    from polar_env.harnesses.spec import SideRequest

__all__ = ["build_prefix_merged", "detect_eot_ids"]


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

    def trace(self, cut: str | None, start: str | None) -> Trace:
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
                "drift": [],  # drift inside a trace: none, a drift boundary cuts (kept for readers)
                "cut": cut,
                "start": start,
            },
        )


def _merge_chain(chain: Chain, eot: Collection[int], cuts: list[dict[str, int]]) -> list[Trace]:
    traces = _merge(chain, eot, cuts)
    return [t.model_copy(update={"trainable": chain.trainable, "role": chain.role}) for t in traces]


def _merge(chain: Chain, eot: Collection[int], cuts: list[dict[str, int]]) -> list[Trace]:
    """One chain's traces; a drift boundary ends a trace (appended to ``cuts`` with its span)."""
    traces: list[Trace] = []
    records = chain.records
    builder = _Builder(records[0])
    builder.sampled(records[0])
    prev, start = records[0], chain.start
    for record, cut in zip(records[1:], chain.cuts, strict=True):  # cut: the boundary grouping found
        # What the model saw and sampled after the shared part: the tail of the previous prompt
        # (its generation prompt, when the last turn was re-rendered) and the raw sampled ids.
        seen = prev.prompt_ids[cut:] + prev.response_ids
        end = turn_end(prev, record, cut, eot)
        canonical, inserted = record.prompt_ids[cut:end], record.prompt_ids[end:]
        if canonical != seen:  # never train after a context the model did not see: cut here
            cuts.append({"seq": record.seq, "span": _span(canonical, seen)})
            traces.append(builder.trace("drift", start))
            builder, start = _Builder(record), "drift"
        else:
            builder.inserted(inserted)
        builder.sampled(record)
        prev = record
    traces.append(builder.trace(None, start))
    return traces


def build_prefix_merged(
    records: Sequence[CompletionRecord],
    session_id: str | None = None,
    *,
    eot_ids: Collection[int] | None = None,
    turn_start_ids: Collection[int] | None = None,
    strict: bool = False,
    prompt_refs: Mapping[int, tuple[int, int]] | None = None,
    side_requests: Sequence[SideRequest] | None = None,
) -> Trajectory:
    """Merge a session's completions into one trace per prefix chain (see the module docstring).
    ``prompt_refs``: the journal's prompt references (seq → (parent, kept)), when known;
    ``side_requests``: the side-request matchers (default: every built-in preset's)."""
    problem = check_records(records, session_id)
    if problem is not None:
        return error_trajectory(records, session_id, problem)
    ordered = sorted(records, key=lambda r: r.seq)
    eot = frozenset(eot_ids) if eot_ids is not None else detect_eot_ids(ordered)
    packed = prompts_of(ordered, prompt_refs)
    turn_start = frozenset(turn_start_ids) if turn_start_ids is not None else detect_turn_start_ids(ordered, eot)
    found = lineage(ordered, eot, turn_start, packed, side_requests)
    chains = found.chains
    cut_at: list[dict[str, int]] = []
    traces = [t for chain in chains for t in _merge_chain(chain, eot, cut_at)]
    stats: dict[str, Any] = {
        "completions": len(ordered),
        "chains": len(chains),
        "traces": len(traces),
        "completions_merged": len(ordered) - len(traces),
        "chains_cut": sum(1 for t in traces if t.metadata["cut"] is not None),
        "drift_boundaries": len(cut_at),  # each one cut: drift is never trained
        "drift_tokens": sum(d["span"] for d in cut_at),
        "eot_ids": sorted(eot),
        "strict": strict,
        **found.stats(),
    }
    return Trajectory(session_id=ordered[0].session_id, traces=traces, metadata={"builder": "prefix_merge", "stats": stats})
