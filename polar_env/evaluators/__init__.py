"""EVALUATORS: name → evaluator and its params model, a ``Registry``. Add one more with one module and
one ``EVALUATORS.register`` line here, or from outside the package with ``@register_evaluator("name")``
(the same function; ``params=MyParams`` checks a task's params when its TaskRequest is built);
``get_evaluator`` also takes an import path (``"pkg.module:attr"``). Every evaluator that runs the
agent's code grades under the grading contract in ``integrity.py`` (re-exported here for custom
evaluators: ``fresh_graded_runtime`` is the one-call helper). ``run_evaluator`` is the one
wrapper every evaluation goes through: a crash
becomes an ERROR result with the exception in its report, an overrun a TIMEOUT, and the agent's
breakage stays the agent's (reward 0, not an ERROR that would mask the sample).
"""

from __future__ import annotations

import asyncio
import logging
import time

from polar_env.evaluators.base import (
    EVALUATORS,
    EvalContext,
    EvalResult,
    Evaluator,
    EvaluatorSpec,
    FreshRuntimeEvaluator,
    FunctionEvaluator,
    PrewarmingEvaluator,
    error_report,
    needs_module,
)
from polar_env.evaluators.completion import SessionCompletion
from polar_env.evaluators.grading import NothingToGrade, fresh_graded_runtime, graded_runtime
from polar_env.evaluators.harbor import HarborEvaluator
from polar_env.evaluators.integrity import (
    POLICIES,
    Graded,
    IntegrityParams,
    IntegrityPolicy,
    admit,
    grading_env,
    register_policy,
    resolve_policy,
)
from polar_env.evaluators.output import OutputEvaluator
from polar_env.evaluators.report import BeforeLimit, EvalReport
from polar_env.evaluators.swebench import SweBenchEvaluator
from polar_env.evaluators.workspace import Changes, WorkspaceBroken
from polar_env.records import Status
from polar_env.runtimes.base import Runtime
from polar_env.runtimes.limits import LimitExceeded
from polar_env.safetext import json_safe

__all__ = [
    "EVALUATORS",
    "POLICIES",
    "Changes",
    "EvalContext",
    "EvalResult",
    "Evaluator",
    "EvaluatorSpec",
    "FreshRuntimeEvaluator",
    "FunctionEvaluator",
    "Graded",
    "IntegrityParams",
    "IntegrityPolicy",
    "NothingToGrade",
    "PrewarmingEvaluator",
    "WorkspaceBroken",
    "admit",
    "fresh_graded_runtime",
    "get_evaluator",
    "graded_runtime",
    "grading_env",
    "prewarm",
    "register_evaluator",
    "register_policy",
    "resolve_policy",
    "run_evaluator",
    "wants_fresh_runtime",
]

_log = logging.getLogger(__name__)

_PREFLIGHT = {"swebench": needs_module("swebench", extra="swebench")}  # the others need the core install only
for _evaluator in (SessionCompletion(), OutputEvaluator(), SweBenchEvaluator(), HarborEvaluator()):
    EVALUATORS.register(_evaluator.name, _evaluator, preflight=_PREFLIGHT.get(_evaluator.name))

register_evaluator = EVALUATORS.register  # the decorator: @register_evaluator("name", params=MyParams)


def get_evaluator(ref: str | Evaluator) -> Evaluator:
    """An evaluator by table name or by import path (``pkg.module:attr`` or ``pkg.module.attr``)."""
    return EVALUATORS.get(ref) if isinstance(ref, str) else ref


def wants_fresh_runtime(evaluator: str | Evaluator, ctx: EvalContext) -> bool:
    """Whether the evaluator grades in a fresh runtime for this context (so needs the agent's change
    set and the pristine base). False for a bad spec too: its evaluation reports it."""
    try:
        ev = get_evaluator(evaluator)
        return isinstance(ev, FreshRuntimeEvaluator) and bool(ev.wants_fresh_runtime(ctx))
    except Exception:  # noqa: BLE001 - evaluate() reports the bad spec
        return False


async def prewarm(evaluator: str | Evaluator, ctx: EvalContext) -> Runtime | None:
    """Prepare the evaluator's fresh runtime ahead of time (while the agent runs); the later
    ``evaluate`` uses it. Returns None when the evaluator needs none. Never raises: a failed
    preparation is remembered and surfaces as the evaluation's ERROR, so this can run as a
    fire-and-forget task."""
    if not wants_fresh_runtime(evaluator, ctx):
        return None
    try:
        ev = get_evaluator(evaluator)
        if isinstance(ev, PrewarmingEvaluator):
            await ev.prewarm(ctx)
        return await ctx.fresh_runtime()
    except Exception as exc:  # noqa: BLE001 - remembered in ctx; evaluate() reports it
        _log.warning("pre-warming evaluator %r failed: %s", evaluator, exc)
        return None


async def run_evaluator(evaluator: str | Evaluator, ctx: EvalContext, *, timeout_s: float | None = None) -> EvalResult:
    """Run one evaluation to a verdict. Returns, never raises (except on cancellation): a crash is
    ERROR with the exception and traceback in ``report``, an overrun of ``timeout_s`` is TIMEOUT.
    The agent's breakage is the agent's, reward 0 and never a (masked) ERROR: an escaped
    ``NothingToGrade``, ``WorkspaceBroken`` or ``LimitExceeded``, and any verdict of a fresh runtime
    that hit one of its limits (it started pristine: what ran in it was the agent's change), whose
    report then names the ``limit`` (the session ends ``limit_exceeded``). The report is made safe
    for every JSON writer (``json_safe``: a file name that is not UTF-8 is escaped, not fatal). The
    fresh runtime, if any, is stopped before returning."""
    started = time.monotonic()
    name = evaluator if isinstance(evaluator, str) else getattr(evaluator, "name", repr(evaluator))
    deadline = asyncio.timeout(timeout_s)
    try:
        ev = get_evaluator(evaluator)
        async with deadline:
            result = await ev.evaluate(ctx)
        if not isinstance(result, EvalResult):
            raise TypeError(f"evaluator {name!r} returned {type(result).__name__}, not EvalResult")
    except TimeoutError as exc:
        if deadline.expired():
            result = EvalResult(status=Status.TIMEOUT, report={"reason": f"evaluation exceeded {timeout_s} s"})
        else:
            result = EvalResult(status=Status.ERROR, report=error_report(exc))
    except (NothingToGrade, WorkspaceBroken, LimitExceeded) as exc:
        result = _agents_breakage(exc)
    except Exception as exc:  # noqa: BLE001 - the task boundary: a crash becomes an ERROR result
        _log.warning("evaluator %r crashed: %s: %s", name, type(exc).__name__, exc)
        result = EvalResult(status=Status.ERROR, report=error_report(exc))
    except asyncio.CancelledError:
        await ctx.aclose()  # a cancelled rollout must not leave its grading runtime behind
        raise
    hit = ctx.fresh_limit_hit()
    if hit is not None:
        before: BeforeLimit = {"status": result.status.value, "reward": result.reward, "reason": result.report.get("reason")}
        result = EvalResult(reward=0.0, report={**result.report, "limit": hit.split("=", 1)[0], "verdict_before_limit": before,
                                                "reason": f"the grading runtime went over a limit: {hit}"})
    extra: EvalReport = {"evaluator": name}
    try:
        await ctx.aclose()
    except Exception as exc:  # noqa: BLE001 - the verdict stands; the failed stop is reported
        extra["cleanup_error"] = f"{type(exc).__name__}: {exc}"
    extra["evaluate_s"] = round(time.monotonic() - started, 3)
    return result.model_copy(update={"report": json_safe({**result.report, **extra})})


def _agents_breakage(exc: NothingToGrade | WorkspaceBroken | LimitExceeded) -> EvalResult:
    """Reward 0 for what the agent's change did to the grader (a custom evaluator let it escape)."""
    if isinstance(exc, NothingToGrade):
        return EvalResult(reward=0.0, report=exc.report)
    report: EvalReport = {"resolved": False, "reason": str(exc)}
    if isinstance(exc, LimitExceeded):
        report["limit"] = exc.limit
    return EvalResult(reward=0.0, report=report)
