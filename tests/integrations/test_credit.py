"""Session-normalised loss weights: a long session's traces share one session's worth of weight."""

from __future__ import annotations

import pytest
from integration_doubles import trace, trajectory

from polar_env.integrations.credit import CreditScheme, annotate, trace_weights


def test_long_and_short_sessions_weigh_the_same() -> None:
    long = trajectory([trace([1], [([5] * n, [])]) for n in (1, 2, 3, 4)], session_id="long")
    short = trajectory([trace([1], [([5, 6], [7])])], session_id="short")
    for traj in (long, short):
        assert sum(trace_weights(traj.traces)) == pytest.approx(1.0)
    assert trace_weights(long.traces) == pytest.approx([0.1, 0.2, 0.3, 0.4])  # by trainable tokens
    # per-token weight is the same inside a session: weight / trainable tokens
    per_token = [w / sum(t.loss_mask) for w, t in zip(trace_weights(long.traces), long.traces, strict=True)]
    assert per_token == pytest.approx([0.1] * 4)
    assert trace_weights(long.traces, CreditScheme.TRACE) == [1.0] * 4
    assert trace_weights([trace([1], [([], [3])])] * 2) == [0.5, 0.5]  # nothing trainable: even split
    assert trace_weights([]) == []


def test_annotate_records_session_ids_and_weights() -> None:
    traj = trajectory([trace([1], [([5], [])]), trace([1, 2], [([6, 7, 8], [])])], session_id="s-9")
    out = annotate(traj)
    assert [t.metadata["session_id"] for t in out.traces] == ["s-9", "s-9"]
    assert [t.metadata["loss_weight"] for t in out.traces] == pytest.approx([0.25, 0.75])
    assert [t.metadata["session_traces"] for t in out.traces] == [2, 2]
    assert out.traces[0].metadata["finish_reason"] == "stop"  # existing metadata kept
    assert "loss_weight" not in traj.traces[0].metadata  # the input is not modified
