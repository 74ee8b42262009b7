"""BUILDERS: name → builder function (records → Trajectory). Add one more with one entry here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from polar_env.records import CompletionRecord, Trajectory
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

Builder = Callable[[Sequence[CompletionRecord]], Trajectory]

BUILDERS: dict[str, Builder] = {
    "per_request": build_per_request,
    "prefix_merge": build_prefix_merged,
    "prefix_merge_strict": lambda records: build_prefix_merged(records, strict=True),
}


def build_trajectories(store_dir: str | Path, builder: str = "prefix_merge",
                       sessions: Sequence[str] | None = None) -> list[Trajectory]:
    """Trajectories for the sessions of a capture store (all, or ``sessions``), one per session. A
    session's outcome written by the rollout pipeline (reward, status, provenance) is attached, and
    so is the session metadata journaled by the gateway, when present."""
    from polar_env.trajectory.outcome import read_outcome, with_outcome
    from polar_env.errors import ConfigError
    from polar_env.proxy.capture import CaptureStore

    if builder not in BUILDERS:
        raise ConfigError(f"unknown builder {builder!r}; known: {', '.join(sorted(BUILDERS))}")
    root = Path(store_dir)
    if not root.is_dir():
        raise ConfigError(f"capture store {root} does not exist")
    store = CaptureStore(root)
    out = []
    for sid in sessions or store.session_ids():
        traj = BUILDERS[builder](store.read(sid))
        outcome = read_outcome(root, sid)
        if outcome is not None:
            traj = with_outcome(traj, outcome)
        read_meta = getattr(store, "read_session_meta", None)
        meta = read_meta(sid) if read_meta is not None else None
        if meta:
            traj = traj.model_copy(update={"metadata": {**traj.metadata, "session": meta}})
        out.append(traj)
    return out
