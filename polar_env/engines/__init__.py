"""Inference engines behind one small interface: a ChatRequest in, a Generation (parsed message
plus prompt ids, sampled ids, aligned logprobs, finish reason) out.

Backends: ``vllm`` (OpenAI server with return_token_ids), ``sglang`` (OpenAI chat or native
/generate, talking to workers directly), ``embedded`` (our CPU engine, in-process). Every backend
raises the EngineError tree from ``polar_env.errors``; none ever returns an empty completion for a
failure. To add a backend: one module implementing ``EngineClient`` plus its config class in
``engines/config.py``, added to ``AnyEngineConfig`` (the table ``ENGINES`` and the ``kind`` union are
made from it; ``build_engine`` builds any of them), with its preflight check in ``_PREFLIGHT`` there
(``engines/ready.py``: a kind without one cannot register).
"""

from __future__ import annotations

from polar_env.engines.base import EngineClient
from polar_env.engines.urls import engine_base_url, engine_urls_of

__all__ = ["EngineClient", "engine_base_url", "engine_urls_of"]
