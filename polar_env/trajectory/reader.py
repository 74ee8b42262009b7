"""Store → trajectories, one session at a time: a session whose journal cannot be read becomes an
ERROR trajectory naming the bad line, a session with no calls an empty one, and every other session
is still built. The session's
metadata (from its persisted state) and, for sessions the rollout pipeline ran, its outcome
(reward, status, evaluation, provenance; ``outcome.py``) are attached, so a store rebuilt later
gives the same rewarded trajectories the pipeline returned."""

from __future__ import annotations

from collections.abc import Iterable

from polar_env.errors import PolarError
from polar_env.journal.protocols import JournalSource
from polar_env.records import FailureKind, Status, Trajectory
from polar_env.trajectory.builders import Builder
from polar_env.trajectory.checks import error_trajectory
from polar_env.trajectory.outcome import with_outcome


def build_session(store: JournalSource, session_id: str, build: Builder) -> Trajectory:
    """One session's trajectory, with the session's metadata (from its persisted state) attached
    as ``metadata["session"]`` when the store has it, and its outcome applied when it has one."""
    try:
        meta = store.read_session_meta(session_id)
    except PolarError:
        meta = None
    outcome = store.read_outcome(session_id)
    if outcome is None and meta is not None and "group_id" in (meta.get("metadata") or {}):
        # a rollout-pipeline session with no outcome: its node died before POSTRUN. Never COMPLETED.
        outcome = {"session_id": session_id, "status": "error", "reward": 0.0, "metadata": meta["metadata"],
                   "failure_kind": "node_lost",
                   "failure_detail": "no outcome was written for this session (its node died before POSTRUN)"}
    try:
        records = store.read(session_id)
    except PolarError as exc:  # JournalError: a line that is not a record (not the torn last one)
        trajectory = error_trajectory([], session_id, str(exc))
    else:
        # a rollout session that made no call has an empty trajectory (its outcome says why), not a builder ERROR
        trajectory = build(records) if records or outcome is None else Trajectory(session_id=session_id, traces=[])
    if meta is not None:
        trajectory.metadata["session"] = meta["metadata"]
    return with_outcome(trajectory, outcome) if outcome is not None else trajectory


def unbuilt(traj: Trajectory) -> bool:
    """The journal could not be read or built (a session that failed otherwise still built its
    trajectory, possibly empty: its calls can be checked and trained by its mask)."""
    return traj.failure_kind is FailureKind.BUILD_ERROR or (traj.status is Status.ERROR and traj.failure_kind is None)


def all_session_ids(store: JournalSource) -> list[str]:
    """Every session of the store: those with a journal, and those that made no call but have an
    outcome (a session that timed out or failed INIT before its first call still has its row)."""
    return sorted({*store.session_ids(), *store.outcome_ids()})


def build_store(store: JournalSource, build: Builder, session_ids: Iterable[str] | None = None) -> list[Trajectory]:
    return [build_session(store, sid, build) for sid in (all_session_ids(store) if session_ids is None else session_ids)]
