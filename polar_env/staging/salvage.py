"""A session whose node died mid-run: what its journal holds becomes its trajectory.

The node process is gone, so its POSTRUN never ran: no outcome file, no trajectory in the result.
The server still reaches the node's shard of the capture store (same host or shared filesystem),
so it builds the partial trajectory from the journal with the session's own builder, marks it
ERROR ``node_lost`` (masked: never trainable, whatever it captured), and writes the outcome file the
node could not, so a later ``polar-env build`` of that store agrees with the job's trajectories.
The result always carries a trajectory (empty when the journal holds nothing), so the group stays whole.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from polar_env.errors import ConfigError, PolarError
from polar_env.journal.protocols import JournalOpener
from polar_env.records import FailureKind, Trajectory
from polar_env.staging.lifecycle import session_metadata
from polar_env.staging.models import SessionResult, SessionSpec, SessionStatus
from polar_env.trajectory.builders import BUILDERS
from polar_env.trajectory.outcome import with_outcome

log = logging.getLogger(__name__)


def salvage(store_root: Path, spec: SessionSpec, result: SessionResult, open_journal: JournalOpener) -> SessionResult:
    """``result`` (the ERROR the server made) as ``node_lost``, with the partial trajectory and an
    outcome on disk. ``open_journal`` opens the shard's store (the server names it)."""
    try:
        records = open_journal(store_root).read(spec.session_id) if store_root.is_dir() else []
    except (PolarError, OSError) as exc:
        log.warning("session %s: its journal is unreadable after its node died: %s", spec.session_id, exc)
        records = []
    detail = result.failure_detail or "its gateway node died"
    outcome = {"session_id": spec.session_id, "metadata": session_metadata(spec, result.node_id),
               "status": SessionStatus.ERROR.value, "reward": 0.0, "evaluation": {},
               "failure_kind": FailureKind.NODE_LOST.value, "failure_detail": detail,
               "stage_times": {**result.stage_times, "salvaged": time.time()}, "harness_exit_code": None,
               "weight_versions": sorted({r.weight_version for r in records if r.weight_version is not None})}
    built = Trajectory(session_id=spec.session_id, traces=[])
    try:  # a table name or a pkg.module:attr import path, as validation accepted
        build = BUILDERS.get(spec.request.builder)
    except ConfigError:
        build = None
    if records and build is not None:
        try:
            built = build(records)
        except Exception as exc:  # noqa: BLE001 - a builder bug must not lose the result
            log.warning("session %s: building its partial trajectory failed: %s", spec.session_id, exc)
    trajectory = with_outcome(built, outcome)
    try:
        open_journal(store_root).write_outcome(spec.session_id, outcome)
    except (OSError, ConfigError) as exc:
        log.warning("session %s: cannot write its outcome: %s", spec.session_id, exc)
    return result.model_copy(update={"status": SessionStatus.ERROR, "failure_kind": FailureKind.NODE_LOST,
                                     "failure_detail": detail, "trajectory": trajectory, "records": len(records),
                                     "mask": True})
