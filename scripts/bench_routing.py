"""Routing policies over N engine servers at production scale, simulated: prefix-cache hit rate,
per-server load and time to first token for round robin, pure hashing, the previous pool's
sticky placement and session-affine load-aware routing (``polar_env.engines.routing.AffinityRouter``,
the class the vLLM pool and the SGLang client route with, imported, not copied), side by side.

The simulation (discrete events, seeded; no engine, no network):
- sessions: ``--live`` run at once out of ``--sessions``; a finished one is replaced by the next
  (an RL rollout's session pool). Turns per session are skewed (log-normal: most sessions short,
  a few 100 turns); each starts from a ``--shared`` token prefix common to all (system prompt,
  tools) plus a task, and grows by its own per-turn amount (tool output + reply) to at most
  ``--context`` tokens; between turns a tool runs (exponential, mean ``--tool-s``).
- servers: a KV cache of ``--kv-tokens`` with LRU eviction of whole sequences; a call's cached
  tokens are the longest of its session's sequence on that server (an earlier, shorter context
  is a prefix of the new one) and the shared prefix, as vLLM's block cache finds them. Prefill
  runs one call at a time per server at ``--prefill-tps`` uncached tokens/s (queueing is what
  overload costs); decode takes ``--reply`` tokens at ``--decode-tps``.
- a routed call is ``route``d when it arrives and ``finish``ed with the usage the server
  reported, exactly as the clients do.

Printed per policy (median over ``--seeds``): prompt tokens from cache overall and after each
session's first call, the lowest per-server hit rate, per-server load (share of prefill work on
the busiest server ÷ the mean), spills, and time to first token (mean, p50, p99); then the
ratios of session-affine to the others.

    python scripts/bench_routing.py [--servers 8] [--sessions 768] [--live 256] [--context 100000]
        [--kv-tokens 1000000] [--prefill-tps 20000] [--seeds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_env.engines.routing import AffinityRouter  # noqa: E402 - after the path is set


# ---- the policies ---------------------------------------------------------------------------
class RoundRobin:
    """Every call to the next server (a router without affinity)."""

    def __init__(self, urls: list[str], clock: object = None) -> None:
        self.urls, self.n = urls, itertools.count()

    def route(self, session: str | None, prompt_tokens: int = 0) -> str | None:
        return self.urls[next(self.n) % len(self.urls)]

    def finish(self, url: str, session: str | None, prompt_tokens: int | None = None,
               cached_tokens: int | None = None, context_tokens: int | None = None) -> None:
        pass

    spills = 0


class PureHash(RoundRobin):
    """A session to the server its id hashes to, whatever the load (rendezvous hash: the SGLang
    client's routing before this change)."""

    def route(self, session: str | None, prompt_tokens: int = 0) -> str | None:
        key = session or ""
        return max(self.urls, key=lambda u: hashlib.blake2b(f"{key}\0{u}".encode(), digest_size=8).digest())


class StickyFewestSessions(RoundRobin):
    """The vLLM pool before this change: a session sticks to the server it was first given, new
    sessions go to the server that was given the fewest (never released: no load, no tokens)."""

    def __init__(self, urls: list[str], clock: object = None) -> None:
        super().__init__(urls)
        self.home: dict[str, str] = {}
        self.count = dict.fromkeys(urls, 0)

    def route(self, session: str | None, prompt_tokens: int = 0) -> str | None:
        key = session or ""
        if key not in self.home:
            url = min(self.urls, key=lambda u: self.count[u])
            self.home[key] = url
            self.count[url] += 1
        return self.home[key]


class Policy:  # what the simulation calls: AffinityRouter's route/finish signature
    route: Callable[..., str | None]
    finish: Callable[..., None]
    spills: int


# ---- the world ------------------------------------------------------------------------------
@dataclass
class Server:
    kv_tokens: int
    cache: OrderedDict[str, int] = field(default_factory=OrderedDict)  # sequence -> tokens, LRU first
    held: int = 0
    free_at: float = 0.0  # when the prefill queue is empty
    prompt: int = 0
    cached: int = 0
    prefill_tokens: int = 0

    def lookup(self, key: str, shared: int) -> int:
        best = 0
        if key in self.cache:
            self.cache.move_to_end(key)
            best = self.cache[key]
        if "shared" in self.cache:
            self.cache.move_to_end("shared")
            best = max(best, shared)
        return best

    def store(self, key: str, tokens: int) -> None:
        self.held += tokens - self.cache.get(key, 0)
        self.cache[key] = tokens
        self.cache.move_to_end(key)
        while self.held > self.kv_tokens and len(self.cache) > 1:
            _, dropped = self.cache.popitem(last=False)
            self.held -= dropped


@dataclass
class Session:
    sid: str
    turns: int
    context: int
    growth: int
    turn: int = 0


@dataclass
class Figures:
    prompt: int = 0
    cached: int = 0
    warm_prompt: int = 0
    warm_cached: int = 0
    ttft: list[float] = field(default_factory=list)


def make_sessions(args: argparse.Namespace, rng: random.Random) -> list[Session]:
    out = []
    for i in range(args.sessions):
        turns = max(2, min(100, int(rng.lognormvariate(math.log(20), 0.9))))  # median 20, a tail to 100
        start = args.shared + rng.randint(500, 4000)
        growth = max(200, (args.context - start) // 100 + rng.randint(-300, 300))  # ~100k at 100 turns
        out.append(Session(f"s{i}", turns, start, growth))
    return out


def simulate(make: Callable[..., Policy], args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    urls = [f"http://server{i}" for i in range(args.servers)]
    clock = [0.0]
    policy = make(urls, clock=lambda: clock[0])  # the simulation's time, not the wall's
    servers = {u: Server(args.kv_tokens) for u in urls}
    waiting = make_sessions(args, rng)
    waiting.reverse()
    events: list[tuple[float, int, str, Session]] = []
    tie = itertools.count()
    figures = Figures()
    for _ in range(min(args.live, len(waiting))):
        heapq.heappush(events, (rng.uniform(0, 30), next(tie), "call", waiting.pop()))
    decode_s = args.reply / args.decode_tps
    while events:
        now, _, kind, s = heapq.heappop(events)
        clock[0] = now
        if kind == "call":
            prompt = min(s.context, args.context)
            url = policy.route(s.sid, prompt)
            assert url is not None
            server = servers[url]
            cached = min(server.lookup(s.sid, args.shared), prompt - 1)
            start = max(now, server.free_at)
            server.free_at = start + (prompt - cached) / args.prefill_tps
            figures.ttft.append(server.free_at - now)
            server.prompt += prompt
            server.cached += cached
            server.prefill_tokens += prompt - cached
            figures.prompt += prompt
            figures.cached += cached
            if s.turn > 0:
                figures.warm_prompt += prompt
                figures.warm_cached += cached
            server.store(s.sid, prompt)
            server.store("shared", args.shared)
            done = server.free_at + decode_s
            heapq.heappush(events, (done, next(tie), f"done {url} {prompt} {cached}", s))
        else:
            _, url, prompt_s, cached_s = kind.split(" ")
            prompt, cached = int(prompt_s), int(cached_s)
            servers[url].store(s.sid, prompt + args.reply)
            policy.finish(url, s.sid, prompt, cached, prompt + args.reply)
            s.turn += 1
            s.context += s.growth
            if s.turn < s.turns:
                heapq.heappush(events, (now + rng.expovariate(1 / args.tool_s), next(tie), "call", s))
            elif waiting:
                heapq.heappush(events, (now + rng.uniform(0, 2), next(tie), "call", waiting.pop()))
    rates = [sv.cached / sv.prompt for sv in servers.values() if sv.prompt]
    work = [sv.prefill_tokens for sv in servers.values()]
    ttft = sorted(figures.ttft)
    return {"hit_rate": figures.cached / figures.prompt, "warm_hit_rate": figures.warm_cached / figures.warm_prompt,
            "min_server_hit_rate": min(rates), "busiest_over_mean": max(work) / statistics.fmean(work),
            "spills": float(policy.spills), "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[int(len(ttft) * 0.99)],
            "calls": float(len(ttft))}


POLICIES: dict[str, Callable[..., Policy]] = {
    "round robin": RoundRobin,  # type: ignore[dict-item]
    "pure hashing": PureHash,  # type: ignore[dict-item]
    "sticky (previous pool)": StickyFewestSessions,  # type: ignore[dict-item]
    "session-affine": AffinityRouter,  # type: ignore[dict-item]
}
ROWS = (("hit_rate", "prompt tokens from cache", "pct"), ("warm_hit_rate", "  after each session's first call", "pct"),
        ("min_server_hit_rate", "lowest per-server hit rate", "pct"),
        ("busiest_over_mean", "prefill work, busiest server / mean", "x"), ("spills", "spills", "n"),
        ("ttft_mean_s", "time to first token, mean (s)", "s"), ("ttft_p50_s", "time to first token, p50 (s)", "s"),
        ("ttft_p99_s", "time to first token, p99 (s)", "s"))


# ---- replay against real servers ----------------------------------------------------------------
async def replay(urls: list[str], model: str, sessions: int, turns: int, words: int, system_words: int,
                 policy: str) -> dict[str, object]:
    """``sessions`` multi-turn sessions of ``turns`` calls at once against real vLLM servers (a
    shared system prompt of ``system_words`` words, then each turn a reply and ~``words`` words of
    tool output); routed by the pool (session-affine) or call by call round robin over plain
    clients. Cached tokens as the servers report them; ``warm_ceiling``: the previous prompt's share
    of each later call's prompt, the most any cache could give."""
    import asyncio

    from polar_env.engines.vllm import VLLMClient
    from polar_env.engines.vllm_pool import VLLMPool
    from polar_env.records import ChatRequest

    rng = random.Random(f"{policy}")
    run = f"{policy} {time.time_ns()}"  # no prefix of an earlier replay can be in the servers' caches
    vocab = [f"w{i}" for i in range(500)]
    pool = VLLMPool(urls, model, metrics_interval_s=1.0, timeout_s=600)
    clients = [VLLMClient(u, model, timeout_s=600) for u in urls]
    order = itertools.count()
    figures = {u: [0, 0] for u in urls}
    warm = [0, 0]
    ceiling = [0, 0]  # previous prompt tokens, prompt tokens, over calls after the first

    async def session(i: int) -> None:
        messages: list[dict[str, object]] = [
            {"role": "system", "content": f"[{run}] You are a coding agent. " + " ".join(rng.choices(vocab, k=system_words))},
            {"role": "user", "content": f"task {i}: " + " ".join(rng.choices(vocab, k=words))}]
        previous = 0
        for turn in range(turns):
            request = ChatRequest(messages=messages, max_tokens=8, temperature=0.0,
                                  chat_template_kwargs={"enable_thinking": False}, extra_body={"session_id": f"{policy}-{i}"})
            if policy == "session-affine":
                gen = await pool.generate(request)
            else:
                url = urls[next(order) % len(urls)]
                gen, cached = await clients[urls.index(url)].complete(request)
                figures[url][0] += len(gen.prompt_ids)
                figures[url][1] += cached or 0
                if turn:
                    warm[0] += len(gen.prompt_ids)
                    warm[1] += cached or 0
            if turn:
                ceiling[0] += previous
                ceiling[1] += len(gen.prompt_ids)
            previous = len(gen.prompt_ids)
            messages = [*messages, {"role": "assistant", "content": gen.message.content or ""},
                        {"role": "user", "content": "tool output: " + " ".join(rng.choices(vocab, k=words))}]

    try:
        await asyncio.gather(*(session(i) for i in range(sessions)))
        if policy == "session-affine":
            await asyncio.sleep(1.5)  # one more /metrics scrape
            report = pool.prefix_cache()
            return {"hit_rate": report["hit_rate"], "warm_hit_rate": report["warm_hit_rate"],
                    "warm_ceiling": ceiling[0] / max(1, ceiling[1]),
                    "min_server_hit_rate": report["min_server_hit_rate"], "spills": report["spills"],
                    "servers": {u: {k: f[k] for k in ("calls", "prompt_tokens", "cached_tokens", "hit_rate",
                                                      "engine_hit_rate")} for u, f in report["servers"].items()}}
        rates = [c / p for p, c in figures.values() if p]
        return {"hit_rate": sum(c for _, c in figures.values()) / max(1, sum(p for p, _ in figures.values())),
                "warm_hit_rate": warm[1] / max(1, warm[0]), "warm_ceiling": ceiling[0] / max(1, ceiling[1]),
                "min_server_hit_rate": min(rates) if rates else None,
                "servers": {u: {"prompt_tokens": p, "cached_tokens": c} for u, (p, c) in figures.items()}}
    finally:
        await pool.aclose()
        for c in clients:
            await c.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=768)
    ap.add_argument("--live", type=int, default=256, help="sessions running at once")
    ap.add_argument("--context", type=int, default=100_000, help="the longest context (tokens)")
    ap.add_argument("--shared", type=int, default=4_000, help="prefix every session shares (tokens)")
    ap.add_argument("--kv-tokens", type=int, default=1_000_000,
                    help="KV cache per server (1M: an H100 serving an 8B-class GQA model, ~57 KB a token)")
    ap.add_argument("--prefill-tps", type=float, default=20_000.0, help="uncached prompt tokens/s per server")
    ap.add_argument("--decode-tps", type=float, default=50.0, help="sampled tokens/s per call")
    ap.add_argument("--reply", type=int, default=300, help="sampled tokens per call")
    ap.add_argument("--tool-s", type=float, default=5.0, help="mean tool time between turns (s)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds simulated (--replay: alternating rounds)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--replay", help="comma-separated vLLM base URLs (started with --enable-prompt-tokens-details): "
                    "replay --sessions multi-turn sessions against them instead of simulating")
    ap.add_argument("--model", default="polar-tiny-qwen3", help="served model name (--replay)")
    ap.add_argument("--turns", type=int, default=5, help="calls per session (--replay)")
    ap.add_argument("--words", type=int, default=40, help="words of tool output per turn (--replay)")
    ap.add_argument("--system-words", type=int, default=800, help="words of the shared system prompt (--replay)")
    args = ap.parse_args()
    if args.replay:
        import asyncio

        urls = [u.strip().rstrip("/") for u in args.replay.split(",") if u.strip()]
        rounds = [{p: asyncio.run(replay(urls, args.model, args.sessions, args.turns, args.words, args.system_words, p))
                   for p in ("round robin", "session-affine")} for _ in range(args.seeds)]  # alternating rounds
        out: dict[str, object] = {"rounds": rounds}
        for p in ("round robin", "session-affine"):
            out[f"median {p}"] = {k: statistics.median(float(r[p][k]) for r in rounds)  # type: ignore[arg-type]
                                  for k in ("hit_rate", "warm_hit_rate", "warm_ceiling", "min_server_hit_rate")}
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        print(f"replay: {len(urls)} vLLM servers, {args.sessions} sessions x {args.turns} turns "
              f"({args.system_words}-word system prompt, {args.words} words a turn), load {' '.join(load)}")
        for p in ("round robin", "session-affine"):
            print(f"{p:>16}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in out[f"median {p}"].items()))  # type: ignore[attr-defined]
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return
    started, cpu = time.time(), time.process_time()
    results: dict[str, dict[str, float]] = {}
    for name, make in POLICIES.items():
        runs = [simulate(make, args, seed) for seed in range(args.seeds)]
        results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{args.servers} servers x {args.kv_tokens:,} KV tokens, {args.sessions} sessions ({args.live} live), "
          f"contexts to {args.context:,}, {int(results['session-affine']['calls']):,} calls; median of "
          f"{args.seeds} seeds; {time.process_time() - cpu:.1f} CPU s, load {' '.join(load)}")
    names = list(POLICIES)
    width = 38
    print(f"{'':{width}}" + "".join(f"{n:>24}" for n in names) + f"{'affine/RR':>12}{'affine/hash':>12}")

    def show(kind: str, v: float) -> str:
        return f"{100 * v:.1f} %" if kind == "pct" else f"{v:.2f}x" if kind == "x" else \
            f"{v:.0f}" if kind == "n" else f"{v:.3f}"

    for key, label, kind in ROWS:
        vals = [results[n][key] for n in names]
        aff = results["session-affine"][key]
        ratios = "".join(f"{aff / results[b][key]:>11.2f}x" if results[b][key] else f"{'—':>12}"
                         for b in ("round robin", "pure hashing"))
        print(f"{label:<{width}}" + "".join(f"{show(kind, v):>24}" for v in vals) + (ratios if kind != "n" else ""))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results,
                                         "loadavg": load, "wall_s": time.time() - started}, indent=2))


if __name__ == "__main__":
    main()
