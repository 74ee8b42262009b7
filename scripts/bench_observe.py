"""What watching costs: the gateway with and without its Prometheus metrics, and the dashboard
over large stores.

1. Gateway: the real app in process, in front of a zero-latency engine double (4k prompt ids, 1k
   sampled ids per call), journaling to disk; 2,000 calls at concurrency 1 and 50, once with the
   metrics middleware and observation and once with both removed (the baseline), side by side.
2. Dashboard: a capture store of N sessions written through JournalStore and the outcome writer;
   time to index it (first request), a sorted page, the next page (cached) and one session page.

    python scripts/bench_observe.py [--calls 2000] [--sessions 1000 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.observe.metrics import METRICS
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, Generation, ProviderAPI, Timings

PROMPT = list(range(1000, 5096))
RESPONSE = list(range(2000, 3023)) + [248046]


class BenchEngine:
    """Engine double: answers at once with fixed ids (the gateway's own cost is what is measured)."""

    name = "bench"

    async def generate(self, request: ChatRequest) -> Generation:
        return Generation(message=AssistantMessage(content="ok"), prompt_ids=PROMPT, response_ids=RESPONSE,
                          response_logprobs=[-0.5] * len(RESPONSE), finish_reason="stop", engine="bench")

    async def aclose(self) -> None:
        return None


async def gateway_run(calls: int, concurrency: int, with_metrics: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        gateway = Gateway(BenchEngine(), JournalStore(Path(tmp)), GatewayConfig(engine_model="m"))  # type: ignore[arg-type]
        app = gateway.app
        if not with_metrics:
            app.middlewares.pop()  # the metrics middleware is the last one installed
            app[METRICS].unsubscribe()  # and no event subscriber: the call series cost nothing
        async with TestClient(TestServer(app)) as client:
            admin = {"Authorization": f"Bearer {gateway.config.admin_token}"}
            keys = []
            for i in range(concurrency):
                s = await (await client.post("/sessions", json={"session_id": f"s{i}"}, headers=admin)).json()
                keys.append({"Authorization": f"Bearer {s['key']}"})
            latencies: list[float] = []
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

            async def worker(key: dict[str, str], n: int) -> None:
                for _ in range(n):
                    started = time.perf_counter()
                    async with client.post("/v1/chat/completions", json=body, headers=key) as resp:
                        await resp.read()
                        assert resp.status == 200
                    latencies.append((time.perf_counter() - started) * 1000)

            await asyncio.gather(*(worker(k, calls // concurrency) for k in keys))
            return latencies


def write_store(root: Path, n: int) -> None:
    store = JournalStore(root / "capture" / "node-0")
    messages = [{"role": "user", "content": "hi"}]
    for i in range(n):
        sid = f"task{i % 250:03d}-g-{i // 250}"
        store.write_session_meta(SessionMeta(session_id=sid, key_sha256="0" * 64, created_at=0.0, closed=True,
                                             metadata={"task_id": f"task{i % 250:03d}", "harness": "pi"}))
        store.append(CompletionRecord(message=AssistantMessage(content="ok"), prompt_ids=PROMPT[:512],
                                      response_ids=RESPONSE[:64], response_logprobs=[-0.5] * 64, finish_reason="stop",
                                      session_id=sid, seq=0, provider_api=ProviderAPI.OPENAI_CHAT,
                                      provider_request={"messages": messages}, chat_request=ChatRequest(messages=messages),
                                      timings=Timings(received_at=0.0)))
        store.write_outcome(sid, {"session_id": sid, "task_id": f"task{i % 250:03d}", "status": "completed",
                                        "reward": float(i % 3 == 0), "records": 1,
                                        "stage_times": {"queued": 0.0, "done": 1.0}, "metadata": {"harness": "pi"}})
    store.close()


async def dashboard_run(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        write_store(Path(tmp), n)
        async with TestClient(TestServer(build_dashboard(Dashboard([Path(tmp)])))) as client:
            out = {}
            for label, path in (("index (first /api/runs)", "/api/runs"),
                                ("sorted page", "/api/runs/{run}/sessions?sort=reward&desc=1&limit=50"),
                                ("next page", "/api/runs/{run}/sessions?sort=reward&desc=1&offset=50&limit=50"),
                                ("session page", "/api/runs/{run}/sessions/task007-g-0"),
                                ("trace page", "/api/runs/{run}/sessions/task007-g-0/trace/0?limit=2000")):
                started = time.perf_counter()
                resp = await client.get(path.format(run=Path(tmp).name))
                await resp.read()
                assert resp.status == 200, path
                out[label] = (time.perf_counter() - started) * 1000
            return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1000, 5000])
    args = parser.parse_args()
    print("gateway per-call latency, ms (engine double answers at once; 4k prompt + 1k sampled ids)")
    print(f"{'concurrency':>11} {'baseline p50':>13} {'metrics p50':>12} {'ratio':>6} {'baseline p99':>13} {'metrics p99':>12}")
    asyncio.run(gateway_run(200, 1, with_metrics=True))  # warm-up: imports, tokenizer, allocator
    for concurrency in (1, 50):
        base: list[float] = []
        with_m: list[float] = []
        for first_with in (False, True, True, False):  # A B B A, so drift over time cancels
            (with_m if first_with else base).extend(asyncio.run(gateway_run(args.calls // 2, concurrency, first_with)))
        p50b, p50m = statistics.median(base), statistics.median(with_m)
        p99b, p99m = statistics.quantiles(base, n=100)[98], statistics.quantiles(with_m, n=100)[98]
        print(f"{concurrency:>11} {p50b:>13.3f} {p50m:>12.3f} {p50m / p50b:>6.3f} {p99b:>13.3f} {p99m:>12.3f}")
    print("\ndashboard, ms per request")
    for n in args.sessions:
        figures = asyncio.run(dashboard_run(n))
        print(f"{n:>6} sessions: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
