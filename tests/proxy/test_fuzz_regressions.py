"""The 5xx classes a valid-key fuzz run found (issue 14), each as a fixed body on every API it
applies to: now a 4xx in the provider's own error shape, and the engine is never called."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.proxy.fuzz_bodies import Case, FuzzGateway

DEEP = '{"a":' * 3000 + "1" + "}" * 3000
BASES: dict[str, tuple[str, dict[str, Any], str]] = {  # route, body, where sampling fields go
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, ""),
    "anthropic": ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, ""),
    "responses": ("/v1/responses", {"input": "hi"}, ""),
    "gemini": ("/v1beta/models/g:generateContent", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
               "generationConfig"),
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzGateway]:
    g = FuzzGateway(tmp_path_factory.mktemp("fuzz-regressions"))
    try:
        yield g
    finally:
        g.close()


def _send(gw: FuzzGateway, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    calls = gw.engine.calls
    status, raw, ctype = gw.send(Case("x", "POST", path, orjson.dumps(body), "session"))
    assert "json" in ctype
    if status >= 400:
        assert gw.engine.calls == calls  # refused before the engine
    return status, orjson.loads(raw)


@pytest.mark.parametrize("api", sorted(BASES))
@pytest.mark.parametrize(("field", "value"), [("top_p", 0.0), ("top_p", -0.5), ("top_p", 1e-320), ("top_p", 5e-324),
                                              ("top_p", 1.5), ("temperature", -2.0), ("temperature", -1e-9)])
def test_out_of_range_sampling_is_a_400(gw: FuzzGateway, api: str, field: str, value: float) -> None:
    path, body, nest = BASES[api]
    key = {"top_p": "topP"}.get(field, field) if api == "gemini" else field
    body = {**body, nest: {key: value}} if nest else {**body, key: value}
    status, err = _send(gw, path, body)
    assert status == 400 and "error" in err, (api, field, value, err)
    assert field.replace("top_p", "top") in str(err).replace("topP", "top").replace("top_p", "top")


def test_in_range_sampling_still_works(gw: FuzzGateway) -> None:
    for api, (path, body, nest) in BASES.items():
        fields = {"topP" if api == "gemini" else "top_p": 0.9, "temperature": 0.0}
        status, _ = _send(gw, path, {**body, nest: fields} if nest else {**body, **fields})
        assert status == 200, api


def test_deeply_nested_string_arguments_are_a_400(gw: FuzzGateway) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": DEEP}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "x"}]}
    responses = {"input": [{"role": "user", "content": "hi"},
                           {"type": "function_call", "call_id": "c", "name": "bash", "arguments": DEEP},
                           {"type": "function_call_output", "call_id": "c", "output": "x"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", responses)):
        status, err = _send(gw, path, body)
        assert status == 400 and "nest deeper" in str(err), (path, err)
