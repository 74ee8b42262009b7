"""Evaluations that grade in a fresh runtime run in the node's evaluation worker process, pre-warm
included; evaluators the worker cannot find, or that ask for the agent's runtime, run in the node.
The agent runtime is the FakeRuntime double (its workspace is empty); the fresh runtime is a
real bwrap sandbox created in the worker."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from polar_env.evaluators import EVALUATORS, EvalContext, EvalResult, register_evaluator
from polar_env.evaluators.base import EvaluatorSpec
from polar_env.records import Status
from polar_env.runtimes.base import RuntimeSpec
from polar_env.staging.eval_worker import EvalJob, EvalWorkers
from polar_env.staging.models import AgentSpec, SessionStatus, TaskRequest
from polar_env.staging.server import LocalNode, RolloutServer
from tests.staging.conftest import FakeRuntimeNode
from tests.waits import until

pytestmark = pytest.mark.slow  # grading worker processes


@register_evaluator("test_where", replace=True)
class Where:
    """Reports the process it ran in and what it was handed."""

    name = "test_where"

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
        return True

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        prewarmed = ctx._fresh is not None  # prewarm() started it while the agent ran
        fresh = await ctx.fresh_runtime()
        if ctx.params.get("agent"):
            await ctx.agent_runtime().exec("true")
        res = await fresh.exec("echo graded")
        changes = None if ctx.changes is None else {"source": ctx.changes.source, "paths": ctx.changes.paths()}
        return EvalResult(reward=1.0, report={"pid": os.getpid(), "changes": changes, "answer": ctx.final_answer,
                                              "exit_code": ctx.exit_code, "fresh_output": res.output.strip(), "prewarmed": prewarmed})


class MainOnly(Where):
    name = "test_main_only"


MainOnly.__module__ = "__main__"  # as if registered in a script: a worker cannot import it
register_evaluator("test_main_only", replace=True)(MainOnly)


async def _run(node_config: Any, evaluator: EvaluatorSpec) -> Any:
    node = FakeRuntimeNode(node_config())
    await node.start()
    server = RolloutServer([LocalNode(node)])
    task = TaskRequest(task_id="echo", instruction="run echo hi and tell me what it printed", num_samples=1,
                       agent=AgentSpec(harness="loop"), evaluator=evaluator)
    try:
        status = await server.run(task)
    finally:
        await server.aclose()
    (result,) = status.results
    assert result.status is SessionStatus.COMPLETED, result.failure_detail
    return result


async def test_fresh_runtime_evaluation_runs_in_the_worker(node_config) -> None:  # type: ignore[no-untyped-def]
    r = await _run(node_config, EvaluatorSpec(name="test_where"))
    ev = r.evaluation
    assert ev["evaluated_in"] == "worker" and ev["pid"] != os.getpid()
    assert ev["prewarmed"] is True and ev["fresh_output"] == "graded" and ev["exit_code"] == 0 and ev["answer"]
    # the agent's change set, taken by the grader in the node before its runtime stopped (the double's is empty)
    assert ev["changes"] == {"source": "snapshot", "paths": []}
    assert r.reward == 1.0


async def test_an_evaluator_the_worker_cannot_import_runs_in_the_node(node_config) -> None:  # type: ignore[no-untyped-def]
    r = await _run(node_config, EvaluatorSpec(name="test_main_only"))
    assert r.evaluation["evaluated_in"] == "node" and r.evaluation["pid"] == os.getpid()
    assert r.reward == 1.0


async def test_an_evaluator_asking_for_the_agent_runtime_is_rerun_in_the_node(node_config) -> None:  # type: ignore[no-untyped-def]
    r = await _run(node_config, EvaluatorSpec(name="test_where", params={"agent": True}))
    assert r.evaluation["evaluated_in"] == "node" and r.evaluation["pid"] == os.getpid()
    assert r.reward == 1.0


async def test_cheap_evaluators_stay_in_the_node(node_config) -> None:  # type: ignore[no-untyped-def]
    r = await _run(node_config, EvaluatorSpec(name="output", regex="printed"))
    assert r.evaluation["evaluated_in"] == "node" and r.evaluation["passed"] is True


def test_registered_names_are_known() -> None:
    assert {"test_where", "test_main_only"} <= set(EVALUATORS)


@register_evaluator("test_sleep", replace=True)
class Sleep(Where):
    name = "test_sleep"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        await asyncio.sleep(float(ctx.params.get("sleep_s", 30)))
        return EvalResult(reward=1.0)


def _job(name: str, **params: Any) -> EvalJob:
    return EvalJob(evaluator=name, module=__name__, task={}, params=params,
                   fresh=RuntimeSpec(network="none"), timeout_s=60)


async def test_a_worker_that_dies_mid_evaluation_gives_an_error_verdict() -> None:
    workers = EvalWorkers(1)
    try:
        verdict = asyncio.ensure_future(workers.evaluate("s1", _job("test_sleep"), timeout_s=60))
        await until(lambda: workers._workers and "s1" in workers._workers[0].pending, "the worker to take s1")
        await asyncio.sleep(0.5)
        workers._workers[0].process.kill()
        result = await asyncio.wait_for(verdict, 30)
        assert result is not None and result.status is Status.ERROR and "worker process exited" in result.report["error"]
        # the next session gets a new worker
        again = await workers.evaluate("s4", _job("test_sleep", sleep_s=0), timeout_s=60)
        assert again is not None and again.reward == 1.0
    finally:
        await asyncio.to_thread(workers.close)


async def test_a_silent_worker_is_given_up_on_and_the_evaluation_cancelled() -> None:
    workers = EvalWorkers(1)
    try:
        result = await workers.evaluate("s2", _job("test_sleep", sleep_s=30), timeout_s=2)
        assert result is not None and result.status is Status.ERROR and "no verdict in 2 s" in result.report["error"]
        # the worker still answers the next session (the cancelled one no longer holds it)
        fast = await workers.evaluate("s3", _job("test_sleep", sleep_s=0), timeout_s=60)
        assert fast is not None and fast.reward == 1.0
    finally:
        await asyncio.to_thread(workers.close)
