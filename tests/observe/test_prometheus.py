"""``GET /metrics`` on the gateway and the rollout server: the exposition parses with
prometheus-client's own parser, and the series move with traffic. The gateway runs in front of the
``FakeEngine`` test double (the real embedded engine is exercised below through a gateway node)."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from polar_env.engines.config import SimulatedEngineConfig
from polar_env.proxy.gateway import Gateway
from polar_env.staging.node import NodeConfig
from polar_env.staging.pools import PoolLimits
from polar_env.staging.server import LocalNode, RolloutServer, build_server_app
from tests.proxy.conftest import FakeEngine, admin_headers, start_gateway
from tests.staging.conftest import FakeRuntimeNode
from tests.staging.test_node import loop_task


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels (parsed by prometheus-client)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed.get((name, tuple(sorted(labels.items()))), 0.0)


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_gateway_metrics_move_with_traffic(tmp_path: Path) -> None:
    client, store = await start_gateway(FakeEngine(), tmp_path)
    other, _ = await start_gateway(FakeEngine(), tmp_path / "second")  # its own registry, same process
    try:
        admin = admin_headers(client)
        assert (await client.get("/metrics")).status == 401  # the control plane's token, like /admin
        before = samples(await (await client.get("/metrics", headers=admin)).text())
        assert value(before, "polar_gateway_engine_in_flight") == 0.0 and value(before, "polar_gateway_paused") == 0.0
        session = await (await client.post("/sessions", json={"session_id": "s1"}, headers=admin)).json()
        key = {"Authorization": f"Bearer {session['key']}"}
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json=CHAT_BODY, headers=key)).status == 200
        bad = await client.post("/v1/chat/completions", data=b"{not json",
                                headers={**key, "Content-Type": "application/json"})
        assert bad.status == 400
        anthropic = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/messages", json=anthropic, headers={"x-api-key": session["key"]})).status == 200

        resp = await client.get("/metrics", headers=admin)
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        after = samples(await resp.text())
        assert value(after, "polar_gateway_requests_total", provider="openai_chat", status="200") == 3
        assert value(after, "polar_gateway_requests_total", provider="openai_chat", status="400") == 1
        assert value(after, "polar_gateway_requests_total", provider="anthropic", status="200") == 1
        assert value(after, "polar_gateway_requests_total", provider="none", status="201") == 1  # POST /sessions
        assert value(after, "polar_gateway_sampled_tokens_total", provider="openai_chat") == 6  # 3 calls x 2 ids
        assert value(after, "polar_gateway_prompt_tokens_total", provider="anthropic") > 0
        assert value(after, "polar_gateway_records_total", provider="openai_chat", finish_reason="stop") == 3
        assert value(after, "polar_gateway_engine_latency_seconds_count", provider="openai_chat") == 3
        assert value(after, "polar_gateway_added_latency_seconds_count", provider="anthropic") == 1
        journal = store.path("s1").stat().st_size
        assert value(after, "polar_gateway_journal_bytes_total") == journal > 0

        untouched = samples(await (await other.get("/metrics", headers=admin_headers(other))).text())
        assert value(untouched, "polar_gateway_requests_total", provider="openai_chat", status="200") == 0

        # the sandbox-facing app counts into the same registry and has no /metrics of its own
        sandbox = TestClient(TestServer(Gateway.of(client.server.app).provider_app))
        await sandbox.start_server()
        try:
            assert (await sandbox.post("/v1/chat/completions", json=CHAT_BODY, headers=key)).status == 200
            assert (await sandbox.get("/metrics", headers=admin)).status == 404
        finally:
            await sandbox.close()
        last = samples(await (await client.get("/metrics", headers=admin)).text())
        assert value(last, "polar_gateway_requests_total", provider="openai_chat", status="200") == 4
    finally:
        await client.close()
        await other.close()


async def test_rollout_server_metrics_count_sessions(tmp_path: Path) -> None:
    config = NodeConfig(engine=SimulatedEngineConfig(latency_s=0.01), store=tmp_path / "store",
                        limits=PoolLimits(), tcp_port=None)
    node = FakeRuntimeNode(config)  # the simulated engine and FakeRuntime test doubles
    await node.start()
    server = RolloutServer([LocalNode(node)])
    app = build_server_app(server, "s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert (await client.get("/metrics")).status == 401
        before = samples(await (await client.get("/metrics", headers=auth)).text())
        assert value(before, "polar_rollout_sessions_finished_total", status="completed") == 0
        assert value(before, "polar_rollout_nodes", state="alive") == 1
        await server.run(loop_task(3))
        after = samples(await (await client.get("/metrics", headers=auth)).text())
        assert value(after, "polar_rollout_sessions_finished_total", status="completed") == 3
        assert value(after, "polar_rollout_reward_count") == 3 and value(after, "polar_rollout_reward_sum") == 3.0
        assert value(after, "polar_rollout_evaluator_seconds_count", evaluator="output") == 3
        assert value(after, "polar_rollout_stage_seconds_count", stage="running") == 3
        assert value(after, "polar_rollout_tasks", state="done") == 1
        assert value(after, "polar_rollout_sessions", stage="running") == 0
        assert value(after, "polar_rollout_engine_calls", node=node.node_id) > 0
        assert value(after, "polar_rollout_sampled_tokens", node=node.node_id) > 0
    await server.aclose()
