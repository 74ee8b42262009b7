"""The evaluation report's keys: what ``EvalResult.report`` may hold, in one place.

A report is a flat JSON object: the session keeps it (without ``traceback``, with ``status``) as
the outcome's ``evaluation``, which the dashboard, the run report and the SFT filter read back. Every
key is optional; which ones appear depends on the evaluator and on how far grading got. A custom
evaluator may add keys of its own: they pass through untouched (``EvalResult`` validates the report
as the plain JSON object it is, so typing it changes no byte of what is written).
"""

from __future__ import annotations

from typing import Any, TypedDict

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema


class ApplyLog(TypedDict):
    """One try at applying a text patch (``grading.changes_from_patch``)."""

    command: str
    exit_code: int
    timed_out: bool
    output: str


class RefusedOutcome(TypedDict):
    """An XFAIL or SKIP the grader did not count as the suite's own."""

    test: str
    status: str
    why: str


class CanaryOutcome(TypedDict):
    """A canary copy of a test and what it came out as, per parameter set."""

    test: str
    of: str
    expected: str  # "fail" or "same as original"
    got: dict[str, str]
    ok: bool


class BeforeLimit(TypedDict):
    """The verdict a grading runtime that went over a limit would otherwise have given."""

    status: str
    reward: float
    reason: str | None


class EvalReport(TypedDict, total=False):
    # every evaluation
    reason: str  # one line for people: why this reward
    evaluator: str
    evaluate_s: float
    cleanup_error: str  # the fresh runtime's stop failed (the verdict stands)
    status: str  # the outcome's copy only: the evaluation's status (or "skipped")
    evaluated_in: str  # "worker" or "node"
    # a crash (status ERROR)
    error: str
    exception_type: str
    traceback: str  # left out of the outcome's copy
    # the verdict
    resolved: bool  # swebench-style: the task's tests say the change fixes it
    passed: bool  # output: the check passed
    tampered: bool
    limit: str  # the limit the agent's change went over (the session ends limit_exceeded)
    verdict_before_limit: BeforeLimit
    # the graded change (integrity.Graded.as_report)
    policy: str
    change_source: str
    graded_paths: list[str]
    dropped_paths: list[dict[str, str]]
    graded_patch: str
    scan_findings: list[dict[str, str | int]]
    apply_logs: list[ApplyLog]
    # the grader's pytest plugin (results.Verdict.as_report)
    results_from: str
    grader_state: str
    runner: dict[str, object]  # the pytest and python versions the plugin saw
    finished: bool
    canaries: list[CanaryOutcome]
    refused_outcomes: list[RefusedOutcome]
    forged_lines: int
    tamper_evidence: list[str]
    grader_faults: list[str]
    # swebench
    instance_id: str
    timings_s: dict[str, float]
    eval_script_source: str
    eval_exit_code: int
    log_tail: str
    markers_added: bool
    swebench: dict[str, object]  # swebench's own report for the instance
    # harbor
    task_dir: str
    verifier_exit_code: int
    verify_s: float
    rewards: dict[str, float]  # the verifier's reward file
    # output
    mode: str
    file: str
    target_head: str
    match: str
    path: str
    value: object
    runtime: str  # "fresh" or "agent"
    command: str
    output_tail: str
    duration_s: float
    # completion, output commands
    exit_code: int | None
    timed_out: bool


class PlainJSONObject:
    """Annotates a report field of a pydantic model: validated and serialized as the plain JSON
    object it is (``dict[str, Any]``), so a custom evaluator's own keys and values pass untouched."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
        return handler(dict[str, Any])
