"""``live.json``: the running job's progress snapshot, written atomically next to its outputs so a
dashboard (or ``watch cat``) can follow a job it did not start. The stage history (for the
timeline) keeps at most ``max_points`` samples by halving its resolution when full."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

LIVE_FILE = "live.json"


class LiveFile:
    def __init__(self, folder: Path, max_points: int = 2000) -> None:
        self.path = Path(folder) / LIVE_FILE
        self.max_points = max_points
        self.started = time.time()
        self.history: list[list[Any]] = []  # [elapsed_s, {stage: n}]

    def __call__(self, snapshot: dict[str, Any]) -> None:
        self.write(snapshot, state="running")

    def write(self, snapshot: dict[str, Any], state: str) -> None:
        stages = dict(snapshot.get("stages", {}))
        if not self.history or self.history[-1][1] != stages or state != "running":
            self.history.append([round(float(snapshot.get("elapsed_s", 0.0)), 3), stages])
            if len(self.history) > self.max_points:
                self.history = self.history[::2]
        body = {**snapshot, "state": state, "started_at": self.started, "updated_at": time.time(),
                "history": self.history}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(orjson.dumps(body, default=str))
        os.replace(tmp, self.path)  # readers never see half a file


def read_live(folder: Path) -> dict[str, Any] | None:
    try:
        data = orjson.loads((Path(folder) / LIVE_FILE).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def final_snapshot(last: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The progress snapshot of a finished job, from its report: every session done, no stage
    occupied, the final statuses and reward (the last tick may predate the last sessions)."""
    done = int(report.get("sessions", 0))
    busy = report.get("engine_busy_fraction")
    return {**last, "stages": dict.fromkeys(last.get("stages") or ("queued", "init", "ready", "running", "postrun"), 0),
            "done": done, "total": max(int(last.get("total", 0)), done),
            "mean_reward": report.get("mean_reward"),
            "statuses": {"completed": 0, "timeout": 0, "error": 0, "cancelled": 0, **report.get("statuses", {})},
            "engine_busy": busy if busy is not None else last.get("engine_busy", 0.0),
            "dead_nodes": last.get("dead_nodes", []), "session_stages": {},
            "elapsed_s": report.get("wall_s", last.get("elapsed_s", 0.0))}


class JobObserver:
    """Everything that watches a running job, fed from its progress ticks: ``live.json``, the
    experiment tracker (``--tracker``), and the terminal table when there is one."""

    def __init__(self, out: Path, tracker: str | None, config: dict[str, Any], progress: Any | None = None) -> None:
        from polar_env.observe.liveness import Heartbeat
        from polar_env.observe.tracker import open_tracker

        self.out = Path(out)
        self.heartbeat = Heartbeat(self.out, kind=str(config.get("mode", "rollout"))).start()  # until close()
        self.finished = False
        self.live = LiveFile(out)
        self.tracker = open_tracker(tracker, out, config, name=f"{config.get('mode', 'rollout')}-{Path(out).name}")
        self.progress = progress
        self.ticks = 0
        self.last: dict[str, Any] = {}

    def __call__(self, snapshot: dict[str, Any]) -> None:
        from polar_env.observe.tracker import rollout_progress_figures

        self.last = snapshot
        self.live(snapshot)
        self.tracker.log(rollout_progress_figures(snapshot), self.ticks)
        self.ticks += 1
        if self.progress is not None:
            self.progress(snapshot)

    def phase(self, text: str, elapsed_s: float) -> None:
        """A start-up step (nodes starting, engines loading) before there is a table to show:
        ``live.json`` says it, and the display prints it as a line (``LiveProgress.note``)."""
        self.live.write({**self.last, "phase": text, "elapsed_s": elapsed_s}, state="starting")
        note = getattr(self.progress, "note", None)
        if callable(note):
            note(f"{text} (+{elapsed_s:.1f}s)")

    def finish(self, report: dict[str, Any]) -> None:
        from polar_env.observe.tracker import rollout_report_figures

        final = final_snapshot(self.last, report)
        self.live.write(final, state="done")
        self.finished = True
        self.tracker.summary(rollout_report_figures(report))
        if self.progress is not None:  # the last frame is the job's end, not the last tick before it
            self.progress({**final, "state": "done"})

    def close(self) -> None:
        """Close the tracker and record how the job ended: called from the job's ``finally``, so an
        exception on its way out is the crash it records (with its one-line error)."""
        from polar_env.observe.liveness import current_exception, json_object, read_json

        exc = current_exception()
        try:
            self.tracker.close()
        finally:
            stopped = json_object((read_json(self.out / "report.json") or {}).get("interrupted"))
            if exc is None and not self.finished:
                self.heartbeat.stop("crashed", error="the job ended without writing its report")
            elif exc is None and stopped:
                signal = stopped.get("signal")
                self.heartbeat.stop("interrupted", signal=signal if isinstance(signal, str) else None)
            else:
                self.heartbeat.stop_for(exc)
