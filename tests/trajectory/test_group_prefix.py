"""One prefix per group: every member's ids, loss mask, logprobs and trainable flag come back
exactly; the prefix is the longest one allowed and never holds a scored position."""

from __future__ import annotations

import random
from pathlib import Path

from polar_env.records import Trace, Trajectory
from polar_env.trajectory.group_prefix import (
    expand,
    group_layouts,
    layout_traces,
    read_jsonl,
    shared_prefix_len,
    write_jsonl,
)


def _trace(prompt: list[int], response: list[int], rng: random.Random, trainable: bool = True) -> Trace:
    mask = [rng.randrange(2) for _ in response]
    return Trace(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                 response_logprobs=[-rng.random() if m else 0.0 for m in mask], trainable=trainable)


def _group(rng: random.Random, n: int) -> list[Trace]:
    """n siblings of one task: one system prompt + task, each continuing differently; some share
    their first sampled ids, some are cut shorter, one is a later chain whose prompt holds an
    earlier sibling's whole first turn."""
    shared = [rng.randrange(50_000) for _ in range(rng.randrange(1, 400))]
    traces = []
    for i in range(n):
        prompt = shared + [rng.randrange(50_000) for _ in range(rng.randrange(0, 3))]
        response = ([7, 7, 7] if i % 2 else []) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
        traces.append(_trace(prompt, response, rng, trainable=i != 1))
    first = traces[0]
    traces.append(_trace(first.prompt_ids + first.response_ids + [9, 9], [rng.randrange(50_000) for _ in range(5)], rng))
    return traces


def _same(a: Trace, b: Trace) -> bool:
    return (a.prompt_ids, a.response_ids, a.loss_mask, a.response_logprobs, a.trainable) == \
        (b.prompt_ids, b.response_ids, b.loss_mask, b.response_logprobs, b.trainable)


def test_members_come_back_exactly_and_the_prefix_is_maximal_and_unscored() -> None:
    rng = random.Random(0)
    saved = 0
    for case in range(200):
        traces = _group(rng, rng.randrange(1, 9))
        layout = layout_traces(f"g{case}", [("s", i, t) for i, t in enumerate(traces)])
        assert all(_same(a, b) for a, b in zip(expand(layout), traces, strict=True))
        n = len(layout.prefix_ids)
        cap = min(len(t.prompt_ids) for t in traces) - 1
        assert n <= cap  # every member's last prompt id (its first scored position) is in its suffix
        full = [t.prompt_ids + t.response_ids for t in traces]
        assert all(ids[:n] == layout.prefix_ids for ids in full)
        if len(traces) > 1 and n < cap:  # maximal: the next id differs somewhere
            assert len({ids[n] for ids in full}) > 1
        assert layout.full_tokens() == sum(map(len, full))
        assert layout.forwarded_tokens() == layout.full_tokens() - (len(traces) - 1) * n
        saved += layout.full_tokens() - layout.forwarded_tokens()
    assert saved > 0


def test_a_group_of_one_and_disjoint_prompts_share_nothing() -> None:
    assert shared_prefix_len([[1, 2, 3]], [2]) == 0
    assert shared_prefix_len([[1, 2, 3], [2, 2, 3]], [2, 2]) == 0
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]], [3, 3]) == 2  # capped: id 3 scores the responses
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]], [4, 4]) == 3


def test_trajectories_group_by_group_id_and_round_trip_through_jsonl(tmp_path: Path) -> None:
    rng = random.Random(1)
    trajectories = []
    for g in range(3):
        for i, trace in enumerate(_group(rng, 4)):
            trajectories.append(Trajectory(session_id=f"g{g}-{i}", traces=[trace], group_id=f"g{g}", sample_index=i))
    layouts = group_layouts(trajectories)
    assert [layout.group_id for layout in layouts] == ["g0", "g1", "g2"]
    assert all(len(layout.prefix_ids) > 0 for layout in layouts)
    path = tmp_path / "groups.jsonl"
    assert write_jsonl(trajectories, path) == 3
    back = [t for layout in read_jsonl(path) for t in expand(layout)]
    assert all(_same(a, b.traces[0]) for a, b in zip(back, trajectories, strict=True))
    trainable = group_layouts(trajectories, trainable_only=True)
    kept = [t for tr in trajectories for t in tr.traces if t.trainable and any(t.loss_mask)]
    assert sum(len(layout.members) for layout in trainable) == len(kept) < len(trajectories)
