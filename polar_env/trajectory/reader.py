"""Store → trajectories, one session at a time: a session whose journal cannot be read becomes an
ERROR trajectory naming the bad line, and every other session is still built."""

from __future__ import annotations

from collections.abc import Iterable

from polar_env.errors import PolarError
from polar_env.proxy.capture import CaptureStore
from polar_env.records import Trajectory
from polar_env.trajectory.builders import Builder
from polar_env.trajectory.checks import error_trajectory


def build_session(store: CaptureStore, session_id: str, build: Builder) -> Trajectory:
    """One session's trajectory, with the session's metadata (from its persisted state) attached
    as ``metadata["session"]`` when the store has it."""
    try:
        records = store.read(session_id)
    except PolarError as exc:  # JournalError: a line that is not a record (not the torn last one)
        return error_trajectory([], session_id, str(exc))
    trajectory = build(records)
    try:
        meta = store.read_session_meta(session_id)
    except PolarError:
        meta = None
    if meta is not None:
        trajectory.metadata["session"] = meta["metadata"]
    return trajectory


def build_store(store: CaptureStore, build: Builder, session_ids: Iterable[str] | None = None) -> list[Trajectory]:
    return [build_session(store, sid, build) for sid in (store.session_ids() if session_ids is None else session_ids)]
