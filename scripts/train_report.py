"""The CPU GRPO acceptance run: 3 seeds + a shuffled-reward control of the toy recipe, one after
another, then the multi-call variant for the merged-vs-per-request figures.

    python scripts/train_report.py [--recipe recipes/cpu_grpo_toy.yaml] [--out runs/report]
                                   [--margin 0.2] [--seeds 0 1 2] [--no-multiturn]
    python scripts/train_report.py --replot RUN_DIR [RUN_DIR ...] --out DIR   # one figure of finished runs

Prints each run's reward curve numbers, first-5 / last-5 means and their difference, the step-0
|Δ|, tokens/s, seconds per step (rollout / train / weight sync) and update counts, writes every
run's report folder plus one reward figure with all curves, and exits 1 when a seed's improvement
does not exceed the margin, the control's does, or (a recipe with held-out tasks) a seed's held-out
reward does not rise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import orjson

from polar_env.train.loop import RunResult, run_recipe
from polar_env.train.recipe import Recipe
from polar_env.train.report import plot_rewards, read_run, write_run


def run(recipe: Recipe) -> RunResult:
    kind = "control" if recipe.control else "grpo"
    print(f"-- {recipe.name} {kind} seed {recipe.seed} ({recipe.source})", flush=True)
    result = asyncio.run(run_recipe(recipe))
    write_run(result, recipe.run_dir())
    s = result.summary()
    print(f"   rewards {s['rewards']}")
    print(f"   first5 {s['first5']:.3f} last5 {s['last5']:.3f} improvement {s['improvement']:+.3f}; "
          f"step-0 max |Δ| {s['step0_max_abs_delta']:.2e}; ratio [{s['ratio_min']:.6f}, {s['ratio_max']:.6f}]")
    print(f"   {s['sampled_tokens_per_s']} sampled tok/s, {s['trained_tokens_per_s']} trained tok/s; s/step "
          f"rollout {s['s_per_step']['rollout_s']} train {s['s_per_step']['train_s']} sync {s['s_per_step']['sync_s']}; "
          f"wall {s['wall_s']} s", flush=True)
    u = s["updates"]
    print(f"   updates: per-request {u['per_request']} rows ({u['per_request_tokens']} ids) vs merged {u['merged']} "
          f"rows ({u['merged_tokens']} ids)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/cpu_grpo_toy.yaml")
    parser.add_argument("--multiturn-recipe", default="recipes/cpu_grpo_toy_multiturn.yaml")
    parser.add_argument("--out", default="runs/report")
    parser.add_argument("--margin", type=float, default=0.2, help="last-5 minus first-5 mean reward a seed must exceed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--no-multiturn", action="store_true")
    parser.add_argument("--replot", type=Path, nargs="+", metavar="RUN_DIR",
                        help="run nothing: plot these finished runs' report folders into OUT/rewards_all.png")
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        out.mkdir(parents=True, exist_ok=True)
        print(f"wrote {plot_rewards([read_run(d) for d in args.replot], out / 'rewards_all.png')}")
        return 0

    def recipe(path: str, seed: int, control: bool = False) -> Recipe:
        tag = "control" if control else "grpo"
        return Recipe.load(Path(path), {"seed": seed, "control": control, "out_dir": str(out / f"{{name}}-{tag}-seed{{seed}}")})

    seeds = [run(recipe(args.recipe, seed)) for seed in args.seeds]
    control = run(recipe(args.recipe, args.seeds[0], control=True))
    runs = [*seeds, control]
    if not args.no_multiturn:
        runs.append(run(recipe(args.multiturn_recipe, args.seeds[0])))
    try:
        print(f"wrote {plot_rewards(runs, out / 'rewards_all.png')}")
    except ImportError:
        print("no PNG: pip install -e '.[report]'")
    held_out_gains = [held["gain"] for r in seeds if (held := r.summary()["held_out"]) is not None]
    verdict = {
        "margin": args.margin,
        "seeds_improve": [round(r.improvement(), 4) for r in seeds],
        "control_improvement": round(control.improvement(), 4),
        # held-out tasks (where the recipe has them) must improve under training too
        "held_out_gains": held_out_gains,
        "passed": (all(r.improvement() > args.margin for r in seeds) and not control.improvement() > args.margin
                   and all(gain > 0 for gain in held_out_gains)),
        "runs": [r.summary() for r in runs],
    }
    (out / "verdict.json").write_bytes(orjson.dumps(verdict, option=orjson.OPT_INDENT_2))
    print(f"margin {args.margin}: seeds {verdict['seeds_improve']}, control {verdict['control_improvement']}, "
          f"held-out gains {verdict['held_out_gains']} -> "
          f"{'PASS' if verdict['passed'] else 'FAIL'}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
