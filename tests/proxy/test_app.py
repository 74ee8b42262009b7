"""The gateway pipeline over HTTP: sessions and keys, capture, streaming, errors, pause/resume."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from polar_env.chat.qwen35.tokenizer import IM_END_ID
from polar_env.errors import EngineHTTPError, EngineProtocolError, EngineTimeout, EngineUnavailable
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import Sampling
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import FakeEngine, Gateway

CHAT = "/v1/chat/completions"


def chat_body(**kw: object) -> dict:
    return {"model": "whatever-the-harness-says", "messages": [{"role": "user", "content": "Run it."}], "tools": [SHELL_TOOL], **kw}


def bearer(session: dict) -> dict[str, str]:
    return {"Authorization": f"Bearer {session['key']}"}


async def test_session_env_and_key_routing(scripted_gateway: Gateway) -> None:
    s = await scripted_gateway.session(session_id="ep-1", metadata={"task": "t"})
    assert s["session_id"] == "ep-1" and s["key"].startswith("sk-polar-")
    assert s["env"]["OPENAI_BASE_URL"].endswith("/v1") and s["env"]["ANTHROPIC_API_KEY"] == s["key"]
    resp = await scripted_gateway.post(CHAT, chat_body(), bearer(s))
    data = await resp.json()
    assert resp.status == 200 and data["model"] == "whatever-the-harness-says"
    (call,) = data["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == '{"command":"echo hi"}'  # compact for byte-identical echo
    assert call["id"].startswith("call_") and data["choices"][0]["finish_reason"] == "tool_calls"
    (record,) = scripted_gateway.store.read("ep-1")
    assert record.session_id == "ep-1" and record.seq == 0 and record.provider_api == "openai_chat"
    assert record.provider_request == chat_body() and record.chat_request.model == "polar-tiny-qwen3"
    assert record.response_ids[-1] == IM_END_ID and len(record.response_logprobs) == len(record.response_ids)
    assert record.weight_version == "0" and record.timings.engine_ms > 0


@pytest.mark.parametrize("header", ["x-api-key", "x-goog-api-key", "Authorization", "query"])
async def test_every_key_location_resolves(scripted_gateway: Gateway, header: str) -> None:
    s = await scripted_gateway.session()
    if header == "query":
        resp = await scripted_gateway.post(f"{CHAT}?key={s['key']}", chat_body())
    else:
        value = f"Bearer {s['key']}" if header == "Authorization" else s["key"]
        resp = await scripted_gateway.post(CHAT, chat_body(), {header: value})
    assert resp.status == 200
    assert len(scripted_gateway.store.read(s["session_id"])) == 1


async def test_unknown_and_foreign_keys_are_refused_and_not_recorded(scripted_gateway: Gateway) -> None:
    a = await scripted_gateway.session(session_id="a")
    b = await scripted_gateway.session(session_id="b")
    resp = await scripted_gateway.post(CHAT, chat_body(), {"Authorization": "Bearer sk-nope"})
    body = await resp.json()
    assert resp.status == 401 and body["error"]["type"] == "authentication_error"
    resp = await scripted_gateway.post(f"/s/b{CHAT}", chat_body(), bearer(a))  # a's key, b's prefix
    assert resp.status == 401
    resp = await scripted_gateway.post(f"/s/a{CHAT}", chat_body(), bearer(a))
    assert resp.status == 200
    assert len(scripted_gateway.store.read("a")) == 1 and scripted_gateway.store.read("b") == []
    del b


async def test_harness_session_header_never_overrides_the_key(scripted_gateway: Gateway) -> None:
    """opencode sends its own x-session-id; the key we issued decides the session."""
    a = await scripted_gateway.session(session_id="mine")
    await scripted_gateway.session(session_id="other")
    resp = await scripted_gateway.post(CHAT, chat_body(), {**bearer(a), "x-session-id": "other"})
    assert resp.status == 200
    assert len(scripted_gateway.store.read("mine")) == 1 and scripted_gateway.store.read("other") == []


async def test_stream_is_synthesized_from_the_full_generation(scripted_gateway: Gateway) -> None:
    s = await scripted_gateway.session()
    resp = await scripted_gateway.post(CHAT, chat_body(stream=True, stream_options={"include_usage": True}), bearer(s))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    frames = [f for f in (await resp.text()).split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    calls = [c for ch in chunks for choice in ch["choices"] for c in choice["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "bash", "arguments": '{"command":"echo hi"}'}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    (record,) = scripted_gateway.store.read(s["session_id"])
    assert chunks[-1]["usage"]["completion_tokens"] == len(record.response_ids)


async def test_tool_round_trip_is_an_exact_token_append(scripted_gateway: Gateway) -> None:
    s = await scripted_gateway.session()
    first = await (await scripted_gateway.post(CHAT, chat_body(), bearer(s))).json()
    msg = first["choices"][0]["message"]
    history = chat_body()["messages"] + [
        {"role": "assistant", "content": None, "reasoning_content": msg["reasoning_content"], "tool_calls": msg["tool_calls"]},
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": [{"type": "text", "text": "hi\n"}]},
    ]
    second = await (await scripted_gateway.post(CHAT, chat_body(messages=history), bearer(s))).json()
    assert second["choices"][0]["message"]["content"] == "The command printed: hi"
    r1, r2 = scripted_gateway.store.read(s["session_id"])
    assert (r1.seq, r2.seq) == (0, 1)
    assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.response_ids)] == r1.prompt_ids + r1.response_ids


async def test_completions_endpoint_delete_and_reopen(scripted_gateway: Gateway, tmp_path) -> None:
    s = await scripted_gateway.session(session_id="keep")
    for _ in range(2):
        assert (await scripted_gateway.post(CHAT, chat_body(), bearer(s))).status == 200
    resp = await scripted_gateway.client.get("/sessions/keep/completions", headers=scripted_gateway.admin)
    data = orjson.loads(await resp.read())
    assert [c["seq"] for c in data["completions"]] == [0, 1]
    info = await (await scripted_gateway.client.get("/sessions/keep", headers=bearer(s))).json()  # its own key
    assert info["completions"] == 2 and info["metadata"] == {}
    resp = await scripted_gateway.client.delete("/sessions/keep", headers=scripted_gateway.admin)
    assert resp.status == 200 and (await resp.json())["closed"] is True
    resp = await scripted_gateway.post(CHAT, chat_body(), bearer(s))
    assert resp.status == 401
    reopened = JournalStore(tmp_path / "capture")
    assert [r.seq for r in reopened.read("keep")] == [0, 1] and reopened.session_ids() == ["keep"]
    assert (await scripted_gateway.client.get("/sessions/nope", headers=scripted_gateway.admin)).status == 404


async def test_torn_final_line_is_skipped(tmp_path) -> None:
    store = JournalStore(tmp_path)
    path = store.path("s")
    path.write_bytes(b'{"truncated": ')
    assert store.read("s") == []


@pytest.mark.parametrize(
    "raw, headers, status, fragment",
    [
        (b"{nope", {}, 400, "not valid JSON"),
        (b"[]", {}, 400, "JSON object"),
        (b'{"model": "m"}', {}, 400, "messages"),
        (b'{"messages": "hi"}', {}, 400, "messages"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', {}, 400, "role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', {}, 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', {"Content-Type": "text/plain"}, 415, "Content-Type"),
        (b'{"messages": [{"role": "user", "content": "' + b"x" * 70_000 + b'"}]}', {}, 413, "exceeds"),
    ],
    ids=["bad-json", "not-object", "no-messages", "messages-str", "bad-role", "bad-max-tokens", "content-type", "oversize"],
)
async def test_bad_input_gets_provider_shaped_4xx(fake_gateway: Gateway, fake_engine: FakeEngine, raw: bytes, headers: dict,
                                                  status: int, fragment: str) -> None:
    s = await fake_gateway.session()
    resp = await fake_gateway.post(CHAT, None, {**bearer(s), **headers}, raw=raw)
    body = await resp.json()
    assert resp.status == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert fragment in body["error"]["message"]
    assert fake_engine.seen == [] and fake_gateway.store.read(s["session_id"]) == []


@pytest.mark.parametrize("pad", [60_000, 70_000])
async def test_a_chunked_body_is_held_to_the_same_limit(fake_gateway: Gateway, fake_engine: FakeEngine, pad: int) -> None:
    """No Content-Length (chunked): the gateway's own read counts the bytes as they come and
    refuses past the limit with the provider's 413, like a declared length."""
    s = await fake_gateway.session()
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * pad + b'"}], "max_tokens": 5}'

    async def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    resp = await fake_gateway.client.post(CHAT, data=chunks(), headers={**bearer(s), "Content-Type": "application/json"})
    if pad < 64 * 1024:
        assert resp.status == 200, await resp.text()
        assert len(fake_gateway.store.read(s["session_id"])) == 1
    else:
        assert resp.status == 413 and "exceeds" in (await resp.json())["error"]["message"]
        assert fake_engine.seen == [] and fake_gateway.store.read(s["session_id"]) == []


async def test_unknown_path_is_a_provider_shaped_404(fake_gateway: Gateway) -> None:
    resp = await fake_gateway.post("/v1/embeddings", {"input": "x"})
    assert resp.status == 404 and "no route" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(
    "error, status, told",
    [
        (EngineTimeout("slow", url="http://10.0.0.7:8000/v1"), 504, "did not answer in time"),
        (EngineUnavailable("cannot reach 10.0.0.7:8000", url="http://10.0.0.7:8000/v1"), 503, "engine unavailable"),
        (EngineHTTPError("context too long", status=400, url="http://10.0.0.7:8000/v1"), 400, "context too long"),
        (EngineHTTPError("slow down", status=429, url="http://10.0.0.7:8000/v1"), 429, "rate limited"),
        (EngineHTTPError("boom at http://10.0.0.7:8000", status=500), 502, "engine failed"),
        (EngineProtocolError("no token ids"), 502, "engine failed"),
    ],
)
async def test_engine_errors_map_to_statuses_and_record_nothing(fake_gateway: Gateway, fake_engine: FakeEngine, error: Exception,
                                                                status: int, told: str) -> None:
    """Engine 429 stays 429 (SDKs back off on it); the engine's own text reaches the harness only
    when it is about the request (4xx), and its internal address never does."""
    fake_engine.error = error
    s = await fake_gateway.session()
    resp = await fake_gateway.post(CHAT, chat_body(), bearer(s))
    body = await resp.json()
    assert resp.status == status and told in body["error"]["message"], body
    assert "10.0.0.7" not in body["error"]["message"]
    assert fake_gateway.store.read(s["session_id"]) == []
    info = await (await fake_gateway.client.get(f"/sessions/{s['session_id']}", headers=fake_gateway.admin)).json()
    assert info["errors"] == 1


async def test_sampling_overrides_and_template_quirks(tmp_path) -> None:
    from tests.proxy.conftest import start_gateway

    engine = FakeEngine()
    client, _ = await start_gateway(engine, tmp_path, sampling=Sampling(temperature=1.0, top_p=1.0, max_tokens=64))
    try:
        gw = Gateway(client, _)
        s = await gw.session()
        messages = [
            {"role": "system", "content": "a"}, {"role": "developer", "content": "b"},
            {"role": "user", "content": "q"}, {"role": "system", "content": "late"},
        ]
        resp = await gw.post(CHAT, {"messages": messages, "temperature": 0.2, "max_tokens": 9999}, bearer(s))
        assert resp.status == 200
        (chat,) = engine.seen
        assert (chat.temperature, chat.top_p, chat.max_tokens) == (1.0, 1.0, 64)
        assert [m["role"] for m in chat.messages] == ["system", "user", "user"]
        assert chat.messages[0]["content"] == "a\n\nb"
        (record,) = gw.store.read(s["session_id"])
        assert any("sent as a user message" in n for n in record.notes)
    finally:
        await client.close()


async def test_pause_drains_in_flight_and_resume_sets_weight_version(fake_gateway: Gateway, fake_engine: FakeEngine) -> None:
    fake_engine.delay_s = 0.3
    s = await fake_gateway.session()
    first = asyncio.create_task(fake_gateway.post(CHAT, chat_body(), bearer(s)))
    await asyncio.sleep(0.05)
    pause = await fake_gateway.client.post("/admin/pause", headers=fake_gateway.admin)
    status = await pause.json()
    assert pause.status == 200 and status["paused"] and status["in_flight"] == 0 and status["drained"]
    assert first.done()  # pause returned only after the in-flight call finished
    blocked = asyncio.create_task(fake_gateway.post(CHAT, chat_body(), bearer(s)))
    await asyncio.sleep(0.1)
    assert not blocked.done() and len(fake_engine.seen) == 1
    await fake_gateway.client.post("/admin/resume", json={"weight_version": 5}, headers=fake_gateway.admin)
    assert (await blocked).status == 200
    r1, r2 = fake_gateway.store.read(s["session_id"])
    assert (r1.weight_version, r2.weight_version) == ("0", "5")


async def test_side_endpoints(fake_gateway: Gateway) -> None:
    assert (await fake_gateway.client.head("/")).status == 200
    models = await (await fake_gateway.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "polar-tiny-qwen3"
    resp = await fake_gateway.client.get("/v1/responses", headers={"Upgrade": "websocket", "Connection": "Upgrade"})
    assert resp.status == 426


async def test_client_disconnect_mid_call_keeps_the_capture(fake_gateway: Gateway, fake_engine: FakeEngine) -> None:
    """A harness that gives up while the engine is still generating: the call completes and is
    journaled anyway (aiohttp does not cancel handlers on disconnect)."""
    import aiohttp

    fake_engine.delay_s = 0.4
    s = await fake_gateway.session()
    url = fake_gateway.client.make_url(CHAT)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(url, json=chat_body(stream=True), headers=bearer(s), timeout=aiohttp.ClientTimeout(total=0.1))
    await asyncio.sleep(0.6)
    (record,) = fake_gateway.store.read(s["session_id"])
    assert record.response_ids == [4, 5]


async def test_count_tokens_is_the_engine_side_prompt_length(scripted_gateway: Gateway, scripted_engine) -> None:
    s = await scripted_gateway.session()
    body = {"model": "claude-x", "messages": [{"role": "user", "content": "Run it."}],
            "tools": [{"name": "bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]}
    resp = await scripted_gateway.post("/v1/messages/count_tokens", body, {"x-api-key": s["key"]})
    counted = (await resp.json())["input_tokens"]
    resp = await scripted_gateway.post("/v1/messages", {**body, "max_tokens": 64}, {"x-api-key": s["key"]})
    assert resp.status == 200
    (record,) = scripted_gateway.store.read(s["session_id"])
    assert counted == len(record.prompt_ids)
    resp = await scripted_gateway.post("/v1/messages/count_tokens", body, {"x-api-key": "sk-wrong"})
    assert resp.status == 401 and (await resp.json())["type"] == "error"


async def test_admin_token_guards_pause(tmp_path) -> None:
    from tests.proxy.conftest import start_gateway

    client, store = await start_gateway(FakeEngine(), tmp_path, admin_token="t0p")
    try:
        assert (await client.post("/admin/pause")).status == 401
        resp = await client.post("/admin/pause", headers={"Authorization": "Bearer t0p"})
        assert resp.status == 200 and (await resp.json())["paused"]
        resp = await client.post("/admin/resume", headers={"Authorization": "Bearer t0p"})
        assert (await resp.json())["paused"] is False
    finally:
        await client.close()
