"""``swebench``: grade the agent's change the way the SWE-bench harness does, under the grading
contract (``integrity.py``), reusing swebench 5.x's grading library (``make_test_spec``, its log
parsers, ``get_eval_tests_report`` and ``get_resolution_status``).

Flow: a fresh runtime holding the repo at base_commit → the agent's change set (taken by the grader
from the workspace, never through the agent's git) admitted by the allow-list and written in →
the instance's eval script (it resets the test files and applies the test patch) run with the
grader's pytest plugin in the policy's hermetic environment → the verdict from the plugin's
authenticated report (each test's status mapped to the dataset's names by swebench's own parser
over a log the grader writes from that report) → canaries checked (a wrong canary outcome is
``tampered``: reward 0, unmasked) → FAIL_TO_PASS / PASS_TO_PASS graded by swebench.

Eval scripts that run no pytest (other runners) are graded from their log as before, and the report
says so (``results_from``): outside the contract. swebench is an optional extra, imported on first
use (it pulls docker, modal and datasets in at import time). Running containers is the runtime's
job, never swebench's.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import tempfile
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvalContext, EvalResult
from polar_env.evaluators.grading import broken_result, check_env, graded_runtime, pytest_gate, pytest_verdict
from polar_env.evaluators.integrity import IntegrityParams, resolve_policy
from polar_env.evaluators.report import EvalReport
from polar_env.evaluators.results import (
    FAILED,
    FINISHED,
    NOT_LOADED,
    SKIPPED,
    UNSUPPORTED,
    synthetic_log,
)
from polar_env.records import Status
from polar_env.tasks.eval_scripts import resolve_eval_script
from polar_env.tasks.swe import END_TEST_OUTPUT, START_TEST_OUTPUT, SweTask


class SweBenchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = 1800.0  # the eval script; SWE-bench's harness default
    apply_timeout_s: float = 120.0  # each apply attempt
    skip_empty_patch: bool = True  # an empty diff is not resolved; do not spend a test run proving it
    log_tail_chars: int = 20_000
    test_command: str | None = None  # builds a swebench-layout eval script for rows that have none
    integrity: IntegrityParams = IntegrityParams()  # the grading-integrity policy and the task's allow-list

    @model_validator(mode="before")
    @classmethod
    def _no_in_place(cls, data: Any) -> Any:
        if isinstance(data, dict) and "refresh_runtime" in data:
            raise ValueError("'refresh_runtime' is gone: swebench grades in a fresh runtime only (the grading "
                             "contract cannot hold in the agent's own workspace)")
        return data


@functools.cache
def _swebench() -> tuple[Any, Any]:
    """(make_test_spec, get_eval_report) from swebench 5.x, imported once (about 1 s)."""
    try:
        from swebench.harness.grading import get_eval_report
        from swebench.harness.utils import make_test_spec
    except ImportError as exc:
        raise ConfigError(
            f"the swebench evaluator needs swebench 5.x ({exc}): pip install 'polar-env[swebench]'"
        ) from exc
    return make_test_spec, get_eval_report


class SweBenchEvaluator:
    name = "swebench"
    params_model = SweBenchParams  # checked when a TaskRequest is built

    def params_of(self, ctx: EvalContext) -> SweBenchParams:
        try:
            return SweBenchParams.model_validate(ctx.params)
        except ValidationError as exc:
            raise ConfigError(f"bad swebench evaluator spec {ctx.params!r}: {exc}") from exc

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
        return True

    async def prewarm(self, ctx: EvalContext) -> None:
        await asyncio.to_thread(_swebench)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        params = self.params_of(ctx)
        task = SweTask.from_row(ctx.task)
        spec, source = await asyncio.to_thread(_test_spec, task, params)
        timings: dict[str, float] = {}
        report: EvalReport = {"instance_id": task.instance_id, "resolved": False, "timings_s": timings,
                              "eval_script_source": source}
        policy = resolve_policy(params.integrity)
        started = time.monotonic()
        runtime, graded = await graded_runtime(ctx, policy, test_files=list(task.test_files()),
                                               timeout_s=params.apply_timeout_s)
        timings["change"] = _since(started)
        report.update(graded.as_report())
        broken = broken_result(graded, report)
        if broken is not None:
            return broken
        if graded.empty and params.skip_empty_patch:
            return _unresolved(report, "no admitted change" if graded.dropped else "empty patch")

        started = time.monotonic()
        workdir = runtime.spec.workdir
        test_files = list(task.test_files())
        env, reporter = await check_env(runtime, policy, files=sorted({t.split("::", 1)[0] for t in task.FAIL_TO_PASS}),
                                        prefer=task.PASS_TO_PASS, prefer_same=task.FAIL_TO_PASS, safe_path=True)
        script = f"{reporter.directory if reporter else '/tmp'}/eval-{secrets.token_hex(6)}.sh"
        await runtime.write_file(script, spec.eval_script.encode())
        run = await runtime.exec(f"bash {script}", env=env, cwd=workdir, timeout_s=params.timeout_s)
        timings["eval"] = _since(started)
        report["eval_exit_code"] = run.exit_code
        report["log_tail"] = run.output[-params.log_tail_chars :]
        if run.timed_out:
            report["reason"] = f"eval script exceeded {params.timeout_s} s"
            return EvalResult(status=Status.TIMEOUT, report=report)

        started = time.monotonic()
        found = await pytest_verdict(runtime, reporter, run.output, test_files=test_files)
        forced = pytest_gate(found, report, refuse=False)
        if forced is not None:
            return forced
        state = found.state if found is not None else NOT_LOADED
        if state == NOT_LOADED and reporter is not None and _runs_pytest(spec):
            return EvalResult(status=Status.ERROR, report={**report, "error": (
                "the grader's pytest plugin never loaded although the eval script runs pytest (no pytest in the "
                "task's environment, a Python it cannot import into, or a script that drops PYTEST_ADDOPTS)")})
        if state == FINISHED and found is not None:
            statuses = _listed_skips_fail(found.statuses, task.FAIL_TO_PASS)
            log = f"+ : '{START_TEST_OUTPUT}'\n{synthetic_log(statuses)}+ : '{END_TEST_OUTPUT}'\n"
        else:
            old = found.loaded.get("pytest") if state == UNSUPPORTED and found is not None and found.loaded else None
            why = f"pytest {old} is older than the grader's plugin supports (4.6)" if old else "the eval script runs no pytest"
            report["results_from"] = f"log: {why} (outside the grading contract)"
            log = run.output
            if START_TEST_OUTPUT not in spec.eval_script:
                # Eval scripts built by the SWE-Gym fork print no markers; like that fork, grade the
                # whole log rather than call every run invalid.
                log = f"+ : '{START_TEST_OUTPUT}'\n{log}\n+ : '{END_TEST_OUTPUT}'\n"
                report["markers_added"] = True
        graded_report = await asyncio.to_thread(_grade, spec, task.instance_id, graded.patch or "(admitted change)", log)
        timings["grade"] = _since(started)
        report["swebench"] = graded_report
        report["resolved"] = bool(graded_report.get("resolved"))
        report["reason"] = _reason(graded_report)
        return EvalResult(reward=1.0 if report["resolved"] else 0.0, report=report)


def _test_spec(task: SweTask, params: SweBenchParams) -> tuple[Any, str]:
    """(swebench's TestSpec around the row's eval script, which source gave the script)."""
    make_test_spec, _ = _swebench()
    found = resolve_eval_script(task, params.test_command)
    return make_test_spec(task.to_swebench_instance(found.script)), found.source


def _listed_skips_fail(statuses: dict[str, str], fail_to_pass: list[str]) -> dict[str, str]:
    """A FAIL_TO_PASS test must pass: SKIPPED is a failure there (swebench counts it as neither,
    and a FAIL_TO_PASS list of nothing but neither resolves). Matched on the id the parser keeps
    (``parse_log_pytest`` cuts ids at a space)."""
    wanted = {t.split(" ", 1)[0] for t in fail_to_pass}
    return {n: FAILED if s == SKIPPED and n.split(" ", 1)[0] in wanted else s for n, s in statuses.items()}


def _runs_pytest(spec: Any) -> bool:
    script = str(spec.eval_script)
    return "pytest" in script or "py.test" in script or str(getattr(spec, "log_parser", "")).startswith("parse_log_pytest")


def _grade(spec: Any, instance_id: str, patch: str, log: str) -> dict[str, Any]:
    _, get_eval_report = _swebench()
    prediction = {"instance_id": instance_id, "model_patch": patch, "model_name_or_path": "polar_env"}
    fd, path = tempfile.mkstemp(prefix="polar-eval-", suffix=".log")  # get_eval_report reads a file
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(log)
        report = get_eval_report(spec, prediction, path, include_tests_status=True)
    finally:
        os.unlink(path)
    return dict(report[instance_id])


def _reason(graded: dict[str, Any]) -> str:
    if graded.get("resolved"):
        return "resolved"
    if not graded.get("patch_successfully_applied"):
        # swebench's name: False here means the log held no usable test results
        why = graded.get("infra_failure_reason")
        return "no usable test results in the eval log" + (f" ({why})" if why else "")
    tests = graded.get("tests_status", {})
    failed = {k: v.get("failure", []) for k, v in tests.items() if k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    parts = [f"{k} failed: {', '.join(v)}" for k, v in failed.items() if v]
    return "; ".join(parts) or "not resolved"


def _unresolved(report: EvalReport, reason: str) -> EvalResult:
    return EvalResult(reward=0.0, report={**report, "resolved": False, "reason": reason})


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
