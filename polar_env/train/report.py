"""The run report: ``summary.json``, ``steps.jsonl``, and two PNGs (reward curve; importance ratio
and step-0 |Δ| histograms). Several runs (seeds, a control) can share one reward figure.

matplotlib is the ``report`` extra; without it the JSON is still written and the PNGs are skipped
with the install line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import orjson

from polar_env.train.loop import RunResult, StepRecord, held_out_summary

PLOT_HINT = "pip install 'polar-env[report]' (matplotlib) to get the PNGs"


def write_run(result: RunResult, out_dir: Path) -> list[Path]:
    """Write one run's files; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "summary.json"
    summary.write_bytes(orjson.dumps(result.summary(), option=orjson.OPT_INDENT_2))
    steps = out_dir / "steps.jsonl"
    steps.write_bytes(b"".join(orjson.dumps(asdict(s)) + b"\n" for s in result.steps))
    written = [summary, steps]
    try:
        written += [plot_rewards([result], out_dir / "reward.png"), plot_histograms(result, out_dir / "ratio_delta.png")]
    except ImportError:
        pass
    return written


def read_run(out_dir: Path) -> RunResult:
    """A run back from the files ``write_run`` wrote: its steps, rewards and held-out results (enough
    to plot it next to another run); the per-token ratios and step-0 deltas are not kept there."""
    summary = orjson.loads((out_dir / "summary.json").read_bytes())
    steps = [StepRecord(**orjson.loads(line)) for line in (out_dir / "steps.jsonl").read_bytes().splitlines() if line]
    held = (summary.get("held_out") or {}).get("per_task", {})
    return RunResult(recipe={k: summary[k] for k in ("name", "seed", "control")}, steps=steps, wall_s=summary["wall_s"],
                     held_out_before={k: v[0] for k, v in held.items()},
                     held_out_after={k: v[1] for k, v in held.items() if v[1] is not None})


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def _label(result: RunResult) -> str:
    kind = "shuffled-reward control" if result.recipe["control"] else "GRPO"
    return f"{result.recipe['name']}: {kind}, seed {result.recipe['seed']} (last5 - first5 {result.improvement():+.2f})"


def plot_rewards(results: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4 + 0.22 * len(results)))
    for result in results:
        style = "--" if result.recipe["control"] else "-"
        (line,) = ax.plot(range(len(result.steps)), result.rewards(), style, marker="o", markersize=3, label=_label(result))
        held = held_out_summary(result.held_out_before, result.held_out_after)
        if held is not None:  # mean over held-out tasks, before the first step and after the last
            before, after = held["before"], held["after"]
            ax.plot([-0.5, len(result.steps) - 0.5], [before, after], ":", marker="s", markersize=5,
                    color=line.get_color(), label=f"held-out tasks, never trained on ({before:.2f} -> {after:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("reward per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)  # below: curves stay visible
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_histograms(result: RunResult, path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    ratios = result.ratios or [1.0]
    left.hist([r - 1.0 for r in ratios], bins=50, color="tab:blue")
    left.set_title(f"importance ratio exp(train - rollout), all steps, {len(ratios)} tokens\n"
                   f"min {min(ratios):.6f}  max {max(ratios):.6f}", fontsize=9)
    left.set_xlabel("ratio - 1")
    deltas = [max(d, 1e-12) for d in result.step0_deltas] or [1e-12]
    right.hist([math.log10(d) for d in deltas], bins=40, color="tab:green")
    right.axvline(-4, color="tab:red", linestyle="--", label="tolerance 1e-4")
    right.set_title(f"step-0 |Δ logprob| (log10), {len(result.step0_deltas)} mask-1 tokens\n"
                    f"max {max(result.step0_deltas, default=0.0):.2e}", fontsize=9)
    right.set_xlabel("log10 |Δ|  (exact zeros shown at -12)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
