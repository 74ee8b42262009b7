"""``GRPOTrainer``: one optimiser step per batch of merged trajectories, on CPU, in fp32.

Per step: advantages per prompt group (``grpo.group_advantages``) → per prompt group, its shared
prefix forwarded once, then each trace's suffix over that prefix's KV cache (``shared_forward``:
the same logprobs as the teacher-forced full forward the fidelity check uses) → the
step-0 check on those logprobs, before anything is updated → the trace's share of the token-mean
loss, backpropagated a few hundred response positions at a time (only response logits are
materialised) → one clipped Adam step. Weight sync to the engine is the caller's (``rollout.py``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polar_env.engines.embedded.model import response_logprobs
from polar_env.records import Trace, Trajectory
from polar_env.train.grpo import LossConfig, group_advantages, group_key, rollout_key, trace_loss
from polar_env.train.shared_forward import SharedPrefix, suffix_logprobs
from polar_env.train.step0 import (
    STEP0_TOLERANCE,
    Step0Mismatch,
    Step0Report,
    check_step0,
)
from polar_env.trajectory.fidelity import scoring_temperature
from polar_env.trajectory.group_prefix import shared_prefix_len


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    tis_clip: float = 2.0
    kl_coef: float = 0.0
    std_normalize: bool = True
    step0_tolerance: float = STEP0_TOLERANCE
    # Response positions whose graphs are kept before one backward: each holds a 248k-wide logits
    # row (~1 MB, a few copies in backward), and each backward pays a dense pass over the 16 M
    # embedding gradient, so a few hundred per backward is both memory-safe and several times
    # faster than one backward per trace.
    backward_chunk_positions: int = 512


@dataclass(slots=True)
class StepStats:
    traces: int = 0
    rollouts: int = 0
    tokens: int = 0  # mask-1 tokens trained
    loss: float = 0.0
    pg: float = 0.0
    kl: float = 0.0
    grad_norm: float = 0.0
    step0: Step0Report = field(default_factory=Step0Report)
    ratios: list[float] = field(default_factory=list)
    seconds: float = 0.0
    full_tokens: int = 0  # ids forwarded with one row per trace
    forwarded_tokens: int = 0  # ids forwarded with one prefix per group


def trainable_traces(trajectories: Sequence[Trajectory]) -> list[tuple[str, Trace, str]]:
    """(label, trace, rollout key) for every trainable trace (a chain the harness continued) with at
    least one mask-1 token."""
    out = []
    for traj in trajectories:
        key = rollout_key(traj)
        for i, trace in enumerate(traj.traces):
            if trace.trainable and any(trace.loss_mask):
                out.append((f"{key}/{i}", trace, key))
    return out


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    prefix_len: int  # ids every member's prompt starts with (0: forward each member in full)
    indices: list[int]  # the members' positions in ``trainable_traces``


def prefix_groups(trajectories: Sequence[Trajectory], items: Sequence[tuple[str, Trace, str]]) -> list[PrefixGroup]:
    """``items`` (from ``trainable_traces``) by prompt group, in first-seen order, each with the
    prefix its members share (``group_prefix.shared_prefix_len``)."""
    group_of_rollout = {rollout_key(t): group_key(t) for t in trajectories}
    members: dict[str, list[int]] = {}
    for index, (_, _, key) in enumerate(items):
        members.setdefault(group_of_rollout[key], []).append(index)
    out = []
    for indices in members.values():
        traces = [items[i][1] for i in indices]
        n = shared_prefix_len([t.prompt_ids + t.response_ids for t in traces], [len(t.prompt_ids) for t in traces])
        out.append(PrefixGroup(n, indices))
    return out


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, config: TrainerConfig = TrainerConfig()) -> None:
        self.model = model
        self.config = config
        self.loss_config = LossConfig(tis_clip=config.tis_clip, kl_coef=config.kl_coef)
        # The reference is the starting policy, frozen; only kept when a KL term is asked for.
        self.reference = copy.deepcopy(model).requires_grad_(False) if config.kl_coef > 0 else None
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, betas=config.betas)
        self.steps = 0

    def step(self, trajectories: Sequence[Trajectory]) -> StepStats:
        """Check and train on one batch sampled with the trainer's current weights (the loop syncs
        after every step, so every batch is on-policy and must pass the step-0 check)."""
        started = time.perf_counter()
        advantages = group_advantages(trajectories, std_normalize=self.config.std_normalize)
        items = trainable_traces(trajectories)
        stats = StepStats(traces=len(items), rollouts=len(advantages))
        stats.tokens = sum(sum(trace.loss_mask) for _, trace, _ in items)
        self.model.eval()  # no dropout: the forward must be the engine's forward
        self.optimizer.zero_grad(set_to_none=True)
        recomputed: list[list[float]] = [[] for _ in items]
        # Gradients accumulate chunk by chunk; the weights do not change until the whole batch
        # has passed the step-0 check.
        chunk: list[torch.Tensor] = []
        positions = 0
        for group in prefix_groups(trajectories, items):
            first = items[group.indices[0]][1].prompt_ids
            prefix = SharedPrefix(self.model, first[: group.prefix_len]) if group.prefix_len else None
            ref_prefix = None
            if prefix is not None and self.reference is not None:
                with torch.no_grad():
                    ref_prefix = SharedPrefix(self.reference, prefix.ids)
            stats.forwarded_tokens += group.prefix_len
            for index in group.indices:
                _label, trace, key = items[index]
                stats.full_tokens += len(trace.prompt_ids) + len(trace.response_ids)
                stats.forwarded_tokens += len(trace.prompt_ids) + len(trace.response_ids) - group.prefix_len
                lp = self._logprobs(self.model, prefix, trace)
                recomputed[index] = lp.detach().tolist()
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self._logprobs(self.reference, ref_prefix, trace)
                loss = self._loss(lp, trace, advantages[key], stats, ref)
                if loss is not None:
                    chunk.append(loss)
                    positions += len(trace.response_ids)
                if positions >= self.config.backward_chunk_positions:
                    torch.stack(chunk).sum().backward()
                    chunk, positions = [], 0
            if prefix is not None:  # the group's member gradients are all on the prefix's leaves now
                if chunk:
                    torch.stack(chunk).sum().backward()
                    chunk, positions = [], 0
                prefix.backward()
        if chunk:
            torch.stack(chunk).sum().backward()
        try:
            stats.step0 = check_step0([(label, trace) for label, trace, _ in items], recomputed,
                                      tolerance=self.config.step0_tolerance)
        except Step0Mismatch:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        params = [p for p in self.model.parameters() if p.grad is not None]
        stats.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)) if params else 0.0
        if params and stats.tokens:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        stats.seconds = time.perf_counter() - started
        return stats

    @staticmethod
    def _logprobs(model: torch.nn.Module, prefix: SharedPrefix | None, trace: Trace) -> torch.Tensor:
        """The trace's response logprobs: over its group's shared prefix when there is one."""
        if prefix is None:
            return response_logprobs(model, trace.prompt_ids, trace.response_ids, scoring_temperature(trace))
        return suffix_logprobs(prefix, trace.prompt_ids, trace.response_ids, scoring_temperature(trace))

    def _loss(self, lp: torch.Tensor, trace: Trace, advantage: float, stats: StepStats,
              ref: torch.Tensor | None) -> torch.Tensor | None:
        """This trace's loss share, or None when its gradient is exactly zero (advantage 0, no KL)."""
        parts = trace_loss(lp, trace.response_logprobs, trace.loss_mask, advantage, max(stats.tokens, 1),
                           self.loss_config, ref)
        stats.loss += float(parts.loss.detach())
        stats.pg += parts.pg
        stats.kl += parts.kl
        stats.ratios.extend(parts.ratio.tolist())
        return parts.loss if advantage != 0.0 or ref is not None else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of the weights, as the engine's ``reload_weights`` takes them."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
