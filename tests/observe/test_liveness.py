"""``heartbeat.json`` and ``run_state``: a run's state measured from its process, not read off a file
that a dead job left saying ``running``. Real processes are started and killed (SIGKILL, an
exception, a clean end); another host and a reused pid are written as the beats such a job leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.errors import ConfigError
from polar_env.observe.live import JobObserver, LiveFile
from polar_env.observe.liveness import HEARTBEAT_FILE, Heartbeat, proc_start, run_state
from polar_env.staging.runs import resolve_run
from tests.waits import until_sync

REPO = Path(__file__).resolve().parents[2]
BEATER = """
import sys, time
from pathlib import Path
from polar_env.observe.liveness import Heartbeat
Heartbeat(Path(sys.argv[1]), kind="rollout", interval_s=0.1).start()
print("beating", flush=True)
time.sleep(600)
"""


def beat(folder: Path, **fields: Any) -> None:
    """A heartbeat as a job left it (the fields the test cares about over this process's own)."""
    hb = Heartbeat(folder, kind="rollout")
    body = {**hb.body, "beat_at": time.time(), **fields}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HEARTBEAT_FILE).write_text(json.dumps(body))


def beater(folder: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", BEATER, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline() == "beating\n"
    return proc


def reap(proc: subprocess.Popen[str]) -> None:
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def test_a_beating_job_runs_and_its_recorded_end_is_the_truth(tmp_path: Path) -> None:
    hb = Heartbeat(tmp_path, kind="eval", interval_s=0.05).start()
    state = run_state(tmp_path)
    assert (state.state, state.kind, state.pid, state.source) == ("running", "eval", os.getpid(), HEARTBEAT_FILE)
    first = json.loads((tmp_path / HEARTBEAT_FILE).read_text())["beat_at"]
    until_sync(lambda: json.loads((tmp_path / HEARTBEAT_FILE).read_text())["beat_at"] > first, "a second beat")
    body = json.loads((tmp_path / HEARTBEAT_FILE).read_text())
    assert body["proc_start"] == proc_start(os.getpid()) and body["interval_s"] == 0.05 and body["host"]
    hb.stop("done")
    time.sleep(0.15)  # the thread has stopped: the recorded end is not overwritten by a late beat
    assert run_state(tmp_path).state == "done" and json.loads((tmp_path / HEARTBEAT_FILE).read_text())["state"] == "done"
    assert run_state(tmp_path).resume is None


def test_sigkill_is_recognised_at_the_next_look_reaped_or_not(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({"command": "rollout"}))
    proc = beater(tmp_path)
    assert run_state(tmp_path).state == "running"
    proc.kill()
    until_sync(lambda: proc_start(proc.pid) is None, "the killed process to be a zombie")  # not reaped yet
    state = run_state(tmp_path)
    assert state.state == "crashed" and f"process {proc.pid} is gone" in state.reason
    assert state.resume == f"polar-env rollout --resume {tmp_path}"
    reap(proc)
    assert run_state(tmp_path).state == "crashed"


def test_a_reused_pid_is_not_the_job(tmp_path: Path) -> None:
    start = proc_start(os.getpid())
    assert start is not None
    beat(tmp_path, proc_start=start - 1)  # this pid, another process start: the job's pid was reused
    state = run_state(tmp_path)
    assert state.state == "crashed" and "belongs to another process" in state.reason


def test_another_hosts_job_is_judged_by_the_age_of_its_last_beat(tmp_path: Path) -> None:
    now = time.time()
    beat(tmp_path, host="gpu-node-7", boot_id="other", pid=1, interval_s=2.0, beat_at=now - 5.0)
    assert run_state(tmp_path, now=now).state == "running"  # within 3 intervals: no /proc to ask
    state = run_state(tmp_path, now=now + 10.0)  # 15 s without a beat, every 2 s expected
    assert state.state == "crashed" and "no heartbeat from gpu-node-7 for 15 s" in state.reason


def test_an_exception_ending_the_job_records_crashed_with_its_line(tmp_path: Path) -> None:
    observer = JobObserver(tmp_path, None, {"mode": "rollout"})
    with pytest.raises(IsADirectoryError):
        try:
            raise IsADirectoryError(21, "Is a directory", str(tmp_path / "trajectories.jsonl.tmp"))
        finally:
            observer.close()  # as run_job's finally calls it
    state = run_state(tmp_path)
    assert state.state == "crashed" and state.error is not None
    assert state.error.startswith("IsADirectoryError: [Errno 21] Is a directory") and "\n" not in state.error


def test_the_observers_end_done_interrupted_and_ctrl_c(tmp_path: Path) -> None:
    done, stopped, ctrl_c = tmp_path / "done", tmp_path / "stopped", tmp_path / "ctrl_c"
    observer = JobObserver(done, None, {"mode": "eval"})
    observer.finish({"sessions": 1})
    observer.close()
    assert run_state(done).state == "done"
    observer = JobObserver(stopped, None, {"mode": "rollout"})
    observer.finish({"sessions": 1})
    (stopped / "report.json").write_text(json.dumps({"interrupted": {"signal": "SIGTERM", "resume": "x"}}))
    observer.close()
    state = run_state(stopped)
    assert (state.state, state.signal) == ("interrupted", "SIGTERM")
    observer = JobObserver(ctrl_c, None, {"mode": "rollout"})
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            observer.close()
    assert run_state(ctrl_c).state == "interrupted"


def test_folders_from_before_heartbeats(tmp_path: Path) -> None:
    report, stopped, fresh, stale, planned, store = (tmp_path / n for n in ("report", "stopped", "fresh", "stale", "plan", "store"))
    for folder in (report, stopped, fresh, stale, planned, store):
        folder.mkdir()
    (report / "report.json").write_text("{}")
    (stopped / "report.json").write_text(json.dumps({"interrupted": {"signal": "SIGINT"}}))
    (stopped / "plan.json").write_text(json.dumps({"command": "eval"}))
    LiveFile(fresh)({"elapsed_s": 1.0, "stages": {}})
    LiveFile(stale)({"elapsed_s": 1.0, "stages": {}})
    (planned / "plan.json").write_text(json.dumps({"command": "rollout"}))
    assert run_state(report).state == "done"
    assert (run_state(stopped).state, run_state(stopped).resume) == ("interrupted", f"polar-env eval --resume {stopped}")
    assert run_state(fresh).state == "running"
    gone = run_state(stale, now=time.time() + 600)  # a live.json that said running ten minutes ago
    assert gone.state == "crashed" and "no heartbeat" in gone.reason
    assert run_state(planned).state == "unknown" and run_state(store).state == "unknown"


def test_resume_refuses_a_run_that_is_still_running(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({"command": "rollout"}))
    proc = beater(tmp_path)
    try:
        with pytest.raises(ConfigError, match="still running"):
            resolve_run(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        reap(proc)
    assert resolve_run(tmp_path) == tmp_path.resolve()  # crashed: resumable


def crashed_run(root: Path) -> Path:
    """A run whose job was SIGKILLed mid-run: live.json says running with alpha-g-1 in RUNNING on
    node-0; its heartbeat names a process that is gone."""
    from tests.dashboard.test_dashboard_live_api import NODE, live_run

    run = live_run(root)
    proc = beater(run)
    proc.kill()
    reap(proc)
    (run / "plan.json").write_text(json.dumps({**json.loads((run / "plan.json").read_text()), "command": "rollout"}))
    live = json.loads((run / "live.json").read_text())
    (run / "live.json").write_text(json.dumps({**live, "nodes": [{**NODE, "metrics_url": "http://127.0.0.1:9/metrics"}]}))
    return run


async def test_the_dashboard_shows_a_killed_run_crashed_everywhere(tmp_path: Path) -> None:
    from polar_env.dashboard.server import Dashboard, build_dashboard

    run = crashed_run(tmp_path)
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        (summary,) = (await (await client.get("/api/runs")).json())["runs"]
        assert summary["state"] == "crashed" and summary["resume"] == f"polar-env rollout --resume {run}"
        live = await (await client.get("/api/runs/r1/live")).json()
        assert live["state"] == "crashed" and "now_s" not in live and "in_flight" not in live  # the timeline stops
        assert live["last_in_flight"] == {"alpha-g-1": "running", "alpha-g-2": "ready"} and live["stages"]["running"] == 1
        page = await (await client.get("/api/runs/r1/sessions")).json()
        rows = {r["session_id"]: (r["status"], r.get("last_stage")) for r in page["rows"]}
        assert rows == {"alpha-g-0": ("completed", None), "alpha-g-1": ("crashed", "running"),
                        "alpha-g-2": ("crashed", "ready"), "alpha-g-3": ("not started", None)}
        assert page["finished"] is True  # nothing more will come: the page stops re-reading
        detail = await (await client.get("/api/runs/r1/sessions/alpha-g-1")).json()
        assert detail["in_flight"] is False and detail["failure_detail"].startswith("the job crashed in running")
        assert "node" not in detail["failure_detail"].split("(")[0]  # the job went, not its node
        topo = await (await client.get("/api/runs/r1/topology")).json()
        (node,) = topo["nodes"]
        assert (node["state"], node["metrics_url"], node["last_metrics_url"]) == ("stopped", None, "http://127.0.0.1:9/metrics")
        assert topo["live"] is False and "crashed" in topo["source"] and topo["job"]["state"] == "crashed"


def test_a_refused_command_leaves_no_folder(tmp_path: Path) -> None:
    made, kept = tmp_path / "new-run", tmp_path / "kept"
    kept.mkdir()
    Heartbeat(made, kind="train").start().discard()
    Heartbeat(kept, kind="train").start().discard()
    assert not made.exists() and kept.is_dir() and not (kept / HEARTBEAT_FILE).exists()


SECOND_SIGNAL = """
import os, signal, sys, time
from pathlib import Path
from polar_env.observe.liveness import Heartbeat
from polar_env.staging.interrupt import _exit_now
Heartbeat(Path(sys.argv[1]), kind="rollout", interval_s=0.1).start()
signal.signal(signal.SIGINT, _exit_now)  # what StopSignals installs after the first signal
print("beating", flush=True)
time.sleep(600)
"""


def test_an_exit_that_skips_the_jobs_ending_still_records_interrupted(tmp_path: Path) -> None:
    """A second Ctrl-C leaves with os._exit (no outputs, no finally): the heartbeat still says
    interrupted by that signal, not a crash."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SECOND_SIGNAL, str(run)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "beating"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    proc.stdout.close()
    state = run_state(run)
    assert state.state == "interrupted", state
    assert json.loads((run / HEARTBEAT_FILE).read_text())["signal"] == "SIGINT"
