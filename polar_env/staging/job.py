"""The main job: roll a task set out through the staged pipeline and write what training needs.

``rollout(job)`` (``polar-env rollout``) loads the tasks (the offline toy SWE set by default, or a
JSONL/JSON/Parquet file), starts the nodes, submits one TaskRequest per task with ``samples``
sessions, shows live progress, and writes to ``out``: ``capture/`` (the journals),
``trajectories.jsonl`` and ``.parquet`` (rewarded, self-describing), ``sessions.jsonl`` (one
SessionResult per line, without the token data), ``report.json`` and ``timeline.png``. ``mode="eval"``
(``polar-env eval``) is the same pipeline reporting pass@1 / pass@k per repo and the engine cost.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from polar_env.env import PolarEnv, PolarEnvConfig, task_request
from polar_env.errors import ConfigError
from polar_env.observe.live import JobObserver
from polar_env.staging.models import SessionResult, TaskRequest, TaskStatus
from polar_env.staging.report import build_report, write_timeline
from polar_env.trajectory.export import write_jsonl, write_parquet

Progress = Callable[[dict[str, Any]], None]


class RolloutJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: PolarEnvConfig = Field(default_factory=PolarEnvConfig)
    tasks: str = "toy"  # "toy" (offline toy SWE set) or a .jsonl/.json/.parquet file of task rows
    task_ids: list[str] | None = None
    limit: int | None = Field(default=None, ge=1)
    samples: int = Field(default=2, ge=1)
    out: Path = Path("polar_rollouts")
    mode: Literal["rollout", "eval"] = "rollout"
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1])
    early_stop_min_usable: int | None = Field(default=None, ge=1)
    tracker: Literal["wandb", "tensorboard"] | None = None  # also log the figures there (polar_env/observe)


def load_tasks(job: RolloutJob) -> list[TaskRequest]:
    """TaskRequests for the job's task set (SWE rows become sandboxed SWE tasks graded by swebench)."""
    from polar_env.tasks.sources import read_rows

    rows: list[Any]
    if job.tasks == "toy":
        from polar_env.tasks.toy import TOY_SOURCES, toy_tasks

        _select([{"task_id": i} for i in TOY_SOURCES], job.task_ids, "the toy task set")
        rows = list(toy_tasks(ids=job.task_ids))
    elif Path(job.tasks).is_dir():  # Harbor task folders (one task, or a folder of them)
        from polar_env.tasks.harbor import load_harbor_rows

        base = job.env.runtime.model_dump(exclude={"source_dir", "image", "workdir"}, exclude_none=True)
        rows = [{**r, "runtime": {**base, **r["runtime"]}} for r in load_harbor_rows(job.tasks)]  # the task's wins
        rows = _select(rows, job.task_ids, job.tasks)
    else:
        path = Path(job.tasks)
        if not path.exists():
            raise ConfigError(f"task file {path} does not exist (give 'toy', a .jsonl/.json/.parquet file or a "
                              "Harbor task folder)")
        rows = _select(list(read_rows(path)), job.task_ids, job.tasks)
    if job.limit is not None:
        rows = rows[: job.limit]
    if not rows:
        raise ConfigError(f"no tasks selected from {job.tasks!r}")
    return [task_request(row, job.env, job.samples, early_stop_min_usable=job.early_stop_min_usable) for row in rows]


def _select(rows: list[Any], task_ids: list[str] | None, where: str) -> list[Any]:
    """The rows named by ``--task-id`` (all without it); a name that matches no row is an error."""
    if task_ids is None:
        return rows
    from polar_env.tasks.sources import unknown_ids_message

    ids = [str(r.get("instance_id") or r.get("task_id")) for r in rows]
    unknown = [i for i in task_ids if i not in set(ids)]
    if unknown:
        raise ConfigError(unknown_ids_message(unknown, ids, where, "--task-id"))
    return [r for r, i in zip(rows, ids, strict=True) if i in set(task_ids)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_tables(results: list[SessionResult], reqs: list[TaskRequest], ks: list[int]) -> dict[str, Any]:
    repo_of = {r.task_id: (r.task.get("repo") or r.task_id.split("__")[0]) for r in reqs}
    by_task: dict[str, list[SessionResult]] = {}
    for r in results:
        by_task.setdefault(r.task_id, []).append(r)
    per_task: dict[str, dict[str, float]] = {}
    for task_id, rs in by_task.items():
        n, c = len(rs), sum(1 for r in rs if r.reward >= 1.0)
        per_task[task_id] = {f"pass@{k}": pass_at_k(n, c, k) for k in ks if k <= n} | {"n": n, "correct": c}
    per_repo: dict[str, dict[str, float]] = {}
    for task_id, scores in per_task.items():
        per_repo.setdefault(repo_of.get(task_id, task_id), {}).setdefault("tasks", 0)
        entry = per_repo[repo_of.get(task_id, task_id)]
        entry["tasks"] += 1
        for key, value in scores.items():
            if key.startswith("pass@"):
                entry.setdefault(key, 0.0)
                entry[key] += value
    for entry in per_repo.values():
        for key in [k for k in entry if k.startswith("pass@")]:
            entry[key] = round(entry[key] / entry["tasks"], 4)
    overall = {f"pass@{k}": round(statistics.fmean([s[f"pass@{k}"] for s in per_task.values() if f"pass@{k}" in s]), 4)
               for k in ks if any(f"pass@{k}" in s for s in per_task.values())}
    return {"overall": overall, "per_repo": per_repo, "per_task": per_task}


async def run_job(job: RolloutJob, progress: Progress | None = None, *, engine: Any | None = None) -> dict[str, Any]:
    out = Path(job.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create output folder {out}: {exc}") from None
    env_config = job.env.model_copy(update={"store": out / "capture"})
    reqs = load_tasks(job.model_copy(update={"env": env_config}))
    total = sum(r.num_samples for r in reqs)
    observer = JobObserver(out, job.tracker, job.model_dump(mode="json"), progress)
    try:
        report = await _run_observed(job, env_config, reqs, total, observer, engine)
    finally:
        observer.close()
    return report


async def _run_observed(job: RolloutJob, env_config: PolarEnvConfig, reqs: list[TaskRequest], total: int,
                        observer: JobObserver, engine: Any | None) -> dict[str, Any]:
    out = Path(job.out)
    started = time.monotonic()
    async with PolarEnv(env_config, engine=engine) as env:
        server = env.cluster.server
        statuses = [server.submit(req) for req in reqs]
        watcher = asyncio.create_task(_watch(server, statuses, total, started, observer))
        try:
            await asyncio.gather(*(server.tasks[s.group_id].runner for s in statuses))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        node_stats = await server.node_stats()
    wall = time.monotonic() - started
    results: list[SessionResult] = [r for s in statuses for r in s.results]
    trajectories = [r.trajectory for r in results if r.trajectory is not None]
    write_jsonl(trajectories, out / "trajectories.jsonl")
    notes = []
    try:
        write_parquet(trajectories, out / "trajectories.parquet")
    except ConfigError as exc:
        notes.append(str(exc))
    with open(out / "sessions.jsonl", "wb") as f:
        for r in results:
            f.write(orjson.dumps(r.model_dump(mode="json", exclude={"trajectory"})) + b"\n")
    report = build_report(results, node_stats, wall, config=job.model_dump(mode="json"))
    if job.mode == "eval":
        report["eval"] = eval_tables(results, reqs, job.pass_k)
        busy = [s.get("engine_busy_s", 0.0) for s in node_stats if "dead" not in s]
        report["cost"] = {"engine_seconds": round(sum(busy), 2), "sampled_tokens": report["sampled_tokens"],
                          "prompt_tokens": sum(len(t.prompt_ids) for tr in trajectories for t in tr.traces)}
    note = write_timeline(results, out / "timeline.png", title=f"stage occupancy ({len(results)} sessions)")
    if note:
        notes.append(note)
    report["notes"] = notes
    report["files"] = sorted({p.name for p in out.iterdir() if not p.name.endswith(".tmp")} | {"report.json"})
    (out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2, default=str))
    observer.finish(report)
    return report


async def _watch(server: Any, statuses: list[TaskStatus], total: int, started: float, progress: Progress) -> None:
    while True:
        stats = await server.node_stats()
        counts: dict[str, int] = {}
        for s in stats:
            for stage, n in s.get("counts", {}).items():
                counts[stage] = counts.get(stage, 0) + n
        done = [r for s in statuses for r in s.results]  # each status fills in as its sessions end
        rewards = [r.reward for r in done]
        progress({"elapsed_s": time.monotonic() - started, "total": total, "done": len(done), "stages": counts,
                  "statuses": {s: sum(1 for r in done if r.status.value == s) for s in
                               ("completed", "timeout", "error", "cancelled")},
                  "mean_reward": statistics.fmean(rewards) if rewards else None,
                  "engine_busy": statistics.fmean([s["engine_busy_fraction"] for s in stats if "dead" not in s] or [0]),
                  "dead_nodes": [s["node_id"] for s in stats if "dead" in s]})
        await asyncio.sleep(0.5)


def rollout(job: RolloutJob | dict[str, Any] | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Run the main job to completion (see the module docstring); returns the report."""
    job = job if isinstance(job, RolloutJob) else RolloutJob.model_validate(job or {})
    return asyncio.run(run_job(job, progress))
