"""Live progress of a rollout: per-stage counts, sessions done, statuses, reward so far, engine-busy
fraction. On a terminal one table redrawn in place, laid out for the terminal's width (split into
stacked tables rather than cut headers); anywhere else (a log file, CI, a pipe) one plain line per
``interval_s``, a heartbeat. The final frame is the job's final state (the observer sends it after
the report is written), never the last tick before the job ended. The run summary is ``summary.py``.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

STAGES = ("queued", "init", "ready", "running", "postrun")
OUTCOMES = ("completed", "timeout", "error", "cancelled")
HEARTBEAT_S = 10.0


def _cells(p: dict[str, Any]) -> list[tuple[str, str]]:
    reward = "-" if p.get("mean_reward") is None else f"{p['mean_reward']:.3f}"
    statuses = p.get("statuses", {})
    return ([(s.upper(), str(p.get("stages", {}).get(s, 0))) for s in STAGES]
            + [(s, str(statuses.get(s, 0))) for s in OUTCOMES]
            + [("reward", reward), ("engine busy", f"{p.get('engine_busy', 0.0):.0%}")])


def _title(p: dict[str, Any]) -> str:
    state = " (done)" if p.get("state") == "done" else ""
    return f"{p.get('title', 'polar-env rollout')} — {p['done']}/{p['total']} sessions, {p['elapsed_s']:.0f}s{state}"


def progress_table(p: dict[str, Any], width: int | None = None) -> Table | Group:
    """The progress table; when one row of columns would not fit ``width``, several stacked tables,
    each as wide as fits, so no header or number is ever cut."""
    width = width or shutil.get_terminal_size().columns
    cells = _cells(p)
    groups: list[list[tuple[str, str]]] = [[]]
    used = 1
    for header, value in cells:
        need = max(len(header), len(value)) + 3  # padding and the column's border
        if groups[-1] and used + need > width:
            groups.append([])
            used = 1
        groups[-1].append((header, value))
        used += need
    tables = []
    for i, group in enumerate(groups):
        table = Table(title=_title(p) if i == 0 else None, header_style="bold", title_justify="left")
        for header, value in group:
            table.add_column(header, justify="right", no_wrap=True, min_width=max(len(header), len(value)))
        table.add_row(*(value for _, value in group))
        tables.append(table)
    if p.get("dead_nodes"):
        tables[-1].caption = f"dead nodes: {', '.join(p['dead_nodes'])}"
    return tables[0] if len(tables) == 1 else Group(*tables)


def progress_line(p: dict[str, Any]) -> str:
    """One plain heartbeat line (no colour, no redraw) for logs."""
    stages = " ".join(f"{s} {p.get('stages', {}).get(s, 0)}" for s in STAGES)
    statuses = p.get("statuses", {})
    outcomes = " ".join(f"{s} {statuses.get(s, 0)}" for s in OUTCOMES)
    reward = "-" if p.get("mean_reward") is None else f"{p['mean_reward']:.3f}"
    line = (f"{_title(p)} | {stages} | {outcomes} | reward {reward} | engine busy {p.get('engine_busy', 0.0):.0%}")
    if p.get("dead_nodes"):
        line += f" | dead nodes: {', '.join(p['dead_nodes'])}"
    return line


class LiveProgress:
    """A callable for ``run_job(progress=...)``: a live table on a terminal, else a heartbeat line
    every ``interval_s`` (and one when the job starts and when it ends)."""

    def __init__(self, console: Console | None = None, *, interval_s: float = HEARTBEAT_S, title: str = "polar-env rollout") -> None:
        self.console = console or Console(stderr=True)
        self.interval_s = interval_s
        self.title = title
        self.live: Live | None = None
        self.last_line = -float("inf")

    def __call__(self, p: dict[str, Any]) -> None:
        p = {"title": self.title, **p}
        if not self.console.is_terminal:
            now = time.monotonic()
            if p.get("state") == "done" or now - self.last_line >= self.interval_s:
                self.last_line = now
                self.console.print(progress_line(p), markup=False, highlight=False, soft_wrap=True)
            return
        table = progress_table(p, self.console.width)
        if self.live is None:
            self.live = Live(table, console=self.console, refresh_per_second=4, transient=False)
            self.live.start()
        else:
            self.live.update(table, refresh=p.get("state") == "done")

    def note(self, line: str) -> None:
        """One plain line (a start-up step), above the table once it is drawn."""
        self.console.print(f"{self.title}: {line}", markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

