"""Embedded engine figures on this machine: process startup, decode tokens/s, prefill latency.

Baseline, side by side: the same decode in-process (no HTTP) vs through the vLLM-shaped server,
so the server's own cost shows as a ratio. Run: ``python scripts/bench_engine.py``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import aiohttp

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.records import ChatRequest

TOKENS = 256
LONG_PROMPT = "lorem ipsum dolor sit amet " * 800  # ~4.8k tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int) -> tuple[subprocess.Popen[str], float]:
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_env.cli", "engine", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready in" in line:
            return proc, time.perf_counter() - started
    raise RuntimeError("engine exited before becoming ready")


async def http_decode(url: str, concurrency: int) -> float:
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": TOKENS, "seed": 0,
            "logprobs": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> int:
            async with s.post(url, json={**body, "seed": i}) as r:
                return len((await r.json())["choices"][0]["token_ids"])
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return sum(counts) / (time.perf_counter() - start)


async def http_prefill(url: str) -> tuple[int, float]:
    body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        start = time.perf_counter()
        async with s.post(url, json=body) as r:
            data = await r.json()
        return len(data["prompt_token_ids"]), (time.perf_counter() - start) * 1000


def main() -> None:
    engine = EmbeddedEngine()
    req = ChatRequest(messages=[{"role": "user", "content": "go"}], max_tokens=TOKENS, seed=0)
    engine.complete(req)
    start = time.perf_counter()
    n = len(engine.complete(req).generation.response_ids)
    in_process = n / (time.perf_counter() - start)

    port = free_port()
    proc, startup_s = start_server(port)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(http_decode(url, 1))  # warm-up
        single = asyncio.run(http_decode(url, 1))
        four = asyncio.run(http_decode(url, 4))
        prompt_len, prefill_ms = asyncio.run(http_prefill(url))
    finally:
        proc.terminate()
        proc.wait()
    print(f"engine process startup (spawn → ready)      : {startup_s:6.1f} s")
    print(f"decode, in-process [baseline]                : {in_process:6.0f} tok/s")
    print(f"decode, HTTP, 1 stream                       : {single:6.0f} tok/s  ({single / in_process:.2f}x baseline)")
    print(f"decode, HTTP, 4 concurrent (aggregate)       : {four:6.0f} tok/s  ({four / in_process:.2f}x baseline)")
    print(f"prefill {prompt_len} prompt tokens + 1 token (HTTP) : {prefill_ms:6.0f} ms")


if __name__ == "__main__":
    main()
