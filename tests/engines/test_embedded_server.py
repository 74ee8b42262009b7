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

from polar_env.chat.qwen35.tokenizer import IM_END_ID
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import ModelSpec, build_model
from polar_env.engines.embedded.server import build_app
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
    assert set(data) >= {"id", "object", "created", "model", "choices", "usage", "prompt_token_ids", "prompt_logprobs",
                         "kv_transfer_params"}
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


async def test_token_fields_only_when_asked(client: TestClient) -> None:
    _, data = await post(client, "/v1/chat/completions", {"messages": USER})
    assert data["prompt_token_ids"] is None and data["choices"][0]["token_ids"] is None
    assert data["choices"][0]["logprobs"] is None


async def test_tokenize_matches_prompt_ids_and_token_in(client: TestClient) -> None:
    _, tok = await post(client, "/tokenize", {"messages": USER, "tools": [SHELL_TOOL]})
    _, data = await post(client, "/v1/chat/completions", {"messages": USER, "tools": [SHELL_TOOL], "return_token_ids": True})
    assert tok["tokens"] == data["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    ids = tok["tokens"] + [1, 2, 3]
    _, data = await post(client, "/v1/chat/completions",
                         {"messages": USER, "return_token_ids": True, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert data["prompt_token_ids"] == ids
    _, text = await post(client, "/detokenize", {"tokens": tok["tokens"][:3]})
    assert text["prompt"].startswith("<|im_start|>system")


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (orjson.dumps({"model": "m"}), "'messages'"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "invalid request"),
        (orjson.dumps({"messages": [{"role": "assistant", "content": "x"}]}), "No user query"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True}), "top_logprobs"),
    ],
)
async def test_bad_requests_get_vllm_error_bodies(client: TestClient, body: bytes, fragment: str) -> None:
    resp = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    data = orjson.loads(await resp.read())
    assert resp.status == 400
    assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["code"] == 400
    assert fragment in data["error"]["message"]


async def test_unknown_path_is_a_json_404(client: TestClient) -> None:
    resp = await client.get("/v2/nothing")
    assert resp.status == 404 and orjson.loads(await resp.read())["error"]["code"] == 404


async def test_models_and_health(client: TestClient) -> None:
    resp = await client.get("/health")
    assert resp.status == 200
    resp = await client.get("/v1/models")
    (card,) = orjson.loads(await resp.read())["data"]
    assert card["id"] == "polar-tiny-qwen3" and card["max_model_len"] == 32768


async def test_weight_sync_endpoints(tmp_path) -> None:
    engine = EmbeddedEngine()
    async with TestClient(TestServer(build_app(engine))) as c:
        body = {"messages": USER, "max_tokens": 3, "seed": 1, "logprobs": True}
        _, before = await post(c, "/v1/chat/completions", body)
        state = build_model(ModelSpec(seed=9)).state_dict()
        blob = save_safetensors({k: v for k, v in state.items() if k != "lm_head.weight"})  # tied to embed_tokens
        resp = await c.post("/update_weights", data=io.BytesIO(blob))
        assert resp.status == 200 and orjson.loads(await resp.read())["weight_version"] == "1"
        _, after = await post(c, "/v1/chat/completions", body)
        assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]
        build_model(ModelSpec(seed=0)).save_pretrained(str(tmp_path))
        status, data = await post(c, "/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert status == 200 and data["weight_version"] == "2"
        _, restored = await post(c, "/v1/chat/completions", body)
        assert restored["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]
        status, data = await post(c, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
        assert status == 400
        resp = await c.post("/update_weights", data=b"garbage")
        assert resp.status == 400
        resp = await c.get("/get_weight_version")
        assert orjson.loads(await resp.read()) == {"weight_version": "2"}


@pytest.mark.slow
async def test_cli_engine_process_serves_requests(unused_tcp_port: int) -> None:
    """``polar-env engine`` as a real process: ready in seconds, answers a scripted tool call."""
    cmd = [sys.executable, "-m", "polar_env.cli", "engine", "--port", str(unused_tcp_port), "--scripted"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        started = time.monotonic()
        seen = []
        while proc.stdout and time.monotonic() - started < 60:
            seen.append(proc.stdout.readline())
            if "ready in" in seen[-1] or proc.poll() is not None:
                break
        assert "ready in" in seen[-1], seen
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{unused_tcp_port}/v1/chat/completions",
                              json={"messages": USER, "tools": [SHELL_TOOL], "return_token_ids": True}) as resp:
                data = await resp.json()
        assert data["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if proc.stdout:
            proc.stdout.close()
        if proc.stdout:
            proc.stdout.close()
