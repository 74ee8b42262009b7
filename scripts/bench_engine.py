"""Embedded engine figures on this machine: sampled tokens/s at 1, 4 and 16 concurrent requests,
this tree against a baseline tree side by side (continuous batching, issue 46); ``--http`` for the
older figures (process startup, in-process vs HTTP decode, prefill latency).

Each (tree, model) measurement is a fresh subprocess with that tree first on ``PYTHONPATH``: it
loads the model, warms up, then runs N requests at once (threads calling ``complete``, each
``ignore_eos`` so every request samples exactly ``--tokens``) and reports wall and CPU seconds
(the process's, all threads). Rounds alternate baseline and this tree, so a load change on a
shared machine hits both; the load average is printed per round. Run::

    python scripts/bench_engine.py [--models tiny,smollm2] [--concurrency 1,4,16] [--rounds 3]
        [--tokens 32] [--smollm2-tokens 16] [--baseline-rev REV ... | --no-baseline] [--baseline-threads 1]
    python scripts/bench_engine.py --http
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENS = 256
LONG_PROMPT = "lorem ipsum dolor sit amet " * 800  # ~4.8k tokens


# -- the worker: one tree, one model, every concurrency ----------------------------------------
def worker(model: str, levels: list[int], tokens: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from polar_env.engines.embedded.engine import EmbeddedEngine, SamplingExtras
    from polar_env.records import ChatRequest

    if model == "smollm2":
        from polar_env.engines.config import EmbeddedEngineConfig

        engine = EmbeddedEngineConfig(template="smollm2", model="smollm2").build()
    else:
        engine = EmbeddedEngine()
    assert isinstance(engine, EmbeddedEngine)
    extras = SamplingExtras(ignore_eos=True)

    def one(i: int) -> int:
        request = ChatRequest(messages=[{"role": "user", "content": f"Tell me story number {i}."}],
                              max_tokens=tokens, temperature=1.0, seed=i)
        return len(engine.complete(request, extras).generation.response_ids)

    one(0)  # warm-up
    results = {}
    for n in levels:
        with ThreadPoolExecutor(n) as pool:
            wall, cpu = time.perf_counter(), time.process_time()
            sampled = sum(pool.map(one, range(1, n + 1)))
            results[n] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "tokens": sampled}
    print("RESULT " + json.dumps(results), flush=True)


def baseline_tree(rev: str) -> Path:
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    out = Path(tempfile.gettempdir()) / f"polar-bench-engine-{sha}"
    if not (out / "polar_env").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", sha, "polar_env"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def measure(tree: Path, model: str, levels: list[int], tokens: int, threads: int | None) -> dict[int, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, "--concurrency",
           ",".join(map(str, levels)), "--tokens", str(tokens)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"worker failed ({tree}, {model}): {done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


def compare(args: argparse.Namespace) -> None:
    levels = [int(n) for n in args.concurrency.split(",")]
    variants: list[tuple[str, Path, int | None]] = []
    for rev in [] if args.no_baseline else args.baseline_rev or ["HEAD"]:
        base = baseline_tree(rev)
        variants.append((f"before ({rev})", base, None))
        if args.baseline_threads:
            variants.append((f"before ({rev}), {args.baseline_threads} thread(s)", base, args.baseline_threads))
    variants.append(("after", REPO, None))
    befores = [name for name, _, _ in variants[:-1]]
    loads: list[float] = []
    runs: dict[tuple[str, str], list[dict[int, dict[str, float]]]] = {}
    for model in args.models.split(","):
        tokens = args.smollm2_tokens if model == "smollm2" else args.tokens
        for r in range(args.rounds):
            for name, tree, threads in variants:  # alternate: a load change hits every variant
                load = os.getloadavg()[0]
                loads.append(load)
                result = measure(tree, model, levels, tokens, threads)
                runs.setdefault((model, name), []).append(result)
                rates = "  ".join(f"{n}:{v['tokens'] / v['wall']:6.1f}" for n, v in result.items())
                print(f"[{model} round {r + 1} {name:<24}] load {load:4.1f}  tok/s {rates}", flush=True)
    print(f"\nload average (1 min) during the runs: mean {statistics.mean(loads):.1f}, "
          f"min {min(loads):.1f}, max {max(loads):.1f} on {os.cpu_count()} CPUs; median of {args.rounds} rounds\n")
    print("cells: sampled tok/s (CPU-ms per token); after: ratio to each baseline, wall (CPU)\n")
    header = "| model | tree | " + " | ".join(f"{n} req" for n in levels) + " |"
    print(header)
    print("|" + "---|" * (2 + len(levels)))
    for (model, name), results in runs.items():
        cells = []
        for n in levels:
            rate = statistics.median(res[n]["tokens"] / res[n]["wall"] for res in results)
            cpu = statistics.median(res[n]["cpu"] / res[n]["tokens"] * 1000 for res in results)
            ratios = []
            for before in befores if name == "after" else []:  # after ÷ each baseline
                base_rate = statistics.median(res[n]["tokens"] / res[n]["wall"] for res in runs[(model, before)])
                base_cpu = statistics.median(res[n]["cpu"] / res[n]["tokens"] * 1000 for res in runs[(model, before)])
                ratios.append(f"{rate / base_rate:.1f}x ({base_cpu / cpu:.1f}x CPU)")
            ratio = f" **{' / '.join(ratios)}**" if ratios else ""
            cells.append(f"{rate:.1f} ({cpu:.1f}){ratio}")
        print(f"| {model} | {name} | " + " | ".join(cells) + " |")


# -- the older figures: startup, in-process vs HTTP ---------------------------------------------
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
    import aiohttp

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
    import aiohttp

    body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        start = time.perf_counter()
        async with s.post(url, json=body) as r:
            data = await r.json()
        return len(data["prompt_token_ids"]), (time.perf_counter() - start) * 1000


def http_figures() -> None:
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.records import ChatRequest

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="tiny (the seeded default) and/or smollm2")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="sampled tokens per request (tiny model)")
    ap.add_argument("--smollm2-tokens", type=int, default=16, help="sampled tokens per request (SmolLM2)")
    ap.add_argument("--baseline-rev", action="append",
                    help="a git tree to compare against (git archive); repeat for several (default HEAD)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--baseline-threads", type=int, help="also run the baseline with this many torch threads")
    ap.add_argument("--http", action="store_true", help="startup, in-process vs HTTP decode, prefill (this tree)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, [int(n) for n in args.concurrency.split(",")], args.tokens)
    elif args.http:
        http_figures()
    else:
        compare(args)


if __name__ == "__main__":
    main()
