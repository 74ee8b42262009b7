"""Inference engines behind one small interface: a ChatRequest in, a Generation (parsed message
plus prompt ids, sampled ids, aligned logprobs, finish reason) out.

Backends: ``vllm`` (OpenAI server with return_token_ids), ``sglang`` (OpenAI chat or native
/generate, talking to workers directly), ``embedded`` (our CPU engine, in-process). Every backend
raises the EngineError tree from ``polar_env.errors``; none ever returns an empty completion for a
failure. To add a backend: one module implementing ``EngineClient`` plus one branch in
``make_engine``.
"""

from __future__ import annotations

from polar_env.engines.base import EngineClient
from polar_env.errors import ConfigError
from polar_env.records import LogprobsMode

__all__ = ["EngineClient", "engine_base_url", "engine_urls_of", "make_engine"]


def engine_base_url(url: str) -> str:
    """An engine's base URL as clients join paths onto it. People copy the OpenAI-style base
    (``http://host:8000/v1``) that harnesses want; the clients add ``/v1/...`` themselves, so a
    trailing ``/v1`` would make every call a 404. Refuses what is not an http(s) URL."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")) or len(base.split("://", 1)[1]) == 0:
        raise ConfigError(f"engine URL {url!r} is not an http(s) URL; give one like http://127.0.0.1:8000")
    return base.removesuffix("/v1")


def engine_urls_of(url: str | list[str] | None) -> list[str]:
    """The URLs in an engine ``url`` setting: a list (NeMo RL's ``policy_base_url``) or a
    comma-separated string, each stripped; empty entries dropped."""
    items = url if isinstance(url, list) else (url or "").split(",")
    return [u.strip() for u in items if isinstance(u, str) and u.strip()]


def make_engine(kind: str, url: str | list[str] | None, model: str, *,
                logprobs_mode: LogprobsMode = "processed") -> EngineClient:
    """An HTTP engine client: ``vllm`` (one base URL, or several as a list or comma-separated: a
    session-sticky, failing-over pool) or ``sglang`` (worker URLs, or a router URL prefixed
    ``router:``). The embedded engine is built directly (it needs model options). A ``/v1``
    suffix on any URL is accepted."""
    urls = engine_urls_of(url)
    if not urls:
        raise ConfigError(f"engine {kind!r} needs a URL")
    if kind == "vllm":
        from polar_env.engines.vllm import VLLMClient

        if len(urls) == 1:
            return VLLMClient(engine_base_url(urls[0]), model, logprobs_mode=logprobs_mode)
        from polar_env.engines.vllm_pool import VLLMPool

        return VLLMPool([engine_base_url(u) for u in urls], model, logprobs_mode=logprobs_mode)
    if kind == "sglang":
        from polar_env.engines.sglang import SGLangClient

        if len(urls) == 1 and urls[0].startswith("router:"):
            return SGLangClient(model=model, router_url=engine_base_url(urls[0].removeprefix("router:")))
        if any(u.startswith("router:") for u in urls):
            raise ConfigError("engine url: give one router:URL or a list of SGLang worker URLs, not both")
        return SGLangClient([engine_base_url(u) for u in urls], model)
    raise ConfigError(f"unknown engine {kind!r}; use vllm, sglang or embedded")
