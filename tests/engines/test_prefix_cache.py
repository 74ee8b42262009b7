"""The embedded engine's prefix KV cache: a prompt that extends an earlier decode prefills only its
new tokens, and decodes exactly as a one-pass prefill would (same ids, logprobs within fp noise)."""

from __future__ import annotations

import pytest
import torch

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import PrefixCache
from polar_env.records import ChatRequest

TURN = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def pair(engine: EmbeddedEngine) -> tuple[EmbeddedEngine, EmbeddedEngine]:
    cached = EmbeddedEngine(prefix_cache_slots=2)  # the same seeded weights as ``engine`` (no cache)
    return engine, cached


def _token_in(prompt: list[int], seed: int) -> ChatRequest:
    return ChatRequest(messages=TURN, prompt_ids=prompt, temperature=1.0, seed=seed, max_tokens=6)


def test_an_extending_prompt_reuses_the_kv_and_decodes_the_same(pair: tuple[EmbeddedEngine, EmbeddedEngine]) -> None:
    plain, cached = pair
    first = cached.complete(ChatRequest(messages=TURN, temperature=1.0, seed=1, max_tokens=6)).generation
    assert cached._prefix is not None and len(cached._prefix.entries) == 1
    (held, _), = cached._prefix.entries
    assert held == first.prompt_ids + first.response_ids[:-1]  # every id but the last was run
    follow = first.prompt_ids + first.response_ids + cached.tokenizer.encode("<|im_start|>user\nAgain.<|im_end|>\n")
    sampled = []
    for engine_seed in (2, 3):  # both reuse the first call's KV: a take leaves the entry in the pool
        want = plain.complete(_token_in(follow, engine_seed)).generation
        got = cached.complete(_token_in(follow, engine_seed)).generation
        assert got.response_ids == want.response_ids
        assert got.response_logprobs == pytest.approx(want.response_logprobs, abs=1e-5)
        sampled.append(got.response_ids)
    # the first call's entry went when the second's (which extends it) came; the third's differs from the second's
    assert [ids for ids, _ in cached._prefix.entries] == [follow + want[:-1] for want in sampled]


def test_the_pool_keeps_the_longest_match_and_a_bounded_number() -> None:
    from transformers import DynamicCache

    def cache_of(n: int) -> DynamicCache:
        cache = DynamicCache()
        cache.update(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), 0)
        return cache

    pool = PrefixCache(slots=2)
    for ids in ([1, 2, 3], [1, 2, 9, 9], [5, 6]):
        pool.put(ids, cache_of(len(ids)))
    assert [ids for ids, _ in pool.entries] == [[1, 2, 9, 9], [5, 6]]  # the oldest went
    cache, kept = pool.take([1, 2, 9, 4, 4])
    assert kept == 3 and cache.get_seq_length() == 3
    assert [ids for ids, _ in pool.entries] == [[5, 6], [1, 2, 9, 9]]  # still there, now the most recent
    again, kept = pool.take([1, 2, 9, 9, 7])  # a sibling takes the same KV
    assert kept == 4 and again.get_seq_length() == 4 and pool.entries[1][1].get_seq_length() == 4
    fresh, none = pool.take([7, 7])
    assert none == 0 and fresh.get_seq_length() == 0
    same, last = pool.take([5, 6])  # a repeated prompt still runs its last id, for the logits
    assert last == 1 and same.get_seq_length() == 1
    pool.put([1], cache_of(4))  # ids that do not match the cache are never kept
    assert [ids for ids, _ in pool.entries] == [[1, 2, 9, 9], [5, 6]]
    pool.put([5, 6, 7], cache_of(3))  # an entry it extends is dropped: the new one matches at least as far
    assert [ids for ids, _ in pool.entries] == [[1, 2, 9, 9], [5, 6, 7]]
    budget = PrefixCache(slots=8, tokens=5)
    for ids in ([1, 2], [3, 4], [5, 6]):
        budget.put(ids, cache_of(2))
    assert [ids for ids, _ in budget.entries] == [[3, 4], [5, 6]]  # past 5 ids in all the least recent went


def test_a_taken_cache_extended_by_a_forward_leaves_the_entry_as_it_was() -> None:
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.arange(8.0).reshape(1, 1, 4, 2), torch.arange(8.0).reshape(1, 1, 4, 2), 0)
    pool = PrefixCache()
    pool.put([1, 2, 3, 4], cache)
    taken, kept = pool.take([1, 2, 3, 9, 9])
    taken.update(torch.full((1, 1, 2, 2), -1.0), torch.full((1, 1, 2, 2), -1.0), 0)
    assert kept == 3 and taken.get_seq_length() == 5
    (_, held), = pool.entries
    assert torch.equal(held.layers[0].keys, torch.arange(8.0).reshape(1, 1, 4, 2))


def test_new_weights_drop_the_kept_kv(pair: tuple[EmbeddedEngine, EmbeddedEngine]) -> None:
    _, cached = pair
    cached.complete(ChatRequest(messages=TURN, temperature=1.0, seed=1, max_tokens=2))
    assert cached._prefix is not None and cached._prefix.entries
    cached.reload_weights({k: v.clone() for k, v in cached.model.state_dict().items()})
    assert cached._prefix.entries == []
