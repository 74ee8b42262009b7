"""The batched paths of the embedded engine that a lone request never takes: prefilling several
prompts in one forward (left-padded, after kept prefixes of different lengths), the preallocated
KV slab (joins, leaves, growth), and the inverse-CDF draw. Each must give what the
one-request-at-a-time path gives: identical ids, logprobs within float noise."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from polar_env.engines.embedded.batcher import Finished, Job, _Waiting, prefill_groups
from polar_env.engines.embedded.engine import EmbeddedEngine, SamplingExtras
from polar_env.engines.embedded.kv import SPARE, BatchKV, kv_layers, pad_together
from polar_env.engines.embedded.model import BLOCK, DecodeParams, RowSampler, draw
from polar_env.records import ChatRequest, Generation

TOLERANCE = 1e-5  # what tests/engines/test_embedded_batching.py allows a row of a batch


def test_draw_samples_the_distribution_reproducibly() -> None:
    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0625, 0.0625])
    n = 40_000
    generator = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(n)]), minlength=len(probs))
    assert counts[1] == 0  # zero mass is never drawn
    sigma = (n * probs * (1 - probs)).sqrt()
    assert bool(((counts - n * probs).abs() <= 5 * sigma + 1).all()), counts
    g1, g2, g3 = (torch.Generator().manual_seed(seed) for seed in (11, 11, 12))
    same, other = [draw(probs, g1) for _ in range(300)], [draw(probs, g2) for _ in range(300)]
    assert same == other != [draw(probs, g3) for _ in range(300)]  # the seed decides


def test_draw_never_picks_past_the_last_token_with_mass() -> None:
    probs = torch.tensor([1.0, 0.0, 0.0])  # all mass on token 0
    generator = torch.Generator().manual_seed(0)
    assert {draw(probs, generator) for _ in range(500)} == {0}


def test_draw_over_a_vocabulary_of_many_blocks() -> None:
    """Mass in a few ids spread over blocks (one at a block's last id, one in a ragged last block),
    none anywhere else: only those are drawn, at their rates."""
    probs = torch.zeros(3 * BLOCK + 7)
    where = {3: 0.4, BLOCK - 1: 0.3, 2 * BLOCK + 5: 0.2, 3 * BLOCK + 6: 0.1}
    for i, p in where.items():
        probs[i] = p
    generator = torch.Generator().manual_seed(5)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(n)]), minlength=len(probs))
    assert set(counts.nonzero().squeeze(1).tolist()) == set(where)
    for i, p in where.items():
        assert abs(int(counts[i]) - n * p) <= 5 * (n * p * (1 - p)) ** 0.5 + 1
    assert {draw(torch.eye(3 * BLOCK)[-1], generator) for _ in range(50)} == {3 * BLOCK - 1}


def _waiting(new: int, reused: int = 0) -> _Waiting:
    params = DecodeParams(max_tokens=1)
    job = Job(list(range(reused + new)), params, None, lambda: False)
    return _Waiting(job, RowSampler.__new__(RowSampler), None, reused)


def test_prefill_groups_keep_padding_and_size_bounded() -> None:
    similar = [_waiting(n) for n in (100, 96, 90, 104)]
    assert [len(g) for g in prefill_groups(similar, 4096)] == [4]
    mixed = prefill_groups([_waiting(n) for n in (10, 2000, 12, 11)], 4096)
    assert sorted(len(g) for g in mixed) == [1, 3] and [w.new for w in mixed[0]] == [2000]
    bounded = prefill_groups([_waiting(1000) for _ in range(9)], 4096)
    assert [len(g) for g in bounded] == [4, 4, 1]
    prefixed = prefill_groups([_waiting(20, reused) for reused in (0, 50, 500)], 4096)
    assert [len(g) for g in prefixed] == [3]  # a kept prefix is not padding of the forward's queries


def test_the_slab_joins_leaves_grows_and_gives_each_row_back() -> None:
    """Rows of different widths (one with a masked gap) joined, decoded past the slab's spare
    columns, some leaving: every row's real columns stay exactly its own KV."""
    torch.manual_seed(0)
    heads, dim, layers = 2, 4, 3

    def rows(n: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        keys = [torch.randn(n, heads, width, dim) for _ in range(layers)]
        return [(k, k.clone()) for k in keys]  # values = keys: one expectation checks both

    first = rows(1, 5)
    batch = BatchKV(first, torch.ones(1, 5, dtype=torch.long))
    gap = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1], [1] * 8])
    second = rows(2, 8)
    from transformers import DynamicCache

    batch = batch.joined(DynamicCache(ddp_cache_data=second), gap)
    assert batch.width == 8 and batch.mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and not batch.dense
    want = {0: [first[li][0][0] for li in range(layers)], 1: [second[li][0][0][:, [2, 3, 5, 6, 7]] for li in range(layers)],
            2: [second[li][0][1] for li in range(layers)]}
    for _ in range(SPARE + 10):  # past the spare columns: the slab grows
        batch.step_mask()
        for li, layer in enumerate(batch.cache.layers):
            step = torch.randn(3, heads, 1, dim)
            assert isinstance(layer, DynamicLayer)
            layer.update(step, step.clone())
            for r in range(3):
                want[r][li] = torch.cat([want[r][li], step[r]], dim=1)
    for r in range(3):
        got = batch.row(r)
        assert got.get_seq_length() == want[r][0].shape[1]
        assert all(torch.equal(kv.values[0], want[r][li]) for li, kv in enumerate(kv_layers(got)))
        for li in range(layers):
            assert torch.equal(kv_layers(got)[li].keys[0], want[r][li])
    kept = batch.select([0, 1])
    assert kept.width == batch.width - 2  # the columns that were padding in both kept rows
    assert batch.select([1, 2]).width == batch.width  # row 2 has none
    for r in (0, 1):
        for li in range(layers):
            assert torch.equal(kv_layers(kept.row(r))[li].keys[0], want[r][li])


def test_pad_together_right_aligns_prefixes_and_masks_the_rest() -> None:
    from transformers import DynamicCache

    a = DynamicCache(ddp_cache_data=[(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))])
    cache, mask = pad_together([a, None], [3, 0])
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    (layer,) = kv_layers(cache)
    assert layer.keys.shape == (2, 1, 3, 2) and layer.keys[1].abs().sum() == 0 and layer.keys[0].sum() == 6


def _submit_together(engine: EmbeddedEngine, requests: list[tuple[ChatRequest, SamplingExtras]]) -> list[Generation]:
    prepared = [engine.prepare(r, x) for r, x in requests]
    futures: list[Future[Finished]] = []
    with engine.scheduler.exclusive():  # admitted at one step boundary
        futures += [engine.scheduler.submit(p.prompt_ids, p.params, p.forced_ids, lambda: False) for p in prepared]
    return [engine._completion(r, p, f.result(timeout=300)).generation
            for (r, _), p, f in zip(requests, prepared, futures, strict=True)]


def _same(alone: list[Generation], batched: list[Generation]) -> None:
    for a, b in zip(alone, batched, strict=True):
        assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason
        worst = max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True))
        assert worst <= TOLERANCE, worst
        assert all(torch.isfinite(torch.tensor(b.response_logprobs)))


@pytest.mark.slow
def test_prompts_of_different_lengths_prefilled_in_one_forward_decode_as_alone() -> None:
    """Four fresh prompts of 3 different lengths: one padded prefill, then 80 tokens each (past
    the slab's spare columns), the same as each alone."""
    engine = EmbeddedEngine()
    words = ["Tell me about the sea and the sky today.", "Tell me about the sea and sky.",
             "Tell me about the sea and the sky.", "Tell me about the sea and the sky today, please."]
    requests = [(ChatRequest(messages=[{"role": "user", "content": w}], max_tokens=80, seed=i, temperature=0.9),
                 SamplingExtras(ignore_eos=True)) for i, w in enumerate(words)]
    alone = [engine.complete(r, x).generation for r, x in requests]
    assert len({len(g.prompt_ids) for g in alone}) >= 3
    prefills = engine.scheduler.prefills
    batched = _submit_together(engine, requests)
    assert engine.scheduler.prefills == prefills + 1  # one forward prefilled all four
    _same(alone, batched)


@pytest.mark.slow
def test_follow_ups_with_kept_prefixes_of_different_lengths_prefill_together() -> None:
    """Token-in follow-ups each reusing its own kept KV (different lengths) and one fresh prompt:
    one prefill forward after the prefixes, the same as an engine without the prefix cache."""
    cached, plain = EmbeddedEngine(prefix_cache_slots=4), EmbeddedEngine()
    word = cached.tokenizer.encode(" word")
    # token-in prompts with distinct first ids: no first request takes another's kept KV
    firsts = [cached.complete(ChatRequest(messages=[{"role": "user", "content": "-"}], prompt_ids=[1000 + n] + word * n,
                                          max_tokens=5, seed=n, temperature=1.0)).generation for n in (3, 30, 90)]
    turn = cached.tokenizer.encode("<|im_start|>user\nAgain, please.<|im_end|>\n<|im_start|>assistant\n")
    follow = [(ChatRequest(messages=[{"role": "user", "content": "-"}], prompt_ids=g.prompt_ids + g.response_ids + turn,
                           max_tokens=12, seed=7, temperature=1.0), SamplingExtras()) for g in firsts]
    fresh_ids = [999] + plain.tokenizer.encode("Hello there, friend, how are you?")
    follow.append((ChatRequest(messages=[{"role": "user", "content": "-"}], prompt_ids=fresh_ids, max_tokens=12,
                               seed=8, temperature=1.0), SamplingExtras()))
    want = [plain.complete(r, x).generation for r, x in follow]
    prefills = cached.scheduler.prefills
    got = _submit_together(cached, follow)
    assert cached.scheduler.prefills == prefills + 1
    _same(want, got)
