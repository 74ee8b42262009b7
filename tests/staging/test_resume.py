"""Run folders, interrupt and resume, as a user meets them: a real ``polar-env rollout`` process gets
SIGINT or SIGTERM mid-run, writes every output with the interrupted sessions marked, and
``--resume`` then finishes the run with the same session ids and complete groups as a run that was
never interrupted. The simulated engine is a test double for the model only (the loop harness runs
in real bwrap sandboxes); the last test uses the real embedded engine and the real pi CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from polar_env.cli import main
from polar_env.dashboard.runs import discover
from polar_env.observe.liveness import run_state
from tests.conftest import REPO_ROOT, require_bwrap, require_extras, unavailable
from tests.waits import until_sync

pytestmark = pytest.mark.slow
OUTPUTS = ("plan.json", "trajectories.jsonl", "trajectories.parquet", "sessions.jsonl", "report.json", "timeline.png")
TASKS = [{"task_id": "alpha__one", "instruction": "run echo hi", "repo": "alpha",
          "evaluator": {"name": "output", "regex": "printed"}},   # the simulated turn always matches
         {"task_id": "beta__two", "instruction": "run echo hi", "repo": "beta",
          "evaluator": {"name": "output", "regex": "never"}}]     # and never matches this


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def sim(tmp_path: Path) -> list[str]:
    """Job flags: two tasks x 3 samples, 1 s per simulated engine call, two RUNNING slots."""
    require_bwrap()
    require_extras("pyarrow")  # the runs write trajectories.parquet
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config = tmp_path / "sim.yaml"
    config.write_text("engine:\n  kind: simulated\n  latency_s: 1.0\n")
    return ["--tasks", str(tasks), "--samples", "3", "--config", str(config), "--harness", "loop",
            "--max-running", "2", "--no-progress"]


def polar(*argv: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as f:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "polar_env.cli", *argv], env=env, stdout=f, stderr=subprocess.STDOUT)


def interrupt_when(proc: subprocess.Popen[bytes], run_dir: Path, done: int, sig: int, timeout_s: float = 300,
                   postrun: bool = False) -> float:
    """Send ``sig`` once ``done`` sessions finished (``postrun``: or are in POSTRUN, which the
    interruption lets finish) and another one is RUNNING; returns the time sent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        try:
            live = json.loads((run_dir / "live.json").read_text())
        except (FileNotFoundError, ValueError):
            live = {}
        stages = live.get("stages", {})
        finished = live.get("done", 0) + (stages.get("postrun", 0) if postrun else 0)
        if finished >= done and stages.get("running", 0) >= 1:
            proc.send_signal(sig)
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"no RUNNING session after {done} finished within {timeout_s} s")


def check_interrupted(run_dir: Path, signal_name: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every output file is there, one row per planned session, the interrupted ones marked."""
    for name in OUTPUTS:
        assert (run_dir / name).is_file(), name
    plan = json.loads((run_dir / "plan.json").read_text())
    planned = [sid for g in plan["groups"] for sid in g["session_ids"]]
    sessions = lines(run_dir / "sessions.jsonl")
    assert [s["session_id"] for s in sessions] == planned  # the full plan, in order
    cut = [s for s in sessions if s["failure_kind"] == "interrupted"]
    assert cut and len(cut) < len(sessions), [s["status"] for s in sessions]
    for s in cut:
        assert s["status"] == "cancelled" and s["mask"] is True and signal_name in s["failure_detail"]
    assert all(s["status"] == "completed" and s["mask"] is False for s in sessions if s not in cut)
    trajectories = {t["session_id"]: t for t in lines(run_dir / "trajectories.jsonl")}
    assert sorted(trajectories) == sorted(planned)  # complete groups, even for never-started sessions
    assert all(trajectories[s["session_id"]]["metadata"]["failure_kind"] == "interrupted" for s in cut)
    for s in cut:  # POSTRUN ran for what was captured: a cut session keeps its calls as (masked) traces
        assert bool(trajectories[s["session_id"]]["traces"]) == (s["records"] > 0), s
    report = json.loads((run_dir / "report.json").read_text())
    assert report["interrupted"]["signal"] == signal_name and report["interrupted"]["interrupted"] == len(cut)
    assert report["sessions"] == len(planned)
    return sessions, planned


def final_rows(run_dir: Path) -> list[tuple[Any, ...]]:
    sessions = lines(run_dir / "sessions.jsonl")
    return [(s["session_id"], s["group_id"], s["task_id"], s["sample_index"], s["status"], s["reward"], s["failure_kind"])
            for s in sessions]


def trajectory_rows(run_dir: Path) -> list[tuple[Any, ...]]:
    return [(t["session_id"], t["metadata"]["group_id"], t["reward"], len(t["traces"]), t["status"])
            for t in lines(run_dir / "trajectories.jsonl")]


def test_sigint_then_resume_equals_an_uninterrupted_run(sim: list[str], tmp_path: Path) -> None:
    out, run_dir = tmp_path / "out", tmp_path / "out" / "resume-me"
    proc = polar("rollout", *sim, "--out", str(out), "--run-id", "resume-me", log=tmp_path / "first.log")
    sent = interrupt_when(proc, run_dir, done=2, sig=signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    stopped_s = time.monotonic() - sent
    printed = (tmp_path / "first.log").read_text()
    assert f"resume with: polar-env rollout --resume {run_dir}" in printed and "interrupted by SIGINT" in printed
    before, planned = check_interrupted(run_dir, "SIGINT")
    assert (out / "latest").resolve() == run_dir.resolve()

    # refused with one line before anything starts: a plan that differs from the flags, a folder of runs, no run
    for argv, words in ((["rollout", "--resume", str(run_dir), "--samples", "4"], "samples=3 in the plan but 4"),
                        (["rollout", "--resume", str(run_dir), "--harness", "pi"], 'env.harness="loop" in the plan but "pi"'),
                        (["eval", "--resume", str(run_dir)], "a rollout run"),
                        (["rollout", "--resume", str(out)], "folder of 1 run(s)"),
                        (["rollout", "--resume", str(tmp_path)], "not a run folder")):
        proc = polar(*argv, log=tmp_path / "refused.log")
        assert proc.wait(timeout=60) == 2, argv
        said = (tmp_path / "refused.log").read_text().strip()
        assert words in said and len(said.splitlines()) == 1 and "Traceback" not in said, said

    started = time.monotonic()
    proc = polar("rollout", "--resume", str(out / "latest"), "--no-progress", log=tmp_path / "resume.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    resume_s = time.monotonic() - started
    after = lines(run_dir / "sessions.jsonl")
    assert [s["session_id"] for s in after] == planned
    assert all(s["status"] == "completed" and s["failure_kind"] is None and not s["mask"] for s in after)
    kept = {s["session_id"]: s for s in before if s["failure_kind"] is None}
    for s in after:  # the finished sessions were kept, not run again
        if s["session_id"] in kept:
            assert s["stage_times"] == kept[s["session_id"]]["stage_times"]
    rerun = [s for s in before if s["failure_kind"] == "interrupted"]
    set_aside = run_dir / "attempts" / "1" / "node-0"
    assert {p.name for p in (set_aside / "sessions").iterdir()} <= {f"{s['session_id']}.json" for s in rerun}
    assert sorted(p.stem for p in (run_dir / "capture" / "node-0").glob("*.jsonl")) == sorted(planned)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resumed"] == {"attempt": 1, "kept": len(kept), "rerun": len(rerun), "set_aside": "attempts/1"}
    assert "interrupted" not in report and report["statuses"] == {"completed": 6}

    # the same plan (same run id), never interrupted
    proc = polar("rollout", *sim, "--out", str(tmp_path / "straight"), "--run-id", "resume-me", log=tmp_path / "straight.log")
    assert proc.wait(timeout=300) == 0
    straight = tmp_path / "straight" / "resume-me"
    assert final_rows(run_dir) == final_rows(straight)  # same ids, groups, statuses and rewards, in plan order
    assert trajectory_rows(run_dir) == trajectory_rows(straight)
    groups: dict[str, int] = {}
    for s in after:
        groups[s["group_id"]] = groups.get(s["group_id"], 0) + 1
    assert sorted(groups.values()) == [3, 3]
    print(f"\nresume (simulated): {len(planned)} sessions, {len(kept)} kept, {len(rerun)} rerun; "
          f"stopped {stopped_s:.1f} s after SIGINT; resume {resume_s:.1f} s; ids compared: {len(planned)} sessions, "
          f"{len(groups)} groups")


def test_sigterm_writes_every_output_and_resumes(sim: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = polar("rollout", *sim, "--out", str(out), log=tmp_path / "first.log")
    until_sync(lambda: (out / "latest").exists(), f"{out}/latest")
    run_dir = (out / "latest").resolve()
    assert run_dir.name.split("-")[2] == "rollout"  # <UTC date>-<time>-rollout-<hex>
    interrupt_when(proc, run_dir, done=1, sig=signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    _, planned = check_interrupted(run_dir, "SIGTERM")
    # how the run is carried out may change on a resume (here: one RUNNING slot instead of two)
    proc = polar("rollout", "--resume", str(run_dir), "--no-progress", "--max-running", "1", log=tmp_path / "resume.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert json.loads((run_dir / "report.json").read_text())["config"]["env"]["limits"]["max_running"] == 1
    assert [r[0] for r in final_rows(run_dir)] == planned
    assert {r[4] for r in final_rows(run_dir)} == {"completed"}


def test_a_second_signal_exits_at_once_and_resume_recovers_what_finished(sim: list[str], tmp_path: Path) -> None:
    """The second SIGINT exits at once, before any output is written; ``--resume`` then keeps the
    sessions whose POSTRUN had finished (from their outcome files and journals) and runs the rest."""
    out, run_dir = tmp_path / "out", tmp_path / "out" / "twice"
    proc = polar("rollout", *sim, "--out", str(out), "--run-id", "twice", log=tmp_path / "log")
    interrupt_when(proc, run_dir, done=2, sig=signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130  # at once: no outputs written (below), the rest left to --resume
    assert "second SIGINT: exiting now" in (tmp_path / "log").read_text()
    assert run_state(run_dir).state == "interrupted"  # what the dashboard shows, not a crash
    assert (run_dir / "plan.json").is_file() and not (run_dir / "sessions.jsonl").exists()
    done = {p.name.split(".result.json")[0]: json.loads(p.read_text())
            for p in (run_dir / "capture" / "node-0").glob("*.result.json")}
    completed = {sid for sid, o in done.items() if o["status"] == "completed"}
    assert len(completed) >= 2
    proc = polar("rollout", "--resume", str(run_dir), "--no-progress", log=tmp_path / "resume.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    after = {s["session_id"]: s for s in lines(run_dir / "sessions.jsonl")}
    assert len(after) == 6 and {s["status"] for s in after.values()} == {"completed"}
    for sid in completed:  # recovered, not run again
        assert after[sid]["stage_times"] == done[sid]["stage_times"] and after[sid]["reward"] == done[sid]["reward"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resumed"]["kept"] == len(completed) and report["resumed"]["rerun"] == 6 - len(completed)
    trajectories = {t["session_id"]: t for t in lines(run_dir / "trajectories.jsonl")}
    assert sorted(trajectories) == sorted(after) and all(trajectories[sid]["traces"] for sid in completed)


def test_build_and_dashboard_never_mix_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs (a rollout, then an eval) into one OUT: each has its own folder and summaries, build
    reads one run at a time, and the dashboard lists both runs (the latest pointer is not a third)."""
    require_bwrap()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASKS[0]) + "\n")
    out = tmp_path / "out"
    common = ["--tasks", str(tasks), "--engine", "simulated", "--harness", "loop", "--out", str(out), "--no-progress"]
    assert main(["rollout", *common, "--samples", "2"]) == 0
    first = (out / "latest").resolve()
    assert main(["eval", *common, "--samples", "1"]) == 0
    second = (out / "latest").resolve()
    assert first != second and first.parent == second.parent == out.resolve()
    assert json.loads((first / "report.json").read_text())["sessions"] == 2
    assert json.loads((second / "report.json").read_text())["eval"]["overall"] == {"pass@1": 1.0}
    capsys.readouterr()
    built: dict[Path, list[str]] = {}
    for run in (first, second):
        assert main(["build", "--store", str(run), "--out", str(tmp_path / "t.jsonl")]) == 0
        built[run] = sorted(json.loads(line)["session_id"] for line in (tmp_path / "t.jsonl").read_text().splitlines())
        assert built[run] == sorted(s["session_id"] for s in lines(run / "sessions.jsonl"))
    assert len(built[first]) == 2 and len(built[second]) == 1 and not set(built[first]) & set(built[second])
    capsys.readouterr()
    assert main(["build", "--store", str(out)]) == 2
    err = capsys.readouterr().err
    assert "folder of 2 run(s)" in err and len(err.strip().splitlines()) == 1
    # both runs may start in the same second (their names then sort by command, not by time)
    assert sorted(p.resolve() for p in discover([out])) == sorted([first, second])
    assert [p.resolve() for p in discover([out / "latest"])] == [second]
    assert sorted(p.resolve() for p in discover([tmp_path])) == sorted([first, second])  # a folder holding OUT


def test_real_engine_and_pi_interrupt_then_resume(tmp_path: Path) -> None:
    """README's main job (toy SWE task, embedded CPU engine, pi in bwrap, swebench grading) with a
    scripted policy that fixes the task, so every session of an uninterrupted run is resolved."""
    from tests.staging.test_rollout_e2e import TOY, fixing_steps

    require_bwrap()
    if shutil.which("node") is None:
        unavailable("node is not on PATH (apt-get install -y nodejs npm)")
    from polar_env.harnesses import get_harness, install_hint, is_installed

    if not is_installed(get_harness("pi")):
        unavailable(f"pi is not installed; run {install_hint(get_harness('pi'))}")
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"steps": fixing_steps()}))
    out, run_dir = tmp_path / "out", tmp_path / "out" / "pi-run"
    started = time.monotonic()
    proc = polar("rollout", "--task-id", TOY, "--samples", "2", "--max-running", "1", "--engine-script", str(script),
                 "--out", str(out), "--run-id", "pi-run", "--no-progress", log=tmp_path / "first.log")
    interrupt_when(proc, run_dir, done=1, sig=signal.SIGINT, postrun=True)  # sample 0 grading, sample 1 RUNNING
    assert proc.wait(timeout=300) == 130, (tmp_path / "first.log").read_text()[-3000:]
    first_s = time.monotonic() - started
    before, planned = check_interrupted(run_dir, "SIGINT")
    started = time.monotonic()
    proc = polar("rollout", "--resume", str(run_dir), "--no-progress", log=tmp_path / "resume.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    resume_s = time.monotonic() - started
    after = lines(run_dir / "sessions.jsonl")
    assert [s["session_id"] for s in after] == planned == [f"{TOY}-pi-run-0", f"{TOY}-pi-run-1"]
    assert all(s["status"] == "completed" and s["reward"] == 1.0 and s["failure_kind"] is None for s in after)
    trajectories = lines(run_dir / "trajectories.jsonl")
    assert [t["session_id"] for t in trajectories] == planned
    assert all(t["reward"] == 1.0 and t["metadata"]["harness"] == "pi" and t["traces"] for t in trajectories)
    print(f"\nresume (embedded + pi): {len(planned)} sessions, "
          f"{sum(1 for s in before if s['failure_kind'] is None)} kept; interrupted run {first_s:.1f} s, "
          f"resume {resume_s:.1f} s")


def test_sigterm_stops_an_embedded_engine_rollout_within_seconds(tmp_path: Path) -> None:
    """The embedded CPU engine with random weights (it decodes up to the cap on every call, here
    20,000 tokens, so a call is always in flight: at the default 256 the batched engine finished
    both sessions inside the wait before the signal): the first SIGTERM aborts those decodes,
    finishes what was captured and exits with the summary and the resume line, within the wait
    below (it measured 5-10 s here under load; before the node aborted its engine calls it took
    ~113 s)."""
    require_bwrap()
    require_extras("pyarrow", "swebench")  # toy__calc-1 is graded by swebench's code
    out, run_dir = tmp_path / "out", tmp_path / "out" / "emb"
    proc = polar("rollout", "--task-id", "toy__calc-1", "--samples", "2", "--harness", "loop", "--out", str(out),
                 "--run-id", "emb", "--no-progress", "--max-tokens", "20000", log=tmp_path / "log")
    def running() -> bool:  # a session in RUNNING, its first engine call under way
        assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        try:
            live = json.loads((run_dir / "live.json").read_text())
        except (FileNotFoundError, ValueError):
            return False
        return bool(live.get("stages", {}).get("running", 0) >= 1)

    until_sync(running, "a session in RUNNING", timeout_s=300)
    time.sleep(2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM, (tmp_path / "log").read_text()[-3000:]
    printed = (tmp_path / "log").read_text()
    assert f"resume with: polar-env rollout --resume {run_dir}" in printed and "interrupted by SIGTERM" in printed
    for name in OUTPUTS:
        assert (run_dir / name).is_file(), name
    sessions = lines(run_dir / "sessions.jsonl")
    assert len(sessions) == 2 and all(s["failure_kind"] == "interrupted" and s["mask"] for s in sessions), sessions
    print(f"\nembedded rollout: exited {time.monotonic() - sent:.1f} s after SIGTERM")
