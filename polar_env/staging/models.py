"""What crosses process lines in a rollout: the task a trainer submits, the per-session spec a node
runs, and the result that comes back (status, reward, evaluation, trajectory, stage times).

All pydantic, so the same objects travel as JSON over HTTP (``polar-env serve``), through Ray, and
in-process. ``TaskRequest`` follows the Polar reference API (``task_id``, ``num_samples``, priority,
runtime/agent/builder/evaluator specs, callback, early stop); field names carry their units.
"""

from __future__ import annotations

import enum
import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvaluatorSpec
from polar_env.evaluators.report import EvalReport, PlainJSONObject
from polar_env.proxy.config import Sampling
from polar_env.records import MASKED_KINDS, SESSION_STATUSES, FailureKind, ProviderAPI, Status, Trajectory
from polar_env.registry import names_checked
from polar_env.runtimes.base import RuntimeSpec


def check_harness_name(value: str, info: ValidationInfo | None = None) -> str:
    """For validators: a harness preset, file, import path or ``loop``, resolved now (ValueError
    with the one line otherwise); skipped under the ``NAMES_CHECKED`` context."""
    if info is not None and names_checked(info):
        return value
    from polar_env.harnesses import LOOP, get_harness
    from polar_env.proxy.providers import PROVIDERS

    try:
        if value != LOOP:  # resolved once: every API the harness (a file may name any) speaks is a provider
            for api in get_harness(value).apis:
                PROVIDERS.entry(api)
        return value
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def check_harness_api(harness: str, api: ProviderAPI | None, info: ValidationInfo | None = None) -> None:
    """For validators: the harness speaks ``api``, a registered provider (``PROVIDERS``: a harness
    file may name any API; its own default is checked where the file is read); ValueError with the
    one line otherwise."""
    if api is None or harness == "loop" or (info is not None and names_checked(info)):
        return
    from polar_env.harnesses import get_harness
    from polar_env.proxy.providers import PROVIDERS

    try:
        PROVIDERS.entry(get_harness(harness).api_of(api))
    except ConfigError as exc:
        raise ValueError(f"api: {exc}") from None


SessionStatus = Status
"""How a session ended: the records' one ``Status`` vocabulary (completed, timeout, error, cancelled;
never ``truncated``, which is a trace's finish). Every session ends in exactly one, after POSTRUN."""


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
    # the trainer's sampling for this task (a Gym row's temperature, slime's sampling params): over
    # the environment's own, which it must not contradict (PolarEnvConfig.check_sampling)
    sampling: Sampling | None = None

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
    """What a node reports for one session: every exit path (INIT failure, agent timeout, harness or
    engine failure, limit hit, evaluator or build failure, cancellation, a dead node) gives one, with
    ``failure_kind`` set whenever ``status`` is not completed, and always a ``trajectory`` (with no
    traces when nothing was captured), so every GRPO group has ``num_samples`` rows. ``mask`` is the
    one flag a trainer drops a sample by (``polar_env.records.masked``)."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    task_id: str
    group_id: str
    sample_index: int
    node_id: str = ""
    status: SessionStatus
    reward: float = 0.0
    evaluation: Annotated[EvalReport, PlainJSONObject] = Field(default_factory=lambda: EvalReport())
    trajectory: Trajectory
    stage_times: dict[str, float] = Field(default_factory=dict)  # stage name -> epoch seconds entered
    records: int = 0  # captured engine calls
    harness_exit_code: int | None = None
    limits: dict[str, Any] = Field(default_factory=dict)  # per limit: value, mechanism; which was hit
    failure_kind: FailureKind | None = None  # None: completed and evaluated
    failure_detail: str | None = None  # free text for people; trainers read failure_kind
    mask: bool = False  # True: a trainer should drop this sample from the loss

    @model_validator(mode="before")
    @classmethod
    def _complete(cls, data: Any) -> Any:
        """Old sessions.jsonl rows said ``error`` for ``failure_detail`` and had no kind (one is
        inferred from their status and text); a result built with no trajectory gets the empty one
        its row needs."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "error" in data:
            error = data.pop("error")
            data.setdefault("failure_detail", error)
            if data.get("failure_kind") is None and "status" in data:
                from polar_env.trajectory.outcome import legacy_failure_kind

                data["failure_kind"] = legacy_failure_kind(Status(data["status"]), data.get("failure_detail"))
                data.setdefault("mask", data["failure_kind"] is not None and data["failure_kind"] in MASKED_KINDS)
        if data.get("trajectory") is None and "session_id" in data:
            data["trajectory"] = empty_trajectory(data)
        return data

    @model_validator(mode="after")
    def _typed(self) -> SessionResult:
        if self.status not in SESSION_STATUSES:
            raise ValueError(f"a session ends {sorted(SESSION_STATUSES)}, not {self.status.value!r}")
        if (self.status is Status.COMPLETED) != (self.failure_kind is None):
            raise ValueError(f"session {self.session_id}: status {self.status.value} with failure_kind "
                             f"{self.failure_kind}: a failure_kind is set exactly when the session did not complete")
        return self

    @property
    def usable(self) -> bool:
        """Counts towards early stop: finished and evaluated (any reward)."""
        return self.status is SessionStatus.COMPLETED

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent in each stage, from the transition timestamps."""
        order = [s.value for s in Stage if s.value in self.stage_times]
        return {a: round(self.stage_times[b] - self.stage_times[a], 4) for a, b in zip(order, order[1:], strict=False)}


def empty_trajectory(result: dict[str, Any]) -> Trajectory:
    """The row of a session that captured nothing: no traces, masked, with the result's outcome."""
    return Trajectory(session_id=result["session_id"], traces=[], reward=result.get("reward", 0.0),
                      status=result.get("status", Status.ERROR), failure_kind=result.get("failure_kind"),
                      failure_detail=result.get("failure_detail"), mask=True, group_id=result.get("group_id"),
                      sample_index=result.get("sample_index"))


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
        kinds: dict[str, int] = {}
        for r in self.results:
            counts[r.status.value] = counts.get(r.status.value, 0) + 1
            if r.failure_kind is not None:
                kinds[r.failure_kind.value] = kinds.get(r.failure_kind.value, 0) + 1
        rewards = [r.reward for r in self.results]
        return {"task_id": self.task_id, "group_id": self.group_id, "state": self.state.value,
                "done": len(self.results), "num_samples": self.num_samples, "statuses": counts,
                "failure_kinds": kinds, "masked": sum(r.mask for r in self.results),
                "mean_reward": sum(rewards) / len(rewards) if rewards else None}
