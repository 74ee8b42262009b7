"""Trace counts say what they count: under ``builder: per_request`` every call is its own trace,
so neither ``polar-env train`` nor the rollout summary prints a "merged" count (it would repeat
the per-request one); a merging builder keeps both counts, named by its builder."""

from __future__ import annotations

import io

from rich.console import Console

from polar_env.records import Trace, Trajectory
from polar_env.staging.summary import figures_table
from polar_env.train.loop import RunResult, update_cost, updates_line


def _summary_updates(builder: str, traj: Trajectory) -> dict[str, object]:
    result = RunResult(recipe={"name": "t", "seed": 0, "control": False, "builder": builder})
    cost = update_cost(traj)
    result.per_request_traces, result.merged_traces = cost.per_request_traces, cost.merged_traces
    updates: dict[str, object] = result.summary()["updates"]
    return updates


def test_per_request_prints_one_count_and_merged_builders_both() -> None:
    one_call = Trace(prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[0.0, 0.0], loss_mask=[1, 1])
    per_request = Trajectory(session_id="s", traces=[one_call, one_call])  # two calls, a trace each
    updates = _summary_updates("per_request", per_request)
    assert updates["builder"] == "per_request" and updates["per_request"] == updates["merged"] == 2
    line = updates_line(updates)
    assert line == "updates 2 traces, one per call (builder per_request merges nothing)" and "merged 2" not in line

    chain = Trace(prompt_ids=[1, 2], response_ids=[3, 9, 4], response_logprobs=[0.0] * 3, loss_mask=[1, 0, 1])
    merged = _summary_updates("prefix_merge_strict", Trajectory(session_id="s", traces=[chain]))
    assert updates_line(merged) == "updates per-request 2 vs merged 1 (builder prefix_merge_strict)"


def _figures(builder: str) -> str:
    report = {"engine_calls": 4, "sampled_tokens": 8, "per_request_traces": 4, "merged_traces": 4 if builder == "per_request" else 2,
              "drift_boundaries": 0, "config": {"env": {"builder": builder}}}
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(figures_table(report))
    return console.export_text()


def test_the_rollout_summary_names_what_its_trace_count_counts() -> None:
    text = _figures("per_request")
    assert "traces (per_request: one per call)" in text and "4 → 4" not in text and "merged" not in text
    assert "traces per-request → merged" in _figures("prefix_merge") and "4 → 2" in _figures("prefix_merge")
