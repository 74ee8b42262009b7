"""Continuation state stays linear in the final context over a long session (not turns ×
context), and the planned prompt is exactly the parent's context plus the new tokens."""

from __future__ import annotations

import orjson

from polar_env.chat import chat_format
from polar_env.proxy.continuation import Continuation
from polar_env.records import AssistantMessage, ChatRequest, Generation
from polar_env.tokenids import JsonIds, ids_json


def test_100_turns_keep_one_context_not_100() -> None:
    tracker = Continuation(chat_format("qwen3.5"))
    messages: list[dict] = [{"role": "user", "content": "start " * 200}]
    prompt = list(range(10, 1010))
    for seq in range(100):
        chat = ChatRequest(messages=list(messages))
        plan, note = tracker.plan(chat)
        if seq:
            assert plan is not None, note
            assert plan.ids[: plan.keep] == plan.parent.context()
            assert ids_json(plan.ids) == orjson.dumps(list(plan.ids))  # extended by the delta, exactly
            assert isinstance(plan.ids, JsonIds)
            prompt = plan.ids
        response = [100 + seq, 248046]
        generation = Generation(message=AssistantMessage(content=f"ok {seq}"), prompt_ids=list(prompt),
                                response_ids=response, response_logprobs=[-1.0, -1.0], finish_reason="stop")
        tracker.remember(chat, generation, seq, plan)
        messages += [{"role": "assistant", "content": f"ok {seq}"}, {"role": "user", "content": f"more {seq} " * 30}]
    final = tracker.turns[-1].context()
    assert final == prompt + [199, 248046]
    chunks = {id(c): c for t in tracker.turns for c in t.context_chunks()}
    assert sum(map(len, chunks.values())) <= len(final)  # the turns share their chunks: one context in all
    assert sum(t.prompt_json is not None for t in tracker.turns) == 1  # only the tip keeps its prompt's JSON
    # messages are shared with the turn they extend, not copied per turn
    assert tracker.turns[-1].messages[0] is tracker.turns[0].messages[0]


def test_turns_keep_untracked_chunks_and_the_tip_its_json() -> None:
    """A turn's context is chunks of ids shared with the turn it extends, out of the cyclic GC once
    seen (per call, a young collection walks a list of chunks, not a context); the tip also keeps its prompt's JSON
    (the JSON the engine was sent), and every turn's context is exact."""
    import gc

    tracker = Continuation(chat_format("qwen3.5"))
    messages: list[dict] = [{"role": "user", "content": "start"}]
    prompt = list(range(10, 60))
    contexts = []
    for seq in range(4):
        plan, note = tracker.plan(ChatRequest(messages=list(messages)))
        if seq:
            assert plan is not None, note
            assert plan.keep == len(contexts[-1]) and plan.ids[: plan.keep] == contexts[-1]
            prompt = plan.ids
        generation = Generation(message=AssistantMessage(content=f"ok {seq}"), prompt_ids=prompt,
                                response_ids=[100 + seq, 248046], response_logprobs=[-1.0, -1.0], finish_reason="stop")
        tracker.remember(ChatRequest(messages=list(messages)), generation, seq, plan)
        tip = tracker.turns[-1]
        if plan is not None:  # token-in: the tip holds the planned prompt's JSON and extends its parent's chunks
            assert tip.prompt_json == plan.ids.json == orjson.dumps(list(prompt))
            assert tip.prompt[: len(plan.parent.prompt)] == plan.parent.prompt
        else:
            assert tip.prompt_json is None  # templated: serialized when first extended
        gc.collect()
        assert not any(map(gc.is_tracked, tip.prompt))  # what a young collection would walk is the chunk list
        contexts.append(generation.prompt_ids + [100 + seq, 248046])
        assert tip.context() == contexts[-1] and tip.context_len() == len(contexts[-1])
        messages += [{"role": "assistant", "content": f"ok {seq}"}, {"role": "user", "content": f"more {seq}"}]
    assert [t.context() for t in tracker.turns] == contexts
    assert [t.prompt_json is not None for t in tracker.turns] == [False, False, False, True]


def test_a_templated_turn_shares_the_common_prefix_of_the_last_context() -> None:
    """A fallback (re-templated) prompt keeps the chunks it shares with the last turn's context
    and stores only the rest, so a session of fallbacks stays linear too."""
    tracker = Continuation(chat_format("qwen3.5"))
    first = list(range(10, 110))
    tracker.remember(ChatRequest(messages=[{"role": "user", "content": "a"}]),
                     Generation(message=AssistantMessage(content="x"), prompt_ids=first, response_ids=[5, 6],
                                response_logprobs=[-1.0, -1.0], finish_reason="stop"), 0)
    rewritten = first[:70] + [7, 8, 9]  # history rewritten after 70 tokens
    tracker.remember(ChatRequest(messages=[{"role": "user", "content": "b"}]),
                     Generation(message=AssistantMessage(content="y"), prompt_ids=rewritten, response_ids=[4],
                                response_logprobs=[-1.0], finish_reason="stop"), 1)
    old, new = tracker.turns
    assert new.context() == rewritten + [4] and new.context_len() == len(rewritten) + 1
    assert new.prompt == (old.prompt[0][:70], (7, 8, 9))


def test_a_long_chain_is_flattened_and_stays_exact(monkeypatch) -> None:
    """Past ``_MAX_CHUNKS`` the next prompt becomes one chunk, so joining a context never walks
    more chunks than that, however long the session."""
    from polar_env.proxy import continuation

    monkeypatch.setattr(continuation, "_MAX_CHUNKS", 4)
    tracker = Continuation(chat_format("qwen3.5"))
    messages: list[dict] = [{"role": "user", "content": "start"}]
    prompt: list[int] = list(range(10, 40))
    for seq in range(12):
        plan, note = tracker.plan(ChatRequest(messages=list(messages)))
        if seq:
            assert plan is not None, note
            assert list(plan.ids) == tracker.turns[-1].context() + list(plan.ids[plan.keep:])
            prompt = plan.ids
        generation = Generation(message=AssistantMessage(content=f"ok {seq}"), prompt_ids=prompt,
                                response_ids=[100 + seq, 248046], response_logprobs=[-1.0, -1.0], finish_reason="stop")
        tracker.remember(ChatRequest(messages=list(messages)), generation, seq, plan)
        assert len(tracker.turns[-1].prompt) <= 4
        assert tracker.turns[-1].context() == list(prompt) + [100 + seq, 248046]
        messages += [{"role": "assistant", "content": f"ok {seq}"}, {"role": "user", "content": f"more {seq}"}]
