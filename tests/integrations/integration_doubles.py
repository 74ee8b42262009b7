"""Test doubles for the trainer-integration tests, named as such.

``SampleDouble`` stands in for ``slime.utils.types.Sample`` (same field names and nested ``Status``
enum; slime is not on PyPI). ``FakePolarEnv`` stands in for ``polar_env.PolarEnv``: it returns
hand-built trajectories instead of running sessions. Hand-built trajectories come from
``trace``/``trajectory`` below.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from polar_env.records import FailureKind, Status, Trace, Trajectory, masked
from polar_env.staging.models import SessionResult


@dataclass
class SampleDouble:
    """Duck-typed stand-in for slime's ``Sample`` (fields used by the contract)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    train_metadata: dict | None = None
    session_id: str | None = None


def trace(
    prompt: list[int],
    turns: list[tuple[list[int], list[int]]],
    *,
    finish: str = "stop",
    weight_versions: list[str | None] | None = None,
    first_logprob: float = -0.5,
) -> Trace:
    """A merged trace: ``turns`` is [(sampled ids, inserted ids after them)]; sampled tokens get
    logprobs first_logprob, first_logprob - 0.01, ... so alignment errors show."""
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    lp = first_logprob
    for sampled, inserted in turns:
        for tok in sampled:
            response.append(tok)
            mask.append(1)
            logprobs.append(lp)
            lp -= 0.01
        response += inserted
        mask += [0] * len(inserted)
        logprobs += [0.0] * len(inserted)
    meta: dict[str, Any] = {"finish_reason": finish, "seqs": list(range(len(turns)))}
    if weight_versions is not None:
        meta["weight_versions"] = weight_versions
    return Trace(prompt_ids=prompt, response_ids=response, loss_mask=mask, response_logprobs=logprobs, metadata=meta)


def trajectory(traces: list[Trace], *, reward: float | None = 1.0, session_id: str = "s-1",
               status: Status = Status.COMPLETED, **metadata: Any) -> Trajectory:
    stamped = [t.model_copy(update={"reward": reward}) for t in traces]
    return Trajectory(session_id=session_id, traces=stamped, reward=reward, status=status, metadata=metadata)


def multi_turn_trace() -> Trace:
    """Three assistant turns with tool results between them, the last one unterminated."""
    return trace([1, 2, 3], [([10, 11, 99], [7, 8]), ([12, 99], [7, 9, 9]), ([13, 14], [])])


DEFAULT_KIND = {"completed": None, "timeout": FailureKind.AGENT_TIMEOUT, "error": FailureKind.ENGINE_ERROR,
                "cancelled": FailureKind.CANCELLED}
"""The failure kind a scripted session of each status gets unless the script names one."""


def fake_result(task_id: str, index: int, status: str, reward: float, traj: Trajectory | None,
                kind: FailureKind | None = None, detail: str | None = None) -> SessionResult:
    """A real ``SessionResult`` for a scripted session (the mask by the real rule)."""
    kind = kind if kind is not None else DEFAULT_KIND[status]
    tokens = sum(sum(t.loss_mask) for t in traj.traces) if traj is not None else 0
    return SessionResult(session_id=f"{task_id}-{index}", task_id=task_id, group_id="g", sample_index=index,
                         status=Status(status), reward=reward, evaluation={"reward": reward}, trajectory=traj,
                         failure_kind=kind, failure_detail=detail or (f"scripted {status}" if kind else None),
                         mask=masked(kind, tokens))


@dataclass
class FakeGroup:
    task_id: str
    group_id: str
    results: list[SessionResult]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [r.trajectory for r in self.results if r.trajectory is not None]


class FakePolarEnv:
    """Test double for ``PolarEnv``: ``rollout`` answers from ``script`` (task_id → list of
    (status, reward, trajectory[, failure kind]) per sample, cycled) and records what it was asked.
    Its results are real ``SessionResult``s."""

    def __init__(self, script: dict[str, list[tuple[Any, ...]]] | None = None,
                 raises: Exception | None = None) -> None:
        self.script = script or {}
        self.raises = raises
        self.calls: list[tuple[Any, int, dict[str, Any]]] = []
        self.entered = 0
        self.exited = 0

    async def __aenter__(self) -> FakePolarEnv:
        self.entered += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited += 1

    async def rollout(self, task: Any, n: int = 1, **overrides: Any) -> FakeGroup:
        self.calls.append((task, n, overrides))
        if self.raises is not None:
            raise self.raises
        if isinstance(task, dict):
            task_id = task.get("task_id") or task["instance_id"]
        else:
            task_id = getattr(task, "task_id", None) or task.instance_id
        plan = self.script[task_id]
        results = []
        for i in range(n):
            status, reward, traj, *kind = plan[(len(self.calls) - 1 + i) % len(plan)]
            results.append(fake_result(task_id, i, status, reward, traj, *kind))
        return FakeGroup(task_id=task_id, group_id="g", results=results)

    async def rollout_many(self, tasks: list[Any], n: int = 1) -> list[FakeGroup]:
        return [await self.rollout(t, n) for t in tasks]
