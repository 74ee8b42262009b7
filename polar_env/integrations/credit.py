"""Credit assignment across the traces of one session.

A session can yield several traces (the per-request builder gives one per call; prefix merging
gives one per chain). A trainer that averages per trace then lets a 40-call session count 40 times
as much as a 1-call one. ``annotate`` records on every trace the session it came from and a loss
weight: with ``CreditScheme.SESSION`` a session's weights sum to 1, split in proportion to each
trace's trainable tokens, so ``sum(weight * mean_token_loss(trace))`` gives every session the same
say and every token inside a session the same say. ``CreditScheme.TRACE`` leaves every weight at
1.0 (the trainer's own averaging decides). The ids are there so trainers can group by session
themselves (slime does: siblings share a ``rollout_id`` and its loss is a per-rollout mean).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from polar_env.records import Trace, Trajectory

SESSION_ID_KEY = "session_id"
LOSS_WEIGHT_KEY = "loss_weight"
SESSION_TRACES_KEY = "session_traces"


class CreditScheme(enum.StrEnum):
    SESSION = "session"  # each session's trace weights sum to 1 (by trainable tokens)
    TRACE = "trace"  # weight 1.0 on every trace


def trace_weights(traces: Sequence[Trace], scheme: CreditScheme = CreditScheme.SESSION) -> list[float]:
    """One loss weight per trace of one session (see the module docstring)."""
    if scheme is CreditScheme.TRACE or not traces:
        return [1.0] * len(traces)
    trainable = [sum(t.loss_mask) if t.trainable else 0 for t in traces]  # a side chain gets no credit
    total = sum(trainable)
    if total == 0:  # nothing trainable: split evenly so the weights still sum to 1
        return [1.0 / len(traces)] * len(traces)
    return [n / total for n in trainable]


def annotate(trajectory: Trajectory, scheme: CreditScheme = CreditScheme.SESSION) -> Trajectory:
    """A copy of ``trajectory`` whose traces carry ``session_id``, ``loss_weight`` and
    ``session_traces`` in their metadata."""
    weights = trace_weights(trajectory.traces, scheme)
    traces = [
        trace.model_copy(update={"metadata": {
            **trace.metadata,
            SESSION_ID_KEY: trajectory.session_id,
            LOSS_WEIGHT_KEY: weight,
            SESSION_TRACES_KEY: len(trajectory.traces),
        }})
        for trace, weight in zip(trajectory.traces, weights, strict=True)
    ]
    return trajectory.model_copy(update={"traces": traces})
