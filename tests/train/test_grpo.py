"""GRPO math on synthetic trajectories: advantages over distinct rollouts, and the token loss."""

from __future__ import annotations

import math
import random

import pytest
import torch

from polar_env.records import Trace, Trajectory
from polar_env.train.grpo import (
    LossConfig,
    group_advantages,
    shuffle_rewards,
    trace_loss,
)


def _traj(session: str, group: str, reward: float, traces: int = 1) -> Trajectory:
    trace = Trace(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 0], response_logprobs=[-1.0, 0.0], reward=reward)
    return Trajectory(session_id=session, traces=[trace] * traces, reward=reward,
                      metadata={"session_id": session, "group_id": group})


def test_a_rollout_with_several_traces_counts_once() -> None:
    # Group g: rewards 1, 0, 0 over three rollouts; rollout "a" was split into three traces
    # (three Trajectory objects sharing its session id). Counting it three times would give
    # mean 0.6; counting it once gives mean 1/3.
    batch = [_traj("a", "g", 1.0, traces=2), _traj("a", "g", 1.0), _traj("a", "g", 1.0), _traj("b", "g", 0.0), _traj("c", "g", 0.0)]
    adv = group_advantages(batch)
    mean, std = 1 / 3, math.sqrt((4 / 9 + 1 / 9 + 1 / 9) / 3)
    assert set(adv) == {"a", "b", "c"}
    assert adv["a"] == pytest.approx((1 - mean) / (std + 1e-6))
    assert adv["b"] == adv["c"] == pytest.approx((0 - mean) / (std + 1e-6))


def test_groups_are_normalised_separately_and_flat_groups_get_zero() -> None:
    batch = [_traj("a", "g1", 1.0), _traj("b", "g1", 0.0), _traj("c", "g2", 5.0), _traj("d", "g2", 5.0)]
    adv = group_advantages(batch)
    assert adv["a"] == pytest.approx(1.0, abs=1e-5) and adv["b"] == pytest.approx(-1.0, abs=1e-5)
    assert adv["c"] == adv["d"] == 0.0
    assert group_advantages(batch, std_normalize=False)["a"] == pytest.approx(0.5)


def test_one_rollout_with_two_rewards_is_refused() -> None:
    with pytest.raises(ValueError, match="rollout a carries two rewards"):
        group_advantages([_traj("a", "g", 1.0), _traj("a", "g", 0.0)])


def test_shuffled_rewards_permute_within_groups_and_keep_rollouts_consistent() -> None:
    batch = [_traj("a", "g1", 1.0), _traj("a", "g1", 1.0), _traj("b", "g1", 0.0), _traj("c", "g1", 0.0),
             _traj("d", "g2", 7.0), _traj("e", "g2", 8.0)]
    seen = set()
    for seed in range(20):
        out = shuffle_rewards(batch, random.Random(seed))
        by_session: dict[str, set[float]] = {}
        for t in out:
            by_session.setdefault(t.session_id, set()).add(float(t.reward or 0.0))
        assert all(len(v) == 1 for v in by_session.values())  # traces of one rollout agree
        assert sorted(by_session[s].pop() for s in "abc") == [0.0, 0.0, 1.0]
        assert {by_session["d"].pop(), by_session["e"].pop()} == {7.0, 8.0}
        seen.add(out[0].reward)
    assert seen == {0.0, 1.0}  # it really moves rewards
    assert [t.reward for t in batch] == [1.0, 1.0, 0.0, 0.0, 7.0, 8.0]  # input untouched


def test_trace_loss_trains_mask_one_tokens_only_and_sums_to_the_token_mean() -> None:
    logits = torch.randn(4, 10, requires_grad=True)
    ids = [1, 2, 3, 4]
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    mask = [1, 0, 0, 1]
    rollout = lp.detach().tolist()
    parts = trace_loss(lp, rollout, mask, advantage=2.0, batch_tokens=8)
    parts.loss.backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[1] == 0) and torch.all(logits.grad[2] == 0)  # mask-0: no gradient
    assert torch.any(logits.grad[0] != 0) and torch.any(logits.grad[3] != 0)
    expected = -2.0 * (lp[0] + lp[3]).item() / 8  # on-policy: ratio 1, weight 1
    assert parts.loss.item() == pytest.approx(expected, rel=1e-6)
    assert parts.tokens == 2 and torch.allclose(parts.ratio, torch.ones(2))


def test_tis_weight_is_truncated_and_detached() -> None:
    lp = torch.tensor([-1.0, -1.0], requires_grad=True)
    rollout = [-1.0 - math.log(10.0), -1.0 + math.log(2.0)]  # ratios 10 and 0.5
    parts = trace_loss(lp, rollout, [1, 1], advantage=1.0, batch_tokens=2, config=LossConfig(tis_clip=2.0))
    parts.loss.backward()
    assert parts.ratio.tolist() == pytest.approx([10.0, 0.5], rel=1e-5)
    # d/dlp of -A * w * lp / N with w detached: -w / N, w = min(ratio, 2)
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-2.0 / 2, -0.5 / 2], rel=1e-5)


def test_kl_to_the_reference_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    same = trace_loss(lp, [-1.0, -2.0], [1, 1], 0.0, 2, LossConfig(kl_coef=0.5), ref_logprobs=lp.detach().clone())
    assert same.kl == pytest.approx(0.0, abs=1e-7)
    away = trace_loss(lp, [-1.0, -2.0], [1, 1], 0.0, 2, LossConfig(kl_coef=0.5), ref_logprobs=torch.tensor([-1.5, -1.0]))
    assert away.kl > 0 and away.loss.item() == pytest.approx(0.5 * away.kl, rel=1e-6)


def test_misaligned_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="must align"):
        trace_loss(torch.zeros(3), [0.0, 0.0], [1, 1, 1], 1.0, 3)
