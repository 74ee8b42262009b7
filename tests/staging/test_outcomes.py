"""Complete groups and typed outcomes: every way a session can end gives one SessionResult with a
trajectory row (empty when nothing was captured), a status from the one vocabulary, a FailureKind,
a detail and the mask rule's verdict; ``polar-env build`` of the store gives the same rows.
Runtimes are the FakeRuntime test double, the engine the simulated one (see conftest)."""

from __future__ import annotations

import asyncio
from typing import Any

from polar_env.engines.simulated import SimulatedEngine
from polar_env.env import build_trajectories
from polar_env.errors import EngineUnavailable
from polar_env.evaluators import EvalContext, EvalResult, register_evaluator
from polar_env.evaluators.base import EvaluatorSpec
from polar_env.journal.store import JournalStore
from polar_env.records import ChatRequest, FailureKind, Generation, Status, Trajectory
from polar_env.staging.models import SessionResult, SessionSpec, SessionStatus, Stage
from polar_env.staging.postrun_pool import Built
from polar_env.staging.salvage import salvage
from polar_env.staging.server import LocalNode, RolloutServer
from tests.staging.conftest import FakeRuntime, FakeRuntimeNode
from tests.staging.test_node import loop_task, started
from tests.waits import until


def check_row(r: SessionResult, kind: FailureKind | None, *, masked: bool, traces: bool) -> Trajectory:
    """The result and its trajectory row agree on everything a trainer reads."""
    traj = r.trajectory
    assert r.failure_kind is kind and traj.failure_kind is kind, (r.failure_kind, r.failure_detail)
    assert r.mask is masked and traj.mask is masked
    assert traj.status is r.status and traj.failure_detail == r.failure_detail
    assert traj.group_id == r.group_id and traj.sample_index == r.sample_index and traj.reward == r.reward
    assert bool(traj.traces) is traces
    if kind is not None:
        assert r.failure_detail
    return traj


def rebuilt(node: FakeRuntimeNode) -> dict[str, Trajectory]:
    return {t.session_id: t for t in build_trajectories(node.store.root)}


async def run_one(node: FakeRuntimeNode, **task: Any) -> SessionResult:
    server = RolloutServer([LocalNode(node)])
    try:
        status = await asyncio.wait_for(server.run(loop_task(1, **task)), 30)
    finally:
        await server.aclose()
    (r,) = status.results
    return r


async def test_a_timeout_before_any_model_call_is_one_masked_engine_bound_timeout_row(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=5.0)))  # the first call outlasts the wall ceiling
    r = await run_one(node, timeout_s=0.3)
    assert r.status is SessionStatus.TIMEOUT and r.records == 0
    traj = check_row(r, FailureKind.ENGINE_BOUND_TIMEOUT, masked=True, traces=False)  # the engine's doing, not the policy's
    again = rebuilt(node)[r.session_id]  # polar-env build of the store gives the same row
    assert again.model_dump(exclude={"metadata"}) == traj.model_dump(exclude={"metadata"})


async def test_init_failure_and_init_timeout_are_init_error_rows(node_config) -> None:  # type: ignore[no-untyped-def]
    failing = await started(FakeRuntimeNode(node_config(), fail_prepare=True))
    r = await run_one(failing)
    assert r.status is SessionStatus.ERROR and "INIT failed" in (r.failure_detail or "")
    check_row(r, FailureKind.INIT_ERROR, masked=True, traces=False)
    assert rebuilt(failing)[r.session_id].failure_kind is FailureKind.INIT_ERROR  # no journal, still a row
    slow = await started(FakeRuntimeNode(node_config(), prepare_s=3.0))
    r = await run_one(slow, init_timeout_s=0.2)
    assert r.status is SessionStatus.TIMEOUT and "INIT exceeded" in (r.failure_detail or "")
    check_row(r, FailureKind.INIT_ERROR, masked=True, traces=False)


class DownEngine(SimulatedEngine):
    """Test double: an engine that cannot be reached."""

    async def generate(self, request: ChatRequest) -> Generation:
        raise EngineUnavailable("connection refused", engine="down", url="http://127.0.0.1:9")


async def test_a_harness_that_fails_on_engine_errors_is_an_engine_error_row(node_config) -> None:  # type: ignore[no-untyped-def]
    node = FakeRuntimeNode(node_config())
    node.engine = DownEngine()
    await node.start()
    r = await run_one(node)
    assert r.status is SessionStatus.ERROR and "engine call(s) with an error" in (r.failure_detail or "")
    check_row(r, FailureKind.ENGINE_ERROR, masked=True, traces=False)


class LimitedRuntime(FakeRuntime):
    """Test double: a runtime whose first command hits the pids limit (as limits.py reports it)."""

    limit_hit: str | None = None

    async def exec(self, command: Any, **kw: Any) -> Any:
        result = await super().exec(command, **kw)
        self.limit_hit = "pids_limit=64 (cgroup): the session's processes were killed"
        return result

    def limits_report(self) -> dict[str, Any]:
        return {"limits": {"pids_limit": 64}, "hit": self.limit_hit}


class LimitNode(FakeRuntimeNode):
    def make_runtime(self, spec: Any, session_id: str, **options: Any) -> Any:
        rt = LimitedRuntime(spec)
        self.made.append(rt)
        return rt


async def test_a_limit_hit_is_limit_exceeded_and_trains_its_tokens(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(LimitNode(node_config()))
    r = await run_one(node)
    assert r.status is SessionStatus.ERROR and r.limits["hit"].startswith("pids_limit")
    check_row(r, FailureKind.LIMIT_EXCEEDED, masked=False, traces=True)  # the policy's doing: reward 0, trained
    assert r.evaluation["status"] == "skipped"


@register_evaluator("test_broken_grader", replace=True)
class BrokenGrader:
    """Test double: a grader that fails (not a wrong fix)."""

    name = "test_broken_grader"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        raise RuntimeError("the grader fell over")


@register_evaluator("test_hanging_tests", replace=True)
class HangingTests:
    """Test double: grading that runs past its timeout (as when the agent's change hangs the tests)."""

    name = "test_hanging_tests"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        await asyncio.sleep(30)
        return EvalResult(reward=1.0)


async def test_evaluator_failures_are_typed(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config()))
    r = await run_one(node, evaluator=EvaluatorSpec(name="test_broken_grader"))
    assert r.status is SessionStatus.ERROR and "the grader fell over" in (r.failure_detail or "")
    check_row(r, FailureKind.EVALUATOR_ERROR, masked=True, traces=True)  # says nothing about the policy
    node = await started(FakeRuntimeNode(node_config()))
    r = await run_one(node, evaluator=EvaluatorSpec(name="test_hanging_tests", timeout_s=0.3))
    assert r.status is SessionStatus.TIMEOUT
    check_row(r, FailureKind.EVALUATION_TIMEOUT, masked=False, traces=True)  # reward 0, never an escape


async def test_a_build_failure_is_a_build_error_row(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config()))
    real = node.postrun.build

    async def broken(open_journal: object, session_id: str, builder: str) -> Built:
        built = await real(open_journal, session_id, builder)
        return Built(None, built.records, built.final_answer, built.weight_versions, "builder prefix_merge failed: boom")

    node.postrun.build = broken  # type: ignore[method-assign]
    r = await run_one(node)
    assert r.status is SessionStatus.ERROR and r.records == 2 and r.reward == 0.0
    check_row(r, FailureKind.BUILD_ERROR, masked=True, traces=False)


async def test_cancel_and_stop_are_cancelled_and_interrupted_and_a_rebuild_agrees(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(), exec_s=5.0))  # the tool call hangs
    specs = [SessionSpec(session_id=f"x-{i}", sample_index=i, group_id="x", request=loop_task(2)) for i in range(2)]
    tasks = [asyncio.create_task(node.run(s)) for s in specs]
    await until(lambda: len(node.made) == 2 and all(rt.commands for rt in node.made), "both tool calls to start")
    assert all(node.runner.runs[s.session_id].stage is Stage.RUNNING for s in specs)
    assert node.cancel("x-0")
    cancelled = await asyncio.wait_for(tasks[0], 10)
    await node.stop()  # the job stops: what still runs is interrupted (--resume runs it again)
    interrupted = await asyncio.wait_for(tasks[1], 10)
    check_row(cancelled, FailureKind.CANCELLED, masked=True, traces=True)
    check_row(interrupted, FailureKind.INTERRUPTED, masked=True, traces=True)
    assert cancelled.status is interrupted.status is SessionStatus.CANCELLED
    again = {t.session_id: t for t in build_trajectories(node.config.store / node.node_id)}
    for r in (cancelled, interrupted):  # sessions and rebuilt trajectories say the same, never "aborted"
        assert again[r.session_id].status is Status.CANCELLED and again[r.session_id].failure_kind is r.failure_kind
        assert again[r.session_id].traces[0].status is Status.CANCELLED and again[r.session_id].mask


async def test_a_dead_nodes_sessions_are_node_lost_rows(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config()))
    r = await run_one(node)  # a journal with two calls, as a node leaves it
    root = node.store.root
    spec = SessionSpec(session_id=r.session_id, sample_index=0, group_id=r.group_id, request=loop_task(2))
    lost = SessionSpec(session_id=f"{r.group_id}-1", sample_index=1, group_id=r.group_id, request=loop_task(2))
    died = "node node-0 died: the actor process exited"
    rows = [salvage(root, s, RolloutServer._error_result(s, "node-0", died), JournalStore) for s in (spec, lost)]
    check_row(rows[0], FailureKind.NODE_LOST, masked=True, traces=True)  # its calls kept, never trained
    check_row(rows[1], FailureKind.NODE_LOST, masked=True, traces=False)  # no journal: still its row
    assert all(x.status is SessionStatus.ERROR and x.failure_detail == died for x in rows)
    again = rebuilt(node)
    assert {x.session_id for x in rows} <= set(again)
    assert all(again[x.session_id].failure_kind is FailureKind.NODE_LOST and again[x.session_id].mask for x in rows)


async def test_a_dead_nodes_session_with_an_import_path_builder_keeps_its_calls(node_config) -> None:  # type: ignore[no-untyped-def]
    """Validation accepts a ``pkg.module:attr`` builder; salvage must build with it too."""
    node = await started(FakeRuntimeNode(node_config()))
    r = await run_one(node)
    request = loop_task(2).model_copy(update={"builder": "polar_env.trajectory.per_request:build_per_request"})
    spec = SessionSpec(session_id=r.session_id, sample_index=0, group_id=r.group_id, request=request)
    row = salvage(node.store.root, spec, RolloutServer._error_result(spec, "node-0", "node node-0 died"), JournalStore)
    check_row(row, FailureKind.NODE_LOST, masked=True, traces=True)


def test_a_session_result_without_a_kind_or_a_trajectory() -> None:
    """A non-completed session must say why; one built without a trajectory gets its empty row; old
    rows (``error``) load."""
    import pytest

    base = {"session_id": "s", "task_id": "t", "group_id": "g", "sample_index": 3}
    with pytest.raises(ValueError, match="failure_kind"):
        SessionResult(**base, status=SessionStatus.ERROR)
    with pytest.raises(ValueError, match="truncated"):
        SessionResult(**base, status=Status.TRUNCATED, failure_kind=FailureKind.HARNESS_ERROR)
    old = SessionResult.model_validate({**base, "status": "timeout", "error": "agent exceeded 1 s",
                                        "failure_kind": "agent_timeout"})
    assert old.failure_detail == "agent exceeded 1 s" and old.trajectory.traces == [] and old.trajectory.mask
    assert (old.trajectory.group_id, old.trajectory.sample_index) == ("g", 3)
    older = SessionResult.model_validate({**base, "status": "error", "error": "INIT failed: RuntimeError: no bwrap"})
    assert older.failure_kind is FailureKind.INIT_ERROR and older.mask  # written before kinds existed
    done = SessionResult.model_validate({**base, "status": "completed", "error": None, "reward": 1.0})
    assert done.failure_kind is None and done.failure_detail is None


async def test_closing_the_server_interrupts_what_still_runs(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(), exec_s=30.0))  # the tool calls hang
    server = RolloutServer([LocalNode(node)])
    status = server.submit(loop_task(2))
    await until(lambda: len(node.made) == 2 and all(rt.commands for rt in node.made), "both tool calls to start")
    await asyncio.wait_for(server.aclose(), 30)  # the job stops (PolarEnv's exit, Ctrl-C)
    await asyncio.wait_for(server.tasks[status.group_id].done.wait(), 10)
    assert [r.failure_kind for r in status.results] == [FailureKind.INTERRUPTED] * 2
    assert all(r.status is SessionStatus.CANCELLED and r.mask and r.trajectory.traces for r in status.results)
