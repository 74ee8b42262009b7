"""One prefix per group: a GRPO group's traces (n samples of one task, and the several traces a
prefix-merged session can yield) as one shared run of token ids plus each trace's own suffix.

Siblings share their prompt (system prompt, tools, task statement: often thousands of tokens);
row-per-trace exports make a trainer forward every copy. A ``GroupLayout`` holds the group's
longest common prefix of ``prompt_ids + response_ids`` once, capped so that every member keeps at
least its last prompt token in its suffix: the prefix never holds a position whose logits score a
response token, so a consumer forwards the prefix once (no logits), reuses its KV cache for each
suffix and reads each member's response logits off the suffix alone. Nothing is re-tokenised,
dropped or invented: each member keeps its ids, loss mask and logprobs exactly, and ``expand``
gives the traces back. ``write_jsonl`` / ``read_jsonl``: one JSON line per group for other
consumers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import orjson

from polar_env.records import Trace, Trajectory


@dataclass(frozen=True, slots=True)
class Member:
    """One trace of the group: its ids after the shared prefix, where its response starts (in the
    full sequence), and its per-response-token loss mask and logprobs, unchanged."""

    session_id: str
    trace_index: int
    prompt_len: int
    suffix_ids: list[int]
    loss_mask: list[int]
    response_logprobs: list[float]
    trainable: bool = True


@dataclass(frozen=True, slots=True)
class GroupLayout:
    group_id: str
    prefix_ids: list[int]
    members: list[Member]

    def ids(self, i: int) -> list[int]:
        """Member ``i``'s full sequence: prompt, then response."""
        return self.prefix_ids + self.members[i].suffix_ids

    def forwarded_tokens(self) -> int:
        """Ids a trainer forwards with this layout: the prefix once, then every suffix."""
        return len(self.prefix_ids) + sum(len(m.suffix_ids) for m in self.members)

    def full_tokens(self) -> int:
        """Ids a trainer forwards with one row per trace (every copy of the prefix)."""
        return sum(len(self.prefix_ids) + len(m.suffix_ids) for m in self.members)


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (slice compares: C speed)."""
    n = min(len(a), len(b), limit)
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def shared_prefix_len(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> int:
    """The ids every sequence starts with, capped at ``min(prompt_lens) - 1`` so each member's
    suffix starts at or before its last prompt token (whose logits score its first response
    token). 0 for fewer than two sequences: a group of one shares nothing."""
    if len(sequences) < 2:
        return 0
    limit = max(min(prompt_lens) - 1, 0)
    first = sequences[0]
    for seq in sequences[1:]:
        limit = common_prefix_len(first, seq, limit)
        if limit == 0:
            break
    return limit


def layout_traces(group_id: str, traces: Sequence[tuple[str, int, Trace]]) -> GroupLayout:
    """``(session id, trace index, trace)`` of one group → its layout."""
    full = [t.prompt_ids + t.response_ids for _, _, t in traces]
    n = shared_prefix_len(full, [len(t.prompt_ids) for _, _, t in traces])
    members = [Member(session_id=sid, trace_index=index, prompt_len=len(t.prompt_ids), suffix_ids=ids[n:],
                      loss_mask=list(t.loss_mask), response_logprobs=list(t.response_logprobs), trainable=t.trainable)
               for (sid, index, t), ids in zip(traces, full, strict=True)]
    return GroupLayout(group_id=group_id, prefix_ids=full[0][:n] if full else [], members=members)


def group_of(traj: Trajectory) -> str:
    """A trajectory's GRPO group: its group id, else its task id, else its own session."""
    meta = traj.metadata
    return str(traj.group_id or meta.get("group_id") or meta.get("task_id") or traj.session_id)


def group_layouts(trajectories: Iterable[Trajectory], *, trainable_only: bool = False) -> list[GroupLayout]:
    """Every group's layout, groups and members in first-seen order. ``trainable_only`` keeps the
    traces a trainer updates on (trainable, at least one mask-1 token)."""
    groups: dict[str, list[tuple[str, int, Trace]]] = {}
    for traj in trajectories:
        for index, trace in enumerate(traj.traces):
            if trainable_only and not (trace.trainable and any(trace.loss_mask)):
                continue
            groups.setdefault(group_of(traj), []).append((traj.session_id, index, trace))
    return [layout_traces(gid, traces) for gid, traces in groups.items()]


def expand(layout: GroupLayout) -> list[Trace]:
    """The members back as traces: ids, loss mask, logprobs and trainable exactly as laid out."""
    out = []
    for i, m in enumerate(layout.members):
        ids = layout.ids(i)
        out.append(Trace(prompt_ids=ids[: m.prompt_len], response_ids=ids[m.prompt_len:], loss_mask=m.loss_mask,
                         response_logprobs=m.response_logprobs, trainable=m.trainable))
    return out


class MemberRow(TypedDict):
    session_id: str
    trace_index: int
    prompt_len: int
    suffix_ids: list[int]
    loss_mask: list[int]
    response_logprobs: list[float]
    trainable: bool


class GroupRow(TypedDict):
    group_id: str
    prefix_ids: list[int]
    members: list[MemberRow]


def to_row(layout: GroupLayout) -> GroupRow:
    return {"group_id": layout.group_id, "prefix_ids": layout.prefix_ids,
            "members": [{"session_id": m.session_id, "trace_index": m.trace_index, "prompt_len": m.prompt_len,
                         "suffix_ids": m.suffix_ids, "loss_mask": m.loss_mask,
                         "response_logprobs": m.response_logprobs, "trainable": m.trainable} for m in layout.members]}


def from_row(row: GroupRow) -> GroupLayout:
    return GroupLayout(group_id=row["group_id"], prefix_ids=row["prefix_ids"],
                       members=[Member(**m) for m in row["members"]])


def write_jsonl(trajectories: Iterable[Trajectory], path: Path, *, trainable_only: bool = False) -> int:
    """One JSON line per group; returns the number of groups."""
    layouts = group_layouts(trajectories, trainable_only=trainable_only)
    with open(path, "wb") as out:
        for layout in layouts:
            out.write(orjson.dumps(to_row(layout)) + b"\n")
    return len(layouts)


def read_jsonl(path: Path) -> list[GroupLayout]:
    rows: list[GroupRow] = [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip()]
    return [from_row(row) for row in rows]
