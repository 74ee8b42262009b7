"""The main job: roll a task set out through the staged pipeline and write what training needs.

``rollout(job)`` (``polar-env rollout``) loads the tasks (the offline toy SWE set by default, or a
JSONL/JSON/Parquet file), writes the run's plan, starts the nodes, submits one TaskRequest per task
with ``samples`` sessions, shows live progress, and writes the run folder ``out/<run id>/``
(``out/latest`` points at it; see ``runs.py``): ``plan.json``, ``capture/`` (the journals),
``trajectories.jsonl`` and ``.parquet`` (rewarded, self-describing, one row per session),
``sessions.jsonl`` (one SessionResult per line, without the token data), ``report.json`` and
``timeline.png``. ``mode="eval"`` (``polar-env eval``) is the same pipeline reporting pass@1 / pass@k
per repo and the engine cost. SIGINT/SIGTERM stop a run with every output written and the
interrupted sessions marked; ``resume=`` (``--resume``) runs only the sessions that did not finish.
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

from polar_env import eventloop
from polar_env.errors import ConfigError
from polar_env.journal.store import JournalStore  # a job is a root: its run folder's store is named here
from polar_env.observe.live import JobObserver
from polar_env.records import FailureKind
from polar_env.staging.cluster import Cluster, start_cluster
from polar_env.staging.config import PolarEnvConfig, task_request
from polar_env.staging.deadline import POSTRUN_SHARE, current, writing_outputs
from polar_env.staging.interrupt import StopSignals
from polar_env.staging.models import SessionResult, SessionStatus, TaskRequest, TaskStatus
from polar_env.staging.report import build_report, write_timeline
from polar_env.staging.runs import (
    ATTEMPTS,
    Plan,
    check_run_id,
    create_run_dir,
    differences,
    finished,
    interrupted,
    make_plan,
    mark_outcome_files,
    new_run_id,
    next_attempt,
    not_started,
    read_results,
    recover,
    resolve_run,
    set_aside,
)
from polar_env.trajectory.export import write_jsonl, write_parquet

Progress = Callable[[dict[str, Any]], None]
# env settings a resume may change: how, not what, it runs
OPERATIONAL = ("limits", "nodes", "ray", "ray_address", "ray_node_resource", "shared_store")


class RolloutJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: PolarEnvConfig = Field(default_factory=PolarEnvConfig)
    tasks: str = "toy"  # "toy" (offline toy SWE set) or a .jsonl/.json/.parquet file of task rows
    task_ids: list[str] | None = None
    limit: int | None = Field(default=None, ge=1)
    samples: int = Field(default=2, ge=1)
    out: Path = Path("polar_rollouts")  # a folder of runs: each run writes out/<run id>/ (see staging/runs.py)
    run_id: str | None = None  # default: <UTC time>-<command>-<6 hex>
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


async def run_job(job: RolloutJob, progress: Progress | None = None, *, engine: Any | None = None,
                  command: str | None = None, resume: Path | None = None,
                  reqs: list[TaskRequest] | None = None) -> dict[str, Any]:
    """Run ``job`` into a new run folder ``job.out/<run id>`` (or continue the run folder ``resume``:
    only the sessions that did not finish, under their planned ids); returns the report.
    ``reqs``: the job's tasks as ``preflight.check_job`` loaded them (else they are loaded here).
    SIGINT/SIGTERM stop it cleanly with every output written (see ``interrupt.py``)."""
    job, run_dir, plan, previous = _open_run(job, command, resume, reqs)
    env_config = job.env.model_copy(update={"store": run_dir / "capture"})
    planned = set(plan.session_ids())
    kept = {sid: r for sid, r in finished(previous).items() if sid in planned}
    if resume is not None:
        kept |= recover(run_dir, plan, kept, JournalStore)  # finished in an attempt that was killed before writing its outputs
    todo, skipped = _todo(plan, kept)
    attempt = next_attempt(run_dir) if resume is not None else 0
    if resume is not None:  # the interrupted attempt's journals and report move to attempts/<n>/
        set_aside(run_dir, [sid for sid in plan.session_ids() if sid not in kept], attempt)
        if (run_dir / "report.json").exists():
            (run_dir / ATTEMPTS / str(attempt)).mkdir(parents=True, exist_ok=True)
            (run_dir / "report.json").replace(run_dir / ATTEMPTS / str(attempt) / "report.json")
    total = sum(len(indices) for _, indices in todo)
    observer = JobObserver(run_dir, job.tracker, job.model_dump(mode="json"), progress)
    started = time.monotonic()
    try:
        with StopSignals(f"the {plan.command} run {plan.run_id}") as signals:  # also while the outputs are written
            results, node_stats = await _run_sessions(env_config, todo, total, started, observer, engine, signals)
            wall, stopped_by = time.monotonic() - started, signals.signal_name
            results = _complete(plan, {**kept, **{r.session_id: r for r in skipped + results}}, stopped_by)
            with writing_outputs():  # work, not waiting: the shutdown watchdog lets it finish (deadline.py)
                report = _write_outputs(run_dir, job, plan, results, node_stats, wall, observer)
            if resume is not None:
                report["resumed"] = {"attempt": attempt, "kept": len(kept), "rerun": total,
                                     "set_aside": f"{ATTEMPTS}/{attempt}"}
            if stopped_by is not None:
                cut = [r for r in results if r.failure_kind is FailureKind.INTERRUPTED]
                report["interrupted"] = {"signal": stopped_by, "exit_code": signals.exit_code,
                                         "finished": len(results) - len(cut), "interrupted": len(cut),
                                         "not_started": sum(1 for r in cut if "running" not in r.stage_times),
                                         "resume": f"polar-env {plan.command} --resume {run_dir}"}
            (run_dir / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2, default=str))
    finally:
        observer.close()
    return report


def _open_run(job: RolloutJob, command: str | None, resume: Path | None,
              reqs: list[TaskRequest] | None) -> tuple[RolloutJob, Path, Plan, list[SessionResult]]:
    """A new run folder with its plan, or the run folder being resumed with its plan and the
    results its last attempt wrote."""
    if resume is None:
        if reqs is None:
            reqs = load_tasks(job)  # a bad task set is refused before any folder exists
        run_id = check_run_id(job.run_id) if job.run_id else new_run_id(command or job.mode)
        job = job.model_copy(update={"run_id": run_id})
        run_dir = create_run_dir(Path(job.out), run_id)
        plan = make_plan(reqs, run_id, command or job.mode, plan_settings(job))
        plan.write(run_dir)
        return job, run_dir, plan, []
    run_dir = resolve_run(Path(resume))
    plan = Plan.read(run_dir)
    env = {**plan.job["env"], **{k: v for k, v in job.env.model_dump(mode="json").items() if k in OPERATIONAL}}
    job = RolloutJob.model_validate({**plan.job, "env": env, "out": str(run_dir.parent), "run_id": plan.run_id,
                                     "tracker": job.tracker})
    if job.tasks == "toy" and reqs is None:
        load_tasks(job)  # the toy repos are built into their cache again if it was cleared
    return job, run_dir, plan, read_results(run_dir)


def plan_settings(job: RolloutJob) -> dict[str, Any]:
    """The job as its plan records it: files the engine reads as absolute paths, so a resume from
    another working directory (and the check of its flags) reads the same files."""
    engine = job.env.engine
    update = {k: Path(v).resolve() for k in ("script", "model_dir") if (v := getattr(engine, k, None)) is not None}
    env = job.env.model_copy(update={"engine": engine.model_copy(update=update)}) if update else job.env
    return job.model_copy(update={"env": env}).model_dump(mode="json")


def check_resume(run_dir: Path, command: str, job: dict[str, Any]) -> RolloutJob:
    """The job to resume ``run_dir`` with: ``job`` is its plan's with the flags given on top, which
    may change how the run is carried out (``OPERATIONAL``: pools, nodes, Ray; the tracker) but
    nothing that shapes its data; otherwise one line naming the first setting that differs."""
    plan = Plan.read(run_dir)
    if plan.command != command:
        raise ConfigError(f"--resume {run_dir}: a {plan.command} run; continue it with polar-env {plan.command} "
                          f"--resume {run_dir}")
    job = {**job, "env": plan_settings(RolloutJob.model_validate(job))["env"]}  # engine files as absolute paths

    def shaping(settings: dict[str, Any]) -> dict[str, Any]:
        env = {k: v for k, v in settings.get("env", {}).items() if k not in OPERATIONAL}
        return {**{k: v for k, v in settings.items() if k not in ("out", "run_id", "tracker")}, "env": env}

    diffs = differences(shaping(plan.job), shaping(job))
    if diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise ConfigError(f"--resume {run_dir}: the flags differ from the run's plan: {diffs[0]}{more}; resume without "
                          "them, or start a new run")
    return RolloutJob.model_validate(job)


def interrupt_line(report: dict[str, Any]) -> str | None:
    """The one line an interrupted run prints: what was kept, and how to resume."""
    info = report.get("interrupted")
    if not info:
        return None
    return (f"interrupted by {info['signal']}: {info['finished']} session(s) finished and kept, {info['interrupted']} "
            f"interrupted ({info['not_started']} never started) marked failure_kind=interrupted, mask=true; every "
            f"output is in {report['run_dir']}/; resume with: {info['resume']}")


def _todo(plan: Plan, kept: dict[str, SessionResult]) -> tuple[list[tuple[TaskRequest, list[int]]], list[SessionResult]]:
    """Per request, the sample indices still to run; and the sessions an early stop makes unnecessary
    (their group already has its usable sessions among the kept ones)."""
    todo, skipped = [], []
    for req, group in zip(plan.requests, plan.groups, strict=True):
        missing = [i for i, sid in enumerate(group.session_ids) if sid not in kept]
        if not missing:
            continue
        usable = sum(1 for sid in group.session_ids if sid in kept and kept[sid].usable)
        need = req.early_stop_min_usable
        if need is not None and usable >= need:
            skipped += [_early_stopped(req, group.session_ids[i], i, usable) for i in missing]
            continue
        if need is not None and usable:
            req = req.model_copy(update={"early_stop_min_usable": need - usable})
        todo.append((req, missing))
    return todo, skipped


def _early_stopped(req: TaskRequest, sid: str, index: int, usable: int) -> SessionResult:
    detail = f"early stop: its group already had {usable} usable session(s)"
    result = SessionResult.model_validate({
        "session_id": sid, "task_id": req.task_id, "group_id": str(req.group_id), "sample_index": index,
        "status": SessionStatus.CANCELLED, "failure_kind": FailureKind.CANCELLED, "failure_detail": detail, "mask": True,
        "stage_times": {"done": time.time()}})
    return result  # its trajectory: the empty, masked row (SessionResult fills it in)


async def _run_sessions(env_config: PolarEnvConfig, todo: list[tuple[TaskRequest, list[int]]], total: int,
                        started: float, observer: JobObserver, engine: Any | None,
                        signals: StopSignals) -> tuple[list[SessionResult], list[dict[str, Any]]]:
    if not todo or signals.fired:
        return [], []
    config = env_config.cluster()
    where = " on Ray" if config.ray else ""
    observer.phase(f"starting {config.nodes} node(s){where}: {env_config.engine.describe()}, gateway, runtime folders",
                   time.monotonic() - started)
    began = time.monotonic()
    cluster = await _start_unless_stopped(config, engine, signals)
    if cluster is None:  # a signal during start-up: cancelled, every session recorded as never started
        return [], []
    observer.phase(f"{config.nodes} node(s) ready in {time.monotonic() - began:.1f}s; dispatching {total} session(s) "
                   "(harness installs, runtime images and tokenizers load in INIT)", time.monotonic() - started)
    try:
        server = cluster.server
        statuses = [] if signals.fired else [server.submit(req, samples=indices) for req, indices in todo]
        watcher = asyncio.create_task(_watch(server, statuses, total, started, observer))
        tasks = [server.tasks[s.group_id].runner for s in statuses]
        runners = asyncio.gather(*(t for t in tasks if t is not None))
        stop = asyncio.create_task(signals.stop.wait())
        try:
            first: set[asyncio.Future[Any]] = {runners, stop}
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            postrun = current().before(POSTRUN_SHARE)  # the signal's deadline (deadline.py): the rest closes
            while not runners.done() and not postrun.expired:  # interrupted: cancel until every group has
                for s in statuses:  # reported (POSTRUN included), or the deadline says stop waiting
                    if not server.tasks[s.group_id].done.is_set():
                        await server.cancel(s.group_id)
                await asyncio.wait({runners}, timeout=postrun.cap(0.5))
            if runners.done():
                await runners
            else:  # past the deadline: what has not reported is recorded as interrupted (_complete)
                runners.cancel()
        finally:
            stop.cancel()
            watcher.cancel()
            await asyncio.gather(watcher, stop, return_exceptions=True)
        node_stats = await server.node_stats()
    finally:
        await cluster.aclose()
    results = []
    for s in statuses:
        for r in s.results:
            if signals.fired and not s.early_stopped and r.status is SessionStatus.CANCELLED:
                r = interrupted(r, str(signals.signal_name))
            results.append(r)
    return results, node_stats


async def _start_unless_stopped(config: Any, engine: Any | None, signals: StopSignals) -> Cluster | None:
    """The started cluster, or None when a signal comes first: the start-up (engines loading,
    minutes on a busy machine) is cancelled then, and what it had started is stopped."""
    start = asyncio.ensure_future(start_cluster(config, engine=engine))
    stop = asyncio.ensure_future(signals.stop.wait())
    try:
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not start.done():
            start.cancel()  # start_cluster stops the nodes it started (by the shutdown deadline)
            await asyncio.wait({start}, timeout=current().remaining())
    return start.result() if start.done() and not start.cancelled() else None


def _complete(plan: Plan, by_id: dict[str, SessionResult], signal_name: str | None) -> list[SessionResult]:
    """One result per planned session, in plan order; a session never dispatched is recorded as
    interrupted before it started."""
    out = []
    for req, group in zip(plan.requests, plan.groups, strict=True):
        for i, sid in enumerate(group.session_ids):
            r = by_id.get(sid)
            out.append(r if r is not None else not_started(req, sid, i, signal_name or "an interruption"))
    return out


def _write_outputs(run_dir: Path, job: RolloutJob, plan: Plan, results: list[SessionResult],
                   node_stats: list[dict[str, Any]], wall: float, observer: JobObserver) -> dict[str, Any]:
    mark_outcome_files(run_dir, results, JournalStore)
    trajectories = [r.trajectory for r in results]
    write_jsonl(trajectories, run_dir / "trajectories.jsonl.tmp")  # each file replaced whole: a kill mid-write
    (run_dir / "trajectories.jsonl.tmp").replace(run_dir / "trajectories.jsonl")  # leaves the previous one
    notes = []
    try:
        write_parquet(trajectories, run_dir / "trajectories.parquet")
    except ConfigError as exc:
        notes.append(str(exc))
    with open(run_dir / "sessions.jsonl.tmp", "wb") as f:
        for r in results:
            f.write(orjson.dumps(r.model_dump(mode="json", exclude={"trajectory"})) + b"\n")
    (run_dir / "sessions.jsonl.tmp").replace(run_dir / "sessions.jsonl")
    report = build_report(results, node_stats, wall, config=job.model_dump(mode="json"))
    report["run_id"], report["run_dir"] = plan.run_id, str(run_dir)
    if job.mode == "eval":
        graded = [r for r in results if r.failure_kind is not FailureKind.INTERRUPTED]
        report["eval"] = eval_tables(graded, plan.requests, job.pass_k)
        busy = [s.get("engine_busy_s", 0.0) for s in node_stats if "dead" not in s]
        report["cost"] = {"engine_seconds": round(sum(busy), 2), "sampled_tokens": report["sampled_tokens"],
                          "prompt_tokens": sum(len(t.prompt_ids) for tr in trajectories for t in tr.traces)}
    note = write_timeline(results, run_dir / "timeline.png", title=f"stage occupancy ({len(results)} sessions)")
    if note:
        notes.append(note)
    report["notes"] = notes
    report["files"] = sorted({p.name for p in run_dir.iterdir() if not p.name.endswith(".tmp")} | {"report.json"})
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
                  "dead_nodes": [s["node_id"] for s in stats if "dead" in s],
                  # for the dashboard: where each started session is, and what each node runs and holds
                  "session_stages": {sid: st for s in stats for sid, st in (s.get("session_stages") or {}).items()},
                  "nodes": [{k: v for k, v in s.items() if k != "session_stages"} for s in stats]})
        await asyncio.sleep(0.5)


def rollout(job: RolloutJob | dict[str, Any] | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Run the main job to completion (see the module docstring); returns the report."""
    job = job if isinstance(job, RolloutJob) else RolloutJob.model_validate(job or {})
    return eventloop.run(run_job(job, progress))
