"""A session's outcome on its trajectory: reward, status, failure and provenance, so files are
self-describing.

The rollout pipeline stores the outcome with the session's journal (``JournalStore.write_outcome``)
and applies it to the trajectory it builds; ``build_trajectories`` applies the same file when it
rebuilds a store later, so both give the same rewarded trajectory with the same ``status``,
``failure_kind``, ``failure_detail`` and ``mask`` (``polar_env.records.masked``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar_env.records import FailureKind, Status, Trajectory, masked
from polar_env.safetext import json_safe

_TYPED = ("status", "reward", "failure_kind", "failure_detail", "error")  # fields of the trajectory, not metadata
_LEGACY = (("INIT", FailureKind.INIT_ERROR), ("limit exceeded", FailureKind.LIMIT_EXCEEDED),
           ("evaluation", FailureKind.EVALUATOR_ERROR), ("builder", FailureKind.BUILD_ERROR),
           ("journal", FailureKind.BUILD_ERROR), ("node", FailureKind.NODE_LOST),
           ("no outcome was written", FailureKind.NODE_LOST))


def legacy_failure_kind(status: Status, detail: str | None) -> FailureKind | None:
    """The failure kind of an outcome written before kinds existed (only its status and error text)."""
    if status is Status.COMPLETED:
        return None
    if status is Status.CANCELLED:
        return FailureKind.CANCELLED
    text = detail or ""
    for prefix, kind in _LEGACY:
        if text.startswith(prefix):
            return FailureKind.EVALUATION_TIMEOUT if kind is FailureKind.EVALUATOR_ERROR and status is Status.TIMEOUT else kind
    return FailureKind.AGENT_TIMEOUT if status is Status.TIMEOUT else FailureKind.HARNESS_ERROR


def failure_kind_of(row: Mapping[str, Any], status: Status) -> FailureKind | None:
    """An outcome's or ``sessions.jsonl`` row's kind (one written before kinds existed: from its
    status and error text)."""
    if row.get("failure_kind"):
        return FailureKind(row["failure_kind"])
    return legacy_failure_kind(status, row.get("failure_detail") or row.get("error"))


def with_outcome(traj: Trajectory, outcome: dict[str, Any]) -> Trajectory:
    """``traj`` with the outcome's reward, status, failure and provenance on it, and the reward on every
    trainable trace (a chain the harness did not continue gets none: ``lineage.py``). A trajectory the
    builder refused (ERROR) of a session that did not fail otherwise is a build error. Lone surrogates
    in the outcome (a file name of the agent's that is not UTF-8) come out escaped, so the
    trajectory's writers never fail on them."""
    outcome = json_safe(outcome)
    reward = float(outcome.get("reward", 0.0))
    status = Status(outcome.get("status") or traj.status)
    detail = outcome.get("failure_detail") or outcome.get("error")
    kind = failure_kind_of(outcome, status)
    if traj.status is Status.ERROR and status is not Status.ERROR:
        status, kind, detail = Status.ERROR, FailureKind.BUILD_ERROR, str(traj.metadata.get("error") or "build failed")
    session_id = outcome.get("session_id", traj.session_id)
    provenance = outcome.get("metadata", {})
    group_id = provenance.get("group_id")
    meta = {**provenance, **{k: v for k, v in outcome.items() if k != "metadata" and k not in _TYPED},
            **traj.metadata}
    traces = [t.model_copy(update={"reward": reward if t.trainable else None,
                                   "status": status if t.status is Status.COMPLETED else t.status,
                                   "metadata": {**t.metadata, "session_id": session_id, "group_id": group_id}})
              for t in traj.traces]
    return traj.model_copy(update={
        "traces": traces, "reward": reward, "status": status, "metadata": meta, "failure_kind": kind,
        "failure_detail": detail, "mask": masked(kind, sum(sum(t.loss_mask) for t in traces if t.trainable)),
        "group_id": group_id, "sample_index": provenance.get("sample_index")})
