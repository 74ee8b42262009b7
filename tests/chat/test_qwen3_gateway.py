"""The ``qwen3`` family end to end: the embedded engine on Qwen3's vocabulary behind the real gateway
in continuation mode, a chat-completions harness echoing reasoning through a scripted tool loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_env.chat import chat_format
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.records import CompletionRecord
from polar_env.trajectory.fidelity import verify
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.chat.test_qwen3_format import published
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import Gateway, start_gateway

POLICY = ScriptedPolicy(steps=(
    ScriptStep(command="ls", reasoning="List first."),
    ScriptStep(command="echo hi", reasoning="Now echo."),
    ScriptStep(text="Done: {tool_output}", reasoning="Wrap up."),
))


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine(policy=POLICY, chat=chat_format("qwen3"))


async def run_session(engine: EmbeddedEngine, tmp_path: Path, *, thinking: bool) -> list[CompletionRecord]:
    """A tool loop to its answer, then a follow-up question and its tool loop."""
    client, store = await start_gateway(engine, tmp_path, template="qwen3")
    try:
        gw = Gateway(client, store)
        key = (await gw.session(session_id="ep", continuation=True))["key"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coder."},
                                          {"role": "user", "content": "Fix the bug."}]
        for turn in range(6):
            if turn == 3:
                messages.append({"role": "user", "content": "Thanks. Check once more."})
            body = {"model": "m", "messages": messages, "tools": [SHELL_TOOL],
                    "chat_template_kwargs": {"enable_thinking": thinking}}
            resp = await gw.post("/v1/chat/completions", body, {"Authorization": f"Bearer {key}"})
            assert resp.status == 200, await resp.text()
            msg = (await resp.json())["choices"][0]["message"]
            echo = {"role": "assistant", "content": msg["content"], "reasoning_content": msg.get("reasoning_content")}
            if msg.get("tool_calls"):
                echo["tool_calls"] = msg["tool_calls"]
            messages.append(echo)
            for call in msg.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"out-{len(messages)}"})
        return store.read("ep")
    finally:
        await client.close()


def notes(records: list[CompletionRecord]) -> list[str]:
    return [next(n for n in r.notes if n.startswith("continuation")) for r in records]


@pytest.mark.slow
async def test_thinking_tool_loops_continue_token_in(engine: EmbeddedEngine, tmp_path: Path) -> None:
    records = await run_session(engine, tmp_path, thinking=True)
    said = notes(records)
    assert [n.startswith("continuation: token-in") for n in said] == [False, True, True, False, True, True], said
    assert "drops the reasoning of turns before the last user query" in said[3]
    assert all(r.message.reasoning for r in records) and records[0].message.tool_calls[0].name == "bash"
    tok = chat_format("qwen3").tokenizer
    for record, note in zip(records, said, strict=True):  # templated prompts: the published template's
        if "token-in" not in note:
            request = record.chat_request
            assert record.prompt_ids == tok.encode(published(request.messages, request.tools, gen=True, think=True))
    traj = build_prefix_merged(records)
    stats = traj.metadata["stats"]
    assert (stats["chains"], stats["drift_boundaries"]) == (2, 0), stats
    assert [t.metadata["seqs"] for t in traj.traces] == [[0, 1, 2], [3, 4, 5]]
    assert verify([traj], engine.model).max_abs_delta <= 1e-4


@pytest.mark.slow
async def test_thinking_off_falls_back_to_the_template(engine: EmbeddedEngine, tmp_path: Path) -> None:
    """With thinking off Qwen3's template drops the empty think block of earlier turns: every call is
    templated, with the reason on the record, and the merged trajectory cuts at each drift boundary
    and counts it (never trained: both modes give the six exact traces)."""
    records = await run_session(engine, tmp_path, thinking=False)
    said = notes(records)
    assert said[0] == "continuation: first turn, templated"
    off = "continuation fallback: qwen3: with thinking off the template drops the empty think block of earlier turns"
    assert [n == off for n in said] == [False, True, True, False, True, True], said
    assert said[3].startswith("continuation fallback: qwen3: the template drops the reasoning")
    assert all(r.message.reasoning is None for r in records)
    for strict in (False, True):  # each boundary: the 4 ids of "<think>\n\n</think>\n\n"
        traj = build_prefix_merged(records, strict=strict)
        stats = traj.metadata["stats"]
        assert (stats["chains"], stats["drift_boundaries"], stats["drift_tokens"], len(traj.traces)) == (1, 5, 20, 6), stats
        assert verify([traj], engine.model).max_abs_delta <= 1e-4
