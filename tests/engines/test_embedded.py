"""The embedded engine in-process: real ids, real logprobs, scripted turns, weight reload."""

from __future__ import annotations

import json

import pytest
import torch

from polar_env.chat.qwen35.template import render
from polar_env.chat.qwen35.tokenizer import IM_END_ID
from polar_env.engines.embedded.engine import EmbeddedEngine, SamplingExtras
from polar_env.engines.embedded.model import ModelSpec, build_model, teacher_forced_logprobs
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.errors import RequestError
from polar_env.records import ChatRequest
from tests.conftest import SHELL_TOOL

pytestmark = pytest.mark.slow  # loads and decodes the embedded engine

USER = [{"role": "user", "content": "Say something."}]


def chat(**kw) -> ChatRequest:
    kw.setdefault("messages", USER)
    return ChatRequest(**kw)


async def test_ids_decode_to_text_and_logprobs_align(engine: EmbeddedEngine) -> None:
    gen = await engine.generate(chat(max_tokens=24, seed=3, chat_template_kwargs={"enable_thinking": False}))
    assert len(gen.response_ids) == 24 and gen.finish_reason == "length"
    assert len(gen.response_logprobs) == len(gen.response_ids)
    assert engine.tokenizer.decode(gen.response_ids) == gen.message.content
    assert all(lp < 0 for lp in gen.response_logprobs)


async def test_prompt_ids_are_template_tokenization(engine: EmbeddedEngine) -> None:
    req = chat(max_tokens=2, tools=[SHELL_TOOL])
    gen = await engine.generate(req)
    assert gen.prompt_ids == engine.tokenizer.encode(render(req.messages, req.tools))


async def test_same_seed_same_tokens_other_seed_differs(engine: EmbeddedEngine) -> None:
    a = await engine.generate(chat(max_tokens=16, seed=7))
    b = await engine.generate(chat(max_tokens=16, seed=7))
    c = await engine.generate(chat(max_tokens=16, seed=8))
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    assert a.response_ids != c.response_ids


async def test_logprobs_are_the_sampling_distribution(engine: EmbeddedEngine) -> None:
    """processed logprobs = teacher-forced log-softmax(logits / T) at the sampling temperature."""
    for temperature in (1.0, 0.5):
        gen = await engine.generate(chat(max_tokens=12, seed=1, temperature=temperature))
        recomputed = teacher_forced_logprobs(engine.model, gen.prompt_ids, gen.response_ids, temperature)
        assert max(abs(a - b) for a, b in zip(recomputed, gen.response_logprobs, strict=True)) < 1e-4
    cold = await engine.generate(chat(max_tokens=12, seed=1, temperature=0.5))
    warm = teacher_forced_logprobs(engine.model, cold.prompt_ids, cold.response_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(warm, cold.response_logprobs, strict=True)) > 1e-3


async def test_top_p_renormalises_logprobs(engine: EmbeddedEngine) -> None:
    full = await engine.generate(chat(max_tokens=8, seed=2))
    nucleus = await engine.generate(chat(max_tokens=8, seed=2, top_p=0.5))
    # A near-uniform model keeps about half the vocabulary: each kept token gains about log 2.
    assert sum(nucleus.response_logprobs) / 8 > sum(full.response_logprobs) / 8 + 0.5


def test_raw_logprobs_mode_ignores_temperature() -> None:
    raw = EmbeddedEngine(logprobs_mode="raw")
    done = raw.complete(chat(max_tokens=6, seed=4, temperature=0.3))
    expected = teacher_forced_logprobs(raw.model, done.generation.prompt_ids, done.generation.response_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(expected, done.generation.response_logprobs, strict=True)) < 1e-4
    assert done.generation.logprobs_mode == "raw"


def test_greedy_is_deterministic_without_seed(engine: EmbeddedEngine) -> None:
    a = engine.complete(chat(max_tokens=8, temperature=0.0)).generation
    b = engine.complete(chat(max_tokens=8, temperature=0.0)).generation
    assert a.response_ids == b.response_ids


def test_eos_stop_string_and_stop_token(engine: EmbeddedEngine) -> None:
    eos = engine.complete(chat(max_tokens=50, seed=1), SamplingExtras(logit_bias={IM_END_ID: 100.0})).generation
    assert eos.response_ids == [IM_END_ID] and eos.finish_reason == "stop" and eos.stop_reason is None
    assert eos.response_logprobs[0] > -1e-3  # the bias is part of the sampled distribution
    first = engine.complete(chat(max_tokens=20, seed=5, chat_template_kwargs={"enable_thinking": False})).generation
    target = first.response_ids[3]
    by_id = engine.complete(chat(max_tokens=20, seed=5, chat_template_kwargs={"enable_thinking": False}),
                            SamplingExtras(stop_token_ids=[target])).generation
    assert by_id.response_ids == first.response_ids[:4] and by_id.stop_reason == target
    word = engine.tokenizer.decode(first.response_ids[4:6])
    by_str = engine.complete(chat(max_tokens=20, seed=5, stop=[word], chat_template_kwargs={"enable_thinking": False})).generation
    assert by_str.finish_reason == "stop" and by_str.stop_reason == word
    assert word not in (by_str.message.content or "")


async def test_scripted_tool_call_then_answer(scripted_engine: EmbeddedEngine) -> None:
    first = await scripted_engine.generate(chat(tools=[SHELL_TOOL]))
    assert first.finish_reason == "tool_calls" and first.response_ids[-1] == IM_END_ID
    (call,) = first.message.tool_calls
    assert call.name == "bash" and json.loads(call.arguments) == {"command": "echo hi"}
    assert first.message.reasoning == "I should run the command."
    recomputed = teacher_forced_logprobs(scripted_engine.model, first.prompt_ids, first.response_ids)
    assert max(abs(a - b) for a, b in zip(recomputed, first.response_logprobs, strict=True)) < 1e-4
    history = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "hi\n"},
    ]
    second = await scripted_engine.generate(chat(messages=history, tools=[SHELL_TOOL]))
    assert second.finish_reason == "stop" and second.message.tool_calls == []
    assert second.message.content == "The command printed: hi"


@pytest.mark.parametrize(
    "tool, expected",
    [
        ({"name": "exec_command", "parameters": {"properties": {"cmd": {"type": "string"}}}}, {"cmd": "echo hi"}),
        ({"name": "run_shell_command", "parameters": {"properties": {"command": {"type": "string"}}}}, {"command": "echo hi"}),
        ({"name": "shell", "parameters": {"properties": {"command": {"type": "array"}}}}, {"command": ["bash", "-lc", "echo hi"]}),
    ],
)
def test_scripted_policy_picks_the_declared_shell_tool(scripted_engine: EmbeddedEngine, tool: dict, expected: dict) -> None:
    other = {"type": "function", "function": {"name": "read_file", "parameters": {"properties": {"path": {"type": "string"}}}}}
    gen = scripted_engine.complete(chat(tools=[other, {"type": "function", "function": tool}])).generation
    (call,) = gen.message.tool_calls
    assert call.name == tool["name"] and json.loads(call.arguments) == expected


def test_scripted_without_shell_tool_answers(scripted_engine: EmbeddedEngine) -> None:
    gen = scripted_engine.complete(chat(chat_template_kwargs={"enable_thinking": False})).generation
    assert gen.finish_reason == "stop" and gen.message.content == "The command printed:" and gen.message.reasoning is None


def test_scripted_turn_truncated_by_max_tokens(scripted_engine: EmbeddedEngine) -> None:
    gen = scripted_engine.complete(chat(tools=[SHELL_TOOL], max_tokens=5)).generation
    assert len(gen.response_ids) == 5 and gen.finish_reason == "length" and gen.message.tool_calls == []


def test_custom_script_steps() -> None:
    policy = ScriptedPolicy(steps=(ScriptStep(command="ls"), ScriptStep(command="pwd"), ScriptStep(text="bye")))
    eng = EmbeddedEngine(policy=policy)
    history = list(USER)
    seen = []
    for _ in range(3):
        gen = eng.complete(chat(messages=history, tools=[SHELL_TOOL])).generation
        if not gen.message.tool_calls:
            seen.append(gen.message.content)
            break
        call = gen.message.tool_calls[0]
        seen.append(json.loads(call.arguments)["command"])
        history += [
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "ok"},
        ]
    assert seen == ["ls", "pwd", "bye"]


def test_token_in_skips_the_template(engine: EmbeddedEngine) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\nraw ids<|im_end|>\n<|im_start|>assistant\n") + [1, 2, 3]
    gen = engine.complete(chat(prompt_ids=ids, max_tokens=3, seed=0)).generation
    assert gen.prompt_ids == ids


def test_request_errors(engine: EmbeddedEngine) -> None:
    with pytest.raises(RequestError, match="maximum context length"):
        engine.complete(chat(prompt_ids=[1] * (engine.max_model_len + 1)))
    with pytest.raises(RequestError, match="out of vocabulary"):
        engine.complete(chat(prompt_ids=[10**7]))


def test_weight_reload_from_state_dict_and_directory(tmp_path) -> None:
    eng = EmbeddedEngine()
    before = eng.complete(chat(max_tokens=4, seed=1)).generation
    other = build_model(ModelSpec(seed=123)).state_dict()
    assert eng.reload_weights(other) == 1
    after = eng.complete(chat(max_tokens=4, seed=1)).generation
    assert after.weight_version == "1" and after.response_logprobs != before.response_logprobs
    original = build_model(ModelSpec(seed=0))
    original.save_pretrained(str(tmp_path))
    assert eng.reload_weights(tmp_path) == 2
    again = eng.complete(chat(max_tokens=4, seed=1)).generation
    assert again.response_ids == before.response_ids and again.response_logprobs == before.response_logprobs
    with pytest.raises(RequestError, match="does not fit"):
        eng.reload_weights({"bogus": torch.zeros(1)})


async def test_a_cancelled_generation_stops_decoding(engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abandoned call (aborted, or the engine closing) leaves the batch at its next token instead
    of sampling to max_tokens for nobody, and frees the model for the next call; so does aclose."""
    import asyncio

    from polar_env.engines.embedded.model import DecodeCancelled
    from tests.waits import until

    scheduler = engine.scheduler
    monkeypatch.setattr(engine, "max_tokens", 100_000)
    request = chat(max_tokens=100_000, temperature=1.0)  # random weights: EOS practically never comes
    for stop in ("cancel", "aclose"):
        steps, cancelled = scheduler.steps, scheduler.cancelled
        call = asyncio.ensure_future(engine.generate(request))
        await until(lambda steps=steps: scheduler.steps > steps + 2, "the decode to start", timeout_s=60)
        if stop == "cancel":
            call.cancel()
        else:
            await engine.aclose()
        with pytest.raises((asyncio.CancelledError, DecodeCancelled)):
            await call
        await until(lambda cancelled=cancelled: scheduler.cancelled == cancelled + 1 and not scheduler.running,
                    f"the request to leave the batch after {stop}")
    assert not scheduler.model_lock.locked()
    ok = await engine.generate(chat(max_tokens=3))  # the engine is still usable
    assert len(ok.response_ids) <= 3


def test_models_built_in_threads_at_once_are_the_seeds_weights() -> None:
    """Nodes in one process build their engines in threads at the same time: each seeded build gets
    the seed's weights (torch's RNG is process-wide) and transformers' lazy import holds."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from polar_env.engines.embedded.model import build_model

    with ThreadPoolExecutor(3) as pool:
        models = list(pool.map(lambda _: build_model(), range(3)))
    alone = build_model().state_dict()
    for model in models:
        for name, value in model.state_dict().items():
            assert torch.equal(value, alone[name]), name
