"""The GRPO math, as pure functions over trajectories and tensors.

``group_advantages`` normalises rewards per prompt group over *distinct rollouts*: a session that
the builder split into several traces (a fork, a sub-agent, a compaction) is one sample of the
policy and counts once in the group's mean and std; its advantage is then broadcast to each of its
traces. ``token_loss`` is the token-level policy-gradient loss on mask-1 tokens only, weighted by
the truncated importance ratio against the rollout logprobs (TIS), with an optional k3 KL penalty
to a frozen reference. Nothing here touches a model, an engine or a file.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polar_env.records import Trajectory

STD_EPS = 1e-6  # a group whose rewards are all equal gets advantage 0, not a division by zero


def rollout_key(traj: Trajectory) -> str:
    """What makes two trajectories the same rollout: their session id."""
    return str(traj.metadata.get("session_id") or traj.session_id)


def group_key(traj: Trajectory) -> str:
    """The prompt group a rollout belongs to (its task's group, else the task id)."""
    meta = traj.metadata
    return str(meta.get("group_id") or meta.get("task_id") or "")


def group_advantages(trajectories: Sequence[Trajectory], *, std_normalize: bool = True) -> dict[str, float]:
    """Rollout key → advantage ``(r - mean) / (std + eps)`` within its prompt group.

    Each distinct rollout contributes its reward once; trajectories sharing a rollout key must
    agree on the reward (they are traces of one session)."""
    rewards: dict[str, float] = {}
    groups: dict[str, list[str]] = defaultdict(list)
    for traj in trajectories:
        key = rollout_key(traj)
        reward = float(traj.reward or 0.0)
        if key in rewards:
            if rewards[key] != reward:
                raise ValueError(f"rollout {key} carries two rewards ({rewards[key]} and {reward})")
            continue
        rewards[key] = reward
        groups[group_key(traj)].append(key)
    advantages: dict[str, float] = {}
    for keys in groups.values():
        values = [rewards[k] for k in keys]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        scale = std + STD_EPS if std_normalize else 1.0
        for k, v in zip(keys, values, strict=True):
            advantages[k] = (v - mean) / scale if std > 0 else 0.0
    return advantages


def shuffle_rewards(trajectories: Sequence[Trajectory], rng: random.Random) -> list[Trajectory]:
    """The control run's input: each group's rollout rewards permuted among its rollouts, so the
    reward no longer depends on what the policy did (traces of one rollout keep sharing one)."""
    by_group: dict[str, list[str]] = defaultdict(list)
    reward_of: dict[str, float] = {}
    for traj in trajectories:
        key = rollout_key(traj)
        if key not in reward_of:
            reward_of[key] = float(traj.reward or 0.0)
            by_group[group_key(traj)].append(key)
    permuted: dict[str, float] = {}
    for keys in by_group.values():
        values = [reward_of[k] for k in keys]
        rng.shuffle(values)
        permuted.update(zip(keys, values, strict=True))
    return [t.model_copy(update={"reward": permuted[rollout_key(t)]}) for t in trajectories]


@dataclass(frozen=True, slots=True)
class LossConfig:
    tis_clip: float = 2.0  # truncation of the importance weight exp(train - rollout) from above
    kl_coef: float = 0.0  # 0 = no reference model, no KL term


@dataclass(slots=True)
class LossParts:
    loss: torch.Tensor  # this trace's share of the batch's token-mean loss
    pg: float
    kl: float
    ratio: torch.Tensor  # exp(train - rollout) on mask-1 tokens, detached
    tokens: int


def trace_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: Sequence[float],
    loss_mask: Sequence[int],
    advantage: float,
    batch_tokens: int,
    config: LossConfig = LossConfig(),
    ref_logprobs: torch.Tensor | None = None,
) -> LossParts:
    """One trace's share of the token-mean GRPO loss over all ``batch_tokens`` mask-1 tokens of the
    batch (summing the shares gives the batch loss, so each trace can be backpropagated alone).

    Per mask-1 token: ``-A * w * logp`` with ``w = min(exp(logp - rollout_logp), tis_clip)``
    detached (TIS: corrects the sampler/trainer mismatch without letting one token's ratio
    explode), plus ``kl_coef * (exp(ref - logp) - (ref - logp) - 1)`` (k3, non-negative) when a
    reference is given. Mask-0 tokens (template and tool tokens the model did not sample) add
    nothing, not even to the denominator."""
    keep = torch.tensor(list(loss_mask), dtype=torch.bool)
    if len(keep) != len(logprobs) or len(rollout_logprobs) != len(logprobs):
        raise ValueError(f"logprobs ({len(logprobs)}), rollout logprobs ({len(rollout_logprobs)}) and "
                         f"loss mask ({len(keep)}) must align")
    lp = logprobs[keep]
    old = torch.tensor(list(rollout_logprobs), dtype=logprobs.dtype)[keep]
    ratio = torch.exp(lp.detach() - old)
    weight = ratio.clamp(max=config.tis_clip)
    pg = (-advantage * weight * lp).sum() / batch_tokens
    loss = pg
    kl_value = 0.0
    if ref_logprobs is not None and config.kl_coef > 0:
        diff = ref_logprobs.detach()[keep] - lp
        kl = (torch.exp(diff) - diff - 1).sum() / batch_tokens
        loss = loss + config.kl_coef * kl
        kl_value = float(kl.detach())
    return LossParts(loss, float(pg.detach()), kl_value, ratio, int(keep.sum()))
