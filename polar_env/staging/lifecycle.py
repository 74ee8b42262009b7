"""One session's way through a gateway node: QUEUED → INIT → READY → RUNNING → POSTRUN → DONE.

INIT registers the gateway session (its metadata journaled with it), installs the harness if the
cache lacks it and prepares the runtime, under ``init_timeout_s``. RUNNING runs the harness under
the agent budget ``timeout_s`` — its own time: seconds its calls spent in the engine extend the
deadline (``_within_budget``) — while the evaluator's fresh runtime is pre-warmed. POSTRUN always
runs — after success, timeout, crash or cancellation — so whatever was captured becomes a
trajectory with an explicit status: it builds with the session's builder (in a worker process),
evaluates (only a session whose agent finished; one that grades in a fresh runtime in an
evaluation worker process, ``eval_worker.py``, which also pre-warms that runtime), attaches
reward and provenance, and stops every runtime.
Failures are data here: ``SessionRunner.run`` returns a ``SessionResult`` and never raises, except when
the node itself is shutting down. Every exit path names its ``FailureKind`` (``Run.fail``), and the
result always carries a trajectory, empty when nothing was captured, so groups stay whole.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from polar_env.errors import ConfigError, PolarError
from polar_env.evaluators import (
    EVALUATORS,
    EvalContext,
    EvalResult,
    EvaluatorSpec,
    prewarm,
    run_evaluator,
    wants_fresh_runtime,
)
from polar_env.evaluators.report import EvalReport
from polar_env.evaluators.workspace import agent_changes, base_manifest
from polar_env.harnesses import loop
from polar_env.harnesses.spec import HarnessSpec
from polar_env.journal.protocols import Journal, JournalSource
from polar_env.proxy.sessions import Session
from polar_env.records import FailureKind, Status, Trajectory
from polar_env.runtimes import Runtime, RuntimeSpec, make_runtime
from polar_env.runtimes.base import limit_hit_of, limits_report_of
from polar_env.runtimes.limits import LimitExceeded
from polar_env.staging.eval_worker import NEEDS_AGENT_RUNTIME, EvalJob, EvalWorkers, offloadable
from polar_env.staging.models import SessionResult, SessionSpec, SessionStatus, Stage
from polar_env.staging.pools import StagePools
from polar_env.staging.postrun_pool import PostrunPool
from polar_env.trajectory.outcome import with_outcome

_log = logging.getLogger(__name__)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EVAL_TIMEOUT_S = 600.0  # the whole evaluation, for an evaluator that states no timeout of its own
EVAL_MARGIN_S = 300.0  # beyond an evaluator's own script timeout: its fresh runtime, the change set, grading
WORKER_GRACE_S = 120.0  # beyond the evaluation's own timeout, before a silent worker is given up on
ENGINE_WAIT_FACTOR = 3.0  # engine time may stretch RUNNING's wall clock to timeout_s × (1 + this), no further
BUDGET_POLL_S = (0.02, 1.0)  # the budget's re-check while a call is in the engine (the deadline moves with
# it): budget/20 within these bounds, so 256 sessions of 600 s poll once a second each, not 50 times
OUTPUT_TAIL = 300  # characters of a harness's output kept in a failure's detail


@dataclass(slots=True)
class Run:
    """Mutable state of one session while it runs; turned into a SessionResult at the end."""

    spec: SessionSpec
    stage: Stage | None = None
    stage_times: dict[str, float] = field(default_factory=dict)
    status: SessionStatus = SessionStatus.COMPLETED
    failure_kind: FailureKind | None = None
    failure_detail: str | None = None
    runtime: Runtime | None = None
    eval_ctx: EvalContext | None = None
    prewarm_task: asyncio.Task[Any] | None = None
    offload: EvalJob | None = None  # the evaluation runs in an evaluation worker process
    exit_code: int | None = None
    output_tail: str = ""  # the harness's last output, for a failure's detail
    final_answer: str | None = None
    engine_s: float = 0.0  # RUNNING's seconds with one of the session's calls in the engine (not charged)
    running_at: float = 0.0  # time.monotonic() when the harness started

    def fail(self, status: SessionStatus, kind: FailureKind, detail: str) -> None:
        """End the run as ``status`` for ``kind``; a later failure replaces an earlier one (a limit
        hit explains the harness's exit, a build error a completed run)."""
        self.status, self.failure_kind, self.failure_detail = status, kind, detail


def session_metadata(spec: SessionSpec, node_id: str) -> dict[str, Any]:
    """Provenance journaled with the gateway session and copied onto its trajectory."""
    req = spec.request
    return {**req.metadata, "task_id": req.task_id, "group_id": spec.group_id, "sample_index": spec.sample_index,
            "harness": req.agent.harness, "api": req.agent.api.value if req.agent.api else None,
            "runtime": req.runtime.kind, "builder": req.builder,
            "evaluator": req.evaluator.name if req.evaluator else None, "node_id": node_id}


def evaluation_runtime_spec(runtime: RuntimeSpec) -> RuntimeSpec:
    """A fresh runtime for grading: the task's repo with no network. The task's environment runs
    the tests: a runtime with an image, or whose env sets PATH (a venv's or conda's bin first), keeps
    that PATH as it is. Only a sandbox with neither (polar's own toy tasks) gets this interpreter's
    prefix, bound read-only and first on PATH, so its tests find pytest."""
    # Docker grades as container root: SWE-bench eval scripts re-install the repo into the image's
    # root-owned environment (the agent's own runtime stays on its unprivileged uid).
    update: dict[str, Any] = {"gateway_socket": None, "network": "none", "user": "root"}
    if runtime.kind == "sandbox" and runtime.image is None and "PATH" not in runtime.env:
        prefixes = sorted({sys.base_prefix, sys.prefix})
        known = {dst for _src, dst in runtime.binds}
        update["binds"] = [*runtime.binds, *((Path(p), p) for p in prefixes if p not in known)]
        base_path = runtime.env.get("PATH", DEFAULT_PATH)
        update["env"] = {**runtime.env, "PATH": f"{Path(sys.executable).parent}:{base_path}"}
    return runtime.model_copy(update=update)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def evaluation_timeout_s(evaluator: EvaluatorSpec) -> float:
    """The whole evaluation's limit: the spec's own ``timeout_s``; else the evaluator's script
    timeout (its params, else its params model's default) plus EVAL_MARGIN_S, so a suite swebench
    allows 1800 s is not cut at 600; never below EVAL_TIMEOUT_S unless the spec says so."""
    if evaluator.timeout_s:
        return evaluator.timeout_s
    try:
        checked = EVALUATORS.check_params(evaluator.name, evaluator.params)
    except ConfigError:
        checked = None  # a bad spec: its evaluation reports it, under the default limit
    own = getattr(checked, "timeout_s", None) if checked is not None else evaluator.params.get("timeout_s")
    if isinstance(own, int | float) and not isinstance(own, bool) and own > 0:
        return max(float(own) + EVAL_MARGIN_S, EVAL_TIMEOUT_S)
    return EVAL_TIMEOUT_S


def _eval_context(evaluator: EvaluatorSpec | None, task: dict[str, Any], runtime: RuntimeSpec, run: Run) -> EvalContext | None:
    if evaluator is None:
        return None
    fresh = evaluation_runtime_spec(runtime)
    return EvalContext(task=task, params=dict(evaluator.params), runtime=run.runtime,
                       runtime_factory=lambda: make_runtime(fresh))


def _eval_job(evaluator: EvaluatorSpec, task: dict[str, Any], runtime: RuntimeSpec, ctx: EvalContext) -> EvalJob | None:
    module = offloadable(evaluator.name, ctx)
    if module is False:
        return None
    return EvalJob(evaluator=evaluator.name, module=module if isinstance(module, str) else None, task=task,
                   params=dict(evaluator.params), fresh=evaluation_runtime_spec(runtime),
                   timeout_s=evaluation_timeout_s(evaluator))


class NodeServices(Protocol):
    """What a session's lifecycle uses of its gateway node, and nothing else: who it is and what it
    serves, where sandboxes reach its gateway, its stage and worker pools, its journal store, and
    its session, harness and runtime operations. ``GatewayNode`` implements it; a test can too."""

    @property
    def node_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def socket(self) -> Path | None: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def harness_cache(self) -> Path | None: ...

    @property
    def pools(self) -> StagePools: ...

    @property
    def postrun(self) -> PostrunPool: ...

    @property
    def evaluations(self) -> EvalWorkers: ...

    @property
    def store(self) -> Journal: ...

    @property
    def journal_opener(self) -> Callable[[], JournalSource]: ...

    async def open_session(self, spec: SessionSpec, metadata: dict[str, Any]) -> None: ...

    def close_session(self, session_id: str) -> None: ...

    def session(self, session_id: str) -> Session: ...

    def harness(self, name: str) -> HarnessSpec: ...

    async def prepare_runtime(self, session: SessionSpec) -> Runtime: ...

    def engine_clock(self, session_id: str) -> Callable[[], float]: ...


class SessionRunner:
    """Takes each session of one node through its stages (the module docstring). It owns the
    sessions in flight (``runs``: their state; ``work``: the task to cancel) and reaches the node
    only through ``NodeServices``."""

    def __init__(self, node: NodeServices) -> None:
        self.node = node
        self.runs: dict[str, Run] = {}
        self.work: dict[str, asyncio.Future[None]] = {}

    async def run(self, spec: SessionSpec) -> SessionResult:
        """One session from QUEUED to DONE; never raises except when the node itself is cancelled."""
        run = Run(spec)
        self.runs[spec.session_id] = run
        try:
            work = asyncio.ensure_future(self._until_postrun(run))
            self.work[spec.session_id] = work
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                if not work.done():  # the node itself is being cancelled: stop the work, still clean up
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    await asyncio.shield(self._postrun(run, cancelled=True))
                    raise
            if work.cancelled():
                if self.node.stopping:
                    run.fail(SessionStatus.CANCELLED, FailureKind.INTERRUPTED, "the node stopped before the session finished")
                else:
                    run.fail(SessionStatus.CANCELLED, FailureKind.CANCELLED, "cancelled")
            return await asyncio.shield(self._postrun(run))
        finally:
            self.runs.pop(spec.session_id, None)
            self.work.pop(spec.session_id, None)

    def _enter(self, run: Run, stage: Stage) -> None:
        self.node.pools.occupancy.move(run.stage, stage)
        run.stage = stage
        run.stage_times[stage.value] = time.time()

    async def _until_postrun(self, run: Run) -> None:
        """QUEUED → INIT → READY → RUNNING. Errors and timeouts become the run's status."""
        spec, req, pools = run.spec, run.spec.request, self.node.pools
        self._enter(run, Stage.QUEUED)
        await pools.prepared.acquire(req.priority)
        holds_place = True
        try:
            async with pools.init:
                self._enter(run, Stage.INIT)
                try:
                    async with asyncio.timeout(req.init_timeout_s):
                        await self.node.open_session(spec, session_metadata(spec, self.node.node_id))
                        run.runtime = await self.node.prepare_runtime(spec)
                        run.eval_ctx = _eval_context(req.evaluator, req.task, req.runtime, run)
                        ctx = run.eval_ctx
                        if ctx is not None and req.evaluator is not None and wants_fresh_runtime(req.evaluator.name, ctx):
                            ctx.base = await base_manifest(run.runtime)  # pristine: before the agent runs
                except TimeoutError:
                    run.fail(SessionStatus.TIMEOUT, FailureKind.INIT_ERROR, f"INIT exceeded {req.init_timeout_s} s")
                    return
                except Exception as exc:  # noqa: BLE001 - the task boundary: a failed INIT is an ERROR result
                    run.fail(SessionStatus.ERROR, FailureKind.INIT_ERROR, f"INIT failed: {_one_line(exc)}")
                    return
            self._enter(run, Stage.READY)
            async with pools.running:
                pools.prepared.release()
                holds_place = False
                self._enter(run, Stage.RUNNING)
                if run.eval_ctx is not None and req.evaluator is not None:
                    run.offload = _eval_job(req.evaluator, req.task, req.runtime, run.eval_ctx)
                    warm = (self.node.evaluations.prewarm(spec.session_id, run.offload) if run.offload is not None
                            else prewarm(req.evaluator.name, run.eval_ctx))
                    run.prewarm_task = asyncio.create_task(warm)
                try:
                    await self._within_budget(run)
                except Exception as exc:  # noqa: BLE001 - a crashed harness launch is an ERROR result
                    run.fail(SessionStatus.ERROR, FailureKind.HARNESS_ERROR, f"harness failed: {_one_line(exc)}")
                finally:
                    self._explain_failure(run)
                    self._enter(run, Stage.POSTRUN)  # off the engine: the RUNNING slot frees now
        finally:
            if holds_place:
                pools.prepared.release()

    async def _within_budget(self, run: Run) -> None:
        """The harness under the agent's budget, charging it only its own time (its commands, the
        harness): the seconds its calls spent queued, prefilled or decoded in the engine move the
        deadline, so a loaded engine never times the policy out. The wall clock stops at
        ``timeout_s × (1 + ENGINE_WAIT_FACTOR)`` all the same: the engine, not the agent, ran the time
        out there (``engine_bound_timeout``, masked). A harness's own exception propagates."""
        budget = run.spec.request.timeout_s
        ceiling = budget * (1 + ENGINE_WAIT_FACTOR)
        poll = min(max(budget / 20, BUDGET_POLL_S[0]), BUDGET_POLL_S[1])
        engine_s = self.node.engine_clock(run.spec.session_id)
        started = run.running_at = time.monotonic()
        agent = asyncio.ensure_future(self._run_agent(run, ceiling))
        wall = 0.0
        try:
            while not agent.done():
                wall = time.monotonic() - started
                left = min(budget - (wall - engine_s()), ceiling - wall)
                if left <= 0:
                    break
                await asyncio.wait({agent}, timeout=max(left, poll))
        finally:
            run.engine_s = engine_s()
            out_of_time = not agent.done()
            if out_of_time:
                agent.cancel()
                await asyncio.gather(agent, return_exceptions=True)
        if not out_of_time:
            agent.result()
            return
        own = wall - run.engine_s
        waited = f"{run.engine_s:.1f} s of its {wall:.1f} s in the engine"
        if own < budget:
            run.fail(SessionStatus.TIMEOUT, FailureKind.ENGINE_BOUND_TIMEOUT,
                     f"the wall ceiling of {ceiling:g} s passed with the agent's own time at {own:.1f} s of its "
                     f"{budget:g} s budget: the session spent {waited}")
        else:
            run.fail(SessionStatus.TIMEOUT, FailureKind.AGENT_TIMEOUT,
                     f"agent exceeded {budget:g} s of its own time (not counted: {waited})")

    async def _run_agent(self, run: Run, wall_s: float) -> None:
        req = run.spec.request
        session = self.node.session(run.spec.session_id)
        assert run.runtime is not None and session.key is not None  # INIT opened both
        if req.agent.harness == loop.NAME:
            outcome = await loop.run_loop_agent(
                run.runtime, socket=self.node.socket, base_url="http://gateway", key=session.key, model=self.node.model,
                prompt=req.instruction, settings=loop.LoopSettings.from_dict(req.agent.settings))
            run.exit_code, run.final_answer = outcome.exit_code, outcome.final_answer
            run.output_tail = outcome.output[-OUTPUT_TAIL:]
            if outcome.exit_code == 1:
                run.fail(SessionStatus.ERROR, FailureKind.HARNESS_ERROR, f"loop agent stopped: {run.output_tail}")
            return
        from polar_env.harnesses.launch import run_harness

        harness = self.node.harness(req.agent.harness)
        result = await run_harness(run.runtime, harness, key=session.key, model=self.node.model, prompt=req.instruction,
                                   api=req.agent.api, env=req.agent.env, timeout_s=wall_s + 5,
                                   cache_dir=self.node.harness_cache)
        run.exit_code, run.output_tail = result.exit_code, result.output.strip()[-OUTPUT_TAIL:]
        if result.timed_out:
            run.fail(SessionStatus.TIMEOUT, FailureKind.AGENT_TIMEOUT, f"agent exceeded {wall_s:g} s of wall time")
        elif result.exit_code != 0:
            run.fail(SessionStatus.ERROR, FailureKind.HARNESS_ERROR,
                     f"harness {harness.name} exited with code {result.exit_code}: {run.output_tail}")

    def _explain_failure(self, run: Run) -> None:
        """At the end of RUNNING: a limit the runtime enforced explains whatever else happened; a harness
        that failed or timed out while the gateway was answering it errors failed because of the engine."""
        hit = limit_hit_of(run.runtime)
        if hit is not None:
            run.fail(SessionStatus.ERROR, FailureKind.LIMIT_EXCEEDED, f"limit exceeded: {hit}")
            return
        if run.failure_kind in (FailureKind.HARNESS_ERROR, FailureKind.AGENT_TIMEOUT, FailureKind.ENGINE_BOUND_TIMEOUT):
            errors = self._engine_errors(run)
            if errors:
                run.fail(SessionStatus.ERROR, FailureKind.ENGINE_ERROR,
                         f"the gateway answered {errors} engine call(s) with an error; then {run.failure_detail}")

    def _gateway_session(self, run: Run) -> Session | None:
        try:
            return self.node.session(run.spec.session_id)
        except PolarError:  # not registered (cannot happen after INIT): nothing to explain
            return None

    def _engine_errors(self, run: Run) -> int:
        session = self._gateway_session(run)
        return int(session.errors) if session is not None else 0  # engine errors (and aborts) it was answered

    def _explain_no_calls(self, run: Run) -> None:
        """A harness that ran and ended (completed, timed out, failed) with no call captured never
        reached the gateway: its base URL or key config misses it, or it died before its first call.
        That run is not the policy's: typed ``no_model_calls`` (masked, not graded), never a silent
        completion. INIT failures, cancellations, limits and engine-bound timeouts keep their kinds."""
        if Stage.RUNNING.value not in run.stage_times or run.failure_kind not in (
                None, FailureKind.AGENT_TIMEOUT, FailureKind.HARNESS_ERROR):
            return
        status = SessionStatus.ERROR if run.status is SessionStatus.COMPLETED else run.status
        ended = f"; it ended: {run.failure_detail}" if run.failure_detail else ""
        errors = self._engine_errors(run)
        if errors:  # it did reach the gateway, which answered only errors
            run.fail(status, FailureKind.ENGINE_ERROR,
                     f"the gateway answered {errors} engine call(s) with an error and captured none{ended}")
            return
        harness = run.spec.request.agent.harness
        session = self._gateway_session(run)
        if session is not None and session.last_used >= run.running_at:  # a request of its key was resolved
            why = ("reached the gateway with its key, but no request became a call (refused before the engine: "
                   "see the gateway's log)")
        else:
            why = ("never reached the gateway (its base URL / API key config does not point at it) or failed "
                   "before its first call")
        output = run.output_tail.strip()
        run.fail(status, FailureKind.NO_MODEL_CALLS,
                 f"no model call was captured: harness {harness} {why}; exit code {run.exit_code}{ended}; "
                 f"output tail: {output[-OUTPUT_TAIL:] if output else '(none)'}")

    async def _evaluate(self, run: Run, evaluator: EvaluatorSpec) -> EvalResult:
        """In the evaluation worker when the run has a job there, else (or when the worker cannot
        run this evaluator) in this process. The agent's change set is taken here by the grader (its
        workspace against the pristine base, never through its git), while its runtime lives."""
        ctx, job, timeout_s = run.eval_ctx, run.offload, evaluation_timeout_s(evaluator)
        assert ctx is not None
        ctx.final_answer, ctx.exit_code = run.final_answer, run.exit_code
        if run.prewarm_task is not None:
            await asyncio.gather(run.prewarm_task, return_exceptions=True)
        if run.runtime is not None and ctx.base is not None:
            try:
                ctx.changes = await agent_changes(run.runtime, ctx.base)
            except LimitExceeded as exc:  # the agent changed more than patch_mb: its own doing
                return EvalResult(reward=0.0, report={"reason": str(exc), "limit": exc.limit})
        if job is not None:
            job.final_answer, job.exit_code, job.timed_out, job.changes = ctx.final_answer, ctx.exit_code, ctx.timed_out, ctx.changes
            result = await self.node.evaluations.evaluate(run.spec.session_id, job, timeout_s + WORKER_GRACE_S)
            if result is not None and result.report.get("exception_type") != NEEDS_AGENT_RUNTIME:
                return result.model_copy(update={"report": {**result.report, "evaluated_in": "worker"}})
            _log.info("session %s: evaluator %s runs in the node (%s)", run.spec.session_id, evaluator.name,
                      "not found in the worker" if result is None else "it asked for the agent runtime")
        result = await run_evaluator(evaluator.name, ctx, timeout_s=timeout_s)
        return result.model_copy(update={"report": {**result.report, "evaluated_in": "node"}})

    async def _postrun(self, run: Run, *, cancelled: bool = False) -> SessionResult:
        spec, req = run.spec, run.spec.request
        if cancelled:
            run.fail(SessionStatus.CANCELLED, FailureKind.INTERRUPTED, "node shutting down")
        if run.stage is not Stage.POSTRUN:
            self._enter(run, Stage.POSTRUN)
        async with self.node.pools.postrun:  # bounds the build/evaluate/cleanup work, not the waiting
            # read + build in a worker process (postrun_pool.py): never on the gateway's GIL
            built = await self.node.postrun.build(self.node.journal_opener, spec.session_id, req.builder)
            if built.error is not None:
                run.fail(SessionStatus.ERROR, FailureKind.BUILD_ERROR, built.error)
            elif built.records == 0:
                self._explain_no_calls(run)  # before grading: such a session is not evaluated
            if run.final_answer is None and built.records:
                run.final_answer = built.final_answer
            reward, evaluation = 0.0, EvalReport()
            if run.status is SessionStatus.COMPLETED and run.eval_ctx is not None and req.evaluator is not None:
                result = await self._evaluate(run, req.evaluator)
                evaluation = result.report.copy()
                evaluation.pop("traceback", None)
                evaluation["status"] = result.status.value
                reward = result.reward
                hit = limit_hit_of(run.runtime) or result.report.get("limit") and result.report["reason"]
                if hit:  # the agent's change ran past patch_mb: the policy's doing, not the grader's
                    run.fail(SessionStatus.ERROR, FailureKind.LIMIT_EXCEEDED, f"limit exceeded: {hit}")
                    reward = 0.0
                elif result.report.get("tampered"):  # the grader's canaries or report say the run was tampered with
                    run.fail(SessionStatus.ERROR, FailureKind.TAMPERED, f"evaluation: {result.report.get('reason')}")
                    reward = 0.0
                elif result.status is Status.TIMEOUT:
                    run.fail(SessionStatus.TIMEOUT, FailureKind.EVALUATION_TIMEOUT, f"evaluation: {result.report.get('reason')}")
                elif result.status is Status.ERROR:
                    run.fail(SessionStatus.ERROR, FailureKind.EVALUATOR_ERROR, f"evaluation failed: {result.report.get('error')}")
            elif req.evaluator is not None:
                evaluation = {"status": "skipped", "reason": f"session {run.status.value}: {run.failure_detail}"}
            await self._cleanup(run)
            self._enter(run, Stage.DONE)
            outcome = self._outcome(run, reward, evaluation, built.weight_versions)
            await asyncio.to_thread(self.node.store.write_outcome, spec.session_id, outcome)
            trajectory = with_outcome(built.trajectory or Trajectory(session_id=spec.session_id, traces=[]), outcome)
        self.node.pools.occupancy.move(Stage.DONE, None)
        return SessionResult(
            session_id=spec.session_id, task_id=req.task_id, group_id=spec.group_id, sample_index=spec.sample_index,
            node_id=self.node.node_id, status=run.status, reward=reward, evaluation=evaluation, trajectory=trajectory,
            stage_times=run.stage_times, records=built.records, harness_exit_code=run.exit_code,
            limits=outcome["limits"], failure_kind=run.failure_kind, failure_detail=run.failure_detail,
            mask=trajectory.mask)

    def _outcome(self, run: Run, reward: float, evaluation: EvalReport, weight_versions: list[str]) -> dict[str, Any]:
        return {"session_id": run.spec.session_id, "metadata": session_metadata(run.spec, self.node.node_id),
                "status": run.status.value, "reward": reward, "evaluation": evaluation,
                "limits": limits_report_of(run.runtime),
                "weight_versions": weight_versions,
                "stage_times": run.stage_times, "harness_exit_code": run.exit_code, "engine_s": round(run.engine_s, 3),
                "failure_kind": run.failure_kind.value if run.failure_kind is not None else None,
                "failure_detail": run.failure_detail}

    async def _cleanup(self, run: Run) -> None:
        if run.prewarm_task is not None and not run.prewarm_task.done():
            run.prewarm_task.cancel()
            await asyncio.gather(run.prewarm_task, return_exceptions=True)
        if run.offload is not None:  # a pre-warmed runtime in the worker that no evaluation used
            try:
                await self.node.evaluations.cancel(run.spec.session_id)
            except Exception as exc:  # noqa: BLE001
                _log.warning("session %s: releasing the worker's grading runtime failed: %s", run.spec.session_id, exc)
        if run.eval_ctx is not None:
            try:
                await run.eval_ctx.aclose()
            except Exception as exc:  # noqa: BLE001 - cleanup must reach the agent runtime too
                _log.warning("session %s: stopping the grading runtime failed: %s", run.spec.session_id, exc)
        if run.runtime is not None:
            try:
                await run.runtime.stop()
            except Exception as exc:  # noqa: BLE001
                _log.warning("session %s: stopping the runtime failed: %s", run.spec.session_id, exc)
        self.node.close_session(run.spec.session_id)
