"""The run's figures count ``no_model_calls`` and ``engine_bound_timeout`` like every failure kind:
``report.json``, the printed run table and next steps, a task's summary and the Prometheus series."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from polar_env.observe.metrics import RolloutMetrics
from polar_env.records import FailureKind, masked
from polar_env.staging.models import SessionResult, SessionStatus, TaskState, TaskStatus
from polar_env.staging.report import build_report
from polar_env.staging.summary import figures_table, next_steps

KINDS = [(SessionStatus.ERROR, FailureKind.NO_MODEL_CALLS), (SessionStatus.TIMEOUT, FailureKind.NO_MODEL_CALLS),
         (SessionStatus.TIMEOUT, FailureKind.ENGINE_BOUND_TIMEOUT), (SessionStatus.TIMEOUT, FailureKind.AGENT_TIMEOUT),
         (SessionStatus.COMPLETED, None)]


def results() -> list[SessionResult]:
    return [SessionResult.model_validate({  # no trajectory: the empty row of a result is filled in
        "session_id": f"s-{i}", "task_id": "t", "group_id": "g", "sample_index": i, "status": status,
        "failure_kind": kind, "failure_detail": kind and f"{kind.value} detail", "mask": masked(kind, 10)})
        for i, (status, kind) in enumerate(KINDS)]


def test_both_kinds_are_masked_whatever_was_sampled() -> None:
    assert masked(FailureKind.NO_MODEL_CALLS, 10) and masked(FailureKind.ENGINE_BOUND_TIMEOUT, 10)
    assert not masked(FailureKind.AGENT_TIMEOUT, 10)  # the policy's own timeout still trains on a zero


def test_report_counts_them_and_the_run_table_and_next_steps_show_them() -> None:
    report = build_report(results(), [], 3.0)
    assert report["failure_kinds"] == {"no_model_calls": 2, "engine_bound_timeout": 1, "agent_timeout": 1}
    assert report["masked"] == 3 and report["statuses"] == {"error": 1, "timeout": 3, "completed": 1}
    assert [row["failure_kind"] for row in report["session_rows"]][:3] == [
        "no_model_calls", "no_model_calls", "engine_bound_timeout"]
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(figures_table(report))
    text = console.export_text()
    assert "2 no_model_calls, 1 agent_timeout, 1 engine_bound_timeout" in text and "masked" in text, text
    steps = "\n".join(next_steps(report, Path("out")))
    assert "2 session(s) ended with no model call captured" in steps and "base URL / API key" in steps
    assert "1 session(s) ran out of wall time waiting on the engine" in steps


def test_a_clean_run_says_none() -> None:
    report = build_report(results()[-1:], [], 1.0)
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(figures_table(report))
    text = console.export_text()
    assert "failure kinds" in text and "│  none │" in text, text
    assert "no model call" not in "\n".join(next_steps(report, Path("out")))


def test_task_summary_and_metrics_count_them() -> None:
    status = TaskStatus(task_id="t", group_id="g", state=TaskState.DONE, num_samples=5, results=results())
    summary = status.summary()
    assert summary["failure_kinds"]["no_model_calls"] == 2 and summary["failure_kinds"]["engine_bound_timeout"] == 1
    metrics = RolloutMetrics()
    for r in results():
        metrics.observe_result(r)
    count = metrics.registry.get_sample_value
    assert count("polar_rollout_failures_total", {"kind": "no_model_calls"}) == 2.0
    assert count("polar_rollout_failures_total", {"kind": "engine_bound_timeout"}) == 1.0
