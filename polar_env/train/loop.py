"""The training loop: rollouts → step-0 check + GRPO step → weight sync, ``steps`` times.

Each step samples ``rollouts_per_task`` rollouts of every task with the engine's current weights,
trains on them once (fully on-policy, so the step-0 check holds on every batch), then pushes the
new weights through the gateway before the next step samples. Each step's timings, rewards and
the weight versions its records carried are kept for the report (``report.py``).
"""

from __future__ import annotations

import asyncio
import copy
import ctypes
import ctypes.util
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

import torch

from polar_env.chat import chat_format
from polar_env.engines.embedded.model import ModelSpec
from polar_env.env import PolarEnv, PolarEnvConfig
from polar_env.records import Trajectory
from polar_env.train.grpo import shuffle_rewards
from polar_env.train.recipe import Recipe
from polar_env.train.rollout import LocalGateway, PolarEnvSource, RolloutSource, flatten
from polar_env.train.seeding import SeededEngine, SessionSeeds
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
    rss_gb: float = 0.0  # resident memory after the step (and after handing freed heap back)
    full_tokens: int = 0  # ids the trainer would forward with one row per trace
    forwarded_tokens: int = 0  # ids it forwarded: one prefix per group (``shared_forward.py``)


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
    held_out_before: dict[str, float] = field(default_factory=dict)  # task id -> mean reward, base weights
    held_out_after: dict[str, float] = field(default_factory=dict)  # the same tasks after the last step

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
            "updates": {"builder": self.recipe.get("builder"),  # "merged" counts what it built
                        "per_request": self.per_request_traces, "merged": self.merged_traces,
                        "per_request_tokens": self.per_request_tokens, "merged_tokens": self.merged_tokens},
            "forward": forward_summary(steps),
            "weight_versions": [s.weight_versions for s in steps],
            "held_out": held_out_summary(self.held_out_before, self.held_out_after),
        }


class ForwardSummary(TypedDict):
    sampled: int  # mask-1 tokens trained on
    full: int  # ids forwarded with one row per trace (before one prefix per group)
    shared: int  # ids forwarded with one prefix per group
    full_per_sampled: float
    shared_per_sampled: float


def forward_summary(steps: list[StepRecord]) -> ForwardSummary:
    sampled = sum(s.sampled_tokens for s in steps)
    full, shared = sum(s.full_tokens for s in steps), sum(s.forwarded_tokens for s in steps)
    return {"sampled": sampled, "full": full, "shared": shared,
            "full_per_sampled": round(full / sampled, 3) if sampled else 0.0,
            "shared_per_sampled": round(shared / sampled, 3) if sampled else 0.0}


class HeldOutSummary(TypedDict):
    tasks: int
    before: float  # mean reward over the held-out tasks, base weights
    after: float  # the same after the last step
    gain: float
    per_task: dict[str, list[float | None]]  # task id -> [before, after]


def held_out_summary(before: dict[str, float], after: dict[str, float]) -> HeldOutSummary | None:
    if not before:
        return None
    mean_before, mean_after = sum(before.values()) / len(before), sum(after.values()) / max(len(after), 1)
    return {"tasks": len(before), "before": round(mean_before, 4), "after": round(mean_after, 4),
            "gain": round(mean_after - mean_before, 4), "per_task": {k: [before[k], after.get(k)] for k in before}}


@dataclass(frozen=True, slots=True)
class UpdateCost:
    per_request_traces: int
    merged_traces: int
    per_request_tokens: int  # ids a trainer forwards when every call is its own row
    merged_tokens: int


def update_cost(traj: Trajectory) -> UpdateCost:
    """What training on this rollout costs merged vs one row per call, for the same data.

    In a prefix-merged trace each call's sampled ids are one mask-1 run, and the call's prompt is
    everything before it; so a per-request row for call i is ``prompt + response[:end_i]``."""
    per_traces = per_tokens = 0
    for trace in traj.traces:
        ends = [i + 1 for i, m in enumerate(trace.loss_mask) if m and (i + 1 == len(trace.loss_mask) or not trace.loss_mask[i + 1])]
        per_traces += len(ends)
        per_tokens += sum(len(trace.prompt_ids) + end for end in ends)
    merged_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in traj.traces)
    return UpdateCost(per_traces, len(traj.traces), per_tokens, merged_tokens)


def release_freed_memory() -> float:
    """Hand freed heap back to the OS and return the resident set in GB.

    Each step frees a batch's activations and a 0.5 GB state-dict copy in worker threads; glibc
    keeps those pages in its per-thread arenas, fragmented, so without a trim RSS grew ~0.6 GB a
    step on SmolLM2 (3.7 → 6.9 GB in 5 steps, 14.4 GB OOM) while the live tensors stayed constant.
    ``malloc_trim(0)`` trims every arena: the same run stays at 2.7 GB."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        if hasattr(libc, "malloc_trim"):  # glibc; musl has none
            libc.malloc_trim(0)
    return resident_gb()


def resident_gb() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


def seed_everything(seed: int) -> None:
    """Seed what draws outside the engine's sessions; each call's sampling seed is its session's
    (``seeding.py``), never a draw from here in arrival order."""
    random.seed(seed)
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
    result.held_out_before = await held_out_rewards(recipe, source)
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
        for traj in batch:
            cost = update_cost(traj)
            result.per_request_traces += cost.per_request_traces
            result.merged_traces += cost.merged_traces
            result.per_request_tokens += cost.per_request_tokens
            result.merged_tokens += cost.merged_tokens
        record = StepRecord(
            step=step, reward_mean=true_mean, rollouts=stats.rollouts, traces=stats.traces,
            sampled_tokens=stats.tokens, rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2,
            weight_versions=sorted({v for t in batch for v in t.metadata.get("weight_versions", [])}),
            new_version=version, step0_max_abs_delta=stats.step0.max_abs_delta,
            ratio_min=min(stats.ratios, default=1.0), ratio_max=max(stats.ratios, default=1.0),
            loss=stats.loss, grad_norm=stats.grad_norm, rss_gb=release_freed_memory(),
            full_tokens=stats.full_tokens, forwarded_tokens=stats.forwarded_tokens,
        )
        result.steps.append(record)
        if on_step is not None:
            on_step(record)
    result.held_out_after = await held_out_rewards(recipe, source)
    result.wall_s = time.perf_counter() - started
    return result


async def held_out_rewards(recipe: Recipe, source: RolloutSource) -> dict[str, float]:
    """Mean reward per held-out task under the engine's current weights (rolled out, never trained on)."""
    tasks = recipe.held_out_tasks()
    groups = await asyncio.gather(*(source.rollout(task, recipe.held_out_rollouts) for task in tasks))
    return {task.task_id: sum(float(t.reward or 0.0) for t in group) / max(len(group), 1)
            for task, group in zip(tasks, groups, strict=True)}


async def run_recipe(recipe: Recipe, on_step: Callable[[StepRecord], None] | None = None) -> RunResult:
    """Build the recipe's rollout source and trainer, then run it. The trainer holds its own copy
    of the engine's initial weights; the engine only ever sees weights through the sync."""
    seed_everything(recipe.seed)
    model_seed = recipe.seed if recipe.engine.model_seed is None else recipe.engine.model_seed
    sampling = recipe.sampling
    store = recipe.run_dir() / "capture"
    chat = chat_format(recipe.engine.template)
    # each call seeded from (seed, task, round, sample, call): the same samples whatever the arrival order
    engine = SeededEngine(SessionSeeds(recipe.seed), model_dir=chat.weights, spec=ModelSpec(seed=model_seed), chat=chat,
                          logprobs_mode=recipe.engine.logprobs_mode, max_tokens=sampling.max_tokens)
    if recipe.source == "polar_env":
        env = PolarEnv(PolarEnvConfig.model_validate(env_settings(recipe, model_seed)), engine=engine)
        async with env:
            trainer = GRPOTrainer(copy.deepcopy(engine.model), recipe.trainer.config())
            return await train_with(recipe, PolarEnvSource(env, recipe.run_dir() / "workspaces"), trainer, on_step)
    trainer = GRPOTrainer(copy.deepcopy(engine.model), recipe.trainer.config())
    async with LocalGateway(engine, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                            builder=recipe.builder, store_dir=store) as source:
        return await train_with(recipe, source, trainer, on_step)


def env_settings(recipe: Recipe, model_seed: int) -> dict[str, object]:
    """The ``PolarEnv`` config of ``source: polar_env``: the recipe's model, the loop harness, its store."""
    sampling = recipe.sampling
    return {
        "engine": {"kind": "embedded", "seed": model_seed, "logprobs_mode": recipe.engine.logprobs_mode,
                   "template": recipe.engine.template},
        "harness": "loop",
        "agent_settings": agent_settings(recipe),
        "builder": recipe.builder, "store": str(recipe.run_dir() / "capture"),
        "sampling": {"temperature": sampling.temperature, "top_p": 1.0, "max_tokens": sampling.max_tokens},
        # a step's groups run at once, as do the held-out ones
        "limits": {"max_running": max(recipe.rollouts_per_task * len(recipe.tasks),
                                      recipe.held_out_rollouts * len(recipe.held_out))},
    }


def agent_settings(recipe: Recipe) -> dict[str, object]:
    """The loop harness's settings: the recipe's agent section, the trainer's token cap, no reasoning block."""
    agent = recipe.agent
    settings: dict[str, object] = {"tools": agent.tools, "max_turns": agent.max_turns,
                                "max_tokens": recipe.sampling.max_tokens, "thinking": False}
    if agent.system is not None:
        settings["system"] = agent.system
    return settings


def updates_line(updates: Mapping[str, object]) -> str:
    """The run's trace counts, saying what each counts: under ``per_request`` every call is its own
    trace, so there is no merged count to set beside the per-request one (it would repeat it)."""
    builder = updates.get("builder")
    if builder == "per_request":
        return f"updates {updates['per_request']} traces, one per call (builder per_request merges nothing)"
    return (f"updates per-request {updates['per_request']} vs merged {updates['merged']}"
            + (f" (builder {builder})" if builder else ""))


def step_line(record: StepRecord) -> str:
    d = asdict(record)
    return (f"step {d['step']:>3}: reward {d['reward_mean']:.3f}  traces {d['traces']:>3}  tokens {d['sampled_tokens']:>4}  "
            f"rollout {d['rollout_s']:.1f}s train {d['train_s']:.1f}s sync {d['sync_s']:.2f}s  "
            f"v{','.join(d['weight_versions'])}->v{d['new_version']}  step0 max|Δ| {d['step0_max_abs_delta']:.1e}  "
            f"ratio [{d['ratio_min']:.3f}, {d['ratio_max']:.3f}]  rss {d['rss_gb']:.2f} GB")
