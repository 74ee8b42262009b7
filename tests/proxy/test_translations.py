"""A session's ``Translations`` (proxy/reuse.py): a provider translates only the body items it has
not seen, and what it returns is the from-scratch translation, notes included; through the
gateway, the engine's requests hold the previous request's message objects for the unchanged
history."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from polar_env.errors import RequestError
from polar_env.proxy.providers import anthropic, openai_chat
from polar_env.proxy.providers.base import Inbound
from polar_env.proxy.reuse import Translations, share_lists
from tests.proxy.conftest import FakeEngine, Gateway


def _chat_body(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "developer", "content": "be brief"}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"question {t}"},
            {"role": "assistant", "content": None, "reasoning_content": f"think {t}",
             "tool_calls": [{"id": f"c{t}", "type": "function", "function": {"name": "bash", "arguments": {"n": t}}}]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": [{"type": "text", "text": f"out {t}"}]},
        ]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}},
             {"type": "web_search"}]  # dropped, with a note
    return {"model": "m", "messages": messages, "tools": tools}


def _anthropic_body(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for t in range(turns):
        messages += [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": f"think {t}", "signature": "s"},
                                              {"type": "redacted_thinking", "data": "x"},  # dropped, with a note
                                              {"type": "tool_use", "id": f"t{t}", "name": "Bash", "input": {"n": t}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{t}", "content": f"out {t}", "is_error": True},
                                         {"type": "text", "text": f"next {t}"}]},
        ]
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "web"}]
    return {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "sys"}], "messages": messages, "tools": tools}


def _same(a: Inbound, b: Inbound) -> None:
    assert orjson.dumps(a.chat.model_dump()) == orjson.dumps(b.chat.model_dump())
    assert a.notes == b.notes


@pytest.mark.parametrize(("provider", "make"), [(openai_chat, _chat_body), (anthropic, _anthropic_body)])
def test_a_memo_translates_as_from_scratch_through_edits_and_refusals(provider: Any, make: Any) -> None:
    memo, shared = Translations(), {}
    for turns in range(1, 9):
        body = orjson.loads(orjson.dumps(make(turns)))  # a fresh parse, as the gateway gets it
        if turns == 4:  # a history rewritten in the middle (compaction): its tail is new objects
            body["messages"][1]["content"] = "compacted"
        if turns == 6:  # a bad new item: refused, and the memo still serves the next body
            bad = orjson.loads(orjson.dumps(body))
            bad["messages"].append({"role": "nobody", "content": "x"})
            share_lists(bad, shared)
            with pytest.raises(RequestError, match=r"messages\[\d+\]"):
                provider.to_chat(bad, {}, memo)
        shared = share_lists(body, shared)
        _same(provider.to_chat(body, {}, memo), provider.to_chat(orjson.loads(orjson.dumps(body)), {}))


def test_shared_items_are_translated_once_and_keep_their_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    translate = openai_chat._message

    def counted(msg: Any, index: int) -> dict[str, Any]:
        calls.append(index)
        return translate(msg, index)

    monkeypatch.setattr(openai_chat, "_message", counted)
    memo, shared = Translations(), {}
    previous = None
    for turns in range(1, 6):
        body = orjson.loads(orjson.dumps(_chat_body(turns)))
        shared = share_lists(body, shared)
        chat = openai_chat.to_chat(body, {}, memo).chat
        if previous is not None:
            assert all(a is b for a, b in zip(chat.messages, previous.messages, strict=False))
            assert chat.tools[0] is previous.tools[0]
        previous = chat
    assert len(calls) == len(_chat_body(5)["messages"])  # each message once, not once per request
    # a new parse of the same history shares nothing without share_lists: translated afresh
    openai_chat.to_chat(orjson.loads(orjson.dumps(_chat_body(5))), {}, memo)
    assert len(calls) == 2 * len(_chat_body(5)["messages"])


def test_a_memo_never_serves_another_format() -> None:
    """One memo, two providers: each name carries its format, so neither reuses the other's."""
    memo = Translations()
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    anthropic_body = {"max_tokens": 5, "messages": chat_body["messages"], "tools": tools}
    openai_chat.to_chat(chat_body, {}, memo)
    inbound = anthropic.to_chat(anthropic_body, {}, memo)  # the same objects: a server tool for Anthropic
    _same(inbound, anthropic.to_chat(anthropic_body, {}))
    assert inbound.chat.tools == []


async def test_a_gateway_session_translates_each_message_once(continuation_gateway: Gateway, fake_engine: FakeEngine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    translate = openai_chat._message
    monkeypatch.setattr(openai_chat, "_message", lambda msg, index: calls.append(index) or translate(msg, index))
    gw, engine, store = continuation_gateway, fake_engine, continuation_gateway.store
    session = await gw.session()
    headers = {"Authorization": f"Bearer {session['key']}"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q0"}]
    for turn in range(3):
        resp = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 5}, headers)
        assert resp.status == 200, await resp.text()
        answer = (await resp.json())["choices"][0]["message"]
        messages = [*messages, {"role": "assistant", "content": answer["content"]}, {"role": "user", "content": f"q{turn + 1}"}]
    first, second, third = engine.seen
    assert all(a is b for a, b in zip(second.messages, first.messages, strict=False))
    assert all(a is b for a, b in zip(third.messages[:4], second.messages, strict=True))
    assert third.messages[4] is not second.messages[-1]
    assert calls == [0, 1, 2, 3, 4, 5]  # each message once, not 2 + 4 + 6 times
    records = store.read(session["session_id"])
    assert [orjson.dumps(r.chat_request.messages) for r in records] == [orjson.dumps(c.messages) for c in engine.seen]
