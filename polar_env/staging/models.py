"""What crosses process lines in a rollout: the task a trainer submits, the per-session spec a node
runs, and the result that comes back (status, reward, evaluation, trajectory, stage times).

All pydantic, so the same objects travel as JSON over HTTP (``polar-env serve``), through Ray, and
in-process. ``TaskRequest`` follows the Polar reference API (``task_id``, ``num_samples``, priority,
runtime/agent/builder/evaluator specs, callback, early stop); field names carry their units.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvaluatorSpec
from polar_env.records import FailureKind, ProviderAPI, Trajectory
from polar_env.registry import names_checked
from polar_env.runtimes.base import RuntimeSpec


def check_harness_name(value: str, info: ValidationInfo | None = None) -> str:
    """For validators: a harness preset, file, import path or ``loop``, resolved now (ValueError
    with the one line otherwise); skipped under the ``NAMES_CHECKED`` context."""
    if info is not None and names_checked(info):
        return value
    from polar_env.harnesses import check_harness

    try:
        return check_harness(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def check_harness_api(harness: str, api: ProviderAPI | None, info: ValidationInfo | None = None) -> None:
    """For validators: the harness speaks ``api`` (ValueError with the one line otherwise)."""
    if api is None or harness == "loop" or (info is not None and names_checked(info)):
        return
    from polar_env.harnesses import get_harness

    try:
        get_harness(harness).api_of(api)
    except ConfigError as exc:
        raise ValueError(f"api: {exc}") from None


class SessionStatus(enum.StrEnum):
    """How a session ended. Every session ends in exactly one of these, and always after POSTRUN."""

    COMPLETED = "completed"
    TIMEOUT = "timeout"
    ERROR = "error"
    CANCELLED = "cancelled"


class Stage(enum.StrEnum):
    """Where a session is. QUEUED: waiting for a READY-buffer place; INIT: runtime being prepared;
    READY: prepared, waiting for a RUNNING slot; RUNNING: the harness runs; POSTRUN: build,
    evaluate, clean up; DONE: the result exists."""

    QUEUED = "queued"
    INIT = "init"
    READY = "ready"
    RUNNING = "running"
    POSTRUN = "postrun"
    DONE = "done"


class AgentSpec(BaseModel):
    """Which harness runs the session. ``harness`` is a preset name (``pi``, ``qwen_code``, ...), a
    harness file or import path (see ``polar_env.harnesses``), or ``loop`` (the built-in agent loop)."""

    model_config = ConfigDict(extra="forbid")

    harness: str = "pi"
    api: ProviderAPI | None = None  # the harness's default wire format when None
    env: dict[str, str] = Field(default_factory=dict)
    settings: dict[str, Any] = Field(default_factory=dict)  # harness-specific (e.g. loop: max_turns)

    @field_validator("harness")
    @classmethod
    def _known_harness(cls, value: str, info: ValidationInfo) -> str:
        return check_harness_name(value, info)

    @model_validator(mode="after")
    def _speaks_api(self, info: ValidationInfo) -> AgentSpec:
        check_harness_api(self.harness, self.api, info)
        return self


class TaskRequest(BaseModel):
    """One task to roll out ``num_samples`` times (one GRPO group)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    instruction: str
    num_samples: int = Field(default=1, ge=1, le=4096)
    priority: int = Field(default=50, ge=0, le=100)  # higher starts INIT first
    timeout_s: float = Field(default=600.0, gt=0)  # the agent's budget (RUNNING)
    init_timeout_s: float = Field(default=300.0, gt=0)  # runtime start + install (INIT)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    agent: AgentSpec = Field(default_factory=AgentSpec)
    builder: str = "prefix_merge"
    evaluator: EvaluatorSpec | None = None
    continuation: bool = True  # token-in continuation mode: append-only chains, zero drift
    callback_url: str | None = None
    early_stop_min_usable: int | None = Field(default=None, ge=1)
    group_id: str | None = None  # defaults to the task id plus a short random suffix
    task: dict[str, Any] = Field(default_factory=dict)  # the task row evaluators read (e.g. a SweTask dump)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("task_id")
    @classmethod
    def _task_id(cls, value: str) -> str:
        if not value or len(value) > 200:
            raise ValueError("task_id must be 1-200 characters")
        return value

    @field_validator("builder")
    @classmethod
    def _known_builder(cls, value: str, info: ValidationInfo) -> str:
        from polar_env.trajectory.builders import BUILDERS

        return BUILDERS.check(value, info)


class SessionSpec(BaseModel):
    """One sample of a task, as dispatched to a gateway node."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    sample_index: int
    group_id: str
    request: TaskRequest


class SessionResult(BaseModel):
    """What a node reports for one session. ``trajectory`` is None only when nothing could be built
    (e.g. the runtime never started); a timed-out, crashed or cancelled session still carries
    whatever was captured."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    task_id: str
    group_id: str
    sample_index: int
    node_id: str = ""
    status: SessionStatus
    reward: float = 0.0
    evaluation: dict[str, Any] = Field(default_factory=dict)
    trajectory: Trajectory | None = None
    stage_times: dict[str, float] = Field(default_factory=dict)  # stage name -> epoch seconds entered
    records: int = 0  # captured engine calls
    harness_exit_code: int | None = None
    error: str | None = None
    limits: dict[str, Any] = Field(default_factory=dict)  # per limit: value, mechanism; which was hit
    failure_kind: FailureKind | None = None  # None: completed and evaluated
    failure_detail: str | None = None  # free text for people; trainers read failure_kind
    mask: bool = False  # True: a trainer should drop this sample from the loss

    @property
    def usable(self) -> bool:
        """Counts towards early stop: finished and evaluated (any reward)."""
        return self.status is SessionStatus.COMPLETED

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent in each stage, from the transition timestamps."""
        order = [s.value for s in Stage if s.value in self.stage_times]
        return {a: round(self.stage_times[b] - self.stage_times[a], 4) for a, b in zip(order, order[1:], strict=False)}


class TaskState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class TaskStatus(BaseModel):
    """A submitted task's progress; the callback payload and the ``GET /rollout/task/{id}`` body."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    group_id: str
    state: TaskState
    num_samples: int
    submitted_at: float = Field(default_factory=time.time)
    finished_at: float | None = None
    results: list[SessionResult] = Field(default_factory=list)
    early_stopped: bool = False

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.status.value] = counts.get(r.status.value, 0) + 1
        rewards = [r.reward for r in self.results]
        return {"task_id": self.task_id, "group_id": self.group_id, "state": self.state.value,
                "done": len(self.results), "num_samples": self.num_samples, "statuses": counts,
                "mean_reward": sum(rewards) / len(rewards) if rewards else None}
