"""The start-up check of an HTTP engine: does it answer, and which model names does it serve.

``polar-env gateway`` runs it before it reports ready. Without it, a wrong URL or model name is
reported as ready and turns every rollout's first call into a 502/503. In RL that reads as the
agent failing, not as a setup mistake. The check waits a bounded time, because trainers often
start the gateway next to an engine that is still loading weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from polar_env.engines.base import EngineClient, new_session, request_json
from polar_env.errors import (
    ConfigError,
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
)


async def engine_urls(client: EngineClient) -> list[str]:
    """The base URLs the client sends generations to (SGLang: every worker, router-discovered)."""
    from polar_env.engines.sglang import SGLangClient
    from polar_env.engines.vllm import VLLMClient
    from polar_env.engines.vllm_pool import VLLMPool

    if isinstance(client, VLLMClient):
        return [client.base_url]
    if isinstance(client, VLLMPool):
        return client.base_urls
    if isinstance(client, SGLangClient):
        return await client.workers()
    return []


async def served_models(base_url: str, *, engine: str, timeout_s: float = 10.0) -> list[str]:
    """The ``id``s listed by ``GET {base_url}/v1/models`` (vLLM and SGLang both serve it)."""
    url = f"{base_url}/v1/models"
    async with new_session() as http:
        data = await request_json(http, url, engine=engine, timeout_s=timeout_s, method="GET")
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise EngineProtocolError(f"GET /v1/models did not return a model list: {str(data)[:200]}", engine=engine, url=url)
    return [str(item["id"]) for item in items if isinstance(item, dict) and item.get("id")]


def choose_model(requested: str | None, served: list[str], url: str, *, strict: bool) -> str:
    """The model name to send: the one asked for, or the engine's only model. vLLM answers 404 to
    any other name (``strict``); SGLang ignores the name, so a mismatch there is no error."""
    if requested is None:
        if len(served) == 1:
            return served[0]
        if not strict:
            return ""
        raise ConfigError(f"the engine at {url} serves {served or 'no models'}; pick one with --served-model-name")
    if strict and requested not in served:
        raise ConfigError(
            f"the engine at {url} serves {served}, not {requested!r}; pass --served-model-name "
            f"{served[0] if served else 'NAME'} (or the name given to vllm serve --served-model-name)"
        )
    return requested


async def wait_for_engine(
    client: EngineClient, *, wait_s: float, on_wait: Callable[[str], None], poll_s: float = 0.5
) -> dict[str, list[str]]:
    """Served models per engine URL, once every URL answers; a ConfigError naming the URL when one
    has not answered after ``wait_s``, or answers with something that is not an engine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    waiting_said = False
    while True:
        where = getattr(client, "router_url", None) or getattr(client, "base_url", "?")
        try:
            urls = await engine_urls(client)
            served: dict[str, list[str]] = {}
            for where in urls:
                served[where] = await served_models(where, engine=client.name)
            return served
        except (EngineHTTPError, EngineProtocolError) as exc:
            raise ConfigError(
                f"{where} does not answer like a {client.name} server ({exc.message}); "
                "--engine-url must be the server's base URL, e.g. http://127.0.0.1:8000"
            ) from exc
        except EngineError as exc:  # not reachable (yet), or too slow
            if loop.time() >= deadline:
                raise ConfigError(
                    f"no {client.name} engine answers at {where} ({exc.message}) after {wait_s:g}s; "
                    "start it first, fix --engine-url, or wait longer with --engine-wait-s"
                ) from exc
            if not waiting_said:
                on_wait(f"waiting up to {wait_s:g}s for the {client.name} engine at {where} ({exc.message})")
                waiting_said = True
            await asyncio.sleep(poll_s)


def served_sources(base_urls: list[str], *, timeout_s: float = 5.0) -> list[str]:
    """What the servers at ``base_urls`` say they loaded, best first: SGLang's ``/get_model_info``
    model and tokenizer paths, then each ``/v1/models`` item's ``root`` (vLLM: the path or id given
    to ``vllm serve``) and ``id``. Blocking, start-up only (``template: auto``); [] when none answers."""
    import json
    import urllib.error
    import urllib.request

    def get(url: str) -> object:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310  (the engine URL from config)
                return json.loads(resp.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None

    found: list[str] = []
    for base in base_urls:
        info = get(f"{base}/get_model_info")
        if isinstance(info, dict):
            found += [str(info[k]) for k in ("model_path", "tokenizer_path") if info.get(k)]
        listing = get(f"{base}/v1/models")
        items = listing.get("data") if isinstance(listing, dict) else None
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict):
                found += [str(item[k]) for k in ("root", "id") if item.get(k)]
    return list(dict.fromkeys(found))
