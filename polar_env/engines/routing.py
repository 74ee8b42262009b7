"""Session-affine, load-aware routing over several engine servers, and the prefix-cache figures
that say whether it works.

Why: at 100k-token contexts a multi-turn session whose call lands on a server without its prefix
pays a full prefill. So a session stays on its *home* server (the one holding its prefix) unless
that server is overloaded; then the call spills to the least-loaded server, which becomes the new
home (it now holds the longest prefix), and the spill is counted and logged. The overload rule is
SGLang's ``cache_aware`` router's imbalance test applied to the home server: spill when
``home - least > spill_abs`` and ``home > spill_rel * least`` (requests in flight from here).

New sessions go to the server with the fewest calls in flight, then the fewest live sessions,
then the fewest prefix tokens held (ties: round robin), so sessions do not pile up on one server
as pure hashing lets them (a peer measured a 98 % -> 5 % hit-rate collapse when hashing overloaded
one engine). A session unused for ``idle_s`` stops counting towards its server's load (its KV is
the first LRU victim) but keeps its home.

Homes are keyed with the policy's weight version: after ``set_version`` no session is sent back
for a prefix computed by the old weights (engines drop their cache on a weight update); every
session is placed afresh, by load.

Hit rates come from the engines' own counters: ``usage.prompt_tokens_details.cached_tokens`` per
call (vLLM with ``--enable-prompt-tokens-details``, SGLang with ``--enable-cache-report``) and each
server's ``/metrics`` (vLLM ``vllm:prefix_cache_{queries,hits}_total``, SGLang
``sglang:{prompt,cached}_tokens_total``). ``report()`` gives them per server and per session; the
warm rate counts only calls after a session's first under the current version (what affinity can
win). ``scripts/bench_routing.py`` runs this class against round robin and pure hashing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypedDict

import aiohttp

from polar_env.records import Generation

_log = logging.getLogger(__name__)
_MAX_SESSIONS = 1 << 16  # homes and per-session counters kept; the least recently used go first


class ServerFigures(TypedDict):
    up: bool
    in_flight: int
    sessions: int  # live sessions homed here
    held_tokens: int  # their last context lengths: the prefix KV they keep warm
    calls: int
    prompt_tokens: int  # of the calls whose usage reported cached tokens
    cached_tokens: int
    hit_rate: float | None  # cached / prompt tokens, from the calls' usage
    spilled_in: int
    spilled_out: int
    engine_hit_rate: float | None  # from the server's /metrics, since the first scrape
    engine_queried_tokens: int


class SessionFigures(TypedDict):
    server: str
    calls: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None
    warm_hit_rate: float | None  # calls after the session's first under this weight version


class CacheReport(TypedDict):
    routing: str
    weight_version: str | None
    calls: int
    placements: int  # sessions given a home (first call, a new weight version, or a dead home)
    spills: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None
    warm_prompt_tokens: int
    warm_cached_tokens: int
    warm_hit_rate: float | None
    min_server_hit_rate: float | None
    servers: dict[str, ServerFigures]
    sessions: dict[str, SessionFigures]


def _rate(hit: int | float, total: int | float) -> float | None:
    return round(hit / total, 4) if total else None


@dataclass(slots=True, eq=False)
class _Server:
    url: str
    up: bool = True
    in_flight: int = 0
    sessions: int = 0
    held_tokens: int = 0
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spilled_in: int = 0
    spilled_out: int = 0
    metrics_base: tuple[float, float] | None = None  # (queries, hits) at the first scrape
    metrics_now: tuple[float, float] | None = None

    def figures(self) -> ServerFigures:
        queried = hits = 0.0
        if self.metrics_base is not None and self.metrics_now is not None:
            queried = self.metrics_now[0] - self.metrics_base[0]
            hits = self.metrics_now[1] - self.metrics_base[1]
        return {"up": self.up, "in_flight": self.in_flight, "sessions": self.sessions,
                "held_tokens": self.held_tokens, "calls": self.calls, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "hit_rate": _rate(self.cached_tokens, self.prompt_tokens),
                "spilled_in": self.spilled_in, "spilled_out": self.spilled_out,
                "engine_hit_rate": _rate(hits, queried), "engine_queried_tokens": int(queried)}


@dataclass(slots=True, eq=False)
class _Home:
    key: str
    server: _Server
    tokens: int = 0  # the context the server holds for the session
    last_used: float = 0.0
    live: bool = True  # counted in its server's sessions / held_tokens


@dataclass(slots=True)
class _SessionStats:
    server: str = ""
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    warm_prompt: int = 0
    warm_cached: int = 0
    cold: bool = True  # the next call is the first under the current version


class AffinityRouter:
    """Picks a server per call (``route``) and is told how it went (``finish``)."""

    def __init__(self, urls: Iterable[str], *, spill_abs: int = 16, spill_rel: float = 1.5,
                 idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._servers: dict[str, _Server] = {}
        self.spill_abs, self.spill_rel, self.idle_s = spill_abs, spill_rel, idle_s
        self._clock = clock
        self._homes: OrderedDict[str, _Home] = OrderedDict()  # least recently used first
        self._live: OrderedDict[str, _Home] = OrderedDict()  # the homes counted as load, in use order
        self._stats: OrderedDict[str, _SessionStats] = OrderedDict()
        self._rr = itertools.count()
        self.version: str | None = None
        self.calls = self.placements = self.spills = 0
        self.set_servers(urls)

    # ---- membership -----------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return list(self._servers)

    def set_servers(self, urls: Iterable[str]) -> None:
        """Follow a changed server list: new ones join, a removed one's sessions are placed afresh."""
        wanted = list(dict.fromkeys(urls))
        for url in wanted:
            self._servers.setdefault(url, _Server(url))
        for url in [u for u in self._servers if u not in wanted]:
            gone = self._servers.pop(url)
            for key in [k for k, h in self._homes.items() if h.server is gone]:
                self._release(self._homes.pop(key))

    def set_up(self, url: str, up: bool) -> None:
        """A server went down (its sessions are placed afresh on their next call) or came back."""
        server = self._servers.get(url)
        if server is None or server.up == up:
            return
        server.up = up
        if not up:
            for key in [k for k, h in self._homes.items() if h.server is server]:
                self._release(self._homes.pop(key))

    def set_version(self, version: str) -> None:
        """A new weight version: every home is forgotten (its KV was computed by the old weights)."""
        if version == self.version:
            return
        self.version = version
        self._homes.clear()
        self._live.clear()
        for server in self._servers.values():
            server.sessions = server.held_tokens = 0
        for stats in self._stats.values():
            stats.cold = True

    def home(self, session: str) -> str | None:
        """The session's home server, if it has one under the current version."""
        home = self._homes.get(session)
        return None if home is None else home.server.url

    # ---- routing ----------------------------------------------------------------------------
    def route(self, session: str | None, prompt_tokens: int = 0, exclude: Iterable[str] = ()) -> str | None:
        """The server for one call (counted in flight until ``finish``), or None if none is up.
        ``prompt_tokens``: the prompt's length when known (token-in), for the load of a new home;
        ``exclude``: servers that already failed this call."""
        skip = set(exclude)
        up = [s for s in self._servers.values() if s.up and s.url not in skip]
        if not up:
            return None
        now = self._clock()
        self._expire(now)
        self.calls += 1
        if session is None:
            server = self._least_busy(up)
        else:
            server = self._session_server(session, up, prompt_tokens, now)
        server.in_flight += 1
        return server.url

    def _session_server(self, session: str, up: list[_Server], prompt_tokens: int, now: float) -> _Server:
        home = self._homes.get(session)
        if home is not None and home.server not in up:  # down, or it failed this call: placed again
            self._release(self._homes.pop(session))
            home = None
        if home is not None:
            self._homes.move_to_end(session)
            self._revive(home, now)
            least = min(up, key=lambda s: s.in_flight)
            load, floor = home.server.in_flight, least.in_flight
            if least is not home.server and load - floor > self.spill_abs and load > self.spill_rel * floor:
                self.spills += 1
                home.server.spilled_out += 1
                least.spilled_in += 1
                _log.info("session %s spilled from %s (%d in flight) to %s (%d in flight)",
                          session, home.server.url, load, least.url, floor)
                self._move(home, least)
            return home.server
        best = min(self.placement_key(s) for s in up)
        ties = [s for s in up if self.placement_key(s) == best]
        server = ties[next(self._rr) % len(ties)]
        home = _Home(session, server, prompt_tokens, now, live=False)
        self._homes[session] = home
        self._revive(home, now)
        self.placements += 1
        while len(self._homes) > _MAX_SESSIONS:
            self._release(self._homes.popitem(last=False)[1])
        return server

    @staticmethod
    def placement_key(s: _Server) -> tuple[int, int, int]:
        """Where a new session goes: the fewest calls in flight (the compute it will share), then
        the fewest live sessions (the work to come), then the fewest prefix tokens held (the KV)."""
        return (s.in_flight, s.sessions, s.held_tokens)

    def _least_busy(self, up: list[_Server]) -> _Server:
        floor = min(s.in_flight for s in up)
        ties = [s for s in up if s.in_flight == floor]
        return ties[next(self._rr) % len(ties)]

    def _move(self, home: _Home, to: _Server) -> None:
        self._release(home)
        home.server = to
        self._revive(home, home.last_used)

    def _revive(self, home: _Home, now: float) -> None:
        home.last_used = now
        if not home.live:
            home.live = True
            home.server.sessions += 1
            home.server.held_tokens += home.tokens
        self._live[home.key] = home
        self._live.move_to_end(home.key)

    def _release(self, home: _Home) -> None:
        if home.live:
            home.live = False
            home.server.sessions -= 1
            home.server.held_tokens -= home.tokens
            self._live.pop(home.key, None)

    def _expire(self, now: float) -> None:
        """Idle sessions stop counting as load (the least recently used first)."""
        while self._live:
            home = next(iter(self._live.values()))
            if now - home.last_used < self.idle_s:
                break
            self._release(home)

    # ---- accounting ---------------------------------------------------------------------------
    def finish(self, url: str, session: str | None, prompt_tokens: int | None = None,
               cached_tokens: int | None = None, context_tokens: int | None = None) -> None:
        """A routed call ended. With its usage (``prompt_tokens``, ``cached_tokens`` as the engine
        reported them; None when it did not) it counts towards the hit rates; ``context_tokens``
        (prompt + response) is what the server now holds for the session."""
        server = self._servers.get(url)
        if server is None:
            return
        server.in_flight = max(0, server.in_flight - 1)
        if prompt_tokens is None:
            return  # failed, or nothing reported
        home = self._homes.get(session) if session is not None else None
        if home is not None and home.server is server and context_tokens is not None:
            if home.live:
                server.held_tokens += context_tokens - home.tokens
            home.tokens = context_tokens
        if cached_tokens is None:
            return
        cached = min(cached_tokens, prompt_tokens)
        server.calls += 1
        server.prompt_tokens += prompt_tokens
        server.cached_tokens += cached
        if session is None:
            return
        stats = self._stats.get(session)
        if stats is None:
            stats = self._stats[session] = _SessionStats()
            while len(self._stats) > _MAX_SESSIONS:
                self._stats.popitem(last=False)
        self._stats.move_to_end(session)
        stats.server = url
        stats.calls += 1
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached
        if not stats.cold:
            stats.warm_prompt += prompt_tokens
            stats.warm_cached += cached
        stats.cold = False

    async def call(self, url: str, session: str | None, reply: Awaitable[tuple[Generation, int | None]]) -> Generation:
        """Await a routed call's ``(generation, cached tokens)`` and ``finish`` it either way."""
        try:
            generation, cached = await reply
        except BaseException:
            self.finish(url, session)
            raise
        prompt = len(generation.prompt_ids)
        self.finish(url, session, prompt, cached, prompt + len(generation.response_ids))
        return generation

    def observe_metrics(self, url: str, queried: float, hits: float) -> None:
        """A scrape of the server's own prefix-cache counters (cumulative since it started)."""
        server = self._servers.get(url)
        if server is None:
            return
        if server.metrics_base is None or queried < server.metrics_base[0]:  # first scrape, or a restart
            server.metrics_base = (queried, hits)
        server.metrics_now = (queried, hits)

    def report(self) -> CacheReport:
        servers = {url: s.figures() for url, s in self._servers.items()}
        prompt = sum(s.prompt_tokens for s in self._servers.values())
        cached = sum(s.cached_tokens for s in self._servers.values())
        warm_prompt = sum(st.warm_prompt for st in self._stats.values())
        warm_cached = sum(st.warm_cached for st in self._stats.values())
        rates = [f["hit_rate"] for f in servers.values() if f["hit_rate"] is not None]
        sessions: dict[str, SessionFigures] = {
            sid: {"server": st.server, "calls": st.calls, "prompt_tokens": st.prompt_tokens,
                  "cached_tokens": st.cached_tokens, "hit_rate": _rate(st.cached_tokens, st.prompt_tokens),
                  "warm_hit_rate": _rate(st.warm_cached, st.warm_prompt)}
            for sid, st in self._stats.items()}
        return {"routing": "session-affine", "weight_version": self.version, "calls": self.calls,
                "placements": self.placements, "spills": self.spills, "prompt_tokens": prompt,
                "cached_tokens": cached, "hit_rate": _rate(cached, prompt), "warm_prompt_tokens": warm_prompt,
                "warm_cached_tokens": warm_cached, "warm_hit_rate": _rate(warm_cached, warm_prompt),
                "min_server_hit_rate": min(rates) if rates else None, "servers": servers, "sessions": sessions}


def merge_reports(reports: Iterable[CacheReport]) -> CacheReport | None:
    """One report over several gateway nodes' (each routes its own sessions, maybe to the same
    servers): token counts summed per server, sessions side by side. None when there are none."""
    reports = list(reports)
    if not reports:
        return None
    servers: dict[str, ServerFigures] = {}
    for rep in reports:
        for url, f in rep["servers"].items():
            got = servers.get(url)
            if got is None:
                servers[url] = f.copy()  # the reports stay as they were
                continue
            for key in ("in_flight", "sessions", "held_tokens", "calls", "prompt_tokens", "cached_tokens",
                        "spilled_in", "spilled_out"):
                got[key] += f[key]
            got["up"] = got["up"] and f["up"]
            got["hit_rate"] = _rate(got["cached_tokens"], got["prompt_tokens"])
            got["engine_queried_tokens"] = max(got["engine_queried_tokens"], f["engine_queried_tokens"])
            if got["engine_hit_rate"] is None:  # the same server's own counters: read, not summed
                got["engine_hit_rate"] = f["engine_hit_rate"]
    prompt = sum(r["prompt_tokens"] for r in reports)
    cached = sum(r["cached_tokens"] for r in reports)
    warm_prompt = sum(r["warm_prompt_tokens"] for r in reports)
    warm_cached = sum(r["warm_cached_tokens"] for r in reports)
    rates = [f["hit_rate"] for f in servers.values() if f["hit_rate"] is not None]
    return {"routing": reports[0]["routing"], "weight_version": reports[-1]["weight_version"],
            "calls": sum(r["calls"] for r in reports), "placements": sum(r["placements"] for r in reports),
            "spills": sum(r["spills"] for r in reports), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": _rate(cached, prompt), "warm_prompt_tokens": warm_prompt, "warm_cached_tokens": warm_cached,
            "warm_hit_rate": _rate(warm_cached, warm_prompt), "min_server_hit_rate": min(rates) if rates else None,
            "servers": servers, "sessions": {k: v for r in reports for k, v in r["sessions"].items()}}


# ---- the engines' own counters ----------------------------------------------------------------
_QUERIED = ("vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total")
_HITS = ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total")


def prefix_counters(text: str) -> tuple[float, float] | None:
    """(queried tokens, cache-hit tokens) from a server's Prometheus text, summed over label sets
    (vLLM's per-engine, SGLang's per cache source); None when it exports neither."""
    queried = hits = 0.0
    found = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _QUERIED or name in _HITS:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            found = True
            if name in _QUERIED:
                queried += value
            else:
                hits += value
    return (queried, hits) if found else None


def cached_tokens(usage: object) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI-style reply, or None."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def scrape_loop(router: AffinityRouter, http: Callable[[], aiohttp.ClientSession], interval_s: float,
                      first: asyncio.Event) -> None:
    """Read every server's ``/metrics`` now (then set ``first``: callers wait for it, so the
    counters' baseline predates their calls) and every ``interval_s``. A server without them (no
    ``--enable-metrics`` on SGLang, not an engine) is left without engine-side figures."""

    async def one(url: str) -> None:
        try:
            async with http().get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            return
        counters = prefix_counters(text)
        if counters is not None:
            router.observe_metrics(url, *counters)

    while True:
        await asyncio.gather(*(one(url) for url in router.urls))
        first.set()
        await asyncio.sleep(interval_s)
