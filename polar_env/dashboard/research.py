"""The researcher's figures over a run's session index: per task, per GRPO group, and one
session's evaluation and training view.

A researcher asks "which tasks did it solve, and why did the rest fail?" before "what did one
session do?", so these are computed from the same cached rows the sessions table pages
(``Run.rows``), with the planned groups of ``plan.json`` for what has not started yet. Nothing
here reads a journal.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

import orjson

from polar_env.dashboard.runs import FINISHED, UNSTARTED, Run, pass_table, sort_slice
from polar_env.records import Trajectory

_ERRORED = ("error", "timeout", "cancelled")
_TASK_SORTS = ("task_id", "state", "harness", "samples", "finished", "completed", "errored", "masked", "mean_reward",
               "mean_traces", "mean_calls")
_STAGES = ("queued", "init", "ready", "running", "postrun")  # a session's way through a node, in order


class TaskRow(TypedDict):
    task_id: str
    state: str  # "done", "running", "pending"
    harness: str | None
    model: str | None
    samples: int
    finished: int
    completed: int
    errored: int
    mean_reward: float | None
    mean_traces: float | None
    mean_calls: float | None
    masked: int
    groups: list[str]


class TasksTable(TypedDict):
    run: str
    model: str | None
    tasks: list[TaskRow]


class TasksPage(TasksTable):
    total: int
    offset: int
    limit: int
    states: dict[str, int]


class Step(TypedDict):
    """One line of ``steps.jsonl`` as the Train view shows it (values as the trainer wrote them)."""

    step: object
    reward_mean: object
    rollouts: object
    sampled_tokens: object
    rollout_s: object
    train_s: object
    loss: object
    versions: object
    tokens_per_s: float | None


class HeldOutTask(TypedDict):
    task_id: str
    before: object
    after: object


class HeldOut(TypedDict):
    tasks: object
    before: object
    after: object
    gain: object
    per_task: list[HeldOutTask]


class TrainView(TypedDict):
    run: str
    kind: str
    steps: list[Step]
    ks: list[int]
    summary: dict[str, object]  # summary.json's headline figures
    held_out: HeldOut | None
    per_version: list[dict[str, object]]  # {"version": ..., pass_table's figures}


class Progress(TypedDict):
    grading: str | None
    stages_reached: list[str]


class GroupView(TypedDict):
    run: str
    group_id: str
    task_id: str | None
    mean_reward: float | None
    counted: int
    advantage_rule: str
    samples: list[dict[str, object]]  # the session rows, each with its ``advantage``
    prev: str | None
    next: str | None
    groups: int
    index: int


class Sibling(TypedDict):
    session_id: str
    sample_index: int | None
    reward: float | None
    status: str


class TestRow(TypedDict):
    group: str
    result: str
    test: str


class IntegrityView(TypedDict):
    dropped_paths: list[dict[str, object]]
    graded_paths: list[object]
    tampered: bool
    tamper_evidence: list[object]
    forged_lines: object
    canaries: int
    failed_canaries: list[dict[str, object]]


class TraceView(TypedDict):
    index: int
    role: str
    trainable: bool
    sampled_tokens: int


class TrainerView(TypedDict):
    mask: bool
    trained_tokens: int
    traces: list[TraceView]
    reward: object
    failure_kind: object


def _mapping(value: object) -> Mapping[str, object]:
    """``value`` if it is a JSON object, else an empty one (what was read back may be anything)."""
    return value if isinstance(value, dict) else {}


def _items(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def _groups(run: Run) -> dict[str, list[dict[str, Any]]]:
    """Each group's rows in sample order, planned groups first (in plan order), then any others."""
    rows = run.rows()
    by_group: dict[str, list[dict[str, Any]]] = {}
    for g in run.plan().get("groups") or []:
        by_group[str(g["group_id"])] = []
    for r in rows:
        by_group.setdefault(str(r.get("group_id") or r["task_id"]), []).append(r)
    for members in by_group.values():
        members.sort(key=lambda r: (r["sample_index"] is None, r["sample_index"] or 0, r["session_id"]))
    return by_group


def model_of(run: Run) -> str | None:
    engine = ((run.plan().get("job") or {}).get("env") or {}).get("engine") or {}
    config_engine = (((run.report().get("config") or {}).get("env") or {}).get("engine")) or {}
    return engine.get("model") or config_engine.get("model")


def tasks_table(run: Run) -> TasksTable:
    """One row per task: state, harness, model, planned and finished samples, completed/errored,
    mean reward over finished samples, mean traces and calls per session, and its groups."""
    planned: dict[str, int] = {}
    for g in run.plan().get("groups") or []:
        planned[str(g["task_id"])] = planned.get(str(g["task_id"]), 0) + len(g.get("session_ids") or [])
    by_task: dict[str, list[dict[str, Any]]] = {}
    groups: dict[str, list[str]] = {}
    for gid, members in _groups(run).items():
        for r in members:
            by_task.setdefault(r["task_id"], []).append(r)
            if gid not in groups.setdefault(r["task_id"], []):
                groups[r["task_id"]].append(gid)
    for g in run.plan().get("groups") or []:
        by_task.setdefault(str(g["task_id"]), [])
        if str(g["group_id"]) not in groups.setdefault(str(g["task_id"]), []):
            groups[str(g["task_id"])].append(str(g["group_id"]))
    model = model_of(run)
    out: list[TaskRow] = []
    for task_id, members in sorted(by_task.items()):
        done = [r for r in members if r["status"] in FINISHED]
        samples = max(planned.get(task_id, 0), len(members))
        started = [r for r in members if r["status"] not in UNSTARTED]
        state = "done" if samples and len(done) == samples else ("pending" if not started else "running")
        out.append({
            "task_id": task_id, "state": state, "harness": ", ".join(sorted({str(r["harness"]) for r in members if r["harness"]})) or None,
            "model": model, "samples": samples, "finished": len(done),
            "completed": sum(r["status"] == "completed" for r in done),
            "errored": sum(r["status"] in _ERRORED for r in done),
            "mean_reward": _mean([float(r["reward"]) for r in done if r["reward"] is not None]),
            "mean_traces": _mean([float(r["traces"]) for r in done if r.get("traces") is not None]),
            "mean_calls": _mean([float(r["calls"]) for r in done if r.get("calls") is not None]),
            "masked": sum(bool(r.get("mask")) for r in members), "groups": groups.get(task_id, []),
        })
    return {"run": run.name, "model": model, "tasks": out}


def tasks_page(run: Run, *, q: str = "", state: str = "", sort: str = "task_id", desc: bool = False, offset: int = 0,
               limit: int = 50) -> TasksPage:
    """One page of the task rows, filtered (``q``: a substring of the task id; ``state``) and
    sorted on the server, like the Sessions view: 1,250 tasks were 21,000 elements in the page."""
    table = tasks_table(run)
    states: dict[str, int] = {}
    for t in table["tasks"]:
        states[t["state"]] = states.get(t["state"], 0) + 1
    rows = [t for t in table["tasks"] if q.lower() in t["task_id"].lower() and (not state or t["state"] == state)]
    sliced = sort_slice(rows, sort if sort in _TASK_SORTS else "task_id", desc=desc, offset=offset, limit=limit)
    return {"run": table["run"], "model": table["model"], "tasks": sliced["rows"], "total": sliced["total"],
            "offset": sliced["offset"], "limit": sliced["limit"], "states": states}


def _json_file(path: Path) -> object:
    try:
        return orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None


def train_view(run: Run) -> TrainView:
    """A ``polar-env train`` run as its own view: per step its mean reward, sampled tokens per
    second of rollout and loss (``steps.jsonl``), the held-out tasks' reward before the first step
    and after the last (``summary.json``, when the recipe has held-out tasks), and pass@k per policy
    version from the sessions' outcomes (a step's samples are one policy's; pooling three steps'
    samples into one pass@k measures no policy)."""
    steps: list[Step] = []
    for line in (run.path / "steps.jsonl").read_bytes().splitlines() if (run.path / "steps.jsonl").exists() else []:
        s = orjson.loads(line)
        steps.append({"step": s.get("step"), "reward_mean": s.get("reward_mean"),
                      "rollouts": s.get("rollouts"), "sampled_tokens": s.get("sampled_tokens"), "rollout_s": s.get("rollout_s"),
                      "train_s": s.get("train_s"), "loss": s.get("loss"), "versions": s.get("weight_versions"),
                      "tokens_per_s": s["sampled_tokens"] / s["rollout_s"] if s.get("rollout_s") else None})
    summary = _mapping(_json_file(run.path / "summary.json"))
    held = _mapping(summary.get("held_out"))
    table = pass_table([r for r in run.rows() if r["status"] in FINISHED])
    versions = table["per_version"] or ({"-": table["overall"]} if table["overall"]["sessions"] else {})
    return {"run": run.name, "kind": run.kind(), "steps": steps, "ks": table["ks"],
            "summary": {k: summary.get(k) for k in ("name", "seed", "control", "steps", "wall_s", "improvement",
                                                    "sampled_tokens_per_s", "trained_tokens_per_s", "step0_max_abs_delta")},
            "held_out": None if not held else {
                "tasks": held.get("tasks"), "before": held.get("before"), "after": held.get("after"), "gain": held.get("gain"),
                "per_task": [{"task_id": t, "before": v[0], "after": v[1]}
                             for t, v in sorted(_mapping(held.get("per_task")).items()) if isinstance(v, list)]},
            "per_version": [{"version": v, **figures} for v, figures in versions.items()]}


def progress_so_far(row: Mapping[str, object], stage_times: dict[str, float], pending: bool) -> Progress:
    """What an in-flight session has reached (its node reports the stage it is in; the stage times
    come with its outcome) and that it has not been graded yet, instead of empty cards."""
    if not pending or stage_times:
        return {"grading": None, "stages_reached": []}
    at = _STAGES.index(row["status"]) if row["status"] in _STAGES else 0
    return {"grading": "running now (postrun)" if row["status"] == "postrun" else "not yet run",
            "stages_reached": list(_STAGES[: at + 1])}


def group_view(run: Run, group_id: str) -> GroupView | None:
    """One GRPO group's samples side by side. ``advantage`` is the reward minus the mean reward of
    the group's finished, unmasked samples (what a GRPO trainer normalises against, before any
    division by the spread); a masked sample has none, since the trainer drops it."""
    groups = _groups(run)
    if group_id not in groups:
        return None
    members = groups[group_id]
    counted = [float(r["reward"]) for r in members
               if r["status"] in FINISHED and not r.get("mask") and r["reward"] is not None]
    mean = statistics.fmean(counted) if counted else None
    samples: list[dict[str, object]] = []
    for r in members:
        advantage = None
        if mean is not None and r["reward"] is not None and r["status"] in FINISHED and not r.get("mask"):
            advantage = round(float(r["reward"]) - mean, 4)
        samples.append({**r, "advantage": advantage})
    order = list(groups)
    at = order.index(group_id)
    return {"run": run.name, "group_id": group_id, "task_id": members[0]["task_id"] if members else None,
            "mean_reward": None if mean is None else round(mean, 4), "counted": len(counted),
            "advantage_rule": "reward minus the mean reward of the group's finished, unmasked samples",
            "samples": samples, "prev": order[at - 1] if at > 0 else None,
            "next": order[at + 1] if at + 1 < len(order) else None, "groups": len(order), "index": at}


def siblings(run: Run, row: Mapping[str, object]) -> list[Sibling]:
    """The other samples of a session's group (itself included), in sample order, for stepping."""
    members = _groups(run).get(str(row.get("group_id") or row["task_id"]), [])
    return [{"session_id": r["session_id"], "sample_index": r["sample_index"], "reward": r["reward"],
             "status": r["status"]} for r in members]


def tests_table(evaluation: Mapping[str, object]) -> list[TestRow]:
    """The evaluator's FAIL_TO_PASS / PASS_TO_PASS (and any other group) with each test's result,
    from swebench's ``tests_status`` (``evaluation.swebench`` or, older, ``graded``/top level)."""
    status = (_mapping(_mapping(evaluation.get("swebench")).get("tests_status"))
              or _mapping(_mapping(evaluation.get("graded")).get("tests_status")) or _mapping(evaluation.get("tests_status")))
    rows: list[TestRow] = []
    for group in sorted(status, key=lambda g: (g not in ("FAIL_TO_PASS", "PASS_TO_PASS"), g)):
        for result, names in sorted(_mapping(status[group]).items()):
            rows.extend({"group": group, "result": result, "test": str(n)} for n in _items(names))
    return rows


_INTEGRITY_KEYS = ("dropped_paths", "graded_paths", "tampered", "tamper_evidence", "forged_lines", "canaries")


def integrity(evaluation: Mapping[str, object]) -> IntegrityView | None:
    """What the grader threw away or distrusted: dropped paths, the tamper verdict and its
    evidence, forged result lines, and the canaries that did not come out as expected. None for
    an evaluator that grades no workspace (an output regex has nothing to tamper with)."""
    if not any(k in evaluation for k in _INTEGRITY_KEYS):
        return None
    canaries = [c for c in _items(evaluation.get("canaries")) if isinstance(c, dict)]
    dropped: list[dict[str, object]] = [d if isinstance(d, dict) else {"path": str(d), "rule": None}
                                        for d in _items(evaluation.get("dropped_paths"))]
    return {"dropped_paths": dropped,
            "graded_paths": _items(evaluation.get("graded_paths")),
            "tampered": bool(evaluation.get("tampered")), "tamper_evidence": _items(evaluation.get("tamper_evidence")),
            "forged_lines": evaluation.get("forged_lines"),
            "canaries": len(canaries), "failed_canaries": [c for c in canaries if not c.get("ok", True)]}


def trainer_view(row: Mapping[str, object], outcome: Mapping[str, object], trajectory: Trajectory) -> TrainerView:
    """What a trainer takes from the session: its ``mask`` (True: dropped from the loss), and per
    trace its role, ``trainable`` flag and mask-1 tokens; ``trained_tokens`` counts the sampled
    tokens of trainable traces, 0 when the session is masked."""
    mask = outcome.get("mask", row.get("mask"))
    if mask is None:
        mask = trajectory.mask
    traces: list[TraceView] = [{"index": i, "role": t.role, "trainable": t.trainable, "sampled_tokens": sum(t.loss_mask)}
                                    for i, t in enumerate(trajectory.traces)]
    trained = 0 if mask else sum(t["sampled_tokens"] for t in traces if t["trainable"])
    return {"mask": bool(mask), "trained_tokens": trained, "traces": traces,
            "reward": row.get("reward"), "failure_kind": row.get("failure_kind")}
