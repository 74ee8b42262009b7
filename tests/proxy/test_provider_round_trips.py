"""Each provider through the live gateway and the scripted embedded engine: a tool call, the
harness-style echo of it, and the final answer — streaming and not. The second prompt must be
the first prompt plus the first sampled ids (the tool loop is append-only on the Qwen3.5 template)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.proxy.conftest import Gateway

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


# -- Anthropic ---------------------------------------------------------------------------------


def anthropic_first() -> dict:
    return {"model": "claude-x", "max_tokens": 512,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Run it."}],
            "tools": [{"name": "Bash", "description": "shell", "input_schema": SCHEMA}]}


def anthropic_content(resp_text: str, stream: bool) -> list[dict]:
    if not stream:
        return json.loads(resp_text)["content"]
    blocks: list[dict] = []
    for event in sse_data(resp_text):
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                block["_json"] = block.get("_json", "") + delta["partial_json"]
    for block in blocks:
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json"))
    return blocks


def anthropic_second(first: dict, content: list[dict]) -> tuple[dict, str]:
    call = next(b for b in content if b["type"] == "tool_use")
    assert call["input"] == {"command": "echo hi"} and call["name"] == "Bash"
    messages = first["messages"] + [
        {"role": "assistant", "content": content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "hi"}]},
    ]
    return {**first, "messages": messages}, "Bash"


def anthropic_answer(content: list[dict]) -> str:
    return "".join(b["text"] for b in content if b["type"] == "text")


# -- OpenAI Chat -------------------------------------------------------------------------------


def chat_first() -> dict:
    return {"model": "qwen-x", "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Run it."}],
            "tools": [{"type": "function", "function": {"name": "run_shell_command", "parameters": SCHEMA}}]}


def chat_message(resp_text: str, stream: bool) -> dict:
    if not stream:
        return json.loads(resp_text)["choices"][0]["message"]
    msg: dict = {"role": "assistant", "content": None, "tool_calls": []}
    for chunk in sse_data(resp_text):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                msg["content"] = (msg["content"] or "") + delta["content"]
            if delta.get("reasoning_content"):
                msg["reasoning_content"] = msg.get("reasoning_content", "") + delta["reasoning_content"]
            msg["tool_calls"] += delta.get("tool_calls", [])
    return msg


def chat_second(first: dict, msg: dict) -> tuple[dict, str]:
    (call,) = msg["tool_calls"]
    assert call["function"]["arguments"] == '{"command":"echo hi"}'
    # Echo the reasoning as opencode and pi do; a harness that drops it makes the Qwen3.5 template
    # render an empty think block (drift the continuation mode removes).
    echoed = {"role": "assistant", "content": None, "reasoning_content": msg["reasoning_content"],
              "tool_calls": [{k: call[k] for k in ("id", "type", "function")}]}
    messages = first["messages"] + [echoed, {"role": "tool", "tool_call_id": call["id"], "content": "hi"}]
    return {**first, "messages": messages}, "run_shell_command"


def chat_answer(msg: dict) -> str:
    return msg["content"]


CASES: dict[str, tuple[str, Callable, Callable, Callable, Callable]] = {
    "anthropic": ("/v1/messages?beta=true", anthropic_first, anthropic_content, anthropic_second, anthropic_answer),
    "openai_chat": ("/v1/chat/completions", chat_first, chat_message, chat_second, chat_answer),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", list(CASES))
async def test_tool_round_trip(scripted_gateway: Gateway, api: str, stream: bool) -> None:
    path, first_body, parse, second_body, answer = CASES[api]
    s = await scripted_gateway.session()
    headers = {"x-api-key": s["key"]} if api == "anthropic" else {"Authorization": f"Bearer {s['key']}"}
    first = {**first_body(), "stream": stream}
    resp = await scripted_gateway.post(path, first, headers)
    assert resp.status == 200, await resp.text()
    if stream:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
    turn1 = parse(await resp.text(), stream)
    second, tool_name = second_body(first, turn1)
    resp = await scripted_gateway.post(path, second, headers)
    assert resp.status == 200, await resp.text()
    assert answer(parse(await resp.text(), stream)) == "The command printed: hi"
    r1, r2 = scripted_gateway.store.read(s["session_id"])
    assert r1.provider_api == api and r1.finish_reason == "tool_calls" and r1.message.tool_calls[0].name == tool_name
    assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.response_ids)] == r1.prompt_ids + r1.response_ids
    assert len(r2.response_logprobs) == len(r2.response_ids) and r2.finish_reason == "stop"
