"""What ``rollout`` / ``eval`` print when the job ends: the sessions table (as wide as the terminal,
session ids never cut), the run figures and eval pass@k as tables, a short excerpt of one session
(its last model turns, its reward and why) and the next step to take.

A first run on the embedded defaults earns reward 0 everywhere; the excerpt shows what the model
did and the next step says how to see a non-zero reward (a scripted policy, real weights) and how
to inspect the run, so the first output teaches something.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from polar_env.staging.progress import OUTCOMES

MAX_SESSION_ROWS = 30  # larger runs: the rest are in sessions.jsonl
EXCERPT_TURNS = 3
TEXT_CHARS = 160


def console_for_stdout() -> Console:
    """stdout as wide as the terminal; a log file or pipe gets 160 columns, not 80."""
    console = Console()
    if console.is_terminal:
        return Console(width=shutil.get_terminal_size((console.width, 24)).columns)
    return Console(width=160)


def print_summary(report: dict[str, Any], console: Console | None = None, out: Path | None = None) -> None:
    console = console or console_for_stdout()
    console.print(sessions_table(report, console.width))
    if not _reason_fits(report, console.width):
        console.print(reasons_table(report))
    console.print(headline(report), markup=False, highlight=False)
    console.print(figures_table(report))
    if "eval" in report:
        for table in eval_tables(report):
            console.print(table)
    for note in report.get("notes", []):
        console.print(f"note: {note}", markup=False, highlight=False)
    folder = out if out is not None else Path(str(report.get("run_dir") or report.get("config", {}).get("out", "")))
    lines = excerpt(report, folder) + next_steps(report, folder)
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _count_words(counts: dict[str, int]) -> str:
    order = [s for s in OUTCOMES if s in counts] + sorted(s for s in counts if s not in OUTCOMES)
    return ", ".join(f"{counts[s]} {s}" for s in order) or "none"


def headline(report: dict[str, Any]) -> str:
    return (f"{report['sessions']} sessions in {report['wall_s']} s: {_count_words(report['statuses'])}; "
            f"mean reward {report['mean_reward']}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


REASON_MIN = 30  # narrower than this, the reasons get their own table


def _columns(report: dict[str, Any], width: int) -> tuple[list[tuple[str, int]], bool]:
    """The sessions table's columns for ``width`` and whether the reason column fits beside them:
    optional columns are dropped first, then the reason moves to its own table; ids are never cut."""
    shown = report["session_rows"][:MAX_SESSION_ROWS]
    id_width = max([len("session"), *(len(r["session_id"]) for r in shown)])
    columns: list[tuple[str, int]] = [("session", id_width), ("status", 9), ("reward", 6), ("calls", 5),
                                      ("traces", 6), ("init s", 6), ("running s", 9), ("postrun s", 9)]
    order = ["traces", "init s", "postrun s", "calls", "running s"]  # optional columns, dropped in this order

    def fit(reason: int) -> list[tuple[str, int]]:
        cols, optional = list(columns), list(order)
        while sum(w + 3 for _, w in cols) + reason + 1 > width and optional:
            drop = optional.pop(0)
            cols = [c for c in cols if c[0] != drop]
        return cols

    with_reason = fit(REASON_MIN + 3)
    if sum(w + 3 for _, w in with_reason) + REASON_MIN + 3 + 1 <= width:
        return with_reason, True
    return fit(0), False


def _reason_fits(report: dict[str, Any], width: int) -> bool:
    return _columns(report, width)[1]


def _why(row: dict[str, Any]) -> str:
    return str(_failure(row) or row["reason"] or _unexplained(row))[:200]


def _failure(row: dict[str, Any]) -> str | None:
    """The typed failure of a session row (``failure_kind: detail``), or None for a clean one."""
    if not row.get("failure_kind"):
        return None
    return f"{row['failure_kind']}: {row['failure_detail']}" if row.get("failure_detail") else str(row["failure_kind"])


def reasons_table(report: dict[str, Any]) -> Table:
    """Why the sessions got their rewards, one row per distinct reason (for narrow terminals)."""
    groups: dict[str, list[str]] = {}
    for row in report["session_rows"]:
        groups.setdefault(_why(row) or "-", []).append(row["session_id"])
    table = Table(title="why", header_style="bold", title_justify="left")
    table.add_column("sessions", justify="right", no_wrap=True)
    table.add_column("reason / error", overflow="fold")
    for why, ids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        table.add_row(str(len(ids)), why)
    return table


def sessions_table(report: dict[str, Any], width: int) -> Table:
    """One row per session (the first ``MAX_SESSION_ROWS``). The session id column is as wide as
    the longest id; optional columns are dropped, narrowest terminal first, before anything is cut."""
    rows = report["session_rows"]
    shown = rows[:MAX_SESSION_ROWS]
    columns, with_reason = _columns(report, width)
    more = len(rows) - len(shown)
    table = Table(title="sessions", header_style="bold", title_justify="left",
                  caption=f"... and {more} more in sessions.jsonl" if more > 0 else None)
    for name, w in columns:
        table.add_column(name, no_wrap=True, min_width=w if name == "session" else None,
                         justify="left" if name in ("session", "status") else "right")
    if with_reason:
        table.add_column("reason / error", overflow="fold", ratio=1)
    for row in shown:
        st = row["stage_s"]
        values = {"session": row["session_id"], "status": row["status"], "reward": f"{row['reward']:.2f}",
                  "calls": str(row["records"]), "traces": str(row["traces"]), "init s": f"{st.get('init', 0):.2f}",
                  "running s": f"{st.get('running', 0):.2f}", "postrun s": f"{st.get('postrun', 0):.2f}"}
        table.add_row(*(values[name] for name, _ in columns), *([_why(row)] if with_reason else []))
    return table


def _unexplained(row: dict[str, Any]) -> str:
    # a completed session's evaluation is empty only when its task has no evaluator
    return "no evaluator: reward 0" if row["status"] == "completed" and row.get("resolved") is None else ""


def figures_table(report: dict[str, Any]) -> Table:
    table = Table(title="run", header_style="bold", title_justify="left", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in (("engine busy", _pct(report.get("engine_busy_fraction"))),
                        ("RUNNING occupancy", _pct(report.get("running_occupancy"))),
                        ("engine calls", str(report.get("engine_calls", 0))),
                        ("sampled tokens", str(report.get("sampled_tokens", 0))),
                        _traces_figure(report),
                        ("drift boundaries", str(report["drift_boundaries"])),
                        ("failure kinds", failure_kinds_text(report.get("failure_kinds") or {})),
                        ("masked", str(report.get("masked", 0)))):
        table.add_row(name, value)
    return table


def failure_kinds_text(kinds: dict[str, int]) -> str:
    """``failure_kinds`` counted, most first: a class of failure (no_model_calls) is never silent."""
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _traces_figure(report: dict[str, Any]) -> tuple[str, str]:
    """Per-request vs built trace counts; under ``per_request`` nothing is merged, so the built
    count is not shown as a merged one that repeats the per-request count."""
    builder = ((report.get("config") or {}).get("env") or {}).get("builder")
    if builder == "per_request":
        return "traces (per_request: one per call)", str(report["merged_traces"])
    return "traces per-request → merged", f"{report['per_request_traces']} → {report['merged_traces']}"


def eval_tables(report: dict[str, Any]) -> list[Table]:
    """pass@k overall and per repo, and the engine cost."""
    ev = report["eval"]
    ks = sorted({k for entry in [ev["overall"], *ev["per_repo"].values()] for k in entry if k.startswith("pass@")},
                key=lambda k: int(k.split("@")[1]))
    table = Table(title="eval: pass@k", header_style="bold", title_justify="left")
    table.add_column("repo")
    table.add_column("tasks", justify="right")
    for k in ks:
        table.add_column(k, justify="right")
    for repo, entry in sorted(ev["per_repo"].items()):
        table.add_row(repo, str(entry.get("tasks", 0)), *(f"{entry[k]:.3f}" if k in entry else "-" for k in ks))
    table.add_section()
    table.add_row("overall", str(sum(e.get("tasks", 0) for e in ev["per_repo"].values())),
                  *(f"{ev['overall'][k]:.3f}" if k in ev["overall"] else "-" for k in ks), style="bold")
    tables = [table]
    if "cost" in report:
        cost = Table(title="eval: cost", header_style="bold", title_justify="left")
        for col in ("engine seconds", "sampled tokens", "prompt tokens"):
            cost.add_column(col, justify="right")
        c = report["cost"]
        cost.add_row(str(c["engine_seconds"]), str(c["sampled_tokens"]), str(c["prompt_tokens"]))
        tables.append(cost)
    return tables


# -- one session, and what to do next ----------------------------------------------------------


def pick_session(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The most instructive session: the best reward, then completed, then the most model calls."""
    if not rows:
        return None
    return max(rows, key=lambda r: (r["reward"], r["status"] == "completed", r["records"]))


def _short(text: str, n: int = TEXT_CHARS, *, collapse: bool = True) -> str:
    """One line of at most ``n`` characters; ``collapse=False`` keeps a command's spacing."""
    text = " ".join(text.split()) if collapse else " ⏎ ".join(line for line in text.splitlines() if line.strip())
    return text if len(text) <= n else text[: n - 1] + "…"


def model_turns(journal: Path, n: int = EXCERPT_TURNS) -> list[str]:
    """The last ``n`` assistant turns in the session's journal, as one line each."""
    from polar_env.journal.reader import read_with_refs

    try:
        records, _ = read_with_refs(journal)
    except Exception:  # noqa: BLE001 - an excerpt is a courtesy: a damaged journal is `polar-env verify`'s job
        return []
    lines = []
    for record in records[-n:]:
        msg = record.message
        said = []
        for call in msg.tool_calls:
            try:
                args = json.loads(call.arguments)
            except ValueError:
                args = call.arguments
            command = args.get("command", args.get("cmd")) if isinstance(args, dict) else None
            shown = command if isinstance(command, str) else call.arguments
            said.append(f"called {call.name}: {_short(str(shown), 120, collapse=False)}")
        if msg.content and msg.content.strip():
            said.append(f"answered: {_short(msg.content)}")
        if not said and msg.reasoning and msg.reasoning.strip():
            said.append(f"only thought: {_short(msg.reasoning)}")
        if not said:
            said.append("no text or tool call")
        if record.finish_reason == "length":
            said.append(f"cut at the token cap ({len(record.response_ids)} tokens)")
        lines.append(f"  call {record.seq + 1}: " + "; ".join(said))
    return lines


def excerpt(report: dict[str, Any], out: Path) -> list[str]:
    row = pick_session(report.get("session_rows", []))
    if row is None:
        return []
    why = _failure(row) or row.get("reason") or _unexplained(row) or "no reason given"
    head = (f"one session, {row['session_id']} ({row['status']}, {row['records']} model call(s)): "
            f"reward {row['reward']:.2f} — {_short(str(why), 200)}")
    journal = out / "capture" / row.get("node_id", "") / f"{row['session_id']}.jsonl"
    turns = model_turns(journal) if row.get("node_id") else []
    if row["records"] > len(turns) and turns:
        head += f"; its last {len(turns)} call(s):"
    return [head, *turns]


def next_steps(report: dict[str, Any], out: Path) -> list[str]:
    """What to do after this run, in the light of its result."""
    config = report.get("config", {})
    engine = config.get("env", {}).get("engine", {})
    steps = []
    statuses = report.get("statuses", {})
    lost = report.get("failure_kinds", {}).get("node_lost", 0)
    if lost:
        dead = ", ".join(s["node_id"] + (f" (host {s['host']})" if s.get("host") else "")
                         for s in report.get("nodes", []) if "dead" in s) or "a node"
        steps.append(f"{lost} session(s) were lost with {dead} (masked, with the calls it had journaled): "
                     f"the same command with --resume {out} runs them again")
    kinds = report.get("failure_kinds", {})
    if kinds.get("no_model_calls"):
        steps.append(f"{kinds['no_model_calls']} session(s) ended with no model call captured (masked): their harness "
                     "never reached the gateway; check the preset's base URL / API key config (failure_detail has its "
                     "exit code and output)")
    steps += timeout_hint(report)
    if statuses.get("error") or statuses.get("timeout"):
        steps.append(f"{statuses.get('error', 0)} error / {statuses.get('timeout', 0)} timeout session(s): the "
                     "reason column says why; sessions.jsonl has each one's failure_kind, failure_detail and stage times")
    if (report.get("mean_reward") or 0) == 0 and engine.get("kind", "embedded") == "embedded" \
            and not engine.get("script") and not real_weights(engine):
        steps.append("reward 0 is expected here: the embedded engine has random weights. To see reward 1, force the "
                      "model's turns with a scripted policy (--engine-script FILE; README 'Scripted policy' has one "
                      "that fixes toy__calc-1), or load real weights with --model-dir, or serve a model and pass "
                      "--engine-url")
    steps.append(f"inspect: polar-env dashboard {out} · rebuild trajectories: polar-env build --store "
                 f"{out} · train on {out / 'trajectories.jsonl'}")
    return ["next: " + steps[0], *("      " + s for s in steps[1:])]


def real_weights(engine: Mapping[str, object]) -> bool:
    """Whether the embedded engine loaded real weights: a ``model_dir``, or a template that names
    its own model (``smollm2``, ``hf:PATH``); else it ran seeded random ones."""
    template = str(engine.get("template") or "")
    return bool(engine.get("model_dir")) or template == "smollm2" or template.startswith("hf:")


BUSY_ENGINE = 0.5  # busier than this through a run whose sessions timed out: the engine was the bottleneck


def timeout_hint(report: dict[str, Any]) -> list[str]:
    """When sessions timed out, what the engine was doing meanwhile and the flag that helps: a
    loaded machine (a busy engine decoding one request at a time, or a starved harness) reads
    otherwise as a policy that ran out of time."""
    timed_out = report.get("statuses", {}).get("timeout", 0)
    if not timed_out:
        return []
    env = (report.get("config") or {}).get("env") or {}
    engine = env.get("engine") or {}
    busy, wall = report.get("engine_busy_fraction"), float(report.get("wall_s") or 0)
    tokens, calls = int(report.get("sampled_tokens") or 0), int(report.get("engine_calls") or 0)
    rate = f"{tokens / wall:.1f}" if wall else "-"
    timeout, running = env.get("timeout_s", 600), (env.get("limits") or {}).get("max_running", 4)
    bound = report.get("failure_kinds", {}).get("engine_bound_timeout", 0)
    kinds = f" ({bound} session(s) ran out of wall time waiting on the engine, masked)" if bound else ""
    doing = (f"{timed_out} session(s) timed out{kinds}; meanwhile the engine was busy {_pct(busy)} of the {wall:g} s "
             f"run and sampled {tokens} tokens in {calls} call(s) ({rate} tokens/s)")
    fewer = f"lower --max-running (now {running}) or " if running > 1 else ""
    if busy is not None and busy >= BUSY_ENGINE:
        one = " (the embedded CPU engine decodes one request at a time)" if engine.get("kind", "embedded") == "embedded" else ""
        return [f"{doing}: the engine, not the policy, was the limit{one}; {fewer}raise --timeout-s (now {timeout:g}), "
                "or give the engine more capacity"]
    return [f"{doing}: the engine was mostly idle, so the harnesses themselves were slow (a loaded machine?); "
            f"{fewer}raise --timeout-s (now {timeout:g})"]
