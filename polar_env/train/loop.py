"""The training loop: rollouts → step-0 check + GRPO step → weight sync, ``steps`` times.

Each step samples ``rollouts_per_task`` rollouts of every task with the engine's current weights,
trains on them once (fully on-policy, so the step-0 check holds on every batch), then pushes the
new weights through the gateway before the next step samples. Each step's timings, rewards and
the weight versions its records carried are kept for the report (``report.py``).
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.model import ModelSpec
from polar_env.train.grpo import shuffle_rewards
from polar_env.train.recipe import Recipe
from polar_env.train.rollout import LocalGateway, RolloutSource, flatten
from polar_env.train.trainer import GRPOTrainer


@dataclass(slots=True)
class StepRecord:
    step: int
    reward_mean: float  # the true reward (also in the control run, whose training sees shuffled ones)
    rollouts: int
    traces: int
    sampled_tokens: int  # mask-1 tokens trained on
    rollout_s: float
    train_s: float
    sync_s: float
    weight_versions: list[str]  # the versions the step's records were sampled under
    new_version: str
    step0_max_abs_delta: float
    ratio_min: float
    ratio_max: float
    loss: float
    grad_norm: float


@dataclass(slots=True)
class RunResult:
    recipe: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)
    step0_deltas: list[float] = field(default_factory=list)  # first step's |Δ| per mask-1 token
    ratios: list[float] = field(default_factory=list)  # every step's importance ratios
    per_request_traces: int = 0
    merged_traces: int = 0
    per_request_tokens: int = 0
    merged_tokens: int = 0
    wall_s: float = 0.0

    def rewards(self) -> list[float]:
        return [s.reward_mean for s in self.steps]

    def improvement(self, window: int = 5) -> float:
        """Mean reward of the last ``window`` steps minus that of the first ``window``."""
        r = self.rewards()
        return sum(r[-window:]) / window - sum(r[:window]) / window if len(r) >= window else 0.0

    def summary(self) -> dict[str, Any]:
        steps = self.steps
        rollout_s = sum(s.rollout_s for s in steps)
        train_s = sum(s.train_s for s in steps)
        return {
            "name": self.recipe["name"], "seed": self.recipe["seed"], "control": self.recipe["control"],
            "steps": len(steps), "wall_s": round(self.wall_s, 1),
            "rewards": [round(r, 4) for r in self.rewards()],
            "first5": round(sum(self.rewards()[:5]) / 5, 4) if len(steps) >= 5 else None,
            "last5": round(sum(self.rewards()[-5:]) / 5, 4) if len(steps) >= 5 else None,
            "improvement": round(self.improvement(), 4),
            "step0_max_abs_delta": max((s.step0_max_abs_delta for s in steps), default=0.0),
            "ratio_min": min((s.ratio_min for s in steps), default=1.0),
            "ratio_max": max((s.ratio_max for s in steps), default=1.0),
            "sampled_tokens_per_s": round(sum(s.sampled_tokens for s in steps) / rollout_s, 1) if rollout_s else 0.0,
            "trained_tokens_per_s": round(sum(s.sampled_tokens for s in steps) / train_s, 1) if train_s else 0.0,
            "s_per_step": {k: round(sum(getattr(s, k) for s in steps) / max(len(steps), 1), 3)
                           for k in ("rollout_s", "train_s", "sync_s")},
            "updates": {"per_request": self.per_request_traces, "merged": self.merged_traces,
                        "per_request_tokens": self.per_request_tokens, "merged_tokens": self.merged_tokens},
            "weight_versions": [s.weight_versions for s in steps],
        }


def seed_everything(seed: int) -> None:
    random.seed(seed)  # the engine draws each request's sampling seed from here
    torch.manual_seed(seed)


async def train_with(
    recipe: Recipe,
    source: RolloutSource,
    trainer: GRPOTrainer,
    on_step: Callable[[StepRecord], None] | None = None,
) -> RunResult:
    """Run the recipe's steps against any rollout source (the seam ``PolarEnv`` plugs into)."""
    result = RunResult(recipe=recipe.model_dump(mode="json"))
    rng = random.Random(recipe.seed + 1_000_003)
    tasks = recipe.toy_tasks()
    started = time.perf_counter()
    for step in range(recipe.steps):
        t0 = time.perf_counter()
        groups = await asyncio.gather(*(source.rollout(task, recipe.rollouts_per_task) for task in tasks))
        batch = flatten(groups)
        t1 = time.perf_counter()
        true_mean = sum(float(t.reward or 0.0) for t in batch) / max(len(batch), 1)
        trained_on = shuffle_rewards(batch, rng) if recipe.control else batch
        stats = await asyncio.to_thread(trainer.step, trained_on)
        t2 = time.perf_counter()
        version = await source.update_weights(trainer.state_dict())
        t3 = time.perf_counter()
        if step == 0:
            result.step0_deltas = list(stats.step0.deltas)
        result.ratios.extend(stats.ratios)
        record = StepRecord(
            step=step, reward_mean=true_mean, rollouts=stats.rollouts, traces=stats.traces,
            sampled_tokens=stats.tokens, rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2,
            weight_versions=sorted({v for t in batch for v in t.metadata.get("weight_versions", [])}),
            new_version=version, step0_max_abs_delta=stats.step0.max_abs_delta,
            ratio_min=min(stats.ratios, default=1.0), ratio_max=max(stats.ratios, default=1.0),
            loss=stats.loss, grad_norm=stats.grad_norm,
        )
        result.steps.append(record)
        if on_step is not None:
            on_step(record)
    result.wall_s = time.perf_counter() - started
    return result


async def run_recipe(recipe: Recipe, on_step: Callable[[StepRecord], None] | None = None) -> RunResult:
    """The default backend: embedded engine + gateway + toy chat loop, all in this process."""
    seed_everything(recipe.seed)
    model_seed = recipe.seed if recipe.engine.model_seed is None else recipe.engine.model_seed
    engine = EmbeddedEngine(spec=ModelSpec(seed=model_seed), logprobs_mode=recipe.engine.logprobs_mode,
                            max_tokens_cap=recipe.sampling.max_tokens)
    # The trainer owns its own copy; the engine only ever sees weights through the sync.
    trainer = GRPOTrainer(copy.deepcopy(engine.model), recipe.trainer.config())
    store = recipe.run_dir() / "capture"
    async with LocalGateway(engine, temperature=recipe.sampling.temperature, max_tokens=recipe.sampling.max_tokens,
                            builder=recipe.builder, store_dir=store) as source:
        result = await train_with(recipe, source, trainer, on_step)
        result.per_request_traces, result.merged_traces = source.per_request_traces, source.merged_traces
        result.per_request_tokens, result.merged_tokens = source.per_request_tokens, source.merged_tokens
    return result


def step_line(record: StepRecord) -> str:
    d = asdict(record)
    return (f"step {d['step']:>3}: reward {d['reward_mean']:.3f}  traces {d['traces']:>3}  tokens {d['sampled_tokens']:>4}  "
            f"rollout {d['rollout_s']:.1f}s train {d['train_s']:.1f}s sync {d['sync_s']:.2f}s  "
            f"v{','.join(d['weight_versions'])}->v{d['new_version']}  step0 max|Δ| {d['step0_max_abs_delta']:.1e}  "
            f"ratio [{d['ratio_min']:.3f}, {d['ratio_max']:.3f}]")
