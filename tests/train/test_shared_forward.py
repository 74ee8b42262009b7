"""The trainer's forward with one prefix per group, on the tiny seeded model: the same logprobs
and the same gradients as one full forward per trace, and the same GRPO update on captured
two-call sessions, with fewer ids forwarded."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import ModelSpec, build_model, response_logprobs
from polar_env.records import Trajectory
from polar_env.train import trainer as trainer_module
from polar_env.train.shared_forward import SharedPrefix, suffix_logprobs
from polar_env.train.trainer import GRPOTrainer, PrefixGroup, TrainerConfig

TOL = 1e-5


def _members(rng: random.Random, prefix: list[int]) -> list[tuple[list[int], list[int]]]:
    return [(prefix + [rng.randrange(1000, 200_000) for _ in range(rng.randrange(1, 4))],
             [rng.randrange(1000, 200_000) for _ in range(rng.randrange(1, 12))]) for _ in range(4)]


@pytest.mark.parametrize("temperature", [1.0, 0.1])
def test_prefix_shared_logprobs_equal_the_full_forward(temperature: float) -> None:
    model = build_model(ModelSpec(seed=3))
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 200_000) for _ in range(300)]
    shared = SharedPrefix(model, prefix)
    for prompt, response in _members(rng, prefix):
        full = response_logprobs(model, prompt, response, temperature)
        mine = suffix_logprobs(shared, prompt, response, temperature)
        assert mine.shape == full.shape
        assert torch.allclose(mine, full, atol=TOL, rtol=0), (mine - full).abs().max()


def test_prefix_shared_gradients_equal_the_full_forward() -> None:
    """Each member's loss backpropagated on its own (the trainer's chunks), then the prefix once:
    the summed gradient is the full forwards'. Without the prefix's backward it is not."""
    rng = random.Random(1)
    prefix = [rng.randrange(1000, 200_000) for _ in range(120)]
    members = _members(rng, prefix)
    weights = [rng.uniform(-1, 1) for _ in members]
    full_model, shared_model = build_model(ModelSpec(seed=4)), build_model(ModelSpec(seed=4))
    sum((w * response_logprobs(full_model, p, r)).sum() for w, (p, r) in zip(weights, members, strict=True)).backward()
    shared = SharedPrefix(shared_model, prefix)
    for w, (p, r) in zip(weights, members, strict=True):
        (w * suffix_logprobs(shared, p, r)).sum().backward()
    partial = {name: param.grad.clone() for name, param in shared_model.named_parameters() if param.grad is not None}
    shared.backward()
    moved = False
    for (name, a), (_, b) in zip(full_model.named_parameters(), shared_model.named_parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), (name, (a.grad - b.grad).abs().max())
        moved |= not torch.allclose(partial.get(name, torch.zeros_like(b.grad)), b.grad, atol=1e-6, rtol=1e-4)
    assert moved  # the prefix's share of the gradient is real


def test_a_prompt_that_does_not_start_with_the_prefix_is_refused() -> None:
    model = build_model()
    shared = SharedPrefix(model, [5, 6, 7])
    with pytest.raises(ValueError, match="shared prefix"):
        suffix_logprobs(shared, [5, 6, 8, 9], [10])
    with pytest.raises(ValueError, match="shared prefix"):
        suffix_logprobs(shared, [5, 6, 7], [10])  # the prefix holds the last prompt id


def _sgd_step(
    policy: torch.nn.Module, trajectories: list[Trajectory], config: TrainerConfig
) -> tuple[dict[str, torch.Tensor], float, int, int]:
    """One trainer step with plain SGD (a test double for Adam, whose first step is ~sign(grad)
    and would magnify float noise): the weights moved by exactly the clipped gradient."""
    trainer = GRPOTrainer(policy, config)
    trainer.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    stats = trainer.step(trajectories)
    delta = {k: v.detach() - before[k] for k, v in policy.state_dict().items()}
    return delta, stats.loss, stats.forwarded_tokens, stats.full_tokens


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_a_trainer_step_with_one_prefix_per_group_updates_as_full_forwards(
    captured: tuple[EmbeddedEngine, list[Trajectory]], monkeypatch: pytest.MonkeyPatch, kl_coef: float
) -> None:
    engine, trajectories = captured
    trajectories = [t.model_copy(update={"reward": float(i % 2)}) for i, t in enumerate(trajectories)]  # advantages ≠ 0
    config = TrainerConfig(kl_coef=kl_coef)
    shared_delta, shared_loss, forwarded, full = _sgd_step(copy.deepcopy(engine.model), trajectories, config)
    assert 0 < forwarded < full
    unshared = trainer_module.prefix_groups
    monkeypatch.setattr(trainer_module, "prefix_groups",
                        lambda trajs, items: [PrefixGroup(0, g.indices) for g in unshared(trajs, items)])
    full_delta, full_loss, forwarded_full, full_again = _sgd_step(copy.deepcopy(engine.model), trajectories, config)
    assert forwarded_full == full_again == full
    assert shared_loss == pytest.approx(full_loss, rel=1e-5, abs=1e-6)  # float32 sums in another order
    assert any(d.abs().max() > 0 for d in full_delta.values())
    for name, d in full_delta.items():  # a delta of weights near 1.0 carries their ulp (1.2e-7); a lost
        # prefix backward differs by the update itself (~1e-4)
        assert torch.allclose(shared_delta[name], d, atol=1e-6, rtol=1e-4), (name, (shared_delta[name] - d).abs().max())
