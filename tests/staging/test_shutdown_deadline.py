"""Exit in seconds whatever the load: a real ``polar-env rollout`` (embedded engine with a scripted
policy, the ``loop`` harness in bwrap sandboxes, graded by a command in a fresh runtime: evaluation
workers and POSTRUN workers both run) on a machine made busy by CPU hogs at normal priority.

* SIGTERM while sessions run: the process exits within ``SIGNAL_EXIT_S`` with exit code 143, the
  summary and the resume line printed, and leaves no process behind;
* SIGTERM during start-up (before the nodes are ready): the same, at once;
* a normal end: the process is gone within ``END_EXIT_S`` of its last printed line.

Those three are slow (a real run each); the pieces of the mechanism are tested on their own first.

Nothing left behind is checked two ways: the child carries a marker environment variable that
every process it starts inherits (bwrap itself, workers, the forkserver), and the descendants seen
just before the signal must all be gone afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar_env.staging import deadline, job
from polar_env.staging.deadline import Deadline
from polar_env.staging.interrupt import StopSignals
from polar_env.staging.postrun_pool import PostrunPool
from tests.conftest import REPO_ROOT, require_bwrap
from tests.waits import until_sync

SIGNAL_EXIT_S = 20.0  # the promise: docs/outcomes.md
END_EXIT_S = 5.0
HOGS = 3
MARK = "POLAR_SHUTDOWN_TEST_MARK"
TASKS = [{"task_id": f"t{i}__sleep", "instruction": "Print numbers, then wait.", "repo": f"r{i}",
          "evaluator": {"name": "output", "command": "true"}} for i in range(2)]


def script(wait_s: int) -> dict[str, Any]:
    """Two tool calls: ~19 KB of output (the next call's prompt carries it, so the journal is too
    large to build in the node: POSTRUN workers), then a wait that the signal interrupts."""
    return {"steps": [{"command": "seq 1 4000 | tr '\\n' ' '", "reasoning": "print"},
                      {"command": f"sleep {wait_s}; echo done", "reasoning": "wait"},
                      {"text": "Done: {tool_output}", "reasoning": "done"}]}


def start_hogs(n: int = HOGS) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


@pytest.fixture
def hogs() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = start_hogs()
    try:
        yield procs
    finally:
        stop(procs)


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and not _zombie(entry):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _zombie(entry: Path) -> bool:
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def descendants(root: int) -> dict[int, str]:
    """``root``'s live descendants: pid → start time (so a reused pid is not mistaken for one)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        starts[int(entry.name)] = fields[19]
    out: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = starts.get(pid, "")
        todo += children.get(pid, [])
    return out


def still_alive(seen: dict[int, str]) -> list[int]:
    alive = []
    for pid, start in seen.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[19] == start and fields[0] != "Z":
            alive.append(pid)
    return alive


# -- the mechanism's pieces ------------------------------------------------------------------------

def test_a_scope_shares_one_deadline_and_restores_the_one_before() -> None:
    assert not deadline.active()
    with deadline.scope(30) as outer:
        assert deadline.current() is outer
        with deadline.scope(60):  # a later deadline does not extend the one under way
            assert deadline.current() is outer
        with deadline.scope(1) as inner:  # an earlier one wins while it lasts
            assert deadline.current() is inner and inner.remaining() <= 1
        assert deadline.current() is outer
    assert not deadline.active() and deadline.current(5).remaining() > 4
    part = Deadline(10).before(0.5)
    assert 4 < part.remaining() <= 5 and part.cap(1) == 1


async def test_a_signal_starts_the_deadline_and_the_job_ends_it() -> None:
    with StopSignals("a test run") as signals:
        signals._fire(signal.SIGTERM)
        assert signals.stop.is_set() and signals.exit_code == 143
        assert deadline.active() and deadline.current().remaining() <= deadline.SIGNAL_BUDGET_S
    assert not deadline.active()  # the next job in this process starts clean


def test_closing_the_postrun_pool_kills_a_busy_worker_at_the_deadline() -> None:
    """Today's close joined a worker for as long as its job took (a niced worker's build on a busy
    machine: minutes); by the deadline it is killed."""
    pool = PostrunPool(1)
    future = pool._executor().submit(time.sleep, 60)
    until_sync(future.running, "the worker's job under way")
    processes = list(pool._executor()._processes.values())
    pool.close(Deadline(0.5))
    assert processes and not any(p.is_alive() for p in processes)
    assert not future.done() or future.exception() is not None  # killed mid-job, not joined to its end


async def test_a_signal_during_start_up_cancels_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up (engines loading: minutes on a busy machine) is cancelled by the signal, not
    waited for; today's job waited for it to end before looking at the signal."""
    import asyncio

    cancelled = asyncio.Event()

    async def slow_start(config: Any, engine: Any = None) -> Any:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(job, "start_cluster", slow_start)
    signals = StopSignals("a test run")
    asyncio.get_running_loop().call_later(0.2, signals.stop.set)
    assert await job._start_unless_stopped(object(), None, signals) is None
    assert cancelled.is_set()  # the hour-long start-up was cancelled, not waited for


def test_killing_the_descendants_takes_their_process_groups_too(tmp_path: Path) -> None:
    """A child in its own session (as sandboxes and harness CLIs run) and its child: both go."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(['sleep', '600'], "
                               "start_new_session=True); time.sleep(600)"])
    try:
        until_sync(lambda: len(deadline.descendants(parent.pid)) >= 1, "the grandchild")
        grandchild = deadline.descendants(parent.pid)[0]
        assert deadline.kill_descendants(parent.pid) == 1
        until_sync(lambda: still_alive({grandchild: _start_of(grandchild)}) == [], "the grandchild's end", timeout_s=10)
        assert parent.poll() is None  # the root itself is not a descendant
    finally:
        parent.kill()
        parent.wait()
    assert not deadline.whole_process()  # pytest is not the polar-env command: finish() returns


def test_the_watchdog_exits_a_stuck_polar_env_process_and_its_children() -> None:
    """The last resort: a main thread stuck past every deadline (today nothing bounds it)."""
    code = ("import subprocess, sys, time; sys.argv[0] = 'polar-env'; from polar_env.staging import deadline; "
            "child = subprocess.Popen(['sleep', '600'], start_new_session=True); print(child.pid, flush=True); "
            "deadline.arm_watchdog(143, limit_s=0.5); time.sleep(600)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    child = int(done.stdout.split()[0])
    assert done.returncode == 143 and "not stopped 0.5 s after the signal" in done.stderr, done.stderr
    until_sync(lambda: not Path(f"/proc/{child}").exists() or _zombie(Path(f"/proc/{child}")), "the child's end",
               timeout_s=10)


def _start_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class Run:
    """One ``polar-env rollout`` subprocess and what it printed (a log file, with arrival times)."""

    def __init__(self, root: Path, name: str, wait_s: int) -> None:
        self.root, self.mark = root, uuid.uuid4().hex
        self.seen_commands: list[str] = []
        (root / "script.json").write_text(json.dumps(script(wait_s)))
        (root / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
        self.run_dir = root / "runs" / name
        self.log = root / f"{name}.log"
        argv = [sys.executable, "-m", "polar_env.cli", "rollout", "--tasks", str(root / "tasks.jsonl"), "--samples", "2",
                "--engine", "embedded", "--engine-script", str(root / "script.json"), "--harness", "loop",
                "--max-running", "4", "--out", str(root / "runs"), "--run-id", name, "--no-progress"]
        env = {**os.environ, MARK: self.mark, "PYTHONUNBUFFERED": "1",  # each line lands when printed
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)

    def printed(self) -> str:
        return self.log.read_text(errors="replace")

    def live(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.run_dir / "live.json").read_text())
            return data
        except (FileNotFoundError, ValueError):
            return {}

    def alive(self) -> bool:
        assert self.proc.poll() is None, self.printed()[-3000:]
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def sigterm_when(run: Run, ready: bool) -> tuple[float, dict[int, str]]:
    """SIGTERM once every session runs (``ready``), or as soon as start-up began; returns the time
    sent and the descendants seen just before."""
    if ready:  # two sessions in their second tool call (the wait), in their sandboxes
        until_sync(lambda: run.alive() and sum("sleep" in command_of(p) for p in descendants(run.proc.pid)) >= 2,
                   "two sessions in their wait", timeout_s=600, poll_s=0.5)
        time.sleep(1)
    else:
        until_sync(lambda: run.alive() and str(run.live().get("phase", "")).startswith("starting"),
                   "the start-up phase", timeout_s=300, poll_s=0.05)
        time.sleep(1)  # the node starting: its engine loading
    seen = descendants(run.proc.pid)
    run.seen_commands = sorted({command_of(p) for p in seen})
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    return sent, seen


def record(line: str) -> None:
    """A figure for the report: printed, and kept in ``$POLAR_SHUTDOWN_FIGURES`` where set."""
    print(line, file=sys.stderr)
    path = os.environ.get("POLAR_SHUTDOWN_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return "?"


def check_stopped(run: Run, sent: float, seen: dict[int, str]) -> float:
    try:
        code = run.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    printed = run.printed()
    record(f"{run.run_dir.name}: exit {code} {took:.1f} s after SIGTERM, load {os.getloadavg()[0]:.1f}, "
           f"{len(seen)} descendants then: {run.seen_commands}")
    assert code == 128 + signal.SIGTERM, (code, took, printed[-3000:])
    assert took <= SIGNAL_EXIT_S, f"exited {took:.1f} s after SIGTERM\n{printed[-3000:]}"
    assert "interrupted by SIGTERM" in printed and f"resume with: polar-env rollout --resume {run.run_dir}" in printed
    time.sleep(0.5)  # a SIGKILLed child is reaped by init
    assert marked(run.mark) == [], printed[-3000:]
    assert still_alive(seen) == [], printed[-3000:]
    return took


@pytest.fixture
def ready_bwrap() -> None:
    require_bwrap()


@pytest.mark.slow
def test_sigterm_while_sessions_run_exits_within_the_deadline_under_load(ready_bwrap: None, hogs: Any,
                                                                         tmp_path: Path) -> None:
    run = Run(tmp_path, "running", wait_s=300)
    try:
        sent, seen = sigterm_when(run, ready=True)
        took = check_stopped(run, sent, seen)
    finally:
        run.kill()
    sessions = [json.loads(x) for x in (run.run_dir / "sessions.jsonl").read_text().splitlines()]
    assert len(sessions) == 4 and all(s["failure_kind"] == "interrupted" for s in sessions), sessions
    record(f"SIGTERM while running, {HOGS} hogs: exited {took:.1f} s after the signal "
          f"(load {os.getloadavg()[0]:.1f})")


@pytest.mark.slow
def test_sigterm_during_startup_exits_at_once_under_load(ready_bwrap: None, hogs: Any, tmp_path: Path) -> None:
    run = Run(tmp_path, "startup", wait_s=300)
    try:
        sent, seen = sigterm_when(run, ready=False)
        took = check_stopped(run, sent, seen)
    finally:
        run.kill()
    sessions = [json.loads(x) for x in (run.run_dir / "sessions.jsonl").read_text().splitlines()]
    assert len(sessions) == 4 and all(s["failure_kind"] == "interrupted" for s in sessions), sessions
    assert json.loads((run.run_dir / "report.json").read_text())["interrupted"]["not_started"] == 4
    record(f"SIGTERM during start-up, {HOGS} hogs: exited {took:.1f} s after the signal "
          f"(load {os.getloadavg()[0]:.1f})")


@pytest.mark.slow
def test_a_normal_end_exits_soon_after_its_last_line(ready_bwrap: None, hogs: Any, tmp_path: Path) -> None:
    run = Run(tmp_path, "normal", wait_s=1)
    last = {"at": time.monotonic(), "size": 0}

    def ended() -> bool:
        size = run.log.stat().st_size
        if size != last["size"]:
            last.update(at=time.monotonic(), size=size)
        return run.proc.poll() is not None

    try:
        until_sync(ended, "the run's end", timeout_s=900, poll_s=0.05)
    finally:
        run.kill()
    gone = time.monotonic()
    printed = run.printed()
    assert run.proc.returncode in (0, 1), printed[-3000:]
    assert "wrote " in printed, printed[-3000:]
    assert gone - last["at"] <= END_EXIT_S, f"exited {gone - last['at']:.1f} s after its last line"
    assert marked(run.mark) == [], printed[-3000:]
    record(f"normal end, {HOGS} hogs: exited {gone - last['at']:.1f} s after the last line")
