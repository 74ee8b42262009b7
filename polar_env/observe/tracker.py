"""Experiment trackers: the figures ``polar-env train`` and ``polar-env rollout``/``eval`` print,
logged to Weights & Biases or TensorBoard as well (``--tracker wandb|tensorboard``).

One small interface (``log`` figures at a step, ``summary`` of the run, ``close``) with the run's
config attached at open. Metric names are ``<group>/<figure>`` (``train/reward_mean``,
``rollout/sessions_done``, ``eval/pass@1``) so both tools group them the same way. W&B runs offline
(files under ``<out>/wandb``, ``wandb sync`` uploads them later) unless ``WANDB_MODE`` says
otherwise or an API key is configured; TensorBoard event files go to ``<out>/tensorboard``.
Adding a tracker: one class here and one entry in ``TRACKERS``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from polar_env.errors import ConfigError


class Tracker(Protocol):
    def log(self, figures: Mapping[str, float], step: int) -> None: ...

    def summary(self, figures: Mapping[str, object]) -> None: ...

    def close(self) -> None: ...


class NoTracker:
    """What runs when no ``--tracker`` was given: nothing."""

    def log(self, figures: Mapping[str, float], step: int) -> None:
        return None

    def summary(self, figures: Mapping[str, object]) -> None:
        return None

    def close(self) -> None:
        return None


def scalars(figures: Mapping[str, object], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) figures dict, flattened to ``a/b/c`` names; bools,
    strings and lists are left out (trackers plot numbers)."""
    out: dict[str, float] = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class TensorBoardTracker:
    """Event files written with TensorBoard's own writer and protobufs (no torch, no TensorFlow), so
    a rollout next to a vLLM server logs as well as the CPU trainer does."""

    def __init__(self, out_dir: Path, config: Mapping[str, object], name: str) -> None:
        require_tracker("tensorboard")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = Path(out_dir) / "tensorboard"
        self.writer = EventFileWriter(str(self.dir), filename_suffix=f".{name}")
        self._text("config", config)

    def _text(self, tag: str, data: Mapping[str, object]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.text.summary_v2 import text_pb

        body = "```\n" + json.dumps(dict(data), indent=2, default=str) + "\n```"
        self.writer.add_event(Event(wall_time=time.time(), step=0, summary=text_pb(tag, body)))

    def _scalars(self, figures: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=value) for name, value in scalars(figures).items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def log(self, figures: Mapping[str, float], step: int) -> None:
        self._scalars(figures, step)

    def summary(self, figures: Mapping[str, object]) -> None:
        self._scalars({f"summary/{k}": v for k, v in scalars(figures).items()}, 0)
        self._text("summary", figures)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, out_dir: Path, config: Mapping[str, object], name: str) -> None:
        require_tracker("wandb")
        import wandb

        # Offline unless the user set WANDB_MODE or has a key: a rollout must never stall on a
        # login prompt or a network it cannot reach.
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        wandb_mode = cast(Literal["online", "offline", "disabled", "shared"], mode)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "polar-env"), name=name, dir=str(self.dir),
                              config=dict(config), mode=wandb_mode, reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, figures: Mapping[str, float], step: int) -> None:
        self.run.log(scalars(figures), step=step)

    def summary(self, figures: Mapping[str, object]) -> None:
        for name, value in scalars(figures).items():
            self.run.summary[name] = value

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for wandb-core to flush the run log (finish alone may return first)


TRACKERS: dict[str, type[TensorBoardTracker] | type[WandbTracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
}


REQUIRES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker → the package it needs (the trackers extra)


def require_tracker(kind: str) -> None:
    """ConfigError, one line, when the tracker's package is not installed: checked by preflight
    before a run folder exists, and again when the tracker opens."""
    import importlib.util

    if kind not in TRACKERS:
        raise ConfigError(f"unknown tracker {kind!r}; known: {', '.join(sorted(TRACKERS))}")
    if importlib.util.find_spec(REQUIRES[kind]) is None:
        raise ConfigError(f"--tracker {kind} needs the {REQUIRES[kind]} package; pip install -e '.[trackers]'")


def open_tracker(kind: str | None, out_dir: Path, config: Mapping[str, object], name: str) -> Tracker:
    if kind is None:
        return NoTracker()
    require_tracker(kind)
    return TRACKERS[kind](out_dir, config, name)


def rollout_progress_figures(snapshot: Mapping[str, Any]) -> dict[str, float]:
    """One live-progress tick of ``polar-env rollout`` as tracker figures."""
    figures = {"rollout/sessions_done": snapshot.get("done", 0),
               "rollout/engine_busy": snapshot.get("engine_busy", 0.0),
               **{f"stages/{k}": v for k, v in snapshot.get("stages", {}).items()}}
    if snapshot.get("mean_reward") is not None:
        figures["rollout/mean_reward"] = snapshot["mean_reward"]
    return scalars(figures)


def rollout_report_figures(report: Mapping[str, Any]) -> dict[str, Any]:
    """The run report's figures: reward, statuses, seconds per stage, engine busy, tokens/s, pass@k."""
    wall = report.get("wall_s") or 0.0
    figures: dict[str, Any] = {
        "mean_reward": report.get("mean_reward"), "sessions": report.get("sessions"),
        "statuses": report.get("statuses", {}), "wall_s": wall,
        "engine_busy_fraction": report.get("engine_busy_fraction"),
        "sampled_tokens": report.get("sampled_tokens"),
        "sampled_tokens_per_s": (report.get("sampled_tokens") or 0) / wall if wall else 0.0,
        "drift_boundaries": report.get("drift_boundaries"),
        "stage_seconds_mean": {k: v.get("mean") for k, v in report.get("stage_seconds", {}).items()},
    }
    if "eval" in report:
        figures["eval"] = {"overall": report["eval"]["overall"], "per_repo": report["eval"]["per_repo"]}
    return figures
