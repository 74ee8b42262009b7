"""VLLMPool against FakeVLLM test doubles (several servers): stickiness, spreading, failover on a
dead server, recovery through /health, and every config surface building a pool. The real
multi-process path (two ``polar-env engine`` servers, one killed mid-run) is in
tests/integrations/test_nemo_gym_pool.py."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fake_engines import MODEL, SEEN, fake_vllm_app

from polar_env.engines.config import VLLMEngineConfig, build_engine, engine_config
from polar_env.engines.vllm import VLLMClient
from polar_env.engines.vllm_pool import VLLMPool
from polar_env.errors import EngineHTTPError, EngineUnavailable
from polar_env.integrations.nemo_gym.agent import polar_env_config
from polar_env.records import ChatRequest
from tests.waits import until


def _app(status: list[int]) -> web.Application:
    app = fake_vllm_app()

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    @web.middleware
    async def fail(request: web.Request, handler: Any) -> Any:
        if status and request.path.startswith("/v1/chat"):
            return web.json_response({"error": {"message": "overloaded"}}, status=status[0])
        return await handler(request)

    app.middlewares.append(fail)
    app.router.add_get("/health", health)
    return app


async def _servers(n: int) -> tuple[list[TestServer], list[list[int]]]:
    statuses: list[list[int]] = [[] for _ in range(n)]
    servers = [TestServer(_app(s), host="127.0.0.1") for s in statuses]
    for s in servers:
        await s.start_server()
    return servers, statuses


def _req(session: str | None) -> ChatRequest:
    extra = {} if session is None else {"session_id": session}
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], extra_body=extra)


def _count(server: TestServer) -> int:
    return len(server.app[SEEN])


async def test_sessions_stick_and_spread() -> None:
    servers, _ = await _servers(3)
    pool = VLLMPool([str(s.make_url("")) for s in servers], MODEL)
    try:
        for _turn in range(3):
            for sid in ("a", "b", "c", "d", "e", "f"):
                await pool.generate(_req(sid))
        assert sorted(_count(s) for s in servers) == [6, 6, 6]  # 2 sessions x 3 turns each
        holders = {sid: pool.router.home(sid) for sid in "abcdef"}
        for s in servers:  # each server saw only its own sessions
            ids = {b["session_id"] for b in s.app[SEEN]}
            assert all(holders[i] == str(s.make_url("")).rstrip("/") for i in ids) and len(ids) == 2
    finally:
        await pool.aclose()
        for s in servers:
            await s.close()


async def test_dead_server_fails_over_and_comes_back() -> None:
    servers, _ = await _servers(2)
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    pool = VLLMPool(urls, MODEL, probe_interval_s=0.05)
    try:
        await pool.generate(_req("s1"))
        await pool.generate(_req("s2"))
        first, second = pool.router.home("s1"), pool.router.home("s2")
        assert first is not second
        port = servers[1].port
        await servers[1].close()  # s2's server dies
        gen = await pool.generate(_req("s2"))
        assert gen.response_ids and pool.failovers == 1
        assert pool.router.home("s2") == first and not pool.health()[urls[1]]["up"]
        assert "cannot reach" in str(pool.health()[urls[1]]["error"])
        revived = TestServer(_app([]), host="127.0.0.1", port=port)
        await revived.start_server()
        await until(lambda: pool.health()[urls[1]]["up"], "the pool to see the revived server up")
        assert pool.router.home("s2") == first  # a moved session stays where its cache now is
        await pool.generate(_req("s3"))
        assert _count(revived) == 1  # new sessions go to the revived, emptier server
        await revived.close()
    finally:
        await pool.aclose()
        await servers[0].close()


async def test_overload_status_fails_over_but_client_errors_do_not() -> None:
    servers, statuses = await _servers(2)
    pool = VLLMPool([str(s.make_url("")) for s in servers], MODEL)
    try:
        statuses[0].append(503)
        statuses[1].append(503)
        with pytest.raises(EngineUnavailable, match="every vLLM server is down"):
            await pool.generate(_req("x"))
        pool2 = VLLMPool([str(s.make_url("")) for s in servers], MODEL)
        statuses[0][:] = [400]
        statuses[1][:] = []
        with pytest.raises(EngineHTTPError):  # the request's fault: no failover, no server marked down
            await pool2.generate(_req("y"))
        assert all(h["up"] for h in pool2.health().values())
        await pool2.aclose()
    finally:
        await pool.aclose()
        for s in servers:
            await s.close()


def test_every_config_surface_builds_a_pool() -> None:
    one = build_engine(VLLMEngineConfig(url="http://127.0.0.1:1/v1", model=MODEL))
    assert isinstance(one, VLLMClient)
    for url in ("http://127.0.0.1:1/v1,http://127.0.0.1:2", ["http://127.0.0.1:1/v1", "http://127.0.0.1:2"]):
        pool = build_engine(VLLMEngineConfig(url=url, model=MODEL))
        assert isinstance(pool, VLLMPool) and pool.base_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cfg = engine_config({"kind": "vllm", "url": ["http://127.0.0.1:1", "http://127.0.0.1:2"]})
    assert isinstance(build_engine(cfg), VLLMPool)
    assert cfg.describe() == "vllm at http://127.0.0.1:1, http://127.0.0.1:2"
    # The Gym agent config with NeMo RL's list of per-DP-rank URLs (each an OpenAI base, /v1).
    polar = polar_env_config({"engine": {"kind": "vllm", "url": ["http://h:1/v1", "http://h:2/v1/"], "model": MODEL}})
    assert polar["engine"]["url"] == ["http://h:1", "http://h:2"]
    assert isinstance(build_engine(engine_config(polar["engine"])), VLLMPool)
