"""Inference engines behind one small interface: a ChatRequest in, a Generation (parsed message
plus prompt ids, sampled ids, aligned logprobs, finish reason) out.

Backends: ``vllm`` (OpenAI server with return_token_ids), ``sglang`` (OpenAI chat or native
/generate, talking to workers directly), ``embedded`` (our CPU engine, in-process). Every backend
raises the EngineError tree from ``polar_env.errors``; none ever returns an empty completion for a
failure. To add a backend: one module implementing ``EngineClient`` plus one line in ``ENGINES``.
"""

from __future__ import annotations

from polar_env.engines.base import EngineClient

__all__ = ["EngineClient"]
