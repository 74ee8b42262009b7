"""Several vLLM servers behind one EngineClient: what NeMo RL hands an environment.

NeMo RL runs one vLLM HTTP server per data-parallel rank and passes their base URLs as a list
(``policy_base_url``). The pool keeps each session on one server, so its growing prefix stays in
that server's prefix cache, and spreads new sessions over the healthy servers (the one with the
fewest sessions, earliest listed on ties), so DP ranks share the work.

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
from collections import OrderedDict
from typing import Literal

import aiohttp

from polar_env.engines.base import new_session
from polar_env.engines.vllm import VLLMClient
from polar_env.errors import ConfigError, EngineHTTPError, EngineUnavailable
from polar_env.records import ChatRequest, Generation

_log = logging.getLogger(__name__)
_FAILOVER_STATUS = frozenset({502, 503, 504})
_MAX_STICKY = 1 << 16  # sessions remembered; the oldest are forgotten first (they re-pick on return)


class _Server:
    __slots__ = ("client", "down_since", "error", "sessions")

    def __init__(self, client: VLLMClient) -> None:
        self.client = client
        self.down_since: float | None = None
        self.sessions = 0
        self.error = ""

    @property
    def up(self) -> bool:
        return self.down_since is None


class VLLMPool:
    """EngineClient over several vLLM servers: session-sticky, health-aware, failing over."""

    name = "vllm"

    def __init__(
        self,
        base_urls: list[str],
        model: str,
        *,
        timeout_s: float = 3600.0,
        logprobs_mode: Literal["processed", "raw"] = "processed",
        probe_interval_s: float = 2.0,
    ) -> None:
        urls = list(dict.fromkeys(u.rstrip("/") for u in base_urls))
        if not urls:
            raise ConfigError("a vLLM pool needs at least one server URL")
        self._model = model
        self.logprobs_mode: Literal["processed", "raw"] = logprobs_mode
        self.probe_interval_s = probe_interval_s
        self._session: aiohttp.ClientSession | None = None
        self._servers = [_Server(VLLMClient(u, model, timeout_s=timeout_s, logprobs_mode=logprobs_mode))
                         for u in urls]
        self._sticky: OrderedDict[str, _Server] = OrderedDict()
        self._probe: asyncio.Task[None] | None = None
        self.failovers = 0

    @property
    def model(self) -> str:
        return self._model

    @model.setter
    def model(self, name: str) -> None:  # the CLI sets the served name after probing
        self._model = name
        for s in self._servers:
            s.client.model = name

    @property
    def base_urls(self) -> list[str]:
        return [s.client.base_url for s in self._servers]

    def health(self) -> dict[str, dict[str, object]]:
        """Per server: up or down (and why), and how many sessions it holds."""
        return {s.client.base_url: {"up": s.up, "sessions": s.sessions, "error": s.error} for s in self._servers}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = new_session()
            for s in self._servers:  # one connection pool for all servers
                s.client._session, s.client._owns_session = self._session, False
        return self._session

    def server_for(self, key: str | None) -> _Server:
        """The server for a session key: its sticky server while up, else the least-loaded one."""
        if key is not None:
            server = self._sticky.get(key)
            if server is not None and server.up:
                self._sticky.move_to_end(key)
                return server
            if server is not None:
                server.sessions -= 1
                del self._sticky[key]
        healthy = [s for s in self._servers if s.up]
        if not healthy:
            detail = "; ".join(f"{s.client.base_url}: {s.error or 'down'}" for s in self._servers)
            raise EngineUnavailable(f"every vLLM server is down ({detail})", engine=self.name,
                                    url=self.base_urls[0])
        server = min(healthy, key=lambda s: s.sessions)
        if key is not None:
            self._sticky[key] = server
            server.sessions += 1
            if len(self._sticky) > _MAX_STICKY:
                _, old = self._sticky.popitem(last=False)
                old.sessions -= 1
        return server

    def _mark_down(self, server: _Server, error: str) -> None:
        if server.up:
            server.down_since = time.monotonic()
            _log.warning("vLLM server %s is down (%s); its %d sessions move to the others",
                         server.client.base_url, error[:200], server.sessions)
        server.error = error[:300]
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def generate(self, request: ChatRequest) -> Generation:
        self._http()
        raw_key = request.extra_body.get("session_id")
        key = None if raw_key is None else str(raw_key)
        for _ in range(len(self._servers)):
            server = self.server_for(key)
            try:
                return await server.client.generate(request)
            except EngineUnavailable as exc:
                self._mark_down(server, str(exc))
            except EngineHTTPError as exc:
                if exc.status not in _FAILOVER_STATUS:
                    raise
                self._mark_down(server, str(exc))
            self.failovers += 1
        return await self.server_for(key).client.generate(request)  # raises "every server is down"

    async def _probe_loop(self) -> None:
        """Bring servers back when ``GET /health`` answers 200; ends when all are up."""
        while any(not s.up for s in self._servers):
            await asyncio.sleep(self.probe_interval_s)
            for s in self._servers:
                if s.up:
                    continue
                try:
                    async with self._http().get(f"{s.client.base_url}/health",
                                                timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        ok = resp.status == 200
                except (TimeoutError, aiohttp.ClientError, OSError):
                    ok = False
                if ok:
                    s.down_since, s.error = None, ""
                    _log.warning("vLLM server %s answers /health again; new sessions may use it", s.client.base_url)

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        if self._session is not None and not self._session.closed:
            await self._session.close()
