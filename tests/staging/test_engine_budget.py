"""The agent's budget charges it only its own time: seconds its calls spent in the engine (queued,
prefilled, decoded) move the deadline, so a slow engine never times the policy out and trains it
on a zero; past the wall ceiling the engine, not the agent, ran the time out (``engine_bound_timeout``,
masked). Through the real lifecycle with the simulated engine test double made slow (``latency_s``),
the loop harness and FakeRuntimes (conftest)."""

from __future__ import annotations

import asyncio

from polar_env.engines.simulated import SimulatedEngine
from polar_env.records import ChatRequest, FailureKind
from polar_env.staging.lifecycle import ENGINE_WAIT_FACTOR
from polar_env.staging.models import SessionResult, SessionStatus
from polar_env.staging.node import MeteredEngine
from tests.staging.conftest import FakeRuntimeNode
from tests.staging.test_node import started
from tests.staging.test_outcomes import check_row, run_one


def running_s(r: SessionResult) -> float:
    return r.stage_times["postrun"] - r.stage_times["running"]


async def test_a_slow_engine_does_not_spend_the_agents_budget(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=0.6)))  # two calls: 1.2 s in the engine
    r = await run_one(node, timeout_s=0.5)
    assert r.status is SessionStatus.COMPLETED and r.failure_kind is None, r.failure_detail
    assert r.reward == 1.0 and r.records == 2 and not r.mask  # graded and trained as any completed session
    assert running_s(r) > 1.2  # ran well past its 0.5 s budget: the engine's time was not charged
    engine_s = r.trajectory.metadata["engine_s"]
    assert 1.2 <= engine_s < running_s(r)
    journaled = sum(rec.timings.engine_ms for rec in node.store.read(r.session_id)) / 1000
    assert abs(journaled - engine_s) < 0.1  # the clock is the gateway's own per-call engine time


async def test_the_engine_running_out_the_wall_ceiling_is_masked_not_a_zero(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=0.6)))  # the second call is still in the engine at 1.0 s
    r = await run_one(node, timeout_s=0.25)
    assert r.status is SessionStatus.TIMEOUT and r.records == 1  # it had made (and been answered) one call
    check_row(r, FailureKind.ENGINE_BOUND_TIMEOUT, masked=True, traces=True)  # not trained with reward 0
    assert r.evaluation["status"] == "skipped" and r.reward == 0.0
    assert "in the engine" in (r.failure_detail or "") and "of its 0.25 s budget" in (r.failure_detail or "")
    assert 0.25 * (1 + ENGINE_WAIT_FACTOR) <= running_s(r) < 3.0


async def test_the_agents_own_time_is_still_charged_beside_a_slow_engine(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=0.4), exec_s=5.0))  # its tool command hangs
    r = await run_one(node, timeout_s=0.5)
    assert r.status is SessionStatus.TIMEOUT and r.records == 1
    check_row(r, FailureKind.AGENT_TIMEOUT, masked=False, traces=True)  # the policy's doing: reward 0, trained
    assert "agent exceeded 0.5 s of its own time" in (r.failure_detail or "")
    assert 0.9 <= running_s(r) < 0.5 * (1 + ENGINE_WAIT_FACTOR)  # 0.5 s of its own plus its call's 0.4 s


def _request(session_id: str) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], extra_body={"session_id": session_id})


async def test_the_engine_clock_counts_a_sessions_concurrent_calls_once_and_only_tracked_sessions() -> None:
    meter = MeteredEngine(SimulatedEngine(latency_s=0.3))
    meter.track("a")
    await asyncio.gather(meter.generate(_request("a")), meter.generate(_request("a")), meter.generate(_request("b")))
    assert 0.3 <= meter.engine_seconds("a") < 0.5  # two calls side by side: 0.3 s of engine wait, not 0.6
    assert meter.engine_seconds("b") == 0.0  # not tracked: not clocked (bounded memory)
    pending = asyncio.ensure_future(meter.generate(_request("a")))
    await asyncio.sleep(0.1)
    assert meter.engine_seconds("a") >= 0.4  # a call in the engine counts as it runs: the deadline moves with it
    await pending
    meter.forget("a")
    assert meter.engine_seconds("a") == 0.0
