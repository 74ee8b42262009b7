"""Bad input through the live gateway, for every provider: a clear 4xx in the provider's own
error shape, the engine never called, nothing recorded."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import FakeEngine, Gateway

PATHS = {
    "anthropic": "/v1/messages",
    "openai_chat": "/v1/chat/completions",
    "openai_responses": "/v1/responses",
    "gemini": "/v1beta/models/any-model:streamGenerateContent?alt=sse",
}
VALID = {
    "anthropic": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "openai_chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "openai_responses": {"model": "m", "input": "hi"},
    "gemini": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
}
MISSING = {"anthropic": {"model": "m", "max_tokens": 16}, "openai_chat": {"model": "m"},
           "openai_responses": {"model": "m"}, "gemini": {"generationConfig": {}}}


def error_message(api: str, body: dict) -> str:
    """The message, read the way each provider's SDK reads it (asserting the shape on the way)."""
    if api == "anthropic":
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}
        return body["error"]["message"]
    if api == "gemini":
        assert set(body["error"]) >= {"code", "message", "status"}
        return body["error"]["message"]
    assert set(body["error"]) >= {"message", "type"}
    return body["error"]["message"]


def auth(api: str, key: str) -> dict[str, str]:
    return {"anthropic": {"x-api-key": key}, "gemini": {"x-goog-api-key": key}}.get(api, {"Authorization": f"Bearer {key}"})


CASES = {
    "bad-json": (lambda api: b"{oops", {}, 400, "not valid JSON"),
    "not-object": (lambda api: b'"text"', {}, 400, "JSON object"),
    "content-type": (lambda api: b"{}", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    "oversize": (lambda api: b'{"pad": "' + b"x" * 70_000 + b'"}', {}, 413, "exceeds"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("api", list(PATHS))
async def test_malformed_bodies(fake_gateway: Gateway, fake_engine: FakeEngine, api: str, case: str) -> None:
    make, headers, status, fragment = CASES[case]
    s = await fake_gateway.session()
    resp = await fake_gateway.post(PATHS[api], None, {**auth(api, s["key"]), **headers}, raw=make(api))
    assert resp.status == status
    assert fragment in error_message(api, await resp.json())
    assert fake_engine.seen == [] and fake_gateway.store.read(s["session_id"]) == []


@pytest.mark.parametrize("api", list(PATHS))
async def test_missing_required_field(fake_gateway: Gateway, fake_engine: FakeEngine, api: str) -> None:
    s = await fake_gateway.session()
    resp = await fake_gateway.post(PATHS[api], MISSING[api], auth(api, s["key"]))
    assert resp.status == 400
    assert error_message(api, await resp.json())
    assert fake_engine.seen == []


@pytest.mark.parametrize("api", list(PATHS))
async def test_unknown_key(fake_gateway: Gateway, fake_engine: FakeEngine, api: str) -> None:
    await fake_gateway.session()
    resp = await fake_gateway.post(PATHS[api], VALID[api], auth(api, "sk-polar-forged"))
    assert resp.status == 401 and "API key" in error_message(api, await resp.json())
    resp = await fake_gateway.post(PATHS[api], VALID[api])  # no key at all
    assert resp.status == 401
    assert fake_engine.seen == []


@pytest.mark.parametrize("api", list(PATHS))
async def test_valid_request_passes(fake_gateway: Gateway, fake_engine: FakeEngine, api: str) -> None:
    s = await fake_gateway.session()
    resp = await fake_gateway.post(PATHS[api], VALID[api], auth(api, s["key"]))
    assert resp.status == 200, await resp.text()
    assert len(fake_gateway.store.read(s["session_id"])) == 1


@pytest.mark.parametrize(
    "path, headers, api",
    [
        ("/v1/messages/batches", {"anthropic-version": "2023-06-01"}, "anthropic"),
        ("/v1beta/models/m:embedContent", {"x-goog-api-key": "KEY"}, "gemini"),
        ("/v1/responses/compact", {}, "openai_responses"),
        ("/v1/embeddings", {}, "openai_chat"),
    ],
)
async def test_unknown_paths_answer_in_the_callers_shape(fake_gateway: Gateway, path: str, headers: dict, api: str) -> None:
    s = await fake_gateway.session()
    resp = await fake_gateway.post(path, {}, {k: v.replace("KEY", s["key"]) for k, v in headers.items()})
    assert resp.status == 404
    assert error_message(api, await resp.json())
