"""What ``polar-env train RECIPE`` does: load the recipe, run it, print each step, write the report.

A bad recipe raises ``ConfigError`` (the CLI prints one line, exit 2); a step-0 failure is one line
naming trace and position (exit 1): the data path is broken, which is not the user's typo.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from polar_env.errors import PolarError
from polar_env.observe.liveness import Heartbeat, current_exception, one_line
from polar_env.observe.tracker import open_tracker
from polar_env.train.loop import StepRecord, run_recipe, step_line, updates_line
from polar_env.train.recipe import Recipe
from polar_env.train.report import PLOT_HINT, write_run
from polar_env.train.step0 import Step0Mismatch


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``): unwound like Ctrl-C, so the run records interrupted."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM")


def run_train(recipe_path: Path, overrides: dict[str, Any], tracker: str | None = None) -> int:
    recipe = Recipe.load(recipe_path, overrides)
    logger = open_tracker(tracker, recipe.run_dir(), recipe.model_dump(mode="json"), name=recipe.name)

    def on_step(record: StepRecord) -> None:
        print(step_line(record), flush=True)
        logger.log(train_step_figures(record), record.step)

    kind = "shuffled-reward control" if recipe.control else "GRPO"
    print(f"{recipe.name}: {kind}, seed {recipe.seed}, {recipe.steps} steps x {len(recipe.tasks)} tasks x "
          f"{recipe.rollouts_per_task} rollouts; report in {recipe.run_dir()}", flush=True)
    beat = Heartbeat(recipe.run_dir(), kind="train").start()  # the dashboard's word on whether it still runs
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() else None
    try:
        result = asyncio.run(run_recipe(recipe, on_step))
        written = write_run(result, recipe.run_dir())
        s = result.summary()
        logger.summary(s)
    except Step0Mismatch as exc:
        beat.stop("crashed", error=one_line(exc))
        print(f"polar-env train: {exc}", file=sys.stderr)
        return 1
    except PolarError:
        beat.discard()  # the user's mistake (one line, exit 2): no run folder left behind
        raise
    except Terminated:
        beat.stop("interrupted", signal="SIGTERM")
        print(f"polar-env train: SIGTERM: stopped; the steps so far are in {recipe.run_dir()}", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        logger.close()
        beat.stop_for(current_exception())  # a no-op after the stops above
    print(f"reward first 5 steps {s['first5']}, last 5 {s['last5']} (Δ {s['improvement']:+.3f}); "
          f"step-0 max |Δ| {s['step0_max_abs_delta']:.2e}; {s['sampled_tokens_per_s']} sampled tokens/s; "
          f"s/step rollout {s['s_per_step']['rollout_s']} train {s['s_per_step']['train_s']} sync {s['s_per_step']['sync_s']}; "
          f"{updates_line(s['updates'])}; wall {s['wall_s']} s")
    fwd = s["forward"]
    print(f"forwarded ids per sampled token: {fwd['full_per_sampled']} one row per trace, "
          f"{fwd['shared_per_sampled']} one prefix per group")
    if (held := s["held_out"]) is not None:
        print(f"held-out ({held['tasks']} tasks never trained on, {recipe.held_out_rollouts} rollouts each): "
              f"reward before {held['before']}, after {held['after']} (Δ {held['gain']:+.3f})")
    print("wrote " + ", ".join(str(p) for p in written))
    if not any(p.suffix == ".png" for p in written):
        print(f"(no PNGs: {PLOT_HINT})")
    return 0


def train_step_figures(record: StepRecord) -> dict[str, float]:
    """One ``StepRecord`` of ``polar-env train`` as tracker figures."""
    rollout_s = record.rollout_s or 0.0
    return {"train/reward_mean": record.reward_mean, "train/loss": record.loss, "train/grad_norm": record.grad_norm,
            "train/step0_max_abs_delta": record.step0_max_abs_delta, "train/ratio_min": record.ratio_min,
            "train/ratio_max": record.ratio_max, "train/traces": record.traces, "train/rollouts": record.rollouts,
            "train/sampled_tokens": record.sampled_tokens,
            "train/sampled_tokens_per_s": record.sampled_tokens / rollout_s if rollout_s else 0.0,
            "time/rollout_s": record.rollout_s, "time/train_s": record.train_s, "time/sync_s": record.sync_s}
