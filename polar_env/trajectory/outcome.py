"""A session's outcome on its trajectory: reward, status and provenance, so files are self-describing.

The rollout pipeline writes the outcome next to the session's journal (``<session>.result.json``)
and applies it to the trajectory it builds; ``build_trajectories`` applies the same file when it
rebuilds a store later, so both give the same rewarded trajectory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from polar_env.records import Status, Trajectory

RESULT_SUFFIX = ".result.json"
# session status → trajectory status; a cancelled session never yields a trainable COMPLETED trace
_STATUS = {"completed": Status.COMPLETED, "timeout": Status.TIMEOUT, "error": Status.ERROR,
           "cancelled": Status.ABORTED}


def with_outcome(traj: Trajectory, outcome: dict[str, Any]) -> Trajectory:
    """``traj`` with the outcome's reward on it and on every trainable trace (a chain the harness did
    not continue gets none: ``lineage.py``), its status (a builder ERROR stays an ERROR) and its
    provenance in ``metadata``."""
    reward = float(outcome.get("reward", 0.0))
    status = traj.status if traj.status is Status.ERROR else _STATUS.get(outcome.get("status", ""), traj.status)
    session_id = outcome.get("session_id", traj.session_id)
    group_id = outcome.get("metadata", {}).get("group_id")
    meta = {**outcome.get("metadata", {}), **{k: v for k, v in outcome.items() if k != "metadata"},
            **{k: v for k, v in traj.metadata.items()}}
    traces = [t.model_copy(update={"reward": reward if t.trainable else None,
                                   "status": status if t.status is Status.COMPLETED else t.status,
                                   "metadata": {**t.metadata, "session_id": session_id, "group_id": group_id}})
              for t in traj.traces]
    return traj.model_copy(update={"traces": traces, "reward": reward, "status": status, "metadata": meta})


def write_outcome(store_root: Path, session_id: str, outcome: dict[str, Any]) -> None:
    path = Path(store_root) / f"{session_id}{RESULT_SUFFIX}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(outcome, default=str))
    tmp.replace(path)  # readers never see half a file


def read_outcome(store_root: Path, session_id: str) -> dict[str, Any] | None:
    path = Path(store_root) / f"{session_id}{RESULT_SUFFIX}"
    try:
        data = orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None
