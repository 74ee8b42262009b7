"""``swebench``: grade the agent's diff the way the SWE-bench harness does, reusing swebench 5.x's
grading library (``make_test_spec``, ``get_eval_report`` and its log parsers).

Flow: the agent's diff → a fresh runtime holding the repo at base_commit → the diff restricted by the
task's grading-integrity policy (``integrity.py``: runner config, conftest files, import hooks and
test files dropped, each listed in ``dropped_paths``) → apply with the harness's fallback chain (reset
between attempts) → put the test patch's files back to base_commit (an added
test file the agent wrote is removed, so the test patch cannot fail to apply and leave the agent's
version in place) → run the instance's eval script in the policy's isolated interpreter environment,
stdout and stderr merged → grade FAIL_TO_PASS /
PASS_TO_PASS. swebench is an optional extra, imported on first use (it pulls docker, modal and
datasets in at import time). Running containers is the runtime's job, never swebench's.
"""

from __future__ import annotations

import asyncio
import functools
import os
import posixpath
import shlex
import tempfile
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvalContext, EvalResult
from polar_env.evaluators.integrity import (
    GIT_ENV,
    IntegrityParams,
    apply_restricted,
    grading_env,
    prepare_grading_home,
    resolve_policy,
)
from polar_env.records import Status
from polar_env.runtimes.base import Runtime
from polar_env.tasks.swe import (
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    SweTask,
    build_eval_script,
)

EVAL_FILE = ".git/polar_eval.sh"


class SweBenchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    refresh_runtime: bool = True  # False: grade the agent's own workspace, as it is (no apply step)
    timeout_s: float = 1800.0  # the eval script; SWE-bench's harness default
    apply_timeout_s: float = 120.0  # each apply attempt
    skip_empty_patch: bool = True  # an empty diff is not resolved; do not spend a test run proving it
    log_tail_chars: int = 20_000
    test_command: str | None = None  # builds a swebench-layout eval script for rows that have none
    integrity: IntegrityParams = IntegrityParams()  # the grading-integrity policy and the task's allow-list


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
        return self.params_of(ctx).refresh_runtime

    async def prewarm(self, ctx: EvalContext) -> None:
        await asyncio.to_thread(_swebench)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        params = self.params_of(ctx)
        task = SweTask.from_row(ctx.task)
        spec = await asyncio.to_thread(_test_spec, task, params)
        patch = ctx.patch if ctx.patch is not None else await ctx.agent_runtime().diff()
        timings: dict[str, float] = {}
        report: dict[str, Any] = {
            "instance_id": task.instance_id,
            "resolved": False,
            "patch_chars": len(patch),
            "timings_s": timings,
        }
        if not patch.strip() and params.skip_empty_patch:
            return _unresolved(report, "empty patch")

        started = time.monotonic()
        runtime = await ctx.fresh_runtime() if params.refresh_runtime else ctx.agent_runtime()
        timings["runtime"] = _since(started)
        workdir = runtime.spec.workdir
        policy = resolve_policy(params.integrity)
        report.update({"policy": policy.name if policy.enabled else "off", "dropped_paths": [], "flagged": []})
        if params.refresh_runtime and patch.strip():
            started = time.monotonic()
            applied = await apply_restricted(runtime, patch, policy, test_files=list(task.test_files()),
                                             timeout_s=params.apply_timeout_s)
            timings["apply"] = _since(started)
            report.update(applied.as_report())
            report["apply_logs"] = applied.logs
            if not applied.applied:
                return _unresolved(report, "patch does not apply")
            report["apply_method"] = applied.method
        else:
            report["runtime"] = "agent"  # graded in place: the policy's environment applies, its diff filter cannot
            await prepare_grading_home(runtime, policy)
        await _reset_test_files(runtime, task)

        started = time.monotonic()
        await runtime.write_file(posixpath.join(workdir, EVAL_FILE), spec.eval_script.encode())
        run = await runtime.exec(f"bash {EVAL_FILE}", env=grading_env(policy, workdir), cwd=workdir,
                                 timeout_s=params.timeout_s)
        timings["eval"] = _since(started)
        report["eval_exit_code"] = run.exit_code
        report["log_tail"] = run.output[-params.log_tail_chars :]
        if run.timed_out:
            report["reason"] = f"eval script exceeded {params.timeout_s} s"
            return EvalResult(status=Status.TIMEOUT, report=report)

        started = time.monotonic()
        log = run.output
        if START_TEST_OUTPUT not in spec.eval_script:
            # Eval scripts built by the SWE-Gym fork print no markers; like that fork, grade the
            # whole log rather than call every run invalid.
            log = f"+ : '{START_TEST_OUTPUT}'\n{log}\n+ : '{END_TEST_OUTPUT}'\n"
            report["markers_added"] = True
        graded = await asyncio.to_thread(_grade, spec, task.instance_id, patch, log)
        timings["grade"] = _since(started)
        report["swebench"] = graded
        report["resolved"] = bool(graded.get("resolved"))
        report["reason"] = _reason(graded)
        return EvalResult(reward=1.0 if report["resolved"] else 0.0, report=report)


def _test_spec(task: SweTask, params: SweBenchParams) -> Any:
    make_test_spec, _ = _swebench()
    script = task.eval_script
    if script is None:
        if params.test_command is None:
            raise ConfigError(
                f"task {task.instance_id} has no eval_script: precompute one (SWE-Gym rows: with the "
                "SWE-Gym fork of the swebench harness) or give the evaluator a test_command"
            )
        if not task.base_commit:
            raise ConfigError(f"task {task.instance_id} has no base_commit")
        script = build_eval_script(
            base_commit=task.base_commit, test_patch=task.test_patch, test_command=params.test_command
        )
    return make_test_spec(task.to_swebench_instance(script))


async def _reset_test_files(runtime: Runtime, task: SweTask) -> None:
    """Test-patch files back to base_commit: edited ones checked out, added ones removed (the eval
    script resets only files that exist at base_commit)."""
    files = task.test_files()
    added = [p for p, kind in files.items() if kind == "added"]
    existing = [p for p, kind in files.items() if kind != "added"]
    steps = []
    if added:
        steps.append("rm -rf -- " + " ".join(shlex.quote(p) for p in added))
    if existing:
        steps.append(f"git checkout {shlex.quote(task.base_commit)} -- " + " ".join(shlex.quote(p) for p in existing))
    if not steps:
        return
    res = await runtime.exec(" && ".join(steps), env=GIT_ENV, cwd=runtime.spec.workdir, timeout_s=120.0)
    if res.exit_code != 0 or res.timed_out:
        raise RuntimeError(f"cannot reset the test files to {task.base_commit}: {res.output[-2000:]}")


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


def _unresolved(report: dict[str, Any], reason: str) -> EvalResult:
    return EvalResult(reward=0.0, report={**report, "resolved": False, "reason": reason})


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
