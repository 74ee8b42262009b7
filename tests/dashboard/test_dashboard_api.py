"""The dashboard's JSON API without a browser: a 1,000-session store is paged, filtered and sorted
server-side (each answer is one bounded page), session pages are bounded too, and a dashboard
bound off loopback demands its token. The store is written through JournalStore and the outcome
writer, the same APIs the rollout pipeline uses."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.chat import chat_format
from polar_env.cli import main
from polar_env.dashboard.command import is_loopback
from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings

N = 1000


def record(sid: str, seq: int, prompt: list[int], response: list[int]) -> CompletionRecord:
    messages = [{"role": "user", "content": "hi"}] + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}] * seq
    return CompletionRecord(
        message=AssistantMessage(content="ok"), prompt_ids=prompt, response_ids=response,
        response_logprobs=[-0.5] * len(response), finish_reason="stop", session_id=sid, seq=seq,
        provider_api=ProviderAPI.OPENAI_CHAT, provider_request={"messages": messages},
        chat_request=ChatRequest(messages=messages), timings=Timings(received_at=0.0))


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big") / "capture" / "node-0"
    store = JournalStore(root)
    for i in range(N):
        sid = f"task{i % 250:03d}-g-{i // 250}"
        store.write_session_meta(SessionMeta(session_id=sid, key_sha256="0" * 64, created_at=0.0, closed=True,
                                             metadata={"task_id": f"task{i % 250:03d}", "harness": "pi" if i % 2 else "loop",
                                                       "sample_index": i // 250}))
        store.append(record(sid, 0, [1, 2, 3], [10, 11, 12]))
        if i == 7:  # one longer session: 3 calls, each prompt extending the last
            store.append(record(sid, 1, [1, 2, 3, 10, 11, 12, 20, 21], [13, 14, 12]))
            store.append(record(sid, 2, [1, 2, 3, 10, 11, 12, 20, 21, 13, 14, 12, 22], [15, 12]))
        status = "timeout" if i % 10 == 0 else "completed"
        store.write_outcome(sid, {"session_id": sid, "task_id": f"task{i % 250:03d}", "sample_index": i // 250,
                                  "status": status, "reward": float(i % 4 == 0), "records": 1,
                                  "stage_times": {"queued": 0.0, "running": 1.0, "done": 1.0 + i / 100},
                                  "evaluation": {"reason": f"case {i}"}, "metadata": {"harness": "pi" if i % 2 else "loop"}})
    store.close()
    return root.parent.parent


async def test_a_thousand_sessions_are_paged_server_side(store_dir: Path) -> None:
    app = build_dashboard(Dashboard([store_dir]))
    async with TestClient(TestServer(app)) as client:
        runs = (await (await client.get("/api/runs")).json())["runs"]
        (run,) = runs
        assert run["sessions"] == N and run["statuses"] == {"completed": 900, "timeout": 100}
        name = run["name"]
        started = time.perf_counter()
        resp = await client.get(f"/api/runs/{name}/sessions?limit=50&sort=reward&desc=1")
        first_page_s = time.perf_counter() - started
        body = await resp.read()
        data = await resp.json()
        assert data["total"] == N and len(data["rows"]) == 50 and len(body) < 30_000  # one page, not the run
        assert all(r["reward"] == 1.0 for r in data["rows"])
        later = await (await client.get(f"/api/runs/{name}/sessions?offset=950&limit=100&sort=reward&desc=1")).json()
        assert len(later["rows"]) == 50 and all(r["reward"] == 0.0 for r in later["rows"])
        filtered = await (await client.get(f"/api/runs/{name}/sessions?status=timeout&harness=loop&limit=500")).json()
        assert filtered["total"] == 100 and {r["status"] for r in filtered["rows"]} == {"timeout"}
        by_text = await (await client.get(f"/api/runs/{name}/sessions?q=case%20999")).json()
        assert [r["session_id"] for r in by_text["rows"]] == ["task249-g-3"]
        capped = await (await client.get(f"/api/runs/{name}/sessions?limit=100000")).json()
        assert len(capped["rows"]) == 500  # the server's page cap
        print(f"first page of {N} sessions (index built): {first_page_s * 1000:.0f} ms")

        sid = "task007-g-0"
        detail = await (await client.get(f"/api/runs/{name}/sessions/{sid}")).json()
        assert detail["calls"] == 3 and len(detail["traces"]) == 1 and detail["traces"][0]["calls"] == 3
        page = await (await client.get(f"/api/runs/{name}/sessions/{sid}/trace/0?offset=2&limit=4")).json()
        assert page["total"] == 3 + 3 + 2 + 3 + 1 + 2 and page["offset"] == 2 and len(page["tokens"]) == 4
        assert [t[0] for t in page["tokens"]] == [3, 10, 11, 12] and [t[2] for t in page["tokens"]] == [None, 1, 1, 1]
        assert [c["seq"] for c in page["calls"]] == [0]
        journal = await (await client.get(f"/api/runs/{name}/sessions/{sid}/journal?offset=1&limit=1")).json()
        assert journal["total"] == 3 and [r["seq"] for r in journal["records"]] == [1]
        transcript = await (await client.get(f"/api/runs/{name}/sessions/{sid}/transcript?offset=1&limit=1")).json()
        (call,) = transcript["calls"]
        assert not call["new_chain"] and [m["role"] for m in call["messages"]] == ["tool"]  # only what call 1 added
        assert (await client.get(f"/api/runs/{name}/sessions/nope")).status == 404
        assert (await client.get("/api/runs/nope/sessions")).status == 404
        assert (await client.get(f"/api/runs/{name}/sessions?offset=x")).status == 400


async def test_token_is_required_when_given(store_dir: Path) -> None:
    app = build_dashboard(Dashboard([store_dir]), token="s3cret")
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/")).status == 401
        assert (await client.get("/api/runs")).status == 401
        assert (await client.get("/api/runs", headers={"Authorization": "Bearer wrong"})).status == 401
        assert (await client.get("/api/runs", headers={"Authorization": "Bearer s3cret"})).status == 200
        page = await client.get("/?token=s3cret")
        assert page.status == 200 and "polar-env dashboard" in await page.text()
        assert (await client.get("/api/runs")).status == 200  # the cookie the page was given


def test_loopback_detection_and_bad_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing does not exist" in err


async def test_live_view_of_a_rollout_server(tmp_path: Path) -> None:
    """``--server``: live figures from a real RolloutServer's /rollout/status (its node is the
    FakeRuntimeNode test double with the simulated engine)."""
    from polar_env.engines.config import SimulatedEngineConfig
    from polar_env.staging.node import NodeConfig
    from polar_env.staging.pools import PoolLimits
    from polar_env.staging.server import LocalNode, RolloutServer, build_server_app
    from tests.staging.conftest import FakeRuntimeNode
    from tests.staging.test_node import loop_task

    node = FakeRuntimeNode(NodeConfig(engine=SimulatedEngineConfig(latency_s=0.01), store=tmp_path / "capture",
                                      limits=PoolLimits(), tcp_port=None))
    await node.start()
    server = RolloutServer([LocalNode(node)])
    async with TestClient(TestServer(build_server_app(server, "tok"), host="127.0.0.1")) as rollout:
        url = str(rollout.make_url("")).rstrip("/")
        dashboard = build_dashboard(Dashboard([tmp_path], server_url=url, server_token="tok"))
        async with TestClient(TestServer(dashboard)) as client:
            before = await (await client.get("/api/runs/server/live")).json()
            assert before["state"] == "idle" and before["done"] == 0 and before["nodes"] == 1
            await server.run(loop_task(3))
            after = await (await client.get("/api/runs/server/live")).json()
            assert after["done"] == 3 and after["total"] == 3 and after["mean_reward"] == 1.0
            assert set(after["stages"]) >= {"running", "postrun"}
            runs = {r["name"]: r for r in (await (await client.get("/api/runs")).json())["runs"]}
            assert runs["server"]["state"] == "idle" and runs["server"]["sessions"] == 3  # its store's sessions
        wrong = build_dashboard(Dashboard([], server_url=url, server_token="nope"))
        async with TestClient(TestServer(wrong)) as client:
            live = await (await client.get("/api/runs/server/live")).json()
            assert live["state"] == "unreachable" and "401" in live["error"]
    await server.aclose()


def test_drift_points_and_chain_starts_are_marked(tmp_path: Path) -> None:
    """A call whose prompt re-rendered the previous reply differently (11 sampled, 99 in the
    prompt) is cut there, never trained after it: two traces, the first cut at the drift and the
    second starting at it, each listed with why."""
    from polar_env.dashboard.session import trace_page, trace_summaries, transcript_page
    from polar_env.trajectory.prefix_merge import build_prefix_merged

    eot = 248046
    records = [record("d", 0, [1, 2, 3], [10, 11, eot]), record("d", 1, [1, 2, 3, 10, 99, eot, 20, 21], [13, eot])]
    trajectory = build_prefix_merged(records)
    first, second = trajectory.traces
    summaries = trace_summaries(trajectory)
    assert [(s["cut"], s["start"], s["drift"]) for s in summaries] == [("drift", None, 0), (None, "drift", 0)]
    assert trajectory.metadata["stats"]["drift_boundaries"] == 1
    page = trace_page(trajectory, 1, 0, 100, chat_format("qwen3.5").tokenizer)
    assert page["drift"] == [] and [c["seq"] for c in page["calls"]] == [1] and page["all_calls"] == 1
    assert [t[2] for t in page["tokens"]] == [None] * len(second.prompt_ids) + second.loss_mask
    assert first.prompt_ids == [1, 2, 3]
    assert transcript_page(records, 0, 10)["calls"][0]["new_chain"]  # the first call opens the chain


async def test_assets_are_shipped_and_reference_no_network(store_dir: Path) -> None:
    async with TestClient(TestServer(build_dashboard(Dashboard([store_dir])))) as client:
        for path in ("/", "/static/app.js", "/static/style.css"):
            resp = await client.get(path)
            text = await resp.text()
            assert resp.status == 200 and len(text) > 300 and resp.charset == "utf-8", path
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
            text = text.replace('"http://www.w3.org/2000/svg"', "")  # the SVG namespace name, never fetched
            assert "http://" not in text and "https://" not in text, path  # no CDN, no fonts, no trackers
        assert (await client.get("/static/../runs.py")).status == 404
        assert (await client.get("/static/other.js")).status == 404


async def test_a_folder_of_run_folders_lists_each_run_once(tmp_path: Path) -> None:
    """``polar-env rollout --out OUT`` writes ``OUT/<run id>/`` and a ``latest`` symlink: the dashboard
    over OUT (or a folder holding OUT) shows every run once, named by its run id, with its sessions."""
    out = tmp_path / "polar_rollouts"
    ids = ["20261201-170000-rollout-aaaaaa", "20261201-171500-eval-bbbbbb"]
    for n, run_id in enumerate(ids):
        root = out / run_id / "capture" / "node-0"
        store = JournalStore(root)
        for i in range(n + 2):
            sid = f"t-{run_id[-6:]}-{i}"
            store.write_session_meta(SessionMeta(session_id=sid, key_sha256="0" * 64, created_at=0.0, closed=True,
                                                 metadata={"task_id": "t", "sample_index": i}))
            store.append(record(sid, 0, [1, 2, 3], [10, 11, 12]))
            store.write_outcome(sid, {"session_id": sid, "status": "completed", "reward": 1.0, "records": 1})
        store.close()
        (out / run_id / "plan.json").write_text("{}")
    (out / "latest").symlink_to(ids[-1], target_is_directory=True)
    for paths in ([out], [tmp_path], [out / ids[0], out / "latest"]):
        dashboard = Dashboard(paths)
        runs = dashboard.refresh()
        expected = ids if paths[0] != out / ids[0] else [ids[0], "latest"]
        assert sorted(runs) == sorted(expected), paths
    async with TestClient(TestServer(build_dashboard(Dashboard([out])))) as client:
        listed = {r["name"]: r["sessions"] for r in (await (await client.get("/api/runs")).json())["runs"]}
        assert listed == {ids[0]: 2, ids[1]: 3}
    (out / "report.json").write_text("{}")  # OUT itself still holds a run of the old flat layout: both are shown
    assert sorted(Dashboard([out]).refresh()) == sorted([out.name, *ids])
