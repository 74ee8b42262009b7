"""Gateway nodes as Ray actors (a local Ray started by the test): sessions run in the node
processes, and a node actor that dies has its sessions reported as errors while the server keeps
serving on the others. The engine is the simulated test double; runtimes are real bwrap sandboxes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_env.engines.config import SimulatedEngineConfig
from polar_env.journal.store import JournalStore
from polar_env.records import FailureKind
from polar_env.staging.cluster import ClusterConfig, start_cluster
from polar_env.staging.models import SessionStatus
from polar_env.staging.node import NodeConfig
from polar_env.staging.pools import PoolLimits
from tests.conftest import require_bwrap, unavailable
from tests.staging.test_node import loop_task
from tests.waits import until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    try:
        import ray
    except ImportError:
        unavailable("Ray is not installed (pip install -e '.[ray]')")
    require_bwrap()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


# None: the nodes write the store (it is on their host); False: they journal to a spool of their
# own that the head pulls into the store, as on hosts that share no disk (staging/shipping.py)
SHARED = pytest.mark.parametrize("shared", [None, False], ids=["shared-store", "pulled"])


def cluster_config(tmp_path: Path, latency_s: float, shared: bool | None = None) -> ClusterConfig:
    node = NodeConfig(engine=SimulatedEngineConfig(latency_s=latency_s), store=tmp_path / "store",
                      limits=PoolLimits(max_running=8), tcp_port=None, runtime_root=tmp_path / "runtimes")
    return ClusterConfig(nodes=2, ray=True, node=node, shared_store=shared)


@SHARED
async def test_sessions_run_in_node_actors(ray_local: None, tmp_path: Path, shared: bool | None) -> None:
    cluster = await start_cluster(cluster_config(tmp_path, 0.02, shared))
    try:
        status = await asyncio.wait_for(cluster.server.run(loop_task(4)), 120)
        stats = await cluster.server.node_stats()
    finally:
        await cluster.aclose()
    assert [r.status for r in status.results] == [SessionStatus.COMPLETED] * 4, [r.failure_detail for r in status.results]
    assert {r.node_id for r in status.results} == {"node-0", "node-1"}
    assert all(r.reward == 1.0 and r.trajectory is not None for r in status.results)
    assert sorted(s["completed"] for s in stats) == [2, 2]
    assert [s["spool"] for s in stats] == [shared is False] * 2
    # each node's shard of the store is whole: every session's journal and outcome
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["node-0", "node-1"]
    for r in status.results:
        shard = tmp_path / "store" / r.node_id
        assert len(JournalStore(shard).read(r.session_id)) == r.records >= 1
        assert JournalStore(shard).read_outcome(r.session_id)["reward"] == 1.0
    if shared is False:  # the spools went with the nodes
        assert not list((tmp_path / "runtimes").rglob("journal-spool"))


@SHARED
async def test_a_killed_node_reports_its_sessions_as_errors(ray_local: None, tmp_path: Path,
                                                            shared: bool | None) -> None:
    import ray

    cluster = await start_cluster(cluster_config(tmp_path, 1.5, shared))  # slow engine: sessions are mid-run
    try:
        running = asyncio.create_task(cluster.server.run(loop_task(4, evaluator=None)))
        dead_dirs = tmp_path / "runtimes" / "node-0"
        def journaled_and_prepared() -> bool:
            journals = list((tmp_path / "store" / "node-0").glob("*.jsonl"))
            return bool(journals and any(p.stat().st_size for p in journals) and any(dead_dirs.glob("*/polar-sandbox-*")))

        await until(journaled_and_prepared, "node-0 to journal a call and prepare its sandboxes", poll_s=0.05)
        ray.kill(cluster.actors[0])
        status = await asyncio.wait_for(running, 120)
        by_node: dict[str, list[SessionStatus]] = {}
        for r in status.results:
            by_node.setdefault(r.node_id, []).append(r.status)
        assert by_node["node-0"] == [SessionStatus.ERROR] * 2
        assert all("node node-0 died" in (r.failure_detail or "") for r in status.results if r.node_id == "node-0")
        # the dead node's sessions keep their partial calls, as masked node_lost trajectories with an outcome on disk
        dead = [r for r in status.results if r.node_id == "node-0"]
        assert sum(r.records for r in dead) >= 1 and any(r.trajectory.traces for r in dead)
        for r in dead:
            assert r.failure_kind is FailureKind.NODE_LOST and r.mask
            assert r.trajectory.status.value == "error" and r.trajectory.reward == 0.0
            assert r.trajectory.failure_kind is FailureKind.NODE_LOST and r.trajectory.mask
            assert (tmp_path / "store" / "node-0" / f"{r.session_id}.result.json").exists()
        from polar_env.env import build_trajectories

        rebuilt = {t.session_id: t for t in build_trajectories(tmp_path / "store" / "node-0")}
        assert set(rebuilt) == {r.session_id for r in dead}  # every lost session has its row, calls or not
        assert all(t.status.value == "error" and t.failure_kind is FailureKind.NODE_LOST for t in rebuilt.values())
        assert by_node["node-1"] == [SessionStatus.COMPLETED] * 2
        # the server keeps serving, on the live node only
        again = await asyncio.wait_for(cluster.server.run(loop_task(2, evaluator=None)), 120)
        assert [r.status for r in again.results] == [SessionStatus.COMPLETED] * 2
        assert {r.node_id for r in again.results} == {"node-1"}
        stats = await cluster.server.node_stats()
        assert "dead" in stats[0] and stats[1]["completed"] == 4
    finally:
        await cluster.aclose()
    # the job's end swept the folders (repo copies) the dead node left; the live node removed its own
    assert not any((tmp_path / "runtimes").rglob("polar-sandbox-*"))
