"""The staged lifecycle on one node: bounds, statuses, partial trajectories, provenance.
Runtimes are the FakeRuntime test double and the engine the simulated one (see conftest)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from polar_env.evaluators.base import EvaluatorSpec
from polar_env.records import FailureKind, Status
from polar_env.staging.models import (
    AgentSpec,
    SessionSpec,
    SessionStatus,
    Stage,
    TaskRequest,
)
from polar_env.staging.server import LocalNode, RolloutServer
from tests.staging.conftest import FakeRuntimeNode
from tests.waits import until


def loop_task(n: int = 1, **kw: Any) -> TaskRequest:
    base: dict[str, Any] = {"task_id": "echo", "instruction": "run echo hi and tell me what it printed",
                            "num_samples": n, "agent": AgentSpec(harness="loop"),
                            "evaluator": EvaluatorSpec(name="output", regex="printed")}
    return TaskRequest(**{**base, **kw})


async def started(node: FakeRuntimeNode) -> FakeRuntimeNode:
    await node.start()
    return node


async def test_session_completes_with_reward_provenance_and_merged_trace(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config()))
    server = RolloutServer([LocalNode(node)])
    try:
        status = await server.run(loop_task(2, metadata={"rollout_step": 7}))
    finally:
        await server.aclose()
    assert [r.status for r in status.results] == [SessionStatus.COMPLETED] * 2
    for r in status.results:
        assert r.reward == 1.0 and r.evaluation["passed"] is True
        assert r.records == 2  # tool call, then the answer
        traj = r.trajectory
        assert traj is not None and traj.reward == 1.0 and traj.status is Status.COMPLETED
        assert len(traj.traces) == 1 and traj.metadata["stats"]["drift_boundaries"] == 0  # continuation: one chain
        assert traj.traces[0].reward == 1.0 and traj.traces[0].metadata["session_id"] == r.session_id
        meta = traj.metadata
        assert (meta["task_id"], meta["group_id"], meta["sample_index"]) == ("echo", status.group_id, r.sample_index)
        assert meta["harness"] == "loop" and meta["rollout_step"] == 7 and meta["weight_versions"] == ["0"]
        assert list(r.stage_times) == ["queued", "init", "ready", "running", "postrun", "done"]
        # the gateway session was registered with the same provenance
        assert r.session_id in node.store.session_ids()
    assert all(rt.stopped for rt in node.made)
    assert {r.sample_index for r in status.results} == {0, 1}


async def test_ready_buffer_and_stage_limits_hold_under_load(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=0.02, max_running=3, max_init=2, ready_buffer=4,
                                                     max_postrun=1), prepare_s=0.02))
    peaks: dict[Stage, int] = {s: 0 for s in Stage}
    prepared_peak = 0

    async def sample() -> None:
        nonlocal prepared_peak
        while True:
            counts = node.pools.occupancy.counts
            for s in Stage:
                peaks[s] = max(peaks[s], counts[s])
            prepared_peak = max(prepared_peak, counts[Stage.INIT] + counts[Stage.READY])
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(sample())
    server = RolloutServer([LocalNode(node)])
    try:
        status = await server.run(loop_task(24))
    finally:
        watcher.cancel()
        await server.aclose()
    assert all(r.status is SessionStatus.COMPLETED for r in status.results)
    assert prepared_peak <= 4 and peaks[Stage.READY] <= 4
    assert node.pools.occupancy.peak[Stage.RUNNING] == 3  # filled, never exceeded
    assert node.pools.occupancy.peak[Stage.INIT] <= 2
    assert node.pools.occupancy.peak[Stage.READY] >= 1  # prepared runtimes did wait for a slot


async def test_agent_timeout_keeps_the_partial_trajectory(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=0.01), exec_s=5.0))  # the tool call hangs
    server = RolloutServer([LocalNode(node)])
    try:
        status = await server.run(loop_task(1, timeout_s=0.5))
    finally:
        await server.aclose()
    r = status.results[0]
    assert r.status is SessionStatus.TIMEOUT and "agent exceeded 0.5 s" in (r.failure_detail or "")
    assert r.failure_kind is FailureKind.AGENT_TIMEOUT and not r.mask  # the policy's doing: trained with reward 0
    assert r.reward == 0.0 and r.evaluation["status"] == "skipped"
    assert r.records == 1 and r.trajectory is not None  # the first call was captured and built
    assert r.trajectory.status is Status.TIMEOUT and len(r.trajectory.traces[0].response_ids) > 0
    assert "postrun" in r.stage_times and node.made[0].stopped


async def test_harness_crash_is_an_error_with_the_partial_trajectory(node_config) -> None:  # type: ignore[no-untyped-def]
    class Crashing(FakeRuntimeNode):
        def make_runtime(self, spec: Any, session_id: str, **options: Any) -> Any:
            rt = super().make_runtime(spec, session_id, **options)

            async def crash(*args: Any, **kw: Any) -> Any:
                raise OSError("the harness process died")

            rt.exec = crash
            return rt

    node = await started(Crashing(node_config()))
    server = RolloutServer([LocalNode(node)])
    try:
        status = await server.run(loop_task(1))
    finally:
        await server.aclose()
    r = status.results[0]
    assert r.status is SessionStatus.ERROR and "the harness process died" in (r.failure_detail or "")
    assert r.failure_kind is FailureKind.HARNESS_ERROR and r.trajectory.failure_kind is FailureKind.HARNESS_ERROR
    assert r.records == 1 and r.trajectory is not None and r.trajectory.status is Status.ERROR
    assert node.made[0].stopped


async def test_init_failure_is_an_error_and_frees_its_place(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(ready_buffer=1, max_running=1), fail_prepare=True))
    server = RolloutServer([LocalNode(node)])
    try:
        status = await asyncio.wait_for(server.run(loop_task(3)), 10)
    finally:
        await server.aclose()
    assert [r.status for r in status.results] == [SessionStatus.ERROR] * 3
    assert all("INIT failed" in (r.failure_detail or "") for r in status.results)
    # each has its (empty) trajectory row, typed init_error and masked
    for r in status.results:
        traj = r.trajectory
        assert r.failure_kind is FailureKind.INIT_ERROR and r.mask
        assert traj.traces == [] and traj.status is Status.ERROR and traj.failure_kind is FailureKind.INIT_ERROR
        assert traj.mask and traj.group_id == status.group_id and traj.sample_index == r.sample_index


async def test_cancel_at_any_stage_reports_cancelled(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(max_running=1, ready_buffer=1), exec_s=5.0))
    spec = SessionSpec(session_id="c-0", sample_index=0, group_id="c", request=loop_task(1))
    ready = SessionSpec(session_id="c-1", sample_index=1, group_id="c", request=loop_task(1))
    queued = SessionSpec(session_id="c-2", sample_index=2, group_id="c", request=loop_task(1))
    try:
        tasks = [asyncio.create_task(node.run(s)) for s in (spec, ready, queued)]
        await until(lambda: [getattr(node.runner.runs.get(f"c-{i}"), "stage", None) for i in range(3)]
                    == [Stage.RUNNING, Stage.READY, Stage.QUEUED] and node.made[0].commands,
                    "c-0 RUNNING its tool call, c-1 READY, c-2 QUEUED")
        # one RUNNING slot (c-0, its tool call hanging), one prepared place (c-1), c-2 waits for it
        assert [node.runner.runs[f"c-{i}"].stage for i in range(3)] == [Stage.RUNNING, Stage.READY, Stage.QUEUED]
        assert all(node.cancel(f"c-{i}") for i in range(3))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    finally:
        await node.stop()
    assert [r.status for r in results] == [SessionStatus.CANCELLED] * 3
    assert [r.failure_kind for r in results] == [FailureKind.CANCELLED] * 3 and all(r.mask for r in results)
    assert results[0].records == 1 and results[0].trajectory.traces  # what was captured is kept, marked
    assert results[0].trajectory.status is Status.CANCELLED and results[1].trajectory.traces == []
    assert all(r.trajectory.status is Status.CANCELLED and r.trajectory.mask for r in results)
    assert len(node.made) == 2 and all(rt.stopped for rt in node.made)  # c-2 never got a runtime


@pytest.mark.slow
async def test_two_hundred_concurrent_sessions_on_one_node(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config(latency_s=0.05, max_running=200, max_init=50,
                                                     max_postrun=8)))
    server = RolloutServer([LocalNode(node)])
    try:
        status = await asyncio.wait_for(server.run(loop_task(200, evaluator=None)), 240)
    finally:
        await server.aclose()
    errors = [r for r in status.results if r.status is not SessionStatus.COMPLETED]
    assert errors == [], errors[:3]
    assert sum(r.records for r in status.results) == 400
    assert node.pools.occupancy.peak[Stage.RUNNING] > 100  # they really ran concurrently
    assert node.meter is not None and node.meter.errors == 0


async def test_the_store_is_self_describing(node_config) -> None:  # type: ignore[no-untyped-def]
    from polar_env.env import build_trajectories

    node = await started(FakeRuntimeNode(node_config()))
    server = RolloutServer([LocalNode(node)])
    try:
        status = await server.run(loop_task(2, evaluator=EvaluatorSpec(name="output", regex="never matches")))
    finally:
        await server.aclose()
    rebuilt = {t.session_id: t for t in build_trajectories(node.store.root)}
    for r in status.results:
        assert r.trajectory is not None
        again = rebuilt[r.session_id]
        assert again.reward == r.reward == 0.0 and again.status is r.trajectory.status
        assert again.metadata["evaluation"]["passed"] is False and again.metadata["task_id"] == "echo"
        assert again.traces == r.trajectory.traces


async def test_the_sandbox_socket_serves_provider_routes_only(node_config) -> None:  # type: ignore[no-untyped-def]
    import aiohttp

    node = await started(FakeRuntimeNode(node_config()))
    try:
        admin = {"Authorization": f"Bearer {node.gateway.config.admin_token}"}
        key = node.open_external(["ext-0"])[0]["key"]
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(node.socket))) as http:
            for method, path in (("POST", "/sessions"), ("GET", "/sessions/ext-0/completions"),
                                 ("POST", "/admin/pause"), ("GET", "/admin/status")):
                async with http.request(method, f"http://gw{path}", json={}, headers=admin) as resp:
                    assert resp.status == 404, path  # not there at all, whatever the credential
            async with http.post("http://gw/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 200
    finally:
        await node.stop()
