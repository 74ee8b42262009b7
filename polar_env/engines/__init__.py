"""Inference engines behind one small interface: a ChatRequest in, a Generation (parsed message
plus prompt ids, sampled ids, aligned logprobs, finish reason) out.

Backends: ``vllm`` (OpenAI server with return_token_ids), ``sglang`` (OpenAI chat or native
/generate, talking to workers directly), ``embedded`` (our CPU engine, in-process). Every backend
raises the EngineError tree from ``polar_env.errors``; none ever returns an empty completion for a
failure. To add a backend: one module implementing ``EngineClient`` plus its config class in
``engines/config.py``, added to ``AnyEngineConfig`` (the table ``ENGINES`` and the ``kind`` union are
made from it; ``build_engine`` builds any of them).
"""

from __future__ import annotations

from polar_env.engines.base import EngineClient
from polar_env.errors import ConfigError

__all__ = ["EngineClient", "engine_base_url", "engine_urls_of"]


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
