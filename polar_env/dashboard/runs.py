"""Run folders and capture stores, indexed for the dashboard.

A *run* is a folder ``polar-env rollout``/``eval`` wrote (``OUT/<run id>/``: ``plan.json``,
``report.json``, ``sessions.jsonl``, ``live.json`` while it runs, ``capture/<node>/`` journals) or a
bare capture store (what ``polar-env gateway --store`` wrote). Sessions are listed from the stores' public API
(``JournalStore.session_metas``/``session_ids``, ``read_outcome``), overlaid with the finished
run's ``sessions.jsonl`` and report rows; nothing here parses a journal line. The index is cached
and rebuilt when a folder changes (a new journal, outcome or report), so a page of a 1,000-session
run is a slice of a list in memory, not a scan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from polar_env.journal.protocols import JournalSource
from polar_env.journal.store import RESULT_SUFFIX, JournalStore
from polar_env.observe.live import read_live
from polar_env.staging.job import pass_at_k
from polar_env.staging.runs import is_run_folder, runs_in

FINISHED = ("completed", "timeout", "error", "cancelled")
PLANNED = "queued"  # a session plan.json names that has not reached a node's INIT yet
NOT_STARTED = "not started"  # planned, and the job is not running (it was killed before the session began)
UNSTARTED = (PLANNED, NOT_STARTED)
LIVE_STATES = ("running", "starting")
COLUMNS = ("session_id", "task_id", "repo", "sample_index", "harness", "status", "failure_kind", "reason", "reward",
           "calls", "tokens", "drift", "wall_s", "node_id", "group_id", "mask", "trainable_tokens")
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
    def __init__(self, path: Path, name: str) -> None:
        self.path = Path(path)
        self.name = name
        self._rows: list[dict[str, Any]] = []
        self._where: dict[str, JournalSource] = {}
        self._signature: tuple[Any, ...] | None = None
        self._built_at = 0.0
        self._stores: dict[Path, JournalStore] = {}
        self._history: tuple[tuple[Any, ...] | None, list[list[Any]]] = (None, [])
        self._summary: tuple[tuple[Any, ...] | None, dict[str, Any]] = (None, {})
        self._plan: tuple[tuple[int, int] | None, dict[str, Any]] = (None, {})
        self._live: tuple[tuple[int, int] | None, dict[str, Any] | None] = (None, None)
        self._staged: tuple[tuple[Any, ...] | None, list[dict[str, Any]]] = (None, [])
        self._auto_template: str | None = None  # template auto, resolved once (its engine may be long gone)

    # -- folders ------------------------------------------------------------------------------
    def store_dirs(self) -> list[Path]:
        root = self.path / "capture" if (self.path / "capture").is_dir() else self.path
        dirs = [root] if _is_store(root) else []
        if root.is_dir():
            dirs += sorted(d for d in root.iterdir() if d.is_dir() and d.name != "sessions" and _is_store(d))
        return dirs

    def store(self, folder: Path) -> JournalStore:
        if folder not in self._stores:
            self._stores[folder] = JournalStore(folder)
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

    def is_live(self) -> bool:
        """The job is running now: its ``live.json`` says so and there is no report yet."""
        live = self.live_snapshot()
        return not self.finished and live is not None and live.get("state") in LIVE_STATES

    # -- the session index ---------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Every session, with the stage live.json gives for those still on a node."""
        signature = self._signature_now()
        stale_live = not self.finished and time.monotonic() - self._built_at > _LIVE_REFRESH_S
        if signature != self._signature or stale_live:
            self._rows, self._where = self._build_rows()
            self._signature, self._built_at = signature, time.monotonic()
        key = (self._signature, self._built_at, self._live[0] if self.is_live() else None)
        if self._staged[0] != key:
            self._staged = (key, with_stages(self._rows, self.live_snapshot() if self.is_live() else None))
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
        key = (self._signature, self._built_at, file_version(self.path / "live.json"))
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
        state = "finished" if self.finished else ("running" if self.is_live() else "store")
        return {
            "name": self.name, "path": str(self.path), "state": state, "sessions": len(rows),
            "statuses": statuses, "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
            "pass": pass_table(done)["overall"], "wall_s": report.get("wall_s", (live or {}).get("elapsed_s")),
            "engine_busy_fraction": report.get("engine_busy_fraction", (live or {}).get("engine_busy")),
            "mode": (report.get("config") or {}).get("mode"),
        }

    def live(self) -> dict[str, Any]:
        """Stage counts, sessions done, reward so far, engine busy and the stage history."""
        snapshot = self.live_snapshot()
        rows = self.rows()
        done = [r for r in rows if r["status"] in FINISHED]
        rewards = [float(r["reward"]) for r in done if r["reward"] is not None]
        base: dict[str, Any] = {"state": "finished" if self.finished else "store", "total": len(rows), "done": len(done),
                "stages": {}, "mean_reward": statistics.fmean(rewards) if rewards else None, "engine_busy": None,
                "history": []}
        if snapshot is not None:
            base.update({k: snapshot[k] for k in ("state", "total", "done", "stages", "mean_reward", "engine_busy",
                                                   "elapsed_s", "statuses", "history", "phase") if k in snapshot})
            if self.is_live():  # the timeline runs to now, not to the last stage change
                base["now_s"] = round(float(snapshot.get("elapsed_s", 0.0)) + max(0.0, time.time() - float(
                    snapshot.get("updated_at") or time.time())), 3)
                base["in_flight"] = snapshot.get("session_stages") or {}  # session id -> stage, past QUEUED
        if self.finished:
            report = self.report()
            base.setdefault("elapsed_s", report.get("wall_s"))
            base["engine_busy"] = base.get("engine_busy") or report.get("engine_busy_fraction")
        if not base.get("history"):
            if self._history[0] != self._signature:  # computed once per index version, not per event
                self._history = (self._signature, finished_history(_read_lines(self.path / "sessions.jsonl")))
            base["history"] = self._history[1]
        return base


def with_stages(rows: list[dict[str, Any]], live: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Unfinished rows with the stage their node reports (``live.json``'s ``session_stages``);
    without a running job, planned sessions that never reached a node are ``not started``."""
    if live is None:
        return [r if r["status"] != PLANNED else {**r, "status": NOT_STARTED} for r in rows]
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
    """pass@k (unbiased; a session with reward >= 1 passes) overall, per repo and per harness, over
    the finished sessions. ``k`` defaults to 1 and the smallest group size."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)
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
        return {name: scores(groups) for name, groups in sorted(parts.items())}

    return {"ks": ks, "overall": scores(by_task), "per_repo": split("repo"), "per_harness": split("harness")}


def compare(a: Run, b: Run) -> dict[str, Any]:
    """The "base vs trained" table: pass@1/pass@k of two runs overall, per repo and per harness,
    with k shared (the smaller group size of the two)."""
    done_a = [r for r in a.rows() if r["status"] in FINISHED]
    done_b = [r for r in b.rows() if r["status"] in FINISHED]
    k = min(pass_table(done_a)["ks"][-1], pass_table(done_b)["ks"][-1])
    ta, tb = pass_table(done_a, (1, k)), pass_table(done_b, (1, k))
    sections = []
    for key in ("overall", "per_repo", "per_harness"):
        if key == "overall":
            names = ["all"]
            left, right = {"all": ta["overall"]}, {"all": tb["overall"]}
            shared = {r["task_id"] for r in done_a} & {r["task_id"] for r in done_b}
            if shared != {r["task_id"] for r in done_a} | {r["task_id"] for r in done_b}:  # the like-for-like figure
                names.append("shared tasks")
                left["shared tasks"] = pass_table([r for r in done_a if r["task_id"] in shared], (1, k))["overall"]
                right["shared tasks"] = pass_table([r for r in done_b if r["task_id"] in shared], (1, k))["overall"]
        else:
            left, right = ta[key], tb[key]
            names = sorted(set(left) | set(right))
        sections.append({"section": key, "rows": [{"name": n, "a": left.get(n), "b": right.get(n)} for n in names]})
    tasks_a, tasks_b = {r["task_id"] for r in done_a}, {r["task_id"] for r in done_b}
    return {"a": a.name, "b": b.name, "ks": sorted({1, k}), "sections": sections,
            "per_task": per_task_deltas(done_a, done_b, k), "failure_kinds": _kinds(done_a, done_b),
            "totals": {"a": _totals(a, done_a), "b": _totals(b, done_b)},
            "task_sets": {"same": tasks_a == tasks_b, "shared": len(tasks_a & tasks_b),
                          "only_a": sorted(tasks_a - tasks_b), "only_b": sorted(tasks_b - tasks_a)}}


def _side(rows: Sequence[dict[str, Any]], k: int) -> dict[str, Any] | None:
    if not rows:
        return None
    passes = sum(1 for r in rows if (r["reward"] or 0) >= 1.0)
    kinds: dict[str, int] = {}
    for r in rows:
        if r.get("failure_kind"):
            kinds[str(r["failure_kind"])] = kinds.get(str(r["failure_kind"]), 0) + 1
    tokens = [float(r["tokens"]) for r in rows if r.get("tokens") is not None]
    return {"sessions": len(rows), "mean_reward": round(statistics.fmean(float(r["reward"] or 0.0) for r in rows), 4),
            "pass@1": round(pass_at_k(len(rows), passes, 1), 4),
            f"pass@{k}": round(pass_at_k(len(rows), passes, k), 4) if len(rows) >= k else None,
            "failure_kinds": kinds, "mean_tokens": round(statistics.fmean(tokens), 1) if tokens else None}


def per_task_deltas(done_a: Sequence[dict[str, Any]], done_b: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """One row per task of either run: its figures in each (None where a run lacks the task)."""
    by_a: dict[str, list[dict[str, Any]]] = {}
    by_b: dict[str, list[dict[str, Any]]] = {}
    for rows, into in ((done_a, by_a), (done_b, by_b)):
        for r in rows:
            into.setdefault(r["task_id"], []).append(r)
    return [{"task_id": t, "a": _side(by_a.get(t, []), k), "b": _side(by_b.get(t, []), k)}
            for t in sorted(set(by_a) | set(by_b))]


def _kinds(done_a: Sequence[dict[str, Any]], done_b: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sessions per failure kind in each run ("-": none, the session completed)."""
    seen: dict[str, list[int]] = {}
    for i, rows in enumerate((done_a, done_b)):
        for r in rows:
            seen.setdefault(str(r.get("failure_kind") or "-"), [0, 0])[i] += 1
    return [{"kind": kind, "a": n[0], "b": n[1]} for kind, n in sorted(seen.items(), key=lambda kv: -sum(kv[1]))]


def _totals(run: Run, done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sessions, tokens and cost (engine seconds, where the report has them; wall otherwise)."""
    report = run.report()
    tokens = [float(r["tokens"]) for r in done if r.get("tokens") is not None]
    busy = sum(float(n.get("engine_busy_s") or 0.0) for n in report.get("nodes") or [] if "dead" not in n)
    return {"sessions": len(done), "sampled_tokens": int(sum(tokens)) if tokens else None,
            "engine_seconds": round(busy, 2) if report else None, "wall_s": report.get("wall_s")}


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


def page(rows: list[dict[str, Any]], *, q: str = "", status: str = "", harness: str = "", sort: str = "session_id",
         desc: bool = False, offset: int = 0, limit: int = 50, reason: str = "", failure_kind: str = "",
         task: str = "") -> dict[str, Any]:
    """Filter, sort and slice the session index server-side (the browser only ever holds a page).
    ``reason``/``failure_kind`` match exactly ("-": none), as the histogram's bars name them."""
    q = q.lower()

    def exact(r: dict[str, Any], key: str, want: str) -> bool:
        return not want or str(r.get(key) or "-") == want

    picked = [r for r in rows
              if (not q or q in r["session_id"].lower() or q in r["task_id"].lower() or q in str(r.get("reason") or "").lower())
              and (not status or r["status"] == status) and (not harness or r["harness"] == harness)
              and exact(r, "reason", reason) and exact(r, "failure_kind", failure_kind) and (not task or r["task_id"] == task)]
    key = sort if sort in COLUMNS else "session_id"
    ended = [r for r in rows if r["status"] in FINISHED]  # the histograms: how sessions ended (none in flight)
    present = [r for r in picked if r.get(key) is not None]
    missing = [r for r in picked if r.get(key) is None]  # blanks last, whichever the direction
    present.sort(key=lambda r: r["session_id"])
    present.sort(key=lambda r: r[key], reverse=desc)  # stable: ties stay in session order either way
    ordered = present + missing
    limit = max(1, min(limit, 500))
    return {"total": len(picked), "offset": offset, "limit": limit, "rows": ordered[offset: offset + limit],
            "statuses": sorted({r["status"] for r in rows}), "harnesses": sorted({str(r["harness"]) for r in rows if r["harness"]}),
            "reasons": counts(ended, "reason"), "failure_kinds": counts(ended, "failure_kind")}
