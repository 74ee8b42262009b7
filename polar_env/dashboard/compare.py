"""Compare: the "base vs trained" table of two runs, over the same cached session index the
Sessions view pages (``Run.rows``).

Overall, per repo and per harness a run's pass@k is only comparable over the tasks both runs
graded, so every part whose task sets differ gets a *shared tasks* row restricted to those. The
per-task rows are as many as the tasks (1,250 in a 5,000-session run): the answer is cached per
pair of runs and ``compare_page`` hands the browser one page of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypedDict

from polar_env.dashboard.runs import FINISHED, Run, pass_table
from polar_env.staging.job import pass_at_k

SHARED = "shared tasks"

Scores = dict[str, object]  # one ``pass_table`` entry: tasks, sessions, mean_reward, pass@k
Side = dict[str, float | int | dict[str, int] | None]  # a task's figures in one run (``pass@<k>`` is keyed by k)


class Pair(TypedDict):
    a: Scores | None
    b: Scores | None


class Row(Pair):
    name: str


class Section(TypedDict):
    section: str  # "overall", "per_repo", "per_harness"
    rows: list[Row]


class TaskDelta(TypedDict):
    task_id: str
    a: Side | None
    b: Side | None


class KindCount(TypedDict):
    kind: str
    a: int
    b: int


class Totals(TypedDict):
    sessions: int
    sampled_tokens: int | None
    engine_seconds: float | None
    wall_s: object


class TaskSets(TypedDict):
    same: bool
    shared: int
    only_a: list[str]
    only_b: list[str]


class Comparison(TypedDict):
    """``GET /api/compare``'s answer before paging (cached per pair of runs)."""

    a: str
    b: str
    ks: list[int]
    sections: list[Section]
    per_task: list[TaskDelta]
    failure_kinds: list[KindCount]
    totals: dict[str, Totals]  # "a", "b"
    task_sets: TaskSets


class ComparisonPage(Comparison):
    per_task_total: int
    per_task_offset: int
    per_task_limit: int


def compare(a: Run, b: Run) -> Comparison:
    """pass@1/pass@k of two runs overall, per repo and per harness, with k shared (the smaller
    group size of the two); a ``<name> · shared tasks`` row wherever the two task sets differ."""
    done_a = [r for r in a.rows() if r["status"] in FINISHED]
    done_b = [r for r in b.rows() if r["status"] in FINISHED]
    k = min(pass_table(done_a)["ks"][-1], pass_table(done_b)["ks"][-1])
    ta, tb = pass_table(done_a, (1, k)), pass_table(done_b, (1, k))
    sections: list[Section] = []
    for key, column in (("overall", None), ("per_repo", "repo"), ("per_harness", "harness")):
        left = {"all": ta["overall"]} if column is None else ta[key]
        right = {"all": tb["overall"]} if column is None else tb[key]
        rows: list[Row] = []
        for name in ["all"] if column is None else sorted(set(left) | set(right)):
            rows.append({"name": name, "a": left.get(name), "b": right.get(name)})
            part_a = [r for r in done_a if column is None or str(r.get(column) or "-") == name]
            part_b = [r for r in done_b if column is None or str(r.get(column) or "-") == name]
            shared = _shared(part_a, part_b, k)
            if shared is not None:
                rows.append({"name": SHARED if column is None else f"{name} · {SHARED}", **shared})
        sections.append({"section": key, "rows": rows})
    tasks_a, tasks_b = {r["task_id"] for r in done_a}, {r["task_id"] for r in done_b}
    return {"a": a.name, "b": b.name, "ks": sorted({1, k}), "sections": sections,
            "per_task": _per_task_deltas(done_a, done_b, k), "failure_kinds": _kinds(done_a, done_b),
            "totals": {"a": _totals(a, done_a), "b": _totals(b, done_b)},
            "task_sets": {"same": tasks_a == tasks_b, "shared": len(tasks_a & tasks_b),
                          "only_a": sorted(tasks_a - tasks_b), "only_b": sorted(tasks_b - tasks_a)}}


def _shared(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], k: int) -> Pair | None:
    """Both runs' figures over the tasks both ran (the like-for-like Δ); None when the task sets
    are the same (the row above is already that) or either run has none of them."""
    tasks_a, tasks_b = {r["task_id"] for r in rows_a}, {r["task_id"] for r in rows_b}
    both = tasks_a & tasks_b
    if tasks_a == tasks_b or not both:
        return None
    return {"a": pass_table([r for r in rows_a if r["task_id"] in both], (1, k))["overall"],
            "b": pass_table([r for r in rows_b if r["task_id"] in both], (1, k))["overall"]}


def compare_page(data: Comparison, *, q: str = "", offset: int = 0, limit: int = 50) -> ComparisonPage:
    """The cached comparison with one page of its per-task rows (``q``: a substring of the task id),
    in task order (as ``per_task`` holds them), bounded as ``runs.sort_slice`` bounds a page."""
    rows = [t for t in data["per_task"] if q.lower() in t["task_id"].lower()] if q else data["per_task"]
    limit, offset = max(1, min(limit, 500)), max(0, offset)
    return {**data, "per_task": rows[offset: offset + limit], "per_task_total": len(rows), "per_task_offset": offset,
            "per_task_limit": limit}


def _side(rows: Sequence[dict[str, Any]], k: int) -> Side | None:
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


def _per_task_deltas(done_a: Sequence[dict[str, Any]], done_b: Sequence[dict[str, Any]], k: int) -> list[TaskDelta]:
    """One row per task of either run: its figures in each (None where a run lacks the task)."""
    by_a: dict[str, list[dict[str, Any]]] = {}
    by_b: dict[str, list[dict[str, Any]]] = {}
    for rows, into in ((done_a, by_a), (done_b, by_b)):
        for r in rows:
            into.setdefault(r["task_id"], []).append(r)
    return [{"task_id": t, "a": _side(by_a.get(t, []), k), "b": _side(by_b.get(t, []), k)}
            for t in sorted(set(by_a) | set(by_b))]


def _kinds(done_a: Sequence[dict[str, Any]], done_b: Sequence[dict[str, Any]]) -> list[KindCount]:
    """Sessions per failure kind in each run ("-": none, the session completed)."""
    seen: dict[str, list[int]] = {}
    for i, rows in enumerate((done_a, done_b)):
        for r in rows:
            seen.setdefault(str(r.get("failure_kind") or "-"), [0, 0])[i] += 1
    return [{"kind": kind, "a": n[0], "b": n[1]} for kind, n in sorted(seen.items(), key=lambda kv: -sum(kv[1]))]


def _totals(run: Run, done: Sequence[dict[str, Any]]) -> Totals:
    """Sessions, tokens and cost (engine seconds, where the report has them; wall otherwise)."""
    report = run.report()
    tokens = [float(r["tokens"]) for r in done if r.get("tokens") is not None]
    busy = sum(float(n.get("engine_busy_s") or 0.0) for n in report.get("nodes") or [] if "dead" not in n)
    return {"sessions": len(done), "sampled_tokens": int(sum(tokens)) if tokens else None,
            "engine_seconds": round(busy, 2) if report else None, "wall_s": report.get("wall_s")}
