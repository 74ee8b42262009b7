"""SGLang client: OpenAI chat or native ``/generate``, posted straight to the workers.

Workers are called directly because the SGLang router does not reliably keep the token metadata
(ids, logprobs) a trainer needs. Give ``worker_urls``, or a ``router_url`` whose ``GET /workers``
lists them (sgl-router / SMG shape: ``{"workers": [{"id", "url", "is_healthy", ...}], "total",
"stats"}``; unhealthy workers are skipped). The router's list is followed, not read once: it is
re-read every ``refresh_s`` and at once when a worker refuses or drops a connection (slime's fault
tolerance removes a dead engine and registers its replacement), and the failed call is retried on
the new list (a fixed worker list fails over to the next listed worker). Calls are routed by
``engines/routing.py`` (session-affine, load-aware, keyed with the weight version; what the SGLang
router's ``cache_aware`` policy does, without the router in the data path): a request carrying
``extra_body["session_id"]`` stays on the worker holding its prefix unless that worker is
overloaded; when the list changes only a removed worker's sessions move; others go to the least
busy worker. Hit rates come from ``usage.prompt_tokens_details.cached_tokens`` (workers started
with ``--enable-cache-report``), ``meta_info.cached_tokens`` (``/generate``) and the workers'
``/metrics`` (``--enable-metrics``).

Every request carries an ``rid``; when the caller cancels a call in flight (the session was
cancelled), the client posts ``/abort_request {"rid"}`` to that worker so the engine stops
generating for nobody.

Launch the workers (Qwen3.5) with ``--tool-call-parser qwen3_coder --reasoning-parser qwen3``
(those parsers serve ``mode="chat"``; ``mode="generate"`` parses locally with ``polar_env.chat``).

- ``mode="chat"``: ``/v1/chat/completions`` with ``return_token_ids`` (per-choice
  ``prompt_token_ids`` / ``response_token_ids``), token-in through top-level ``input_ids``.
- ``mode="generate"``: the slime path. We render the served family's template (its ChatFormat) and tokenize ourselves (or
  take ``prompt_ids``), post ids to ``/generate`` and decode + parse the sampled ids locally.
  ``tool_choice`` and ``response_format`` are not enforced there. Set ``max_tokens``: SGLang's
  ``max_new_tokens`` default is small.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

import aiohttp
from pydantic import ValidationError

from polar_env.chat import ChatFormat, Tokenizer, chat_format
from polar_env.engines.base import new_session, post_json, request_json
from polar_env.engines.routing import AffinityRouter, CacheReport, cached_tokens, scrape_loop
from polar_env.engines.vllm import BadFactory, chat_logprobs, chat_message, openai_chat_body
from polar_env.errors import (
    ConfigError,
    EngineHTTPError,
    EngineProtocolError,
    EngineUnavailable,
)
from polar_env.records import AssistantMessage, ChatRequest, Generation

_DISCOVERY_TIMEOUT_S = 30.0
_ABORT_TIMEOUT_S = 5.0
_FAILOVER_STATUS = frozenset({502, 503, 504})
_MAX_ATTEMPTS = 3  # a call tries at most this many workers (the router's list is re-read between)


class SGLangClient:
    """EngineClient for SGLang workers."""

    name = "sglang"

    def __init__(
        self,
        worker_urls: list[str] | None = None,
        model: str = "",
        *,
        router_url: str | None = None,
        mode: Literal["chat", "generate"] = "chat",
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 3600.0,
        refresh_s: float = 10.0,
        rejoin_wait_s: float = 300.0,
        chat: ChatFormat | None = None,  # the served family's format (generate mode renders and parses with it)
        metrics_interval_s: float = 2.0,
    ) -> None:
        if not worker_urls and not router_url:
            raise ConfigError("SGLangClient needs worker_urls or a router_url to discover them from")
        if mode not in ("chat", "generate"):
            raise ConfigError(f"SGLangClient mode must be 'chat' or 'generate', not {mode!r}")
        self.model = model
        self.router_url = router_url.rstrip("/") if router_url else None
        self.mode: Literal["chat", "generate"] = mode
        self.timeout_s = timeout_s
        self._workers: list[str] | None = _dedupe(worker_urls) if worker_urls else None
        self.refresh_s = refresh_s
        self.rejoin_wait_s = rejoin_wait_s
        self._read_at = 0.0  # monotonic time of the last router read
        self.router = AffinityRouter(self._workers or [])
        self.metrics_interval_s = metrics_interval_s
        self._scraper: asyncio.Task[None] | None = None
        self._scraped = asyncio.Event()
        self._aborts: set[asyncio.Task[None]] = set()
        self.rediscoveries = 0
        self._lock = asyncio.Lock()
        self._session = session
        self._owns_session = session is None
        self.chat = chat or chat_format("qwen3.5")
        self._tokenizer: Tokenizer | None = None

    def _http(self) -> aiohttp.ClientSession:
        # Created lazily: aiohttp wants a running loop, and the ctor may run outside one.
        if self._session is None or (self._owns_session and self._session.closed):
            self._session = new_session()
        return self._session

    # ---- worker selection -------------------------------------------------------------------

    async def workers(self, *, refresh: bool = False) -> list[str]:
        """The worker base URLs: the given list, or the router's (re-read when older than
        ``refresh_s``, or now with ``refresh``)."""
        if self.router_url is None:
            assert self._workers is not None
            return self._workers
        stale = self._workers is None or refresh or time.monotonic() - self._read_at > self.refresh_s
        if stale:
            seen = self._read_at
            async with self._lock:
                if self._read_at == seen:  # nobody re-read it while we waited
                    first = self._workers is None
                    try:
                        self._workers = await self._listed(first=first, wait=refresh)
                    except (EngineUnavailable, EngineHTTPError, EngineProtocolError):
                        if first or refresh:
                            raise
                        # The router is briefly away: keep routing to the last known workers.
                    self._read_at = time.monotonic()
        assert self._workers is not None
        return self._workers

    async def _listed(self, *, first: bool, wait: bool) -> list[str]:
        """The router's healthy workers. None at start is a setup mistake (ConfigError); none
        after a worker failed is an engine restart in progress (slime removes the dead engine and
        registers its replacement once it is up): wait up to ``rejoin_wait_s`` for one."""
        deadline = time.monotonic() + self.rejoin_wait_s
        while True:
            urls = await self._discover()
            if urls:
                return urls
            if first and not wait:
                raise ConfigError(f"SGLang router {self.router_url}/workers lists no healthy workers; "
                                  "start the engines (or register them) before the gateway")
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"SGLang router lists no healthy workers for {self.rejoin_wait_s:g}s",
                                        engine=self.name, url=f"{self.router_url}/workers")
            await asyncio.sleep(0.5)

    async def _discover(self) -> list[str]:
        assert self.router_url is not None
        url = f"{self.router_url}/workers"
        timeout_s = min(self.timeout_s, _DISCOVERY_TIMEOUT_S)
        data = await request_json(self._http(), url, engine=self.name, timeout_s=timeout_s, method="GET")
        items = data.get("urls", data.get("workers")) if isinstance(data, dict) else data
        urls: list[str] = []
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and (item.get("is_healthy") is False
                                           or item.get("worker_type", "regular") not in ("regular", None)):
                continue  # unhealthy, or a PD prefill/decode half that cannot serve a request alone
            u = item.get("url") if isinstance(item, dict) else item
            if isinstance(u, str) and u:
                urls.append(u)
        # Sorted: the same list, however the router orders it.
        return sorted(_dedupe(urls))

    async def generate(self, request: ChatRequest) -> Generation:
        extra = dict(request.extra_body)
        raw_key = extra.pop("session_id", None)
        key = None if raw_key is None else str(raw_key)
        extra.setdefault("rid", uuid.uuid4().hex)
        prompt_ids = None
        if self.mode == "generate":
            prompt_ids = list(request.prompt_ids) if request.prompt_ids is not None else await self._render(request)
        known = prompt_ids if prompt_ids is not None else request.prompt_ids
        if self._scraper is None:
            self.router.set_servers(await self.workers())  # the servers the first scrape reads
            self._scraper = asyncio.get_running_loop().create_task(
                scrape_loop(self.router, self._http, self.metrics_interval_s, self._scraped))
        if not self._scraped.is_set():
            await self._scraped.wait()  # the servers' counters before this client's first calls
        tried: set[str] = set()
        for attempt in range(_MAX_ATTEMPTS):
            listed = await self.workers(refresh=attempt > 0)
            self.router.set_servers(listed)
            skip = tried & set(listed)
            worker = self.router.route(key, len(known or ()), () if skip == set(listed) else skip)
            assert worker is not None  # the list is never empty (workers() raises instead)
            try:
                return await self.router.call(worker, key, self._call(worker, request, extra, prompt_ids))
            except (EngineUnavailable, EngineHTTPError) as exc:
                if isinstance(exc, EngineHTTPError) and exc.status not in _FAILOVER_STATUS:
                    raise
                tried.add(worker)
                if attempt == _MAX_ATTEMPTS - 1 or (self.router_url is None and len(tried) >= len(listed)):
                    raise
            self.rediscoveries += 1  # the worker is gone or going: follow the router's new list
        raise AssertionError("unreachable")

    def set_weight_version(self, version: str) -> None:
        """The trainer's new weights: sessions are placed afresh (the workers flushed their cache)."""
        self.router.set_version(version)

    def prefix_cache(self) -> CacheReport:
        """Per-worker and per-session prefix-cache hit rates, and how sessions were routed."""
        return self.router.report()

    async def _call(self, worker: str, request: ChatRequest, extra: dict[str, Any],
                    prompt_ids: list[int] | None) -> tuple[Generation, int | None]:
        try:
            if prompt_ids is None:
                url = f"{worker}/v1/chat/completions"
                body = self.chat_body(request, extra)
                data = await post_json(self._http(), url, body, engine=self.name, timeout_s=self.timeout_s)
                return self.parse_chat(data, request, url=url), cached_tokens(data.get("usage"))
            url = f"{worker}/generate"
            body = self.generate_body(request, prompt_ids, extra)
            data = await post_json(self._http(), url, body, engine=self.name, timeout_s=self.timeout_s)
            meta = data.get("meta_info")
            cached = meta.get("cached_tokens") if isinstance(meta, dict) else None
            generation = await self.parse_generate(data, request, prompt_ids, url=url)
            return generation, cached if isinstance(cached, int) and not isinstance(cached, bool) else None
        except asyncio.CancelledError:
            # The caller gave up (session cancelled): stop the engine generating for nobody.
            task = asyncio.get_running_loop().create_task(self._abort(worker, str(extra["rid"])))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise

    async def _abort(self, worker: str, rid: str) -> None:
        try:
            await post_json(self._http(), f"{worker}/abort_request", {"rid": rid}, engine=self.name,
                            timeout_s=_ABORT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort: the request may have finished already
            pass

    def chat_body(self, req: ChatRequest, extra: dict[str, Any]) -> dict[str, Any]:
        """The ``/v1/chat/completions`` JSON for ``req`` (``extra`` is extra_body minus session_id)."""
        body: dict[str, Any] = openai_chat_body(req, self.model or req.model or "default", extra)
        if req.prompt_ids is not None:
            body["input_ids"] = list(req.prompt_ids)
        return body

    def generate_body(self, req: ChatRequest, prompt_ids: list[int], extra: dict[str, Any]) -> dict[str, Any]:
        """The native ``/generate`` JSON; extra ``sampling_params`` merge into ours."""
        sp: dict[str, Any] = {}
        if req.max_tokens is not None:
            sp["max_new_tokens"] = req.max_tokens
        if req.temperature is not None:
            sp["temperature"] = req.temperature
        if req.top_p is not None:
            sp["top_p"] = req.top_p
        if req.stop:
            sp["stop"] = req.stop
        if req.seed is not None:
            sp["sampling_seed"] = req.seed
        extra = dict(extra)
        sp.update(extra.pop("sampling_params", None) or {})
        # We decode the ids ourselves; keep specials and stop strings so text and ids agree.
        sp.update(skip_special_tokens=False, no_stop_trim=True)
        body: dict[str, Any] = {**extra, "input_ids": prompt_ids, "sampling_params": sp}
        body.update(return_logprob=True, logprob_start_len=-1, stream=False)
        return body

    # ---- parsing ----------------------------------------------------------------------------

    def parse_chat(self, data: dict[str, Any], request: ChatRequest, *, url: str = "") -> Generation:
        """Turn an SGLang chat response into a Generation, or raise EngineProtocolError."""
        bad = self._bad_at(url)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise bad("SGLang response has no choices")
        choice = choices[0]
        prompt_ids = choice.get("prompt_token_ids")
        response_ids = choice.get("response_token_ids")
        fields = (
            ("choices[0].prompt_token_ids", prompt_ids),
            ("choices[0].response_token_ids", response_ids),
        )
        if not isinstance(prompt_ids, list) or not isinstance(response_ids, list):
            missing = [name for name, value in fields if not isinstance(value, list)]
            raise bad(
                f"SGLang returned no token ids ({' and '.join(missing)} null, missing or not a list): "
                "`return_token_ids` needs SGLang >= 0.5.23 and non-streaming, and a router in between "
                "can drop them; point the client at the workers"
            )
        if request.prompt_ids is not None and prompt_ids != list(request.prompt_ids):
            raise bad("SGLang ignored token-in: choices[0].prompt_token_ids differ from the input_ids sent")
        logprobs = chat_logprobs(choice.get("logprobs"), bad, engine="SGLang")
        if len(logprobs) != len(response_ids):
            raise bad(
                f"SGLang logprobs misaligned: {len(logprobs)} logprobs for {len(response_ids)} token ids"
            )
        finish = choice.get("finish_reason")
        if not isinstance(finish, str):
            raise bad(f"SGLang choice has no finish_reason (got {finish!r})")
        meta = data.get("metadata")
        version = meta.get("weight_version") if isinstance(meta, dict) else None
        try:
            return Generation(
                message=chat_message(choice.get("message"), bad, engine="SGLang"),
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                response_logprobs=logprobs,
                finish_reason=finish,
                stop_reason=choice.get("matched_stop"),
                model=str(data.get("model") or self.model or request.model),
                engine=self.name,
                weight_version=None if version is None else str(version),
            )
        except ValidationError as exc:
            raise bad(f"SGLang response has ill-typed fields: {exc}") from exc

    async def parse_generate(
        self, data: dict[str, Any], request: ChatRequest, prompt_ids: list[int], *, url: str = ""
    ) -> Generation:
        """Turn a ``/generate`` response into a Generation; decodes and parses the sampled ids."""
        bad = self._bad_at(url)
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise bad("SGLang /generate response has no meta_info")
        fr = meta.get("finish_reason")
        if not isinstance(fr, dict) or not isinstance(fr.get("type"), str):
            raise bad(f"SGLang meta_info.finish_reason missing or malformed (got {fr!r})"[:300])
        if fr["type"] == "abort":
            raise bad(f"SGLang aborted the request: {fr.get('message') or '(no message)'}")
        output_ids = data.get("output_ids")
        if not isinstance(output_ids, list):
            raise bad("SGLang /generate returned no output_ids (null, missing or not a list)")
        logprobs = self._triple_logprobs(meta.get("output_token_logprobs"), output_ids, bad)
        matched = fr.get("matched") if fr["type"] == "stop" else None
        message = await self._parse_text(output_ids, matched, request, prompt_ids)
        finish = fr["type"]
        if finish == "stop" and message.tool_calls:
            finish = "tool_calls"
        version = meta.get("weight_version")
        try:
            return Generation(
                message=message,
                prompt_ids=prompt_ids,
                response_ids=output_ids,
                response_logprobs=logprobs,
                finish_reason=finish,
                stop_reason=matched,
                model=self.model or request.model,
                engine=self.name,
                weight_version=None if version is None else str(version),
            )
        except ValidationError as exc:
            raise bad(f"SGLang response has ill-typed fields: {exc}") from exc

    @staticmethod
    def _triple_logprobs(triples: Any, output_ids: list[Any], bad: BadFactory) -> list[float]:
        if not isinstance(triples, list):
            raise bad(
                "SGLang returned no meta_info.output_token_logprobs although `return_logprob: true` was sent"
            )
        if len(triples) != len(output_ids):
            raise bad(
                f"SGLang logprobs misaligned: {len(triples)} logprobs for {len(output_ids)} output_ids"
            )
        out: list[float] = []
        for i, (triple, tid) in enumerate(zip(triples, output_ids, strict=True)):
            if not isinstance(triple, list) or len(triple) < 2:
                raise bad(f"SGLang output_token_logprobs[{i}] is not a [logprob, token_id, text] triple")
            lp, lp_id = triple[0], triple[1]
            if not isinstance(lp, (int, float)) or isinstance(lp, bool):
                raise bad(f"SGLang output_token_logprobs[{i}] has no numeric logprob (got {lp!r})")
            if lp_id != tid:
                raise bad(
                    f"SGLang logprobs misaligned at position {i}: logprob is for token {lp_id!r} "
                    f"but output_ids has {tid!r}"
                )
            out.append(float(lp))
        return out

    # ---- local rendering / parsing (generate mode), in the served family's format -------------

    async def _tok(self) -> Tokenizer:
        if self._tokenizer is None:
            # Loading takes seconds; keep the event loop serving other requests meanwhile.
            self._tokenizer = await asyncio.to_thread(lambda: self.chat.tokenizer)
        return self._tokenizer

    async def _render(self, req: ChatRequest) -> list[int]:
        thinking = bool(req.chat_template_kwargs.get("enable_thinking", True))
        tok = await self._tok()
        return list(tok.encode(self.chat.render(req.messages, req.tools, enable_thinking=thinking)))

    async def _parse_text(
        self, output_ids: list[int], matched: Any, req: ChatRequest, prompt_ids: list[int]
    ) -> AssistantMessage:
        ids = output_ids[:-1] if output_ids and output_ids[-1] in self.chat.eos_ids else output_ids
        text = (await self._tok()).decode(list(ids))
        if isinstance(matched, str) and matched and text.endswith(matched):
            text = text[: -len(matched)]  # like the chat endpoint: a stop string is not content
        return self.chat.parse(text, tools=req.tools, thinking=self.chat.opens_thinking(prompt_ids))

    def _bad_at(self, url: str) -> BadFactory:
        def bad(message: str) -> EngineProtocolError:
            return EngineProtocolError(message, engine=self.name, url=url)

        return bad

    async def aclose(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            await asyncio.gather(self._scraper, return_exceptions=True)
        if self._aborts:  # let pending aborts reach their workers before the session closes
            await asyncio.gather(*self._aborts, return_exceptions=True)
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()


def _dedupe(urls: list[str]) -> list[str]:
    return list(dict.fromkeys(u.rstrip("/") for u in urls))
