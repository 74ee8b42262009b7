"""Readable output (issue 16, finding 8): a live table laid out for the terminal's width whose final
frame is the job's end, a heartbeat line per interval off a terminal, the summary and eval pass@k
as tables (no dict reprs), an excerpt of one session and the next step. Before: the final frame
said "5/6 sessions" after 6/6, headers were cut at 80 columns and session ids at 100, a log got one
frame, and the summary printed ``{'completed': 6}``-style reprs."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from polar_env.staging.job import RolloutJob, run_job
from polar_env.staging.progress import LiveProgress, progress_line, progress_table
from polar_env.staging.summary import next_steps, print_summary, sessions_table
from tests.conftest import require_bwrap

HEADERS = ("QUEUED", "INIT", "READY", "RUNNING", "POSTRUN", "completed", "timeout", "error", "cancelled", "reward",
           "engine busy")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def snapshot(done: int = 3, total: int = 6, **extra: Any) -> dict[str, Any]:
    return {"elapsed_s": 12.0, "total": total, "done": done,
            "stages": {"queued": 1, "init": 0, "ready": 0, "running": 2, "postrun": 0},
            "statuses": {"completed": done, "timeout": 0, "error": 0, "cancelled": 0},
            "mean_reward": 0.5, "engine_busy": 0.42, "dead_nodes": [], **extra}


def render(renderable: Any, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False)
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [60, 80, 100, 200])
def test_progress_table_never_cuts_a_header(width: int) -> None:
    text = render(progress_table(snapshot(), width), width)
    assert all(len(line) <= width for line in text.splitlines()), text
    for header in HEADERS:
        assert header in text, (width, text)
    assert "3/6 sessions" in text
    if width >= 200:
        assert sum("QUEUED" in line and "engine busy" in line for line in text.splitlines()) == 1  # one row of columns


def _report(ids: list[str], reason: str) -> dict[str, Any]:
    rows = [{"session_id": i, "task_id": i.rsplit("-", 2)[0], "node_id": "node-0", "status": "completed", "reward": 0.0,
             "records": 3, "traces": 1, "stage_s": {"init": 1.0, "running": 20.5, "postrun": 0.4}, "resolved": False,
             "reason": reason, "error": None, "sample_index": 0, "drift_boundaries": 0, "sampled_tokens": 10,
             "harness_exit_code": 0} for i in ids]
    return {"session_rows": rows, "sessions": len(rows), "wall_s": 23.0, "statuses": {"completed": len(rows)},
            "mean_reward": 0.0, "engine_busy_fraction": 0.5, "running_occupancy": 0.25, "engine_calls": 9,
            "sampled_tokens": 30, "per_request_traces": 9, "merged_traces": 3, "drift_boundaries": 0, "notes": [],
            "config": {"out": "polar_rollouts", "env": {"engine": {"kind": "embedded"}}}}


@pytest.mark.parametrize("width", [80, 100, 120])
def test_session_ids_are_never_cut(width: int) -> None:
    ids = ["toy__textkit-1-334a33-0", "toy__bsearch-1-9f00aa-1", "swe-gym__getmoto__moto-4918-0c1d2e-12"]
    text = render(sessions_table(_report(ids, "FAIL_TO_PASS tests failed: " + "test_zero_divisor " * 8), width), width)
    assert all(len(line) <= width for line in text.splitlines()), text
    for session_id in ids:
        assert session_id in text, text
    if width >= 100:
        assert "reason / error" in text and "FAIL_TO_PASS tests failed" in text
    else:  # too narrow for the reasons beside 38-character ids: print_summary adds the "why" table
        console = Console(width=width, record=True, file=io.StringIO())
        print_summary(_report(ids, "FAIL_TO_PASS tests failed: test_zero_divisor"), console)
        why = console.export_text()
        assert re.search(r"│\s+3 │ FAIL_TO_PASS tests failed: test_zero_divisor\s+│", why), why


def test_heartbeat_off_a_terminal() -> None:
    out = io.StringIO()
    live = LiveProgress(Console(file=out, force_terminal=False, width=300), interval_s=3600)
    live(snapshot(done=0))
    live(snapshot(done=3))  # within the interval: no line
    live(snapshot(done=6, state="done"))  # the end: always a line
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == progress_line({"title": "polar-env rollout", **snapshot(done=0)})
    assert "6/6 sessions, 12s (done)" in lines[1] and "completed 6" in lines[1]
    out2 = io.StringIO()
    every = LiveProgress(Console(file=out2, force_terminal=False, width=300), interval_s=0)
    for done in range(4):
        every(snapshot(done=done))
    assert len(out2.getvalue().splitlines()) == 4


def test_next_step_after_a_first_all_zero_run() -> None:
    steps = next_steps(_report(["a-1-0"], "empty patch"), Path("polar_rollouts"))
    text = "\n".join(steps)
    assert "random weights" in text and "--engine-script" in text and "README 'Scripted policy'" in text
    assert "polar-env dashboard polar_rollouts" in text and "polar-env build --store polar_rollouts ·" in text


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """An eval job of 6 sessions (simulated engine test double, loop harness, real bwrap sandboxes)
    watched by a LiveProgress on a (recorded) terminal."""
    require_bwrap()
    tmp = tmp_path_factory.mktemp("output")
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"echo-{i}", "instruction": "run echo hi",
                                         "evaluator": {"name": "output", "regex": "printed"}}) + "\n" for i in range(3)))
    job = RolloutJob.model_validate({"env": {"engine": {"kind": "simulated"}, "harness": "loop"}, "tasks": str(tasks),
                                     "samples": 2, "out": str(tmp / "out"), "mode": "eval", "pass_k": [1, 2]})
    screen = io.StringIO()
    live = LiveProgress(Console(file=screen, force_terminal=True, width=100))
    try:
        report = asyncio.run(run_job(job, live))
    finally:
        live.stop()
    return report, ANSI.sub("", screen.getvalue()), Path(report["run_dir"])


def test_start_up_says_what_it_is_doing_before_the_table(finished_job: tuple[dict[str, Any], str, Path]) -> None:
    _, screen, _ = finished_job
    starting = re.search(r"polar-env rollout: starting 1 node\(s\): simulated engine [^\n]*\(\+\d+\.\ds\)", screen)
    ready = re.search(r"polar-env rollout: 1 node\(s\) ready in \d+\.\ds; dispatching 6 session\(s\)", screen)
    assert starting and ready, screen[:2000]
    first_frame = screen.index("/6 sessions")
    assert starting.start() < ready.start() < first_frame  # said before the first frame, in order


def test_final_live_frame_is_the_end_of_the_job(finished_job: tuple[dict[str, Any], str, Path]) -> None:
    report, screen, _ = finished_job
    assert report["sessions"] == 6
    frames = re.findall(r"(\d+)/6 sessions, \d+s( \(done\))?", screen)
    assert frames and frames[-1] == ("6", " (done)"), frames[-3:]
    last = screen[screen.rindex("6/6 sessions"):]
    assert re.search(r"│\s+0 │\s+0 │\s+0 │\s+0 │\s+0 │\s+6 │", last), last  # nothing left in a stage, 6 completed


def test_summary_is_tables_with_an_excerpt(finished_job: tuple[dict[str, Any], str, Path]) -> None:
    report, _, out = finished_job
    console = Console(width=100, record=True, file=io.StringIO())
    print_summary(report, console, out=out)
    text = console.export_text()
    assert "{'" not in text and "':" not in text, text  # no Python dict reprs
    assert "6 sessions in" in text and "6 completed; mean reward 1.0" in text
    assert re.search(r"│ overall\s+│\s+3 │\s+1\.000 │\s+1\.000 │", text), text  # pass@1 and pass@2 per repo + overall
    assert "eval: cost" in text and "engine seconds" in text
    assert re.search(r"one session, echo-\d-\w+-\d \(completed, 2 model call\(s\)\): reward 1\.00 — regex 'printed' matched",
                     text), text
    assert "call 1: called bash: echo hi" in text and "call 2: answered: The command printed: hi" in text
    assert "next: inspect: polar-env dashboard" in text
