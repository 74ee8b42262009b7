"""The embedded engine over HTTP: vLLM 0.33 field names and shapes, errors, weight sync."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from safetensors.torch import save as save_safetensors

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import ModelSpec, build_model
from polar_env.engines.embedded.server import build_app
from polar_env.qwen.tokenizer import IM_END_ID

from tests.conftest import SHELL_TOOL

USER = [{"role": "user", "content": "Use the tool."}]


@pytest.fixture
async def client(scripted_engine: EmbeddedEngine):
    async with TestClient(TestServer(build_app(scripted_engine))) as c:
        yield c


async def post(client: TestClient, path: str, body: dict) -> tuple[int, dict]:
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def test_chat_completion_shape(client: TestClient) -> None:
    status, data = await post(client, "/v1/chat/completions", {
        "model": "polar-tiny-qwen3", "messages": USER, "tools": [SHELL_TOOL],
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
    })
    assert status == 200
    assert set(data) >= {"id", "object", "created", "model", "choices", "usage", "prompt_token_ids", "prompt_logprobs", "kv_transfer_params"}
    assert data["object"] == "chat.completion"
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] is None
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    assert len(ids) == len(entries) and ids[-1] == IM_END_ID
    assert entries[-1]["token"] == "<|im_end|>" and entries[-1]["bytes"] == list(b"<|im_end|>")
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2 for e in entries)
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] is None and msg["reasoning"] == "I should run the command."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "bash", "arguments": '{"command": "echo hi"}'}
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call["id"])
    assert data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])
    assert data["usage"]["completion_tokens"] == len(ids)
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == ids.index(248069) + 1


async def test_vllm_refusals(client: TestClient) -> None:
    status, data = await post(client, "/v1/chat/completions", {"model": "no-such-model", "messages": USER})
    assert status == 404 and "does not exist" in data["error"]["message"]
    status, data = await post(client, "/v1/chat/completions", {"messages": USER, "structured_outputs": {"choice": ["a"]}})
    assert status == 400 and "not supported" in data["error"]["message"]


async def test_padding_ids_and_split_characters_decode_like_vllm(engine: EmbeddedEngine) -> None:
    """Ids past the real vocabulary are padding rows: sampled, they decode to nothing (no crash).
    A token holding the first bytes of a character reports "" and the next one the character."""
    async with TestClient(TestServer(build_app(engine))) as c:
        _, data = await post(c, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0,
                                                         "logprobs": True, "return_token_ids": True, "logit_bias": {"248100": 100}})
        assert data["choices"][0]["token_ids"] == [248100, 248100]
        assert [e["token"] for e in data["choices"][0]["logprobs"]["content"]] == ["", ""]
    tok = engine.tokenizer
    ids = tok.encode("a𓀀b")  # 𓀀 takes four byte-level tokens
    assert tok.token_texts(ids) == ["a", "", "", "", "𓀀", "b"]
    assert tok.decode(ids[:3]) == "a"  # an unfinished character at the end is left out
    assert tok.decode(ids) == "a𓀀b"
