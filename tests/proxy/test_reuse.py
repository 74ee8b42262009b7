"""Unchanged history shares the previous request's objects only where it serializes the same
(proxy/reuse.py), the journal encoder's fingerprints of shared items equal a from-scratch
computation, and a gateway session's journal is what it was without the sharing."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_env.journal.format import Encoder, fingerprint, fingerprint_since
from polar_env.proxy.reuse import same_json, share_lists, shared_prefix
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from tests.proxy.conftest import FakeEngine, Gateway


def _history(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for t in range(turns):
        out += [{"role": "user", "content": f"question {t} " * 20},
                {"role": "assistant", "content": f"answer {t}", "tool_calls": [{"id": f"c{t}", "n": t}]}]
    return out


def test_only_items_that_serialize_the_same_are_shared() -> None:
    old = _history(3)
    fresh = orjson.loads(orjson.dumps(old))  # equal, other objects (a new parse)
    assert shared_prefix(fresh + [{"role": "user", "content": "x"}], old) == len(old)
    # equal for Python's ==, not as JSON: never shared
    for i, change in ((2, {"n": 0.0}), (4, {"n": True}), (1, None)):
        other = orjson.loads(orjson.dumps(old))
        if change is None:
            other[i] = {"content": other[i]["content"], "role": "user"}  # keys reordered
        else:
            other[i]["tool_calls"] = [{"id": other[i]["tool_calls"][0]["id"], **change}]
        assert other == old
        assert shared_prefix(other, old) == i
    assert shared_prefix([], old) == 0 and shared_prefix(fresh, []) == 0


def test_share_lists_takes_the_old_objects_and_keeps_the_json() -> None:
    prev_body = {"model": "m", "messages": _history(2), "tools": [{"type": "function", "function": {"name": "f"}}]}
    previous = share_lists(prev_body, {})
    body = orjson.loads(orjson.dumps({**prev_body, "messages": _history(3)}))
    before = orjson.dumps(body)
    lists = share_lists(body, previous)
    assert orjson.dumps(body) == before
    assert all(a is b for a, b in zip(body["messages"], prev_body["messages"], strict=False))
    assert body["messages"][len(prev_body["messages"])] is not None
    assert body["tools"][0] is prev_body["tools"][0]
    assert lists["messages"] is body["messages"]


def test_incremental_fingerprints_equal_a_from_scratch_computation() -> None:
    prev_fp = prev_items = None
    previous: dict[str, list[Any]] = {}
    for turns in range(1, 8):
        body: dict[str, Any] = orjson.loads(orjson.dumps({"model": "m", "messages": _history(turns), "n": turns}))
        if turns == 5:  # a rewritten history (compaction): nothing shared from here on
            body["messages"][1]["content"] = "compacted"
        previous = share_lists(body, previous)
        fp, prev_items = fingerprint_since(body, prev_fp, prev_items)
        assert fp == fingerprint(body)
        prev_fp = fp
    # items the encoder did not see before (no sharing at all) are hashed like from scratch
    body = {"messages": _history(2)}
    assert fingerprint_since(body, prev_fp, prev_items)[0] == fingerprint(body)


def _record(seq: int, messages: list[dict[str, Any]]) -> CompletionRecord:
    return CompletionRecord(
        session_id="s", seq=seq, provider_api=ProviderAPI.OPENAI_CHAT,
        provider_request={"model": "m", "messages": messages},
        chat_request=ChatRequest(messages=messages),
        prompt_ids=list(range(10 * (seq + 1))), response_ids=[1, 2], response_logprobs=[-1.0, -1.0],
        message=AssistantMessage(content="a"), finish_reason="stop",
        timings=Timings(received_at=1.0, engine_ms=1.0, total_ms=2.0),
    )


def test_journal_lines_are_the_same_with_and_without_shared_objects() -> None:
    plain, shared = Encoder(), Encoder()
    previous: dict[str, list[Any]] = {}
    for seq in range(6):
        messages = _history(seq + 1)
        if seq == 3:
            messages[2]["tool_calls"][0]["n"] = 0.0  # == 0, another JSON: must be stored as changed
        fresh = orjson.loads(orjson.dumps(messages))
        lists = {"messages": orjson.loads(orjson.dumps(messages))}
        previous = share_lists(lists, previous)
        a, token_a = plain.encode(_record(seq, fresh))
        b, token_b = shared.encode(_record(seq, lists["messages"]))
        assert a == b
        plain.commit(token_a)
        shared.commit(token_b)


async def test_a_gateway_session_records_each_body_exactly(continuation_gateway: Gateway, fake_engine: FakeEngine) -> None:
    """Through the gateway (continuation on): every record's provider request serializes as the
    body sent, a history value that is == but not the same JSON included; the engine gets the
    same messages as without the sharing."""
    gw, engine, store = continuation_gateway, fake_engine, continuation_gateway.store
    session = await gw.session()
    headers = {"Authorization": f"Bearer {session['key']}"}
    sent = []
    for turn in range(4):
        messages = [{k: v for k, v in m.items() if k != "tool_calls"} | {"n": i} for i, m in enumerate(_history(turn + 1))]
        if turn == 2:
            messages[3]["n"] = 3.0  # the same value for ==, another JSON
        body = {"model": "m", "messages": messages, "max_tokens": 5}
        sent.append(orjson.dumps(body))
        resp = await gw.post("/v1/chat/completions", body, headers)
        assert resp.status == 200, await resp.text()
    records = store.read(session["session_id"])
    assert [orjson.dumps(r.provider_request) for r in records] == sent
    assert [orjson.dumps(r.chat_request.messages) for r in records] == [orjson.dumps(c.messages) for c in engine.seen]


def _deep(levels: int) -> Any:
    value: Any = "x"
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


def test_recordable_check_of_shared_history_reads_only_the_new_items() -> None:
    """Shared items were checked with the body they came from; the new ones are checked at their
    depth, with the same verdict as the whole-body check (around orjson's 254-level limit)."""
    import pytest

    from polar_env.errors import RequestError
    from polar_env.proxy.pipeline import check_recordable

    def verdict(body: dict[str, Any], checked: dict[str, list[Any]] | None = None) -> bool:
        try:
            check_recordable(body, checked)
        except RequestError:
            return False
        return True

    previous = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    lists = share_lists(previous, {})
    for levels in range(236, 250):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": _deep(levels)}],
                "extra": _deep(levels - 1)}
        whole = verdict(orjson.loads(orjson.dumps(body)))
        share_lists(body, lists)
        assert body["messages"][0] is previous["messages"][0]
        assert verdict(body, lists) == whole
    assert not verdict({"model": "m", "x": _deep(250)}, lists)
    # a shared item is not serialized again: one that could not be is passed as already checked
    trusted = {"messages": [_deep(260)]}
    assert verdict({"messages": trusted["messages"][:1]}, trusted)
    with pytest.raises(RequestError):
        check_recordable({"messages": [_deep(260)]}, trusted)


def test_message_checks_skip_only_what_was_checked_before() -> None:
    import pytest

    from polar_env.chat import RequestRules
    from polar_env.errors import RequestError
    from polar_env.proxy.validate import check_messages

    rules = RequestRules(system_first=True, needs_user_query=True)
    bad_args = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}
    tool_only = {"role": "user", "content": "<tool_response>r</tool_response>"}
    with pytest.raises(RequestError, match="not valid JSON"):
        check_messages([{"role": "user", "content": "q"}, bad_args], rules)
    check_messages([{"role": "user", "content": "q"}, bad_args], rules, checked=2)  # trusted: not parsed again
    with pytest.raises(RequestError, match="not valid JSON"):
        check_messages([{"role": "user", "content": "q"}, bad_args], rules, checked=1)
    # the rules over positions and the whole list still apply to checked messages
    with pytest.raises(RequestError, match="System message must be at the beginning"):
        check_messages([{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], rules, checked=2)
    with pytest.raises(RequestError, match="No user query"):
        check_messages([tool_only, {"role": "assistant", "content": "a"}, tool_only], rules, checked=2)
    check_messages([tool_only, {"role": "user", "content": "real"}, tool_only], rules, checked=3)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, -0.0, 1.0, 2.5, -1.0]) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
    max_leaves=12,
)


def _variant(value: Any, flips: list[bool]) -> Any:
    """``value`` rebuilt with some nodes changed in ways ``==`` does not see (1 -> 1.0 -> True,
    0.0 -> -0.0, reversed key order), as chosen by ``flips``; the rest copied."""
    flip = flips.pop() if flips else False
    if isinstance(value, dict):
        items = [(k, _variant(v, flips)) for k, v in value.items()]
        return dict(reversed(items) if flip else items)
    if isinstance(value, list):
        return [_variant(v, flips) for v in value]
    if flip and type(value) is int and value in (0, 1):
        return float(value)
    if flip and type(value) is float:
        return -value if value == 0 else (True if value == 1.0 else value)
    if flip and type(value) is bool:
        return int(value)
    return orjson.loads(orjson.dumps(value))  # another object, equal


@settings(max_examples=400, deadline=None)
@given(st.lists(_json, min_size=1, max_size=4), st.lists(st.booleans(), max_size=30))
def test_the_share_check_agrees_with_orjson_on_generated_values(values: list[Any], flips: list[bool]) -> None:
    """``==`` plus ``same_json`` shares exactly the prefix ``orjson.dumps`` would write alike."""
    other = [_variant(v, list(flips)) for v in values]
    expected = next((i for i, (a, b) in enumerate(zip(values, other, strict=True)) if orjson.dumps(a) != orjson.dumps(b)),
                    len(values))
    assert shared_prefix(other, values) == expected
    for a, b in zip(values, other, strict=True):
        assert (a == b and same_json(a, b)) == (orjson.dumps(a) == orjson.dumps(b))


def test_a_history_nested_past_the_comparison_limit_is_not_shared() -> None:
    deep: Any = "x"
    for _ in range(5000):
        deep = [deep]
    assert shared_prefix([{"a": 1}, deep], [{"a": 1}, deep]) == 2  # the very object: shared
    assert shared_prefix([{"a": 1}, deep], [{"a": 1}, [deep]]) == 1
