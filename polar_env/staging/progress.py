"""Live progress of a rollout in the terminal (rich): per-stage counts, sessions done, statuses,
reward so far, engine-busy fraction; and the final per-session table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

STAGES = ("queued", "init", "ready", "running", "postrun")


def progress_table(p: dict[str, Any]) -> Table:
    table = Table(title=f"polar-env rollout — {p['done']}/{p['total']} sessions, {p['elapsed_s']:.0f}s",
                  show_header=True, header_style="bold")
    for stage in STAGES:
        table.add_column(stage.upper(), justify="right")
    for col in ("completed", "timeout", "error", "cancelled", "reward", "engine busy"):
        table.add_column(col, justify="right")
    reward = "-" if p["mean_reward"] is None else f"{p['mean_reward']:.3f}"
    table.add_row(*(str(p["stages"].get(s, 0)) for s in STAGES), *(str(p["statuses"][s]) for s in
                  ("completed", "timeout", "error", "cancelled")), reward, f"{p['engine_busy']:.0%}")
    if p.get("dead_nodes"):
        table.caption = f"dead nodes: {', '.join(p['dead_nodes'])}"
    return table


class LiveProgress:
    """A callable for ``run_job(progress=...)`` that redraws one table in place."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live: Live | None = None

    def __call__(self, p: dict[str, Any]) -> None:
        if self.live is None:
            self.live = Live(progress_table(p), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()
        else:
            self.live.update(progress_table(p))

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)  # a log file or pipe: do not squeeze the table to 80 columns
    table = Table(title="sessions", header_style="bold")
    for col in ("session", "status", "reward", "calls", "traces", "init s", "running s", "postrun s", "reason / failure"):
        table.add_column(col)
    for row in report["session_rows"]:
        st = row["stage_s"]
        failure = f"{row['failure_kind']}: {row['failure_detail']}" if row.get("failure_kind") else None
        why = failure or row["reason"] or ""
        table.add_row(row["session_id"], row["status"], f"{row['reward']:.2f}", str(row["records"]), str(row["traces"]),
                      f"{st.get('init', 0):.2f}", f"{st.get('running', 0):.2f}", f"{st.get('postrun', 0):.2f}",
                      why[:70])
    console.print(table)
    busy = report["engine_busy_fraction"]
    occ = report["running_occupancy"]
    console.print(
        f"{report['sessions']} sessions in {report['wall_s']} s: {report['statuses']}; mean reward "
        f"{report['mean_reward']}; engine busy {busy if busy is None else f'{busy:.1%}'}; RUNNING occupancy "
        f"{occ if occ is None else f'{occ:.1%}'}; traces per-request {report['per_request_traces']} → merged "
        f"{report['merged_traces']}; drift boundaries {report['drift_boundaries']}")
    if "eval" in report:
        console.print(f"eval: {report['eval']['overall']}; per repo: {report['eval']['per_repo']}; cost {report['cost']}")
    for note in report.get("notes", []):
        console.print(f"note: {note}")
