"""``harbor``: grade a Harbor task the way Harbor's verifier does, under polar's grading rules.

Harbor's verifier copies the task's ``tests/`` to ``/tests`` in the agent's container, runs
``tests/test.sh`` and reads ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (numbers;
``reward`` is the one polar trains on). polar grades in a fresh runtime instead: the agent's
container is the adversary's, so nothing it left there (a planted ``/tests``, a pre-written
reward file, a patched interpreter) may reach the grader. What does reach it is the agent's change
of the workdir as the grader took it, admitted by the grading contract's allow-list
(``integrity.py``; the rest is reported in ``dropped_paths``) and written into a clean copy of the
task's workspace; the verifier runs under the policy's hermetic interpreter environment. ``tests/`` always comes
from the task folder on the host; the reward file is removed before the verifier runs, so only the
verifier can write it.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvalContext, EvalResult
from polar_env.evaluators.grading import (
    broken_result,
    check_env,
    failing_tests,
    graded_runtime,
    pytest_gate,
    pytest_verdict,
)
from polar_env.evaluators.integrity import WORKSPACE_POLICY, IntegrityParams, resolve_policy
from polar_env.evaluators.report import EvalReport
from polar_env.records import Status
from polar_env.runtimes.base import Runtime

TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
STAGE_TESTS = "/tmp/polar_harbor/tests"
STAGE_OUT = "/tmp/polar_harbor/verifier"
STAGING_FAILED = 97
VERIFY_SCRIPT = (
    f"rm -rf {TESTS_DIR} {VERIFIER_DIR} {STAGE_OUT}; mkdir -p {TESTS_DIR} {VERIFIER_DIR} {STAGE_OUT} "
    f"&& cp -a {STAGE_TESTS}/. {TESTS_DIR}/ || exit {STAGING_FAILED}; "
    f"bash {TESTS_DIR}/test.sh; code=$?; cp -a {VERIFIER_DIR}/. {STAGE_OUT}/ 2>/dev/null; exit $code"
)


class HarborParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = 600.0  # task.toml [verifier] timeout_sec
    env: dict[str, str] = Field(default_factory=dict)  # task.toml [verifier] env
    apply_timeout_s: float = 120.0
    log_tail_chars: int = 20_000
    integrity: IntegrityParams = IntegrityParams()  # default policy: allowlist-workspace (the workspace is the deliverable)


def _task_dir(task: Any) -> Path:
    raw = task.get("harbor_task_dir") if isinstance(task, dict) else None
    if not raw:
        raise ConfigError("the harbor evaluator needs task['harbor_task_dir'] (load the task with polar_env.tasks.harbor)")
    path = Path(raw)
    if not (path / "tests" / "test.sh").is_file():
        raise ConfigError(f"{path}: no tests/test.sh")
    return path


def parse_reward(text_file: bytes | None, json_file: bytes | None) -> tuple[float, dict[str, float]]:
    """Harbor's reward files: ``reward.txt`` holds one number; ``reward.json`` an object of
    numbers (``reward`` is used, else the only value) or one number. Raises ValueError."""
    if text_file is not None and text_file.strip():
        value = float(text_file.decode("utf-8", "replace").strip())
        rewards: dict[str, float] = {"reward": value}
    elif json_file is not None and json_file.strip():
        data = json.loads(json_file)
        rewards = data if isinstance(data, dict) else {"reward": data}
        for v in rewards.values():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"non-numeric reward {v!r} in reward.json")
        if "reward" in rewards:
            value = float(rewards["reward"])
        elif len(rewards) == 1:
            value = float(next(iter(rewards.values())))
        else:
            raise ValueError(f"reward.json has several rewards and no 'reward' key: {sorted(rewards)}")
    else:
        raise ValueError("the verifier wrote no reward file (reward.txt or reward.json)")
    if not math.isfinite(value):
        raise ValueError(f"non-finite reward {value!r}")
    return value, rewards


async def _read(runtime: Runtime, path: str) -> bytes | None:
    try:
        return await runtime.read_file(path)
    except (OSError, ConfigError, FileNotFoundError):
        return None


class HarborEvaluator:
    name = "harbor"
    params_model = HarborParams  # checked when a TaskRequest is built

    def params_of(self, ctx: EvalContext) -> HarborParams:
        try:
            return HarborParams.model_validate(ctx.params)
        except ValidationError as exc:
            raise ConfigError(f"bad harbor evaluator spec {ctx.params!r}: {exc}") from exc

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
        return True

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        params = self.params_of(ctx)
        task_dir = _task_dir(ctx.task)
        report: EvalReport = {"task_dir": str(task_dir)}
        started = time.monotonic()
        policy = resolve_policy(params.integrity, default=WORKSPACE_POLICY)
        runtime, graded = await graded_runtime(ctx, policy, timeout_s=params.apply_timeout_s)
        workdir = runtime.spec.workdir
        report.update(graded.as_report())
        broken = broken_result(graded, report)
        if broken is not None:
            return broken
        # The task's tests, from the host folder, staged where every runtime lets the host write
        # (/tmp); one shell puts them at /tests, gives the verifier a clean /logs/verifier, runs
        # it and copies what it wrote back out (a sandbox's / lives only as long as one exec).
        tests = task_dir / "tests"
        for f in sorted(p for p in tests.rglob("*") if p.is_file()):
            await runtime.write_file(posixpath.join(STAGE_TESTS, f.relative_to(tests).as_posix()), f.read_bytes())
        env, reporter = await check_env(runtime, policy)
        run = await runtime.exec(VERIFY_SCRIPT, env={**env, **params.env}, cwd=workdir,
                                timeout_s=params.timeout_s)
        report.update({"verifier_exit_code": run.exit_code, "log_tail": run.output[-params.log_tail_chars:],
                       "verify_s": round(time.monotonic() - started, 3)})
        if run.timed_out:
            report["reason"] = f"verifier exceeded {params.timeout_s} s"
            return EvalResult(status=Status.TIMEOUT, report=report)
        if run.exit_code == STAGING_FAILED:
            report["reason"] = "could not stage /tests and /logs/verifier in the grading runtime"
            return EvalResult(status=Status.ERROR, report=report)
        found = await pytest_verdict(runtime, reporter, run.output)
        forced = pytest_gate(found, report)
        if forced is not None:
            return forced
        text = await _read(runtime, f"{STAGE_OUT}/reward.txt")
        data = await _read(runtime, f"{STAGE_OUT}/reward.json")
        try:
            reward, rewards = parse_reward(text, data)
        except ValueError as exc:
            report["reason"] = str(exc)
            return EvalResult(status=Status.ERROR, report=report)
        report["rewards"] = rewards
        failing = failing_tests(found)
        if reward > 0 and failing:
            report["reason"] = f"the verifier gave {reward:g}, but the authenticated report has failing tests: {failing[:5]}"
            return EvalResult(reward=0.0, report=report)
        return EvalResult(reward=reward, report=report)
