"""One session, page by page: the transcript as the harness saw it, the merged traces token by
token (loss mask, logprob, call starts, drift points), and the raw journal records.

Records come from ``JournalStore.read`` and trajectories from ``trajectory.reader.build_session``
(the same reader ``polar-env build`` uses), cached per session until its journal changes. Every
answer is one page: a 100k-token trace or a 100-call journal never travels to the browser whole.
Token text is decoded id by id for display only; nothing decoded here is ever re-encoded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from polar_env.chat import Tokenizer, chat_format
from polar_env.journal.protocols import JournalSource
from polar_env.records import CompletionRecord, Trajectory
from polar_env.trajectory.builders import BUILDERS
from polar_env.trajectory.reader import build_session

_CACHE_SESSIONS = 8  # parsed journals kept in memory (one is ~the journal's size)
_TOKENIZER_LOCK = threading.Lock()  # one load, whether the warm-up thread or a first trace page starts it


def tokenizer(template: str = "qwen3.5") -> Tokenizer:
    """The tokenizer of a run's model family, which its token texts are decoded with (loaded once;
    a page that asks while the warm-up thread loads it waits for that load instead of starting a
    second one)."""
    with _TOKENIZER_LOCK:
        return chat_format(template).tokenizer


def warm_tokenizer(template: str = "qwen3.5") -> threading.Thread:
    """Load a tokenizer in the background (seconds of CPU on first use), so the first session
    page a user opens after ``polar-env dashboard`` starts does not wait for it."""
    thread = threading.Thread(target=tokenizer, args=(template,), name="dashboard-tokenizer", daemon=True)
    thread.start()
    return thread


class SessionCache:
    def __init__(self, size: int = _CACHE_SESSIONS) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, str], tuple[tuple[int, int], list[CompletionRecord], Trajectory]]
        self._items = OrderedDict()

    def get(self, store: JournalSource, session_id: str, builder: str) -> tuple[list[CompletionRecord], Trajectory]:
        path = store.path(session_id)
        try:
            stat = path.stat()
            version = (stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:
            version = (0, 0)
        key = (str(path.parent), session_id)
        hit = self._items.get(key)
        if hit is not None and hit[0] == version:
            self._items.move_to_end(key)
            return hit[1], hit[2]
        records = store.read(session_id)
        trajectory = build_session(store, session_id, BUILDERS.get(builder if builder in BUILDERS else "prefix_merge"))
        self._items[key] = (version, records, trajectory)
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return records, trajectory


class TraceSummary(TypedDict):
    index: int
    prompt_tokens: int
    response_tokens: int
    sampled_tokens: int
    calls: int | None
    seqs: object
    drift: int
    cut: object
    start: object
    status: str
    trainable: bool
    role: str
    finish_reason: object


class CallStart(TypedDict):
    at: int  # position in prompt + response
    seq: int | None


class TracePage(TypedDict):
    index: int
    offset: int
    limit: int
    total: int
    prompt_tokens: int
    tokens: list[list[object]]  # [id, text, mask (None in the prompt), logprob]
    calls: list[CallStart]
    drift: list[dict[str, int]]
    all_calls: int


class TranscriptCall(TypedDict):
    seq: int
    new_chain: bool
    provider_api: str
    messages: Sequence[Mapping[str, object]]
    tools: list[object]
    reply: dict[str, object]
    finish_reason: str
    prompt_tokens: int
    sampled_tokens: int
    engine_ms: float
    total_ms: float
    weight_version: str | None
    notes: list[str]


class TranscriptPage(TypedDict):
    offset: int
    total: int
    calls: list[TranscriptCall]


class JournalPage(TypedDict):
    offset: int
    total: int
    records: list[dict[str, object]]


def trace_summaries(trajectory: Trajectory) -> list[TraceSummary]:
    out: list[TraceSummary] = []
    for i, t in enumerate(trajectory.traces):
        out.append({"index": i, "prompt_tokens": len(t.prompt_ids), "response_tokens": len(t.response_ids),
                    "sampled_tokens": sum(t.loss_mask), "calls": len(t.metadata.get("seqs", [])) or None,
                    "seqs": t.metadata.get("seqs"), "drift": len(t.metadata.get("drift", [])),
                    "cut": t.metadata.get("cut"), "start": t.metadata.get("start"), "status": t.status.value,
                    "trainable": t.trainable, "role": t.role,
                    "finish_reason": t.metadata.get("finish_reason")})
    return out


def trace_page(trajectory: Trajectory, index: int, offset: int, limit: int, tokenizer: Tokenizer) -> TracePage:
    """Tokens ``[offset, offset + limit)`` of trace ``index`` over prompt + response: id, text,
    region, mask (None in the prompt), logprob; plus where calls start and drift begins."""
    trace = trajectory.traces[index]
    n_prompt = len(trace.prompt_ids)
    total = n_prompt + len(trace.response_ids)
    offset = max(0, min(offset, total))
    end = min(total, offset + max(1, min(limit, 5000)))
    ids = [trace.prompt_ids[i] if i < n_prompt else trace.response_ids[i - n_prompt] for i in range(offset, end)]
    texts = tokenizer.token_texts(ids)
    tokens: list[list[object]] = []
    for j, pos in enumerate(range(offset, end)):
        if pos < n_prompt:
            tokens.append([ids[j], texts[j], None, None])
        else:
            r = pos - n_prompt
            logprob = round(trace.response_logprobs[r], 5) if trace.loss_mask[r] else None
            tokens.append([ids[j], texts[j], trace.loss_mask[r], logprob])
    # a call's sampled run starts where the mask turns 0 -> 1 (the first one right after the prompt)
    seqs = trace.metadata.get("seqs", [])
    starts: list[tuple[int, int | None]] = []  # (position, call seq)
    for r, m in enumerate(trace.loss_mask):
        if m and (r == 0 or not trace.loss_mask[r - 1]):
            starts.append((n_prompt + r, seqs[len(starts)] if len(starts) < len(seqs) else None))
    drift: list[dict[str, int]] = [{"at": int(d["at"]), "span": int(d["span"]), "seq": int(d["seq"])}
                                   for d in trace.metadata.get("drift", [])]
    return {"index": index, "offset": offset, "limit": end - offset, "total": total, "prompt_tokens": n_prompt,
            "tokens": tokens, "calls": [{"at": at, "seq": seq} for at, seq in starts if offset <= at < end],
            "drift": [d for d in drift if offset <= d["at"] + d["span"] and d["at"] < end],
            "all_calls": len(starts)}


def _assistant_echo(message: dict[str, Any]) -> bool:
    return message.get("role") == "assistant"


def transcript_page(records: list[CompletionRecord], offset: int, limit: int) -> TranscriptPage:
    """Calls ``[offset, offset + limit)``: the messages each call added to the conversation (all of
    them when it does not extend the previous call's: a new chain — sub-agent, compaction), then
    the model's reply (reasoning, text, tool calls), finish reason and timings."""
    ordered = sorted(records, key=lambda r: r.seq)
    out: list[TranscriptCall] = []
    for i in range(max(0, offset), min(len(ordered), offset + max(1, min(limit, 50)))):
        record = ordered[i]
        messages = record.chat_request.messages
        previous = ordered[i - 1].chat_request.messages if i > 0 else None
        extends = previous is not None and messages[: len(previous)] == previous
        new = messages[len(previous):] if extends and previous is not None else messages
        if extends and new and _assistant_echo(new[0]):
            new = new[1:]  # the previous reply, already shown as that call's reply
        out.append({
            "seq": record.seq, "new_chain": not extends, "provider_api": record.provider_api.value,
            "messages": new, "tools": [t.get("function", t).get("name") for t in record.chat_request.tools],
            "reply": record.message.model_dump(), "finish_reason": record.finish_reason,
            "prompt_tokens": len(record.prompt_ids), "sampled_tokens": len(record.response_ids),
            "engine_ms": round(record.timings.engine_ms, 1), "total_ms": round(record.timings.total_ms, 1),
            "weight_version": record.weight_version, "notes": record.notes,
        })
    return {"offset": offset, "total": len(ordered), "calls": out}


def journal_page(records: list[CompletionRecord], offset: int, limit: int) -> JournalPage:
    """Raw journal records ``[offset, offset + limit)`` as stored (at most 20 per page)."""
    ordered = sorted(records, key=lambda r: r.seq)
    chosen = ordered[max(0, offset): max(0, offset) + max(1, min(limit, 20))]
    return {"offset": offset, "total": len(ordered), "records": [r.model_dump(mode="json") for r in chosen]}
