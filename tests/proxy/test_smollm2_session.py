"""A multi-turn tool session on SmolLM2 (template ``smollm2``, real weights, a scripted policy)
through the real gateway in token-in continuation mode: the generic ``hf:`` family's continuation
text must make every turn's prompt extend the previous turn's prompt + sampled ids exactly, so the
merged trace has zero drift, its loss mask is 1 on exactly the sampled ids, and the step-0 check
(teacher-forced logprobs on the merged trace) holds on real weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_env.chat.hf import HFChatFormat
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import teacher_forced_logprobs
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.records import CompletionRecord
from polar_env.train.step0 import STEP0_TOLERANCE
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import Gateway, start_gateway

pytestmark = pytest.mark.slow  # loads SmolLM2-135M (fp32, from the cached GGUF conversion)

POLICY = ScriptedPolicy(steps=(ScriptStep(command="echo hi", reasoning="I should run it."),
                               ScriptStep(text="The command printed: {tool_output}")))


@pytest.fixture(scope="module")
def smol_engine(smollm2: HFChatFormat) -> EmbeddedEngine:
    return EmbeddedEngine(model_dir=smollm2.weights, chat=smollm2, policy=POLICY, model_name="smollm2")


async def call(gw: Gateway, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One harness call; the assistant message sent back exactly as the gateway returned it."""
    resp = await gw.post("/v1/chat/completions", {"model": "smollm2", "messages": messages, "tools": [SHELL_TOOL],
                                                  "temperature": 1.0}, {"Authorization": f"Bearer {key}"})
    assert resp.status == 200, await resp.text()
    message: dict[str, Any] = (await resp.json())["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


async def test_token_in_session_has_exact_masks_and_zero_drift(smol_engine: EmbeddedEngine, tmp_path: Path) -> None:
    client, store = await start_gateway(smol_engine, tmp_path, template="smollm2")
    try:
        gw = Gateway(client, store)
        key = (await gw.session(session_id="smol", continuation=True))["key"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a shell agent."},
                                          {"role": "user", "content": "Run echo hi."}]
        for follow_up in ("tool", "user", "tool", None):
            reply = await call(gw, key, messages)
            messages.append(reply)
            if follow_up == "tool":
                (tool_call,) = reply["tool_calls"]
                messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": "hi\n"})
            elif follow_up == "user":
                assert reply["content"] == "The command printed: hi"
                messages.append({"role": "user", "content": "Again, please."})
    finally:
        await client.close()

    records: list[CompletionRecord] = sorted(store.read("smol"), key=lambda r: r.seq)
    assert len(records) == 4
    chat = smol_engine.chat
    for prev, record in zip(records, records[1:], strict=False):
        assert any("token-in" in note for note in record.notes), record.notes
        sampled = prev.prompt_ids + prev.response_ids
        assert record.prompt_ids[: len(sampled)] == sampled, "a turn does not extend the previous one"
        assert prev.response_ids[-1] == chat.end_of_turn_id
    # token-in equals what a fresh render of the history the harness sent would have given
    last = records[-1]
    assert last.prompt_ids == chat.tokenizer.encode(chat.render(last.chat_request.messages, last.chat_request.tools))

    traj = build_prefix_merged(records)
    stats = traj.metadata["stats"]
    assert (stats["chains"], stats["traces"], stats["drift_boundaries"], stats["drift_tokens"]) == (1, 1, 0, 0), stats
    (trace,) = traj.traces
    start = len(records[0].prompt_ids)
    assert trace.prompt_ids == records[0].prompt_ids
    assert trace.response_ids == last.prompt_ids[start:] + last.response_ids
    want_mask = [0] * len(trace.response_ids)
    want_lps = [0.0] * len(trace.response_ids)
    for record in records:
        at = len(record.prompt_ids) - start
        want_mask[at: at + len(record.response_ids)] = [1] * len(record.response_ids)
        want_lps[at: at + len(record.response_ids)] = record.response_logprobs
    assert trace.loss_mask == want_mask and trace.response_logprobs == want_lps

    recomputed = teacher_forced_logprobs(smol_engine.model, trace.prompt_ids, trace.response_ids, 1.0)
    deltas = [abs(a - b) for a, b, m in zip(recomputed, trace.response_logprobs, trace.loss_mask, strict=True) if m]
    assert len(deltas) == sum(len(r.response_ids) for r in records) and max(deltas) <= STEP0_TOLERANCE
