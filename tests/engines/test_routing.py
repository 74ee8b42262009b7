"""Session-affine, load-aware routing (polar_env/engines/routing.py) and the prefix-cache figures,
on the router itself and through the vLLM pool and the SGLang client against named test doubles
(tests/fake_engines.py: PrefixCacheVLLM keeps a block prefix cache and reports it as vLLM does)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from fake_engines import MODEL, PrefixCacheVLLM, ScriptedEngine, load_fixture

from polar_env.engines.routing import AffinityRouter, cached_tokens, merge_reports, prefix_counters
from polar_env.engines.sglang import SGLangClient
from polar_env.engines.vllm_pool import VLLMPool
from polar_env.records import ChatRequest
from polar_env.staging.topology import engine_members
from tests.waits import until

A, B, C = "http://a", "http://b", "http://c"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_session_stays_on_its_server_and_new_ones_go_to_the_least_loaded() -> None:
    router = AffinityRouter([A, B])
    first = router.route("long", 0)
    assert first is not None
    router.finish(first, "long", 90_000, 0, 90_500)  # a 90k context now held there
    for _ in range(3):
        assert router.route("long") == first
        router.finish(first, "long", 91_000, 90_496, 91_500)
    other = router.route("short", 0)
    assert other is not None and other != first  # one live session against none
    router.finish(other, "short", 1_000, 0, 1_200)
    assert router.route("short2") == other  # one session each: far fewer tokens held there
    assert router.route("short3") == first  # one call in flight there, none here
    assert router.report()["servers"][first]["sessions"] == 2 and router.report()["placements"] == 4


def test_an_overloaded_home_spills_to_the_least_loaded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    router = AffinityRouter([A, B], spill_abs=2, spill_rel=1.5)
    home = router.route("s")
    assert home is not None
    router.finish(home, "s", 100, 0, 110)
    other = B if home == A else A
    router.set_up(other, False)
    for i in range(3):  # three calls of other sessions placed on the same server, still in flight
        router.route(f"busy{i}")
    router.set_up(other, True)
    assert router.report()["servers"][home]["in_flight"] == 3
    with caplog.at_level(logging.INFO, logger="polar_env.engines.routing"):
        moved = router.route("s")
    assert moved is not None and moved != home
    assert router.spills == 1 and router.home("s") == moved  # the spill server is the new home
    figures = router.report()["servers"]
    assert figures[home]["spilled_out"] == 1 and figures[moved]["spilled_in"] == 1
    assert "spilled from" in caplog.text
    # Below the threshold it stays home: 1 in flight against 0 is not overload.
    calm = AffinityRouter([A, B], spill_abs=2)
    h = calm.route("x")
    assert h is not None
    assert calm.route("x") == h and calm.spills == 0


def test_a_new_weight_version_places_sessions_afresh_and_their_next_call_counts_as_cold() -> None:
    router = AffinityRouter([A, B])
    homes = {}
    for sid in ("s1", "s2", "s3", "s4"):
        url = router.route(sid)
        assert url is not None
        homes[sid] = url
        router.finish(url, sid, 1000, 0, 1100)
        router.route(sid)
        router.finish(url, sid, 1200, 1088, 1300)
    assert router.report()["warm_hit_rate"] == round(4 * 1088 / (4 * 1200), 4)
    router.set_version("v2")
    assert all(router.home(sid) is None for sid in homes)  # no home survives: its KV is the old weights'
    assert all(f["sessions"] == 0 and f["held_tokens"] == 0 for f in router.report()["servers"].values())
    url = router.route("s1")
    assert url is not None
    router.finish(url, "s1", 1400, 0, 1500)  # the engine flushed: a cold call, not a warm miss
    report = router.report()
    assert report["warm_prompt_tokens"] == 4 * 1200 and report["weight_version"] == "v2"
    assert report["sessions"]["s1"]["calls"] == 3 and report["placements"] == 5


def test_idle_sessions_stop_counting_as_load_but_keep_their_home() -> None:
    clock = Clock()
    router = AffinityRouter([A, B], idle_s=60, clock=clock)
    old = router.route("old")
    assert old is not None
    router.finish(old, "old", 50_000, 0, 50_100)
    clock.now = 120.0
    fresh = router.route("fresh")  # the old session's 50k no longer weigh on its server
    assert fresh is not None
    assert router.report()["servers"][old]["held_tokens"] == 0
    assert router.route("old") == old and router.report()["servers"][old]["held_tokens"] == 50_100


def test_a_removed_or_dead_server_moves_only_its_sessions() -> None:
    router = AffinityRouter([A, B, C])
    homes = {sid: router.route(sid) for sid in ("s1", "s2", "s3")}
    assert set(homes.values()) == {A, B, C}
    router.set_servers([A, B])
    assert router.home(next(s for s, u in homes.items() if u == C)) is None
    assert [router.home(s) for s, u in homes.items() if u != C] == [u for u in homes.values() if u != C]
    router.set_up(A, False)
    assert router.route(next(s for s, u in homes.items() if u == A)) == B
    assert router.route("z", exclude=[B]) is None  # A down, B excluded: nothing to route to


def test_hit_rates_per_server_and_session_and_merged_over_nodes() -> None:
    router = AffinityRouter([A, B])
    a = router.route("s")
    assert a is not None
    router.finish(a, "s", 1000, 0, 1100)  # first call: cold
    router.route("s")
    router.finish(a, "s", 1200, 1100, 1300)
    router.route("s")
    router.finish(a, "s", 1400, None, 1500)  # the engine reported nothing: not counted
    report = router.report()
    assert report["hit_rate"] == round(1100 / 2200, 4) and report["warm_hit_rate"] == round(1100 / 1200, 4)
    assert report["sessions"]["s"] == {"server": a, "calls": 2, "prompt_tokens": 2200, "cached_tokens": 1100,
                                       "hit_rate": 0.5, "warm_hit_rate": round(1100 / 1200, 4)}
    assert report["min_server_hit_rate"] == 0.5  # the other server served nothing: no rate, not 0
    merged = merge_reports([report, report])
    assert merged is not None and merged["prompt_tokens"] == 4400 and merged["servers"][a]["calls"] == 4
    assert merged["hit_rate"] == 0.5 and merge_reports([]) is None


def test_the_engines_counters_are_read_as_vllm_and_sglang_export_them() -> None:
    vllm = ('# TYPE vllm:prefix_cache_queries_total counter\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0\n'
            'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n')
    assert prefix_counters(vllm) == (1500.0, 900.0)
    sglang = ('sglang:prompt_tokens_total{model_name="q"} 4096\n'
              'sglang:cached_tokens_total{cache_source="device",model_name="q"} 3000\n'
              'sglang:cached_tokens_total{cache_source="host",model_name="q"} 168\n')
    assert prefix_counters(sglang) == (4096.0, 3168.0)
    assert prefix_counters("# nothing\nother_metric 3\n") is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 48}}) == 48
    assert cached_tokens({"prompt_tokens_details": None}) is None and cached_tokens(None) is None
    router = AffinityRouter([A])
    router.observe_metrics(A, 1000, 100)
    router.observe_metrics(A, 3000, 1900)  # since the first scrape: 1800 of 2000
    assert router.report()["servers"][A]["engine_hit_rate"] == 0.9


@pytest.fixture
async def vllm_servers() -> AsyncIterator[list[PrefixCacheVLLM]]:
    servers = [await PrefixCacheVLLM().start() for _ in range(2)]
    yield servers
    for s in servers:
        await s.stop()


def _turn(session: str, ids: list[int]) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], prompt_ids=ids, extra_body={"session_id": session})


async def test_the_pool_keeps_multi_turn_sessions_on_their_prefix_and_reports_hit_rates(
        vllm_servers: list[PrefixCacheVLLM]) -> None:
    pool = VLLMPool([s.url for s in vllm_servers], MODEL, metrics_interval_s=0.05)
    contexts = {f"s{i}": [1000 * i + t for t in range(200)] for i in range(4)}
    try:
        for _turn_no in range(5):
            for sid, ids in contexts.items():
                gen = await pool.generate(_turn(sid, ids))
                ids.extend(gen.response_ids + list(range(50)))  # the reply, then a tool result
        report = pool.prefix_cache()
        assert report["warm_hit_rate"] is not None and report["warm_hit_rate"] >= 0.8
        assert report["spills"] == 0 and report["placements"] == 4
        for sid in contexts:  # every call of a session went to one server
            assert sum(sid in s.sessions for s in vllm_servers) == 1
            assert report["sessions"][sid]["calls"] == 5
        assert all(f["sessions"] == 2 and f["hit_rate"] is not None for f in report["servers"].values())
        # the servers' own counters, read before the first call and since: the same figures as the usage
        await until(lambda: all(f["engine_hit_rate"] == f["hit_rate"] for f in pool.prefix_cache()["servers"].values()),
                    "the pool to read both servers' /metrics")
        members = engine_members(pool)
        shown, listed = members["prefix_cache"], members["members"]
        assert isinstance(shown, dict) and shown["hit_rate"] == report["hit_rate"]
        assert isinstance(listed, list) and all("hit_rate" in m for m in listed)  # the dashboard's columns
        # A weight update: the servers drop their cache; no session is sent back for its old prefix.
        pool.set_weight_version("1")
        for s in vllm_servers:
            s.cached.clear()
        for sid, ids in contexts.items():
            await pool.generate(_turn(sid, ids))
        after = pool.prefix_cache()
        assert after["placements"] == 8 and after["warm_prompt_tokens"] == report["warm_prompt_tokens"]
    finally:
        await pool.aclose()


async def test_new_sessions_go_where_fewer_sessions_and_tokens_are(vllm_servers: list[PrefixCacheVLLM]) -> None:
    pool = VLLMPool([s.url for s in vllm_servers], MODEL, metrics_interval_s=60)
    try:
        await pool.generate(_turn("huge", list(range(5000))))
        hot = pool.router.home("huge")
        for i in range(2):  # one session each after the first: then the 5k tokens held decide
            await pool.generate(_turn(f"small{i}", [9_000_000 + 100 * i + t for t in range(50)]))
        assert all(pool.router.home(f"small{i}") != hot for i in range(2))
    finally:
        await pool.aclose()


async def test_sglang_counts_cached_tokens_from_chat_usage_and_generate_meta() -> None:
    workers = [await ScriptedEngine().start() for _ in range(2)]
    chat = load_fixture("sglang_chat.json")
    chat["usage"] = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
    for w in workers:
        w.reply("/v1/chat/completions", chat)
        w.metrics = 'sglang:prompt_tokens_total{model_name="q"} 100\nsglang:cached_tokens_total{model_name="q"} 80\n'
    client = SGLangClient([w.url for w in workers], MODEL, metrics_interval_s=60)
    try:
        for _ in range(3):
            await client.generate(ChatRequest(messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"session_id": "s"}))
        report = client.prefix_cache()
        home = client.router.home("s")
        assert home is not None and report["servers"][home]["calls"] == 3
        prompt = report["sessions"]["s"]["prompt_tokens"] // 3
        assert report["sessions"]["s"]["cached_tokens"] == 3 * min(8, prompt)
        assert [len(w.requests) for w in workers].count(3) == 1
        client.set_weight_version("8")
        assert client.router.home("s") is None
    finally:
        await client.aclose()
        for w in workers:
            await w.close()


def test_the_simulator_meets_the_done_when_figures_with_the_real_router() -> None:
    """scripts/bench_routing.py at a reduced size (seeded, no clock): the router keeps >= 90 % of
    prompt tokens after each session's first call in cache and no server under 50 %, where
    spreading calls round robin does not."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_routing

    args = argparse.Namespace(servers=4, sessions=96, live=48, context=100_000, shared=4_000, kv_tokens=1_000_000,
                              prefill_tps=20_000.0, decode_tps=50.0, reply=300, tool_s=5.0)
    affine = bench_routing.simulate(AffinityRouter, args, seed=0)
    spread = bench_routing.simulate(bench_routing.RoundRobin, args, seed=0)
    assert affine["warm_hit_rate"] >= 0.9 and affine["min_server_hit_rate"] >= 0.5
    assert spread["warm_hit_rate"] < affine["warm_hit_rate"] - 0.1
