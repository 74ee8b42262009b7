"""The run report of a batch of sessions: per-session status and reward, stage timings, engine-busy
fraction, RUNNING-slot occupancy, per-request vs merged trace counts, drift, and a PNG timeline of
stage occupancy (matplotlib, the ``report`` extra; skipped with a note without it).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polar_env.engines.routing import merge_reports
from polar_env.staging.models import SessionResult, Stage

TIMELINE_STAGES = (Stage.QUEUED, Stage.INIT, Stage.READY, Stage.RUNNING, Stage.POSTRUN)


def session_row(r: SessionResult) -> dict[str, Any]:
    traj = r.trajectory
    stats = traj.metadata.get("stats", {})
    return {"session_id": r.session_id, "task_id": r.task_id, "sample_index": r.sample_index, "node_id": r.node_id,
            "status": r.status.value, "reward": r.reward, "records": r.records,
            "traces": len(traj.traces), "drift_boundaries": stats.get("drift_boundaries", 0),
            "sampled_tokens": sum(sum(t.loss_mask) for t in traj.traces),
            "captured_tokens": stats.get("captured_tokens", 0),  # sampled tokens the gateway recorded
            "trainable_tokens": stats.get("trainable_tokens", 0),  # of those, in chains the harness continued
            "stage_s": r.stage_seconds(), "harness_exit_code": r.harness_exit_code,
            "resolved": r.evaluation.get("resolved"), "reason": r.evaluation.get("reason"),
            "failure_kind": r.failure_kind.value if r.failure_kind is not None else None,
            "failure_detail": r.failure_detail, "mask": r.mask}


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"mean": round(statistics.fmean(values), 3), "p50": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


def build_report(results: Sequence[SessionResult], node_stats: Sequence[dict[str, Any]], wall_s: float,
                 config: dict[str, Any] | None = None) -> dict[str, Any]:
    rows = [session_row(r) for r in results]
    statuses: dict[str, int] = {}
    failures: dict[str, int] = {}
    for r in results:
        statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
        if r.failure_kind is not None:
            failures[r.failure_kind.value] = failures.get(r.failure_kind.value, 0) + 1
    stage_s: dict[str, list[float]] = {}
    for r in results:
        for stage, secs in r.stage_seconds().items():
            stage_s.setdefault(stage, []).append(secs)
    per_task: dict[str, list[float]] = {}
    for r in results:
        per_task.setdefault(r.task_id, []).append(r.reward)
    live = [s for s in node_stats if "dead" not in s]
    busy = [s["engine_busy_fraction"] for s in live]
    return {
        "config": config or {},
        "wall_s": round(wall_s, 2),
        "sessions": len(results),
        "statuses": statuses,
        "failure_kinds": failures,
        "masked": sum(r.mask for r in results),
        "mean_reward": round(statistics.fmean([r.reward for r in results]), 4) if results else None,
        "per_task_mean_reward": {k: round(statistics.fmean(v), 4) for k, v in per_task.items()},
        "stage_seconds": {k: _summary(v) for k, v in stage_s.items()},
        "engine_busy_fraction": round(statistics.fmean(busy), 4) if busy else None,
        "running_occupancy": round(statistics.fmean([s["running_occupancy"] for s in live]), 4) if live else None,
        "engine_calls": sum(s.get("engine_calls", 0) for s in live),
        "sampled_tokens": sum(s.get("sampled_tokens", 0) for s in live),
        "per_request_traces": sum(r.records for r in results),
        "merged_traces": sum(row["traces"] for row in rows),
        "drift_boundaries": sum(row["drift_boundaries"] for row in rows),
        "captured_tokens": sum(row["captured_tokens"] for row in rows),
        "trainable_tokens": sum(row["trainable_tokens"] for row in rows),
        "nodes": list(node_stats),
        "session_rows": rows,
        # per server and per session, from the engines' own counters (engines/routing.py); None: no routed engine
        "prefix_cache": merge_reports(s["engine"]["prefix_cache"] for s in live
                                      if "prefix_cache" in (s.get("engine") or {})),
    }


def occupancy_series(results: Sequence[SessionResult]) -> tuple[list[float], dict[Stage, list[int]]]:
    """Step series of sessions per stage over time (seconds since the first transition)."""
    events: list[tuple[float, Stage, int]] = []
    for r in results:
        times = r.stage_times
        order = [s for s in Stage if s.value in times]
        for a, b in zip(order, order[1:], strict=False):
            if a in TIMELINE_STAGES:
                events.append((times[a.value], a, 1))
                events.append((times[b.value], a, -1))
    if not events:
        return [], {}
    events.sort(key=lambda e: (e[0], e[2]))
    t0 = events[0][0]
    counts = {s: 0 for s in TIMELINE_STAGES}
    xs: list[float] = []
    series: dict[Stage, list[int]] = {s: [] for s in TIMELINE_STAGES}
    for t, stage, delta in events:
        counts[stage] += delta
        xs.append(t - t0)
        for s in TIMELINE_STAGES:
            series[s].append(counts[s])
    return xs, series


def write_timeline(results: Sequence[SessionResult], path: Path, title: str = "stage occupancy") -> str | None:
    """Write the stacked stage-occupancy timeline; returns a note instead when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "timeline skipped: matplotlib is not installed (pip install -e '.[report]')"
    xs, series = occupancy_series(results)
    if not xs:
        return "timeline skipped: no stage transitions"
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    ax.stackplot(xs, *[series[s] for s in TIMELINE_STAGES], labels=[s.value for s in TIMELINE_STAGES], step="post")
    ax.set_xlabel("seconds")
    ax.set_ylabel("sessions")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
