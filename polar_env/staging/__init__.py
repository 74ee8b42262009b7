"""Staged rollouts: TaskRequest → sessions on gateway nodes → SessionResults with rewards.

``models`` (what crosses process lines), ``pools`` (stage limits and the READY buffer),
``lifecycle`` (one session INIT → READY → RUNNING → POSTRUN), ``node`` (a gateway node, in-process
or as a Ray actor), ``server`` (dispatch, early stop, callbacks, HTTP), ``cluster`` (starting nodes
locally or on Ray), ``report`` (run reports and the stage timeline).
"""

from __future__ import annotations

from polar_env.staging.models import (
    AgentSpec,
    SessionResult,
    SessionSpec,
    SessionStatus,
    Stage,
    TaskRequest,
    TaskState,
    TaskStatus,
)
from polar_env.staging.pools import PoolLimits

__all__ = [
    "AgentSpec",
    "PoolLimits",
    "SessionResult",
    "SessionSpec",
    "SessionStatus",
    "Stage",
    "TaskRequest",
    "TaskState",
    "TaskStatus",
]
