"""Run folders and capture stores, indexed for the dashboard.

A *run* is a folder ``polar-env rollout``/``eval`` wrote (``OUT/<run id>/``: ``plan.json``,
``report.json``, ``sessions.jsonl``, ``live.json`` while it runs, ``capture/<node>/`` journals) or a
bare capture store (what ``polar-env gateway --store`` wrote). Sessions are listed from the stores' public API
(``JournalSource.session_metas``/``session_ids``, ``read_outcome``), overlaid with the finished
run's ``sessions.jsonl`` and report rows; nothing here parses a journal line. The index is cached
and rebuilt when a folder changes (a new journal, outcome or report), so a page of a 1,000-session
run is a slice of a list in memory, not a scan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from polar_env.journal.protocols import JournalOpener, JournalSource
from polar_env.journal.store import RESULT_SUFFIX
from polar_env.observe.live import read_live
from polar_env.observe.liveness import RunState, run_state
from polar_env.staging.job import pass_at_k
from polar_env.staging.runs import is_run_folder, runs_in

FINISHED = ("completed", "timeout", "error", "cancelled")
PLANNED = "queued"  # a session plan.json names that has not reached a node's INIT yet
NOT_STARTED = "not started"  # planned, and the job is not running (it was killed before the session began)
UNSTARTED = (PLANNED, NOT_STARTED)
LIVE_STATES = ("running", "starting")
STOPPED = ("crashed", "interrupted")  # a job that ended before its end: its unfinished sessions say so
_STATE_TTL_S = 1.0  # how long a run's measured state (heartbeat, /proc) is reused
COLUMNS = ("session_id", "task_id", "repo", "sample_index", "harness", "status", "failure_kind", "reason", "reward",
           "calls", "tokens", "drift", "wall_s", "node_id", "group_id", "mask", "trainable_tokens", "weight_version")
_LIVE_REFRESH_S = 2.0  # journals grow without touching their folder's mtime: re-count open sessions this often


def _is_store(path: Path) -> bool:
    """A capture store: the gateway writes each session's state under ``sessions/``."""
    return path.is_dir() and ((path / "sessions").is_dir() or any(path.glob("*" + RESULT_SUFFIX)))


def is_run(path: Path) -> bool:
    """A run folder, a capture store, or a folder of per-node stores (a PolarEnv ``store``)."""
    if not path.is_dir():
        return False
    if is_run_folder(path) or (path / "capture").is_dir() or _is_store(path):
        return True
    return any(_is_store(child) for child in path.iterdir() if child.is_dir())


def discover(paths: Iterable[Path]) -> list[Path]:
    """Each path that is a run; else the runs inside it: its run folders (``polar-env rollout --out``
    writes ``OUT/<run id>/``), and those of the folders of runs directly inside it. ``latest``
    pointers (symlinks) are not runs of their own, unless given as the path."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if is_run_folder(path) or (is_run(path) and not runs_in(path)):
            found.append(path)
            found.extend(runs_in(path))  # an OUT that still holds a run of the old flat layout, and the new runs
            continue
        if not path.is_dir():
            continue
        for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink()):
            inner = runs_in(child)
            if inner and not is_run_folder(child):
                found.extend(inner)
            elif is_run(child):
                found.append(child)
    return found


def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    except (FileNotFoundError, orjson.JSONDecodeError):
        return []


def file_version(path: Path) -> tuple[int, int]:
    """(mtime, size): what tells a cached figure that its file changed."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return (0, 0)
    return (stat.st_mtime_ns, stat.st_size)


def repo_of(task_id: str, task_repo: str | None = None) -> str:
    return task_repo or task_id.split("__")[0]


def wall_of(stage_times: dict[str, float]) -> float | None:
    if not stage_times:
        return None
    return round(max(stage_times.values()) - min(stage_times.values()), 3)


class Run:
    """One run's sessions and figures; its stores are opened with ``open_journal`` (the dashboard
    server, the root, names the store)."""

    def __init__(self, path: Path, name: str, open_journal: JournalOpener) -> None:
        self.path = Path(path)
        self.name = name
        self.open_journal = open_journal
        self._rows: list[dict[str, Any]] = []
        self._where: dict[str, JournalSource] = {}
        self._signature: tuple[Any, ...] | None = None
        self._built_at = 0.0
        self._stores: dict[Path, JournalSource] = {}
        self._history: tuple[tuple[Any, ...] | None, list[list[Any]]] = (None, [])
        self._summary: tuple[tuple[Any, ...] | None, dict[str, Any]] = (None, {})
        self._plan: tuple[tuple[int, int] | None, dict[str, Any]] = (None, {})
        self._live: tuple[tuple[int, int] | None, dict[str, Any] | None] = (None, None)
        self._staged: tuple[tuple[Any, ...] | None, list[dict[str, Any]]] = (None, [])
        self._state: tuple[tuple[Any, ...], float, RunState | None] = ((), 0.0, None)
        self._auto_template: str | None = None  # template auto, resolved once (its engine may be long gone)

    # -- folders ------------------------------------------------------------------------------
    def store_dirs(self) -> list[Path]:
        root = self.path / "capture" if (self.path / "capture").is_dir() else self.path
        dirs = [root] if _is_store(root) else []
        if root.is_dir():
            dirs += sorted(d for d in root.iterdir() if d.is_dir() and d.name != "sessions" and _is_store(d))
        return dirs

    def store(self, folder: Path) -> JournalSource:
        if folder not in self._stores:
            self._stores[folder] = self.open_journal(folder)
        return self._stores[folder]

    def _signature_now(self) -> tuple[Any, ...]:
        return (tuple((d, file_version(d), file_version(d / "sessions")) for d in self.store_dirs()),
                file_version(self.path / "report.json"), file_version(self.path / "sessions.jsonl"))

    @property
    def finished(self) -> bool:
        return (self.path / "report.json").exists()

    def report(self) -> dict[str, Any]:
        data = _read_json(self.path / "report.json")
        return data if isinstance(data, dict) else {}

    def live_snapshot(self) -> dict[str, Any] | None:
        """``live.json``, re-read only when it changes (twice a second while the job runs)."""
        version = file_version(self.path / "live.json")
        if self._live[0] != version:
            self._live = (version, read_live(self.path))
        return self._live[1]

    def state(self) -> RunState:
        """The job's measured state (``liveness.run_state``: its heartbeat and process, else the
        files), re-read when those files change, else at most once a second (the process check)."""
        files = tuple(file_version(self.path / f) for f in ("heartbeat.json", "report.json", "live.json"))
        seen, at, known = self._state
        if known is None or seen != files or time.monotonic() - at > _STATE_TTL_S:
            known = run_state(self.path)
            self._state = (files, time.monotonic(), known)
        return known

    def state_name(self) -> str:
        """running, done, crashed, interrupted; ``store`` for a bare capture store."""
        state = self.state().state
        return "store" if state == "unknown" else state

    def live_version(self) -> Any:
        """What changes when the live snapshot does (a cache key)."""
        return file_version(self.path / "live.json")

    def kind(self) -> str:
        """``train`` for a ``polar-env train`` run (its heartbeat says so, or its ``steps.jsonl``),
        ``rollout`` for a rollout/eval run folder, ``store`` for a bare capture store."""
        if self.state().kind == "train" or (self.path / "steps.jsonl").exists():
            return "train"
        return "rollout" if is_run_folder(self.path) else "store"

    def is_live(self) -> bool:
        """The job is running now: its process beats (``heartbeat.json``), not just a file saying so."""
        return self.state().running

    # -- the session index ---------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Every session, with the stage live.json gives for those still on a node."""
        signature = self._signature_now()
        live = self.is_live()
        stale_live = live and not self.finished and time.monotonic() - self._built_at > _LIVE_REFRESH_S
        if signature != self._signature or stale_live:
            self._rows, self._where = self._build_rows()
            self._signature, self._built_at = signature, time.monotonic()
        state = self.state_name()
        key = (self._signature, self._built_at, state, self.live_version() if state in ("running", *STOPPED) else None)
        if self._staged[0] != key:
            self._staged = (key, with_stages(self._rows, (self.live_snapshot() or {}) if live else None, state,
                                             self.live_snapshot() if state in STOPPED else None))
        return self._staged[1]

    def version(self) -> tuple[Any, ...] | None:
        """What the rows were built from: equal versions, equal rows (a cache key for figures over them)."""
        self.rows()
        return self._staged[0]

    def _build_rows(self) -> tuple[list[dict[str, Any]], dict[str, JournalSource]]:
        finished = {r["session_id"]: r for r in _read_lines(self.path / "sessions.jsonl") if "session_id" in r}
        report_rows = {r["session_id"]: r for r in self.report().get("session_rows", [])}
        rows: list[dict[str, Any]] = []
        where: dict[str, JournalSource] = {}
        for folder in self.store_dirs():
            store = self.store(folder)
            metas = {m.session_id: m for m in store.session_metas()}
            ids = set(metas) | set(store.session_ids()) | set(store.outcome_ids())
            for sid in sorted(ids):
                outcome = finished.get(sid) or store.read_outcome(sid) or {}
                meta = dict(outcome.get("metadata") or {})
                if sid in metas:
                    meta = {**metas[sid].metadata, **meta}
                rows.append(self._row(sid, store, outcome, meta, report_rows.get(sid, {}), metas.get(sid)))
                where[sid] = store
        return rows + self._planned_rows({r["session_id"] for r in rows}), where

    def _planned_rows(self, seen: set[str]) -> list[dict[str, Any]]:
        """The sessions ``plan.json`` names that no store has yet (a job lists them all from its
        first second, not as each reaches INIT)."""
        plan = self.plan()
        harness = ((plan.get("job") or {}).get("env") or {}).get("harness")
        repos = {str(q.get("group_id")): q.get("repo") for q in plan.get("requests") or [] if isinstance(q, dict)}
        out = []
        for g in plan.get("groups") or []:
            for i, sid in enumerate(g.get("session_ids") or []):
                if sid not in seen:
                    task_id = str(g["task_id"])
                    out.append({**dict.fromkeys(COLUMNS), "session_id": sid, "task_id": task_id,
                                "repo": repo_of(task_id, repos.get(str(g["group_id"]))), "sample_index": i,
                                "harness": harness, "status": PLANNED, "group_id": str(g["group_id"]),
                                "traces": None, "failure_detail": None, "ended_at": None, "rollout_id": None})
        return out

    @staticmethod
    def _row(sid: str, store: JournalSource, outcome: dict[str, Any], meta: dict[str, Any], report_row: dict[str, Any],
             session_meta: Any) -> dict[str, Any]:
        status = outcome.get("status") or ("closed" if session_meta is not None and session_meta.closed else "running")
        task_id = str(outcome.get("task_id") or meta.get("task_id") or sid)
        calls = outcome.get("records")
        if calls is None:
            calls = store.next_seq(sid)  # open sessions only; reads the journal's tail, not all of it
        return {
            "session_id": sid, "task_id": task_id, "repo": repo_of(task_id, meta.get("repo")),
            "sample_index": outcome.get("sample_index", meta.get("sample_index")),
            "harness": meta.get("harness"), "status": status,
            "failure_kind": outcome.get("failure_kind") or report_row.get("failure_kind"),
            "reward": outcome.get("reward"), "calls": calls,
            "tokens": report_row.get("sampled_tokens"), "drift": report_row.get("drift_boundaries"),
            "wall_s": wall_of(outcome.get("stage_times") or {}), "node_id": outcome.get("node_id") or meta.get("node_id"),
            "reason": (outcome.get("evaluation") or {}).get("reason") or report_row.get("reason"),
            "group_id": outcome.get("group_id") or meta.get("group_id"),
            "mask": outcome.get("mask", report_row.get("mask")),  # known once the session's row is written
            "traces": report_row.get("traces"), "trainable_tokens": report_row.get("trainable_tokens"),
            "failure_detail": outcome.get("failure_detail") or outcome.get("error"),  # "error": outcomes before kinds
            "ended_at": max((outcome.get("stage_times") or {}).values(), default=None),  # for the curves
            "rollout_id": meta.get("slime_rollout_id"),  # a slime run's rollout (its W&B step)
            # the policy it was sampled under (a train run's step): pass@k is per version
            "weight_version": ",".join(str(v) for v in outcome.get("weight_versions") or []) or None,
        }

    def locate(self, session_id: str) -> tuple[JournalSource | None, dict[str, Any]] | None:
        """The session's store (None: planned, not on a node yet) and its row."""
        row = next((r for r in self.rows() if r["session_id"] == session_id), None)
        return None if row is None else (self._where.get(session_id), row)

    def outcome(self, store: JournalSource, session_id: str) -> dict[str, Any]:
        return store.read_outcome(session_id) or next(
            (r for r in _read_lines(self.path / "sessions.jsonl") if r.get("session_id") == session_id), {})

    # -- figures -------------------------------------------------------------------------------
    def plan(self) -> dict[str, Any]:
        """``plan.json`` (planned groups, the job's config), re-read only when it changes."""
        version = file_version(self.path / "plan.json")
        if self._plan[0] != version:
            data = _read_json(self.path / "plan.json")
            self._plan = (version, data if isinstance(data, dict) else {})
        return self._plan[1]

    def template(self) -> str:
        """The engine's chat template the run was served with (its tokens decode with it)."""
        engine = ((self.plan().get("job") or {}).get("env") or {}).get("engine") or {}
        template = engine.get("template") if isinstance(engine, dict) else None
        if template == "auto":
            if self._auto_template is None:
                self._auto_template = self._resolve_auto(engine)
            return self._auto_template
        return template if isinstance(template, str) else "qwen3.5"

    @staticmethod
    def _resolve_auto(engine: dict[str, Any]) -> str:
        """``template: auto``, read off the model the run served where its files or engine still
        are; a failed probe is not repeated per trace page (it waits on the engine's URLs)."""
        from polar_env.engines.config import engine_config
        from polar_env.errors import ConfigError

        try:
            return engine_config(engine).resolved_template()
        except (ConfigError, ValueError):
            return "qwen3.5"

    def summary(self) -> dict[str, Any]:
        """The Runs list's row, cached until the index or ``live.json`` changes: the list asks for
        every run on each visit, and a finished run's report is about half a megabyte per 1,000 sessions."""
        rows = self.rows()
        key = (self._signature, self._built_at, file_version(self.path / "live.json"), self.state_name())
        if self._summary[0] != key:
            self._summary = (key, self._summarize(rows))
        return self._summary[1]

    def _summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        report = self.report()
        live = self.live_snapshot()
        done = [r for r in rows if r["status"] in FINISHED]
        statuses: dict[str, int] = {}
        for r in rows:
            statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        rewards = [float(r["reward"]) for r in done if r["reward"] is not None]
        measured = self.state()
        table, kind = pass_table(done), self.kind()
        last = list(table["per_version"])[-1] if table["per_version"] else None  # a train run: its last policy's figure
        state = self.state_name()
        if state == "store" and kind == "train" and (self.path / "summary.json").exists():
            state = "done"  # a train run from before heartbeats: its summary is written at its end
        return {
            "name": self.name, "path": str(self.path), "state": state, "state_reason": measured.reason,
            "resume": measured.resume, "error": measured.error, "sessions": len(rows), "kind": kind,
            "statuses": statuses, "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
            "pass": table["per_version"][last] if last else table["overall"], "pass_version": last,
            "wall_s": report.get("wall_s", (live or {}).get("elapsed_s")),
            "engine_busy_fraction": report.get("engine_busy_fraction", (live or {}).get("engine_busy")),
            "mode": (report.get("config") or {}).get("mode"),
        }

    def live(self) -> dict[str, Any]:
        """Stage counts, sessions done, reward so far, engine busy and the stage history."""
        snapshot = self.live_snapshot()
        rows = self.rows()
        done = [r for r in rows if r["status"] in FINISHED]
        rewards = [float(r["reward"]) for r in done if r["reward"] is not None]
        measured = self.state()
        base: dict[str, Any] = {"state": self.state_name(), "total": len(rows), "done": len(done),
                "stages": {}, "mean_reward": statistics.fmean(rewards) if rewards else None, "engine_busy": None,
                "history": [], "reason": measured.reason, "resume": measured.resume, "error": measured.error}
        if snapshot is not None:
            base.update({k: snapshot[k] for k in ("total", "done", "stages", "mean_reward", "engine_busy",
                                                   "elapsed_s", "statuses", "history", "phase") if k in snapshot})
            if measured.running:  # the timeline runs to now, not to the last stage change
                base["state"] = snapshot["state"] if snapshot.get("state") in LIVE_STATES else "running"
                base["now_s"] = round(float(snapshot.get("elapsed_s", 0.0)) + max(0.0, time.time() - float(
                    snapshot.get("updated_at") or time.time())), 3)
                base["in_flight"] = snapshot.get("session_stages") or {}  # session id -> stage, past QUEUED
            elif measured.state in STOPPED:  # where its sessions were when it stopped (the timeline stops there too)
                base["last_in_flight"] = snapshot.get("session_stages") or {}
        if measured.running:  # from the first look (live.json holds no counts until the nodes start):
            waiting = sum(r["status"] == PLANNED for r in rows)  # every planned session no node has is QUEUED
            base["stages"] = {**base["stages"], "queued": max(int(base["stages"].get("queued") or 0), waiting)}
            started = (snapshot or {}).get("started_at") or measured.started_at  # the clock runs from the start
            if started:
                base["elapsed_s"] = round(max(float(base.get("elapsed_s") or 0.0), time.time() - float(started)), 3)
        if self.finished:
            report = self.report()
            base.setdefault("elapsed_s", report.get("wall_s"))
            base["engine_busy"] = base.get("engine_busy") or report.get("engine_busy_fraction")
        if not base.get("history"):
            if self._history[0] != self._signature:  # computed once per index version, not per event
                self._history = (self._signature, finished_history(_read_lines(self.path / "sessions.jsonl")))
            base["history"] = self._history[1]
        return base


def with_stages(rows: list[dict[str, Any]], live: dict[str, Any] | None, state: str = "running",
                last: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Unfinished rows with the stage their node reports (``live.json``'s ``session_stages``);
    without a running job, planned sessions that never reached a node are ``not started``, and
    when the job crashed or was interrupted before finishing, those on a node say so (``state``)
    with the stage ``last`` (its final ``live.json``) saw them in."""
    if live is None:
        was: dict[str, str] = (last or {}).get("session_stages") or {}
        out = []
        for r in rows:
            if r["status"] == PLANNED:
                r = {**r, "status": NOT_STARTED}
            elif state in STOPPED and r["status"] not in FINISHED and r["status"] != "closed":
                r = {**r, "status": state, "last_stage": was.get(r["session_id"])}
            out.append(r)
        return out
    stages: dict[str, str] = live.get("session_stages") or {}
    return [r if r["status"] in FINISHED or r["session_id"] not in stages else {**r, "status": stages[r["session_id"]]}
            for r in rows]


def finished_history(results: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """Stage occupancy over time of finished sessions, from their stage times (like timeline.png)."""
    from polar_env.staging.models import SessionResult
    from polar_env.staging.report import occupancy_series

    parsed = [SessionResult.model_validate(r) for r in results if "stage_times" in r]
    xs, series = occupancy_series(parsed)
    return [[round(x, 3), {stage.value: counts[i] for stage, counts in series.items()}] for i, x in enumerate(xs)]


def pass_table(rows: Sequence[dict[str, Any]], ks: Sequence[int] | None = None) -> dict[str, Any]:
    """pass@k (unbiased; a session with reward >= 1 passes) overall, per repo, per harness and per
    policy version, over the finished sessions. ``k`` defaults to 1 and the smallest group size.
    Where sessions were sampled under several weight versions (a train run's steps), a group is a
    task under one version: pass@k of one policy, never k samples pooled from several."""
    versions = {r.get("weight_version") for r in rows} - {None}  # a session that made no call has none
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        key = r["task_id"] if len(versions) < 2 else f"{r['task_id']}@{r.get('weight_version')}"
        by_task.setdefault(key, []).append(r)
    n_min = min((len(v) for v in by_task.values()), default=1)
    ks = sorted(set(ks or (1, n_min)))

    def scores(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        out: dict[str, Any] = {"tasks": len(groups), "sessions": sum(len(v) for v in groups.values())}
        rewards = [float(r["reward"] or 0.0) for v in groups.values() for r in v]
        out["mean_reward"] = round(statistics.fmean(rewards), 4) if rewards else None
        for k in ks:
            vals = [pass_at_k(len(v), sum(1 for r in v if (r["reward"] or 0) >= 1.0), k) for v in groups.values() if len(v) >= k]
            out[f"pass@{k}"] = round(statistics.fmean(vals), 4) if vals else None
        return out

    def split(key: str) -> dict[str, Any]:
        parts: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for task_id, v in by_task.items():
            for r in v:
                parts.setdefault(str(r.get(key) or "-"), {}).setdefault(task_id, []).append(r)
        return {name: scores(groups) for name, groups in sorted(parts.items(), key=lambda kv: version_order(kv[0]))}

    return {"ks": ks, "overall": scores(by_task), "per_repo": split("repo"), "per_harness": split("harness"),
            "per_version": split("weight_version") if len(versions) > 1 else {}}


def version_order(name: str) -> tuple[int, int, str]:
    """Weight versions in training order ("2" before "10"); other names after, by name."""
    return (0, int(name), name) if name.isdigit() else (1, 0, name)


def counts(rows: Sequence[dict[str, Any]], key: str, top: int = 15) -> dict[str, Any]:
    """The run's histogram of ``key``: the ``top`` values as ``[[value, sessions], ...]``, most
    frequent first ("-" for none), and how many sessions the rest hold (free-text reasons can be
    as many as the sessions, and a page stays one page)."""
    seen: dict[str, int] = {}
    for r in rows:
        value = str(r.get(key) or "-")
        seen[value] = seen.get(value, 0) + 1
    ranked = sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"bars": [list(kv) for kv in ranked[:top]], "other_values": len(ranked[top:]),
            "other_sessions": sum(n for _, n in ranked[top:])}


def sort_slice(rows: Sequence[Mapping[str, Any]], key: str, *, desc: bool = False, offset: int = 0,
               limit: int = 50) -> dict[str, Any]:
    """One page of ``rows`` sorted on ``key``, blanks last whichever the direction, ties in their
    given order; at most 500 rows (the browser only ever holds a page)."""
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]
    present.sort(key=lambda r: r[key], reverse=desc)  # stable
    limit, offset = max(1, min(limit, 500)), max(0, offset)
    return {"total": len(rows), "offset": offset, "limit": limit, "rows": (present + missing)[offset: offset + limit]}


def page(rows: list[dict[str, Any]], *, q: str = "", status: str = "", harness: str = "", sort: str = "session_id",
         desc: bool = False, offset: int = 0, limit: int = 50, reason: str = "", failure_kind: str = "",
         task: str = "") -> dict[str, Any]:
    """Filter, sort and slice the session index server-side (the browser only ever holds a page).
    ``reason``/``failure_kind`` match exactly ("-": none), as the histogram's bars name them. Each
    histogram counts the sessions the other filters keep (a task's reasons on its page), all of its
    own values (so a picked bar can be switched for another)."""
    q = q.lower()

    def exact(r: dict[str, Any], key: str, want: str) -> bool:
        return not want or str(r.get(key) or "-") == want

    kept = [r for r in rows
            if (not q or q in r["session_id"].lower() or q in r["task_id"].lower() or q in str(r.get("reason") or "").lower())
            and (not status or r["status"] == status) and (not harness or r["harness"] == harness)
            and (not task or r["task_id"] == task)]
    picked = [r for r in kept if exact(r, "reason", reason) and exact(r, "failure_kind", failure_kind)]
    ended = [r for r in kept if r["status"] in FINISHED]  # the histograms: how sessions ended (none in flight)
    by_id = sorted(picked, key=lambda r: r["session_id"])
    sliced = sort_slice(by_id, sort if sort in COLUMNS else "session_id", desc=desc, offset=offset, limit=limit)
    return {**sliced, "statuses": sorted({r["status"] for r in rows}),
            "harnesses": sorted({str(r["harness"]) for r in rows if r["harness"]}),
            "reasons": counts([r for r in ended if exact(r, "failure_kind", failure_kind)], "reason"),
            "failure_kinds": counts([r for r in ended if exact(r, "reason", reason)], "failure_kind")}
