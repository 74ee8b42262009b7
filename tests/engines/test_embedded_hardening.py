"""The embedded engine never returns a non-finite logprob, and carries the trainer's weight label."""

from __future__ import annotations

import math

import pytest

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.records import ChatRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("temperature", [1e-310, 1e-45, 1e-6, 0.0])
def test_tiny_temperatures_decode_greedily_with_finite_logprobs(engine: EmbeddedEngine, temperature: float) -> None:
    tiny = engine.complete(ChatRequest(messages=MESSAGES, temperature=temperature, max_tokens=6, seed=1)).generation
    greedy = engine.complete(ChatRequest(messages=MESSAGES, temperature=0.0, max_tokens=6, seed=2)).generation
    assert all(math.isfinite(lp) for lp in tiny.response_logprobs)
    assert tiny.response_ids == greedy.response_ids and tiny.response_logprobs == greedy.response_logprobs


def test_weight_label_until_the_next_reload(engine: EmbeddedEngine) -> None:
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = engine.weight_version
    try:
        engine.set_weight_version("step-3")
        assert engine.complete(ChatRequest(messages=MESSAGES, max_tokens=2)).generation.weight_version == "step-3"
        engine.reload_weights(state)
        assert engine.complete(ChatRequest(messages=MESSAGES, max_tokens=2)).generation.weight_version == str(before + 1)
    finally:
        engine.version_label = None
        engine.weight_version = before
