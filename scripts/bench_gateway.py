"""Gateway overhead: direct-to-engine vs through-the-gateway, in the same run.

A mock engine process answers every chat request with a fixed vLLM-shaped body (4k prompt ids,
1k response ids with logprobs, a tool call) after ``--engine-ms`` of simulated generation. The
gateway process runs the real pipeline against it (OpenAI-Chat provider, session key, vLLM client,
journal on disk). The load generator drives both at 1, 50 and 200 concurrent sessions, streaming
and not, and prints latency p50/p99, the gateway's added latency and the throughput ratio.

    python scripts/bench_gateway.py [--engine-ms 200] [--seconds 8] [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp
import orjson

PROMPT_IDS = 4096
RESPONSE_IDS = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_body() -> bytes:
    rng = random.Random(0)
    ids = [rng.randrange(248_000) for _ in range(RESPONSE_IDS - 1)] + [248046]
    return orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "prompt_token_ids": [rng.randrange(248_000) for _ in range(PROMPT_IDS)],
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": None, "reasoning": "Plan " * 40,
                        "tool_calls": [{"id": "chatcmpl-tool-0123456789abcdef0123456789abcdef", "type": "function",
                                        "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}]},
            "logprobs": {"content": [{"token": f"t{i}", "logprob": -rng.random() * 5, "bytes": [116], "top_logprobs": []} for i in ids]},
            "token_ids": ids, "finish_reason": "tool_calls", "stop_reason": None,
        }],
        "usage": {"prompt_tokens": PROMPT_IDS, "completion_tokens": RESPONSE_IDS, "total_tokens": PROMPT_IDS + RESPONSE_IDS},
    })


def run_mock_engine(port: int, engine_ms: float) -> None:
    """Child process: a vLLM-shaped mock answering after ``engine_ms``."""
    from aiohttp import web

    body = engine_body()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(engine_ms / 1000)  # fixed, so direct and gateway latencies compare exactly
        return web.Response(body=body, content_type="application/json")

    async def models(request: web.Request) -> web.Response:  # the gateway's start-up check reads it
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=1024)


def wait_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} never opened")


async def drive(url: str, body: dict, headers: dict[str, str], concurrency: int, seconds: float, spread_s: float) -> list[float]:
    """``concurrency`` closed-loop clients for ``seconds``; returns per-request latencies (ms).

    Clients start spread over ``spread_s`` (one engine call): sessions of a rollout are not
    synchronised, and starting them all at once would measure one burst instead of a steady state.
    """
    latencies: list[float] = []
    payload = orjson.dumps(body)
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def client(i: int) -> None:
            await asyncio.sleep(spread_s * i / concurrency)
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                async with s.post(url, data=payload, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append((time.perf_counter() - start) * 1000)

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return latencies


def cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds a process has used so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def stage_cpu_ns(s: aiohttp.ClientSession, gateway_url: str) -> dict[str, int]:
    """The gateway's cumulative CPU ns per call stage (``polar_env.stagecpu``; {} for a tree without it)."""
    async with s.get(f"{gateway_url}/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
        status = await r.json() if r.status == 200 else {}
    return {name: v["cpu_ns"] for name, v in status.get("stage_cpu", {}).items()}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


ADMIN_TOKEN = "polar-bench-admin"


async def main_async(args: argparse.Namespace) -> None:
    engine_port, gateway_port = free_port(), free_port()
    store = tempfile.mkdtemp(prefix="polar-bench-")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--serve-engine", str(engine_port), "--engine-ms", str(args.engine_ms)]),
        subprocess.Popen([sys.executable, "-m", "polar_env.cli", "gateway", "--port", str(gateway_port), "--engine", "vllm",
                          "--admin-token", ADMIN_TOKEN,
                          "--engine-url", f"http://127.0.0.1:{engine_port}", "--store", store], stdout=subprocess.PIPE,
                         env={**os.environ, "POLAR_ENV_LOOP": args.loop} if args.loop else None, text=True),
    ]
    try:
        wait_port(engine_port)
        wait_port(gateway_port)
        assert procs[1].stdout is not None
        ready = procs[1].stdout.readline().strip()  # names the gateway's event loop
        threading.Thread(target=procs[1].stdout.read, daemon=True).start()  # whatever follows, drained
        engine_url = f"http://127.0.0.1:{engine_port}/v1/chat/completions"
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        request = {"model": "bench", "messages": [{"role": "user", "content": "go " * 200}],
                   "tools": [{"type": "function", "function": {
                       "name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gateway_url}/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                key = (await r.json())["key"]
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        print(f"mock engine: {PROMPT_IDS} prompt ids, {RESPONSE_IDS} response ids + logprobs, {len(engine_body()) / 1e3:.0f} kB, "
              f"{args.engine_ms:g} ms per call; {args.seconds:g} s per cell; {os.cpu_count()} CPUs shared by all three processes; "
              f"load {os.getloadavg()[0]:.2f}\n{ready}")
        print(f"{'sessions':>8} {'stream':>6} | {'direct p50':>10} {'p99':>7} | {'gateway p50':>11} {'p99':>7} | "
              f"{'added p50':>9} {'p99':>7} | {'direct rps':>10} {'gw rps':>7} {'ratio':>6} | {'gw CPU/req':>10} {'of it sys':>9}")
        for concurrency in args.concurrency:
            for stream in args.stream:
                spread = args.engine_ms / 1000
                plain = {"Content-Type": "application/json"}
                await drive(engine_url, request, plain, concurrency, 1.0, spread)  # warm
                direct = await drive(engine_url, request, plain, concurrency, args.seconds, spread)
                async with aiohttp.ClientSession() as s:
                    stages0 = await stage_cpu_ns(s, gateway_url)
                gw_cpu = cpu_s(procs[1].pid)
                via = await drive(f"{gateway_url}/v1/chat/completions", {**request, "stream": stream}, auth, concurrency,
                                  args.seconds, spread)
                user, system = (b - a for a, b in zip(gw_cpu, cpu_s(procs[1].pid), strict=True))
                async with aiohttp.ClientSession() as s:
                    stages = {k: v - stages0.get(k, 0) for k, v in (await stage_cpu_ns(s, gateway_url)).items()}
                gw_cpu_ms = (user + system) / max(len(via), 1) * 1000  # sys: the kernel's socket work (loopback sends)
                sys_ms = system / max(len(via), 1) * 1000
                d50, d99, g50, g99 = pct(direct, 50), pct(direct, 99), pct(via, 50), pct(via, 99)
                drps, grps = len(direct) / args.seconds, len(via) / args.seconds
                print(f"{concurrency:>8} {str(stream):>6} | {d50:>8.1f}ms {d99:>5.1f}ms | {g50:>9.1f}ms {g99:>5.1f}ms | "
                      f"{g50 - d50:>7.2f}ms {g99 - d99:>5.2f}ms | {drps:>10.1f} {grps:>7.1f} {grps / drps:>6.2f} | "
                      f"{gw_cpu_ms:>8.2f}ms {sys_ms:>7.2f}ms")
                if stages:  # CPU per request by stage (the journal's on its writer thread or inline)
                    per = {k: v / 1e6 / max(len(via), 1) for k, v in stages.items()}
                    print(f"{'':>15} stages ms/req: sum {sum(per.values()):.3f}; "
                          + " ".join(f"{k} {v:.3f}" for k, v in per.items()))
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-ms", type=float, default=200.0, help="simulated generation time per call")
    parser.add_argument("--seconds", type=float, default=8.0, help="measurement time per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 50, 200], help="concurrent sessions per cell")
    parser.add_argument("--stream", type=lambda v: v.lower() in ("1", "true", "yes"), nargs="+", default=[False, True],
                        help="streaming modes to measure (true/false)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"],
                        help="the gateway's event loop (POLAR_ENV_LOOP; default: uvloop where installed)")
    parser.add_argument("--serve-engine", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        run_mock_engine(args.serve_engine, args.engine_ms)
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
