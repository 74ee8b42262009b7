"""Several vLLM servers behind one EngineClient: what NeMo RL hands an environment.

NeMo RL runs one vLLM HTTP server per data-parallel rank and passes their base URLs as a list
(``policy_base_url``). Calls are routed by ``engines/routing.py``: a session stays on the server
holding its prefix (keyed with the weight version) unless that server is overloaded, then spills
to the least-loaded one (counted, logged); new sessions go where the fewest prefix tokens are held.
``prefix_cache()`` reports per-server and per-session hit rates from each reply's
``usage.prompt_tokens_details.cached_tokens`` (start vLLM with ``--enable-prompt-tokens-details``)
and each server's ``/metrics`` (``vllm:prefix_cache_queries_total`` / ``..._hits_total``).

Health: a server that refuses connections, drops them or answers 502/503/504 is marked down and
the request is retried at once on another healthy server (the failed call produced nothing the
gateway recorded, so the retry cannot duplicate a capture). Its sessions move for good; a
background probe (``GET /health``) brings the server back for new sessions. A timeout is not a
failover: a long generation is not a dead server, and retrying it would double the load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

import aiohttp

from polar_env.engines.base import new_session
from polar_env.engines.routing import AffinityRouter, CacheReport, scrape_loop
from polar_env.engines.vllm import VLLMClient
from polar_env.errors import ConfigError, EngineHTTPError, EngineUnavailable
from polar_env.records import ChatRequest, Generation

_log = logging.getLogger(__name__)
_FAILOVER_STATUS = frozenset({502, 503, 504})


class _Server:
    __slots__ = ("client", "down_since", "error")

    def __init__(self, client: VLLMClient) -> None:
        self.client = client
        self.down_since: float | None = None
        self.error = ""

    @property
    def up(self) -> bool:
        return self.down_since is None


class VLLMPool:
    """EngineClient over several vLLM servers: session-affine, load-aware, failing over."""

    name = "vllm"

    def __init__(
        self,
        base_urls: list[str],
        model: str,
        *,
        timeout_s: float = 3600.0,
        logprobs_mode: Literal["processed", "raw"] = "processed",
        probe_interval_s: float = 2.0,
        metrics_interval_s: float = 2.0,
    ) -> None:
        urls = list(dict.fromkeys(u.rstrip("/") for u in base_urls))
        if not urls:
            raise ConfigError("a vLLM pool needs at least one server URL")
        self._model = model
        self.logprobs_mode: Literal["processed", "raw"] = logprobs_mode
        self.probe_interval_s = probe_interval_s
        self.metrics_interval_s = metrics_interval_s
        self._session: aiohttp.ClientSession | None = None
        self._servers = {u: _Server(VLLMClient(u, model, timeout_s=timeout_s, logprobs_mode=logprobs_mode))
                         for u in urls}
        self.router = AffinityRouter(urls)
        self._probe: asyncio.Task[None] | None = None
        self._scraper: asyncio.Task[None] | None = None
        self._scraped = asyncio.Event()
        self.failovers = 0

    @property
    def model(self) -> str:
        return self._model

    @model.setter
    def model(self, name: str) -> None:  # the CLI sets the served name after probing
        self._model = name
        for s in self._servers.values():
            s.client.model = name

    @property
    def base_urls(self) -> list[str]:
        return list(self._servers)

    def health(self) -> dict[str, dict[str, object]]:
        """Per server: up or down (and why), the sessions it holds, calls in flight, its hit rate."""
        figures = self.router.report()["servers"]
        return {url: {"up": s.up, "sessions": figures[url]["sessions"], "in_flight": figures[url]["in_flight"],
                      "hit_rate": figures[url]["hit_rate"], "error": s.error}
                for url, s in self._servers.items()}

    def prefix_cache(self) -> CacheReport:
        """Per-server and per-session prefix-cache hit rates, and how sessions were routed."""
        return self.router.report()

    def set_weight_version(self, version: str) -> None:
        """The trainer's new weights: sessions are placed afresh (vLLM's cache is reset with them)."""
        self.router.set_version(version)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = new_session()
            for s in self._servers.values():  # one connection pool for all servers
                s.client._session, s.client._owns_session = self._session, False
        return self._session

    def _mark_down(self, url: str, error: str) -> None:
        server = self._servers[url]
        if server.up:
            server.down_since = time.monotonic()
            _log.warning("vLLM server %s is down (%s); its sessions move to the others", url, error[:200])
        server.error = error[:300]
        self.router.set_up(url, False)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    def _down(self) -> EngineUnavailable:
        detail = "; ".join(f"{url}: {s.error or 'down'}" for url, s in self._servers.items())
        return EngineUnavailable(f"every vLLM server is down ({detail})", engine=self.name, url=self.base_urls[0])

    async def generate(self, request: ChatRequest) -> Generation:
        self._http()
        if self._scraper is None:
            self._scraper = asyncio.get_running_loop().create_task(
                scrape_loop(self.router, self._http, self.metrics_interval_s, self._scraped))
        if not self._scraped.is_set():
            await self._scraped.wait()  # the servers' counters before this client's first calls
        raw_key = request.extra_body.get("session_id")
        key = None if raw_key is None else str(raw_key)
        known = len(request.prompt_ids) if request.prompt_ids is not None else 0
        for _ in range(len(self._servers)):
            url = self.router.route(key, known)
            if url is None:
                break
            try:
                return await self.router.call(url, key, self._servers[url].client.complete(request))
            except (EngineUnavailable, EngineHTTPError) as exc:
                if isinstance(exc, EngineHTTPError) and exc.status not in _FAILOVER_STATUS:
                    raise
                self._mark_down(url, str(exc))
                self.failovers += 1
        raise self._down()

    async def _probe_loop(self) -> None:
        """Bring servers back when ``GET /health`` answers 200; ends when all are up."""
        while any(not s.up for s in self._servers.values()):
            await asyncio.sleep(self.probe_interval_s)
            for url, s in self._servers.items():
                if s.up:
                    continue
                try:
                    async with self._http().get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        ok = resp.status == 200
                except (TimeoutError, aiohttp.ClientError, OSError):
                    ok = False
                if ok:
                    s.down_since, s.error = None, ""
                    self.router.set_up(url, True)
                    _log.warning("vLLM server %s answers /health again; new sessions may use it", url)

    async def aclose(self) -> None:
        for task in (self._probe, self._scraper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None and not self._session.closed:
            await self._session.close()
