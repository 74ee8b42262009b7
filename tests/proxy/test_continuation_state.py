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
    stored = sum(len(t.suffix) + len(t.response_ids) for t in tracker.turns)
    assert stored <= len(final)  # the tree's ids add up to at most the final context
    assert sum(t.cache is not None for t in tracker.turns) == 1  # only the tip caches its context
    # messages are shared with the turn they extend, not copied per turn
    assert tracker.turns[-1].messages[0] is tracker.turns[0].messages[0]


def test_the_tip_keeps_its_prompt_as_a_tuple_with_its_json() -> None:
    """The tip's context is its prompt (a tuple: out of the cyclic GC once seen, with the JSON the
    engine was sent) + its sampled ids; the next plan copies it once, and a non-tip rebuilds it
    from its parent exactly."""
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
        assert type(tip.cache) is tuple and tip.cache == tuple(prompt)
        if plan is not None:  # token-in: the tip holds the planned prompt and its JSON
            assert tip.cache_json == plan.ids.json == orjson.dumps(list(prompt))
            gc.collect()
            assert not gc.is_tracked(tip.cache)  # a tuple of ints: untracked at its first collection
        else:
            assert tip.cache_json is None  # templated: serialized when first extended
        contexts.append(generation.prompt_ids + [100 + seq, 248046])
        assert tip.context() == contexts[-1] and tip.context_len() == len(contexts[-1])
        messages += [{"role": "assistant", "content": f"ok {seq}"}, {"role": "user", "content": f"more {seq}"}]
    assert [t.context() for t in tracker.turns] == contexts  # non-tips rebuilt from their parents
    assert [t.cache is not None for t in tracker.turns] == [False, False, False, True]
