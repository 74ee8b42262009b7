"""Live mode, health, curves and Compare through the API, without a browser (the browser suite,
``test_dashboard_live_browser.py``, runs them over real ``polar-env`` runs): a run folder whose
``live.json`` is written by the job's own ``LiveFile`` with what ``_watch`` puts there (each
started session's stage, each node's stats), over stores written through JournalStore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.dashboard import compare as compare_module
from polar_env.dashboard import server as server_module
from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.observe.live import LiveFile
from tests.dashboard.test_dashboard_api import record
from tests.dashboard.test_dashboard_research_api import session, write_run

NODE = {"node_id": "node-0", "host": "h", "pid": 1, "active": 2, "completed": 1,
        "counts": {"queued": 0, "init": 0, "ready": 1, "running": 1, "postrun": 0},
        "limits": {"max_init": 4, "max_running": 1, "max_postrun": 2, "ready_buffer": 5},
        "engine_in_flight": 1, "engine_busy_fraction": 0.5, "engine_calls": 3, "engine": {"client": "EmbeddedEngine", "members": []}}


def live_run(tmp_path: Path) -> Path:
    """alpha-g-0 finished; alpha-g-1 running and alpha-g-2 ready on node-0 (journals and session
    state, no outcome yet); alpha-g-3 planned only."""
    run = tmp_path / "runs" / "r1"
    write_run(run, [session("alpha", 0, 1.0)], {"alpha": 4})
    (run / "sessions.jsonl").unlink()  # written at the end of a job: not yet
    store = JournalStore(run / "capture" / "node-0")
    for i in (1, 2):
        sid = f"alpha-g-{i}"
        store.write_session_meta(SessionMeta(session_id=sid, key_sha256="0" * 64, created_at=0.0,
                                             metadata={"harness": "loop", "task_id": "alpha", "group_id": "alpha-g", "node_id": "node-0"}))
        store.append(record(sid, 0, [1, 2, 3], [10, 11, 12]))
    store.close()
    live = LiveFile(run)
    live({"elapsed_s": 5.0, "total": 4, "done": 1, "stages": NODE["counts"], "dead_nodes": [],
          "session_stages": {"alpha-g-1": "running", "alpha-g-2": "ready"}, "nodes": [NODE]})
    return run


async def test_unfinished_sessions_show_their_stage_and_no_verdict(tmp_path: Path) -> None:
    live_run(tmp_path)
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        page = await (await client.get("/api/runs/r1/sessions")).json()
        assert {r["session_id"]: r["status"] for r in page["rows"]} == {
            "alpha-g-0": "completed", "alpha-g-1": "running", "alpha-g-2": "ready", "alpha-g-3": "queued"}
        assert page["failure_kinds"]["bars"] == [["-", 1]]  # how sessions ended: in flight and planned ones have not
        running = await (await client.get("/api/runs/r1/sessions/alpha-g-1")).json()
        assert running["in_flight"] is True and running["failure_detail"] is None and running["trainer"]["mask"] is None
        planned = await (await client.get("/api/runs/r1/sessions/alpha-g-3")).json()
        assert planned["row"]["status"] == "queued" and planned["traces"] == [] and planned["calls"] == 0
        live = await (await client.get("/api/runs/r1/live")).json()
        assert live["in_flight"] == {"alpha-g-1": "running", "alpha-g-2": "ready"} and live["now_s"] >= 5.0
        (run,) = (await (await client.get("/api/runs")).json())["runs"]
        assert run["state"] == "running" and run["sessions"] == 4
        topo = await (await client.get("/api/runs/r1/topology")).json()
        assert topo["source"] == "live.json" and topo["live"] is True
        assert (await (await client.get("/api/runs/r1/curves")).json())["live"] is True  # the page re-reads it
        assert [(n["node_id"], n["state"], n["engine_in_flight"]) for n in topo["nodes"]] == [("node-0", "alive", 1)]


async def test_a_dead_node_and_a_run_that_stopped(tmp_path: Path) -> None:
    run = live_run(tmp_path)
    live = json.loads((run / "live.json").read_text())
    dead = {**live, "dead_nodes": ["node-0"], "nodes": [{"node_id": "node-0", "dead": "the actor died"}]}
    (run / "live.json").write_text(json.dumps(dead))  # the job still runs; its node does not
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        lost = await (await client.get("/api/runs/r1/sessions/alpha-g-1")).json()
        assert lost["in_flight"] is False and "died before POSTRUN" in lost["failure_detail"]
        topo = await (await client.get("/api/runs/r1/topology")).json()
        assert topo["dead_nodes"] == ["node-0"] and topo["nodes"][0]["dead"] == "the actor died"
        (run / "live.json").write_text(json.dumps({**dead, "state": "done"}))  # killed: no report
        page = await (await client.get("/api/runs/r1/sessions")).json()
        assert {r["session_id"]: r["status"] for r in page["rows"]}["alpha-g-3"] == "not started"


async def test_compare_per_task_and_a_task_set_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[int] = []
    real = compare_module.compare

    def counting(a: Any, b: Any) -> dict[str, Any]:
        computed.append(1)
        return real(a, b)

    monkeypatch.setattr(server_module, "compare", counting)
    write_run(tmp_path / "runs" / "a", [session("alpha", 0, 1.0), session("beta", 0, 0.0, status="error", kind="engine_error")],
              {"alpha": 1, "beta": 1})
    write_run(tmp_path / "runs" / "b", [session("alpha", 0, 0.0, status="timeout", kind="agent_timeout")], {"alpha": 1})
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        data = await (await client.get("/api/compare?a=a&b=b")).json()
        assert data["task_sets"] == {"same": False, "shared": 1, "only_a": ["beta"], "only_b": []}
        alpha, beta = data["per_task"]
        assert (alpha["a"]["mean_reward"], alpha["b"]["mean_reward"], alpha["b"]["failure_kinds"]) == (1.0, 0.0, {"agent_timeout": 1})
        assert beta["task_id"] == "beta" and beta["b"] is None
        overall = {r["name"]: (r["a"]["pass@1"], r["b"]["pass@1"]) for r in data["sections"][0]["rows"]}
        assert overall == {"all": (0.5, 0.0), "shared tasks": (1.0, 0.0)}  # alpha alone: like for like
        kinds = {f["kind"]: (f["a"], f["b"]) for f in data["failure_kinds"]}
        assert kinds == {"-": (1, 0), "engine_error": (1, 0), "agent_timeout": (0, 1)}
        assert await (await client.get("/api/compare?a=a&b=b")).json() == data and computed == [1]  # cached
        extra = session("beta", 0, 1.0)
        store = JournalStore(tmp_path / "runs" / "b" / "capture" / "node-0")
        store.write_outcome(extra["session_id"], extra)
        store.close()
        again = await (await client.get("/api/compare?a=a&b=b")).json()
        assert again["task_sets"]["same"] is True and computed == [1, 1]  # b's rows changed: computed again


async def test_curves_over_time_and_per_slime_rollout(tmp_path: Path) -> None:
    rows = []
    for i, (reward, rollout) in enumerate([(1.0, 0), (0.0, 0), (1.0, 1), (1.0, 1)]):
        row = session("alpha", i, reward)
        row["stage_times"] = {"queued": 10.0 + i, "done": 20.0 + i}
        row["metadata"] = {**row["metadata"], "slime_rollout_id": rollout}
        rows.append(row)
    write_run(tmp_path / "runs" / "r1", rows, {"alpha": 4})
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        c = await (await client.get("/api/runs/r1/curves")).json()
        assert [(p["mean_reward"], p["pass_rate"]) for p in c["points"]] == [(1.0, 1.0), (0.5, 0.5), (0.6667, 0.6667), (0.75, 0.75)]
        assert [p["wall_s"] for p in c["points"]] == [10.0] * 4 and c["latency"]["p50_wall_s"] == 10.0
        assert [(r["rollout_id"], r["sessions"], r["mean_reward"]) for r in c["per_rollout"]] == [(0, 2, 0.5), (1, 2, 1.0)]
        assert c["steps"] == [] and c["trackers"] == [] and c["live"] is False
