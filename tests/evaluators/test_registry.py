"""The evaluator table, the ``run_evaluator`` wrapper, fresh-runtime pre-warming, and EvalResult rules."""

from __future__ import annotations

import asyncio
import sys

import pytest
from pydantic import ValidationError

from polar_env.errors import ConfigError
from polar_env.evaluators import (
    EVALUATORS,
    EvalContext,
    EvalResult,
    EvaluatorSpec,
    get_evaluator,
    prewarm,
    register_evaluator,
    run_evaluator,
)
from polar_env.evaluators.completion import SessionCompletion
from polar_env.records import Status


@pytest.fixture
def scratch_names():  # type: ignore[no-untyped-def]
    """Names registered by a test are removed afterwards, so tests do not leak into the table."""
    before = EVALUATORS.snapshot()
    yield
    EVALUATORS.restore(before)


def test_builtins_are_registered() -> None:
    assert {"session_completion", "output", "swebench"} <= set(EVALUATORS)
    assert all(EVALUATORS[name].name == name for name in ("session_completion", "output", "swebench"))


async def test_register_a_class(scratch_names) -> None:  # type: ignore[no-untyped-def]
    @register_evaluator("answer_length")
    class AnswerLength:
        async def evaluate(self, ctx: EvalContext) -> EvalResult:
            return EvalResult(reward=len(ctx.final_answer or "") / 10, report={"chars": len(ctx.final_answer or "")})

    assert isinstance(AnswerLength, type)  # the decorator hands the class back unchanged
    assert get_evaluator("answer_length").name == "answer_length"
    result = await run_evaluator("answer_length", EvalContext(task={}, final_answer="hello"))
    assert (result.status, result.reward) == (Status.COMPLETED, 0.5)
    assert result.report["chars"] == 5 and result.report["evaluator"] == "answer_length"
    assert result.report["evaluate_s"] >= 0


async def test_register_a_function(scratch_names) -> None:  # type: ignore[no-untyped-def]
    @register_evaluator("always_half")
    async def always_half(ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=0.5)

    result = await run_evaluator("always_half", EvalContext(task={}))
    assert result.reward == 0.5
    assert await always_half(EvalContext(task={})) == EvalResult(reward=0.5)


def test_duplicate_names_need_replace(scratch_names) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="already registered"):
        register_evaluator("output")(SessionCompletion)
    register_evaluator("output", replace=True)(SessionCompletion)
    assert isinstance(EVALUATORS["output"], SessionCompletion)


def test_lookup_by_import_path() -> None:
    assert isinstance(get_evaluator("polar_env.evaluators.completion:SessionCompletion"), SessionCompletion)
    assert isinstance(get_evaluator("polar_env.evaluators.completion.SessionCompletion"), SessionCompletion)
    with pytest.raises(ConfigError, match="unknown evaluator"):
        get_evaluator("no_such_evaluator")
    with pytest.raises(ConfigError, match="cannot import"):
        get_evaluator("polar_env.evaluators.completion:Nope")
    with pytest.raises(ConfigError, match="not an evaluator"):
        get_evaluator("polar_env.evaluators.completion:EvalResult")


async def test_a_crash_is_an_error_with_the_exception(scratch_names) -> None:  # type: ignore[no-untyped-def]
    @register_evaluator("crashes")
    async def crashes(ctx: EvalContext) -> EvalResult:
        raise ValueError("boom: the grader fell over")

    result = await run_evaluator("crashes", EvalContext(task={}))
    assert (result.status, result.reward) == (Status.ERROR, 0.0)
    assert result.report["error"] == "ValueError: boom: the grader fell over"
    assert result.report["exception_type"] == "builtins.ValueError"
    assert "in crashes" in result.report["traceback"]


async def test_wrong_return_type_and_unknown_name_are_errors(scratch_names) -> None:  # type: ignore[no-untyped-def]
    @register_evaluator("returns_float")
    async def returns_float(ctx: EvalContext) -> float:
        return 1.0

    result = await run_evaluator("returns_float", EvalContext(task={}))
    assert result.status is Status.ERROR and "not EvalResult" in result.report["error"]
    result = await run_evaluator("no_such_evaluator", EvalContext(task={}))
    assert result.status is Status.ERROR and "unknown evaluator" in result.report["error"]


async def test_overrunning_its_budget_is_a_timeout(scratch_names) -> None:  # type: ignore[no-untyped-def]
    @register_evaluator("slow")
    async def slow(ctx: EvalContext) -> EvalResult:
        await asyncio.sleep(10)
        return EvalResult(reward=1.0)

    result = await run_evaluator("slow", EvalContext(task={}), timeout_s=0.05)
    assert (result.status, result.reward) == (Status.TIMEOUT, 0.0)
    assert "exceeded" in result.report["reason"]


async def test_a_timeout_error_raised_inside_is_an_error_not_a_timeout(scratch_names) -> None:  # type: ignore[no-untyped-def]
    @register_evaluator("raises_timeout")
    async def raises_timeout(ctx: EvalContext) -> EvalResult:
        raise TimeoutError("upstream grader timed out")

    result = await run_evaluator("raises_timeout", EvalContext(task={}), timeout_s=30)
    assert result.status is Status.ERROR and "upstream grader" in result.report["error"]


def test_eval_result_rules() -> None:
    with pytest.raises(ValidationError, match="carries reward 0"):
        EvalResult(reward=1.0, status=Status.ERROR)
    with pytest.raises(ValidationError, match="COMPLETED, TIMEOUT or ERROR"):
        EvalResult(status=Status.TRUNCATED)
    with pytest.raises(ValidationError, match="finite"):
        EvalResult(reward=float("nan"))
    assert EvalResult.model_validate_json(EvalResult(reward=1.0, report={"a": 1}).model_dump_json()).report == {"a": 1}


def test_evaluator_spec_gathers_flat_params() -> None:
    spec = EvaluatorSpec.model_validate({"name": "output", "regex": "4[0-9]", "timeout_s": 5})
    assert (spec.name, spec.params, spec.timeout_s) == ("output", {"regex": "4[0-9]"}, 5)
    nested = EvaluatorSpec.model_validate({"name": "output", "params": {"regex": "x"}})
    assert nested.params == {"regex": "x"}
    assert EvaluatorSpec.model_validate("swebench").name == "swebench"


# --- fresh runtimes -------------------------------------------------------------------------------


@pytest.fixture
def fresh_kind(scratch_names, local_runtimes):  # type: ignore[no-untyped-def]
    """Registers ``uses_fresh``: writes a file in the fresh runtime, then reads it back."""

    class UsesFresh:
        name = "uses_fresh"
        crash = False

        def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
            return True

        async def evaluate(self, ctx: EvalContext) -> EvalResult:
            rt = await ctx.fresh_runtime()
            await rt.write_file("/testbed/marker.txt", b"hi")
            if self.crash:
                raise RuntimeError("crashed after preparing")
            return EvalResult(reward=1.0 if await rt.read_file("/testbed/marker.txt") == b"hi" else 0.0)

    register_evaluator("uses_fresh")(UsesFresh)
    made = []

    def factory():  # type: ignore[no-untyped-def]
        rt = local_runtimes()
        made.append(rt)
        return rt

    return EVALUATORS["uses_fresh"], factory, made


async def test_fresh_runtime_is_stopped_after_evaluation(fresh_kind) -> None:  # type: ignore[no-untyped-def]
    _, factory, made = fresh_kind
    result = await run_evaluator("uses_fresh", EvalContext(task={}, runtime_factory=factory))
    assert result.reward == 1.0
    assert len(made) == 1 and made[0].prepared and made[0].stopped


async def test_fresh_runtime_is_stopped_after_a_crash(fresh_kind) -> None:  # type: ignore[no-untyped-def]
    ev, factory, made = fresh_kind
    ev.crash = True
    result = await run_evaluator("uses_fresh", EvalContext(task={}, runtime_factory=factory))
    assert result.status is Status.ERROR and "crashed after preparing" in result.report["error"]
    assert made[0].stopped


async def test_prewarm_then_evaluate_uses_one_runtime(fresh_kind) -> None:  # type: ignore[no-untyped-def]
    _, factory, made = fresh_kind
    ctx = EvalContext(task={}, runtime_factory=factory)
    warm = asyncio.create_task(prewarm("uses_fresh", ctx))  # as a lifecycle would, while the agent runs
    result = await run_evaluator("uses_fresh", ctx)
    assert (await warm) is made[0]
    assert result.reward == 1.0 and len(made) == 1 and made[0].stopped


async def test_prewarm_of_an_evaluator_without_fresh_runtime_is_none() -> None:
    assert await prewarm("session_completion", EvalContext(task={})) is None


async def test_failed_prewarm_surfaces_as_the_evaluation_error(fresh_kind) -> None:  # type: ignore[no-untyped-def]

    class BrokenRuntime:
        stopped = False

        async def prepare(self) -> None:
            raise OSError("image not found: polar-test/none")

        async def stop(self) -> None:
            BrokenRuntime.stopped = True

    ctx = EvalContext(task={}, runtime_factory=BrokenRuntime)
    assert await prewarm("uses_fresh", ctx) is None  # never raises: it may run fire-and-forget
    assert BrokenRuntime.stopped
    result = await run_evaluator("uses_fresh", ctx)
    assert result.status is Status.ERROR and "image not found" in result.report["error"]


async def test_no_factory_is_an_error(fresh_kind) -> None:  # type: ignore[no-untyped-def]
    result = await run_evaluator("uses_fresh", EvalContext(task={}))
    assert result.status is Status.ERROR and "no runtime_factory" in result.report["error"]


async def test_cancelled_evaluation_stops_its_fresh_runtime(scratch_names, local_runtimes) -> None:  # type: ignore[no-untyped-def]
    started = asyncio.Event()

    @register_evaluator("hangs_in_fresh")
    async def hangs_in_fresh(ctx: EvalContext) -> EvalResult:
        await ctx.fresh_runtime()
        started.set()
        await asyncio.sleep(60)
        return EvalResult()

    made = []

    def factory():  # type: ignore[no-untyped-def]
        made.append(local_runtimes())
        return made[-1]

    task = asyncio.create_task(run_evaluator("hangs_in_fresh", EvalContext(task={}, runtime_factory=factory)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made[0].stopped


async def test_swebench_without_the_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from polar_env.evaluators import swebench as swebench_evaluator

    swebench_evaluator._swebench.cache_clear()
    monkeypatch.setitem(sys.modules, "swebench.harness.grading", None)  # import → ImportError
    monkeypatch.setitem(sys.modules, "swebench.harness.utils", None)
    try:
        ctx = EvalContext(task={"instance_id": "x__y-1", "eval_script": "true"}, patch="")
        result = await run_evaluator("swebench", ctx)
    finally:
        swebench_evaluator._swebench.cache_clear()
    assert result.status is Status.ERROR
    assert "pip install 'polar-env[swebench]'" in result.report["error"]
