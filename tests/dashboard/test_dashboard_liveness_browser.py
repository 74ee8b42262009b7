"""A run's state on the Runs, Live and Health pages is measured from its job's process (its
``heartbeat.json``), not read off the last file it wrote. Real ``polar-env rollout`` subprocesses
(embedded engine with a scripted policy, the ``loop`` harness in bwrap, one task x one sample),
started together and watched by one dashboard process:

* ``finished``: runs to its end: ``done``, its node ``stopped`` (no live ``/metrics``);
* ``killed``: SIGKILL while its session sleeps in RUNNING: ``crashed`` at the next look, its
  timeline stopped, the session ``crashed`` (last seen ``running``) and the resume command shown;
* ``stopped``: SIGTERM while its session runs: the job stops cleanly: ``interrupted``;
* ``crashed``: an exception ends the job before ``report.json``: the folder its trajectories file is
  written through (``trajectories.jsonl.tmp``) is made a directory while the session runs (a real
  I/O fault, no test hook), so writing the outputs raises ``IsADirectoryError``: ``crashed`` with
  that one-line error.

And a ``polar-env serve --local`` with ``dashboard --server``: each of its sessions shows its real
stage (one RUNNING slot: one ``running``, the others ``ready``/``queued``), and an in-flight
session's page has no "node died" card.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.test_dashboard_browser import CHROMIUM, TASKS, env, served_dashboard, shot, wait_ready
from tests.dashboard.test_dashboard_live_browser import STAGES, goto, rollout, statuses
from tests.waits import until_sync

pytestmark = pytest.mark.slow
SLEEPY = "sleep 60; echo 6*7=$((6*7))"  # the session sits in RUNNING for a minute: time to kill or stop it


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.dashboard.test_dashboard_browser import require_browser

    require_browser()
    path = tmp_path_factory.mktemp("liveness")
    (path / "runs").mkdir()
    return path


@pytest.fixture(scope="module")
def dashboard(root: Path) -> Iterator[str]:
    with served_dashboard(str(root / "runs")) as url:
        yield url


@pytest.fixture(scope="module")
def jobs(root: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The four runs, started together (their minute of sleep overlaps)."""
    started = {"finished": rollout(root, "finished", "echo 6*7=$((6*7))", TASKS[:1], 1),
               "killed": rollout(root, "killed", SLEEPY, TASKS[:1], 1),
               "stopped": rollout(root, "stopped", SLEEPY, TASKS[:1], 1),
               "crashed": rollout(root, "crashed", "sleep 8; echo 6*7=$((6*7))", TASKS[:1], 1)}
    try:
        crashed = root / "runs" / "crashed"
        until_sync(lambda: crashed.is_dir() or started["crashed"].poll() is not None, "the crashed run's folder",
                   timeout_s=300, poll_s=0.05)
        (crashed / "trajectories.jsonl.tmp").mkdir()  # where its outputs are written: now they cannot be
        yield started
    finally:
        for job in started.values():
            if job.poll() is None:
                job.kill()
            job.communicate(timeout=60)


def running_session(run: Path) -> bool:
    try:
        live = json.loads((run / "live.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return "running" in (live.get("session_stages") or {}).values()


@pytest.fixture(scope="module")
def ended(root: Path, jobs: dict[str, subprocess.Popen[str]]) -> dict[str, tuple[int, str]]:
    """Each job brought to its end as its name says; its exit code and output."""
    runs = root / "runs"
    for name, sig in (("killed", signal.SIGKILL), ("stopped", signal.SIGTERM)):  # (the first test kills its own)
        job = jobs[name]
        until_sync(lambda: running_session(runs / name) or job.poll() is not None, f"{name}'s session in RUNNING",  # noqa: B023
                   timeout_s=300)
        if job.poll() is None:
            job.send_signal(sig)
    out = {}
    for name, job in jobs.items():
        text, _ = job.communicate(timeout=600)
        out[name] = (job.returncode, text)
    return out


@pytest.fixture
def context() -> Iterator[Any]:
    """A browser context whose pages record console errors; the test fails on any."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        errors: list[str] = []

        def watch(page: Any) -> None:
            page.on("console", lambda m: errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))

        ctx.on("page", watch)
        yield ctx
        ctx.close()
        browser.close()
        assert errors == [], errors


def run_states(page: Any, dashboard: str) -> dict[str, str]:
    """The Runs page's state badge per run, freshly loaded (the list is read once per visit)."""
    page.goto("about:blank")  # the same URL again would not re-render it
    goto(page, dashboard, "#/")
    rows = page.locator("#runs tbody tr")
    return {str(rows.nth(i).get_attribute("data-run")): rows.nth(i).locator('td[data-col="state"] .badge').inner_text()
            for i in range(rows.count())}


def test_a_killed_run_is_crashed_at_the_next_look(root: Path, dashboard: str, jobs: dict[str, subprocess.Popen[str]],
                                                  context: Any) -> None:
    page = context.new_page()
    runs = root / "runs"
    until_sync(lambda: running_session(runs / "killed") or jobs["killed"].poll() is not None, "killed's session running",
               timeout_s=300)
    assert run_states(page, dashboard)["killed"] == "running"  # while its process beats
    goto(page, dashboard, "#/run/killed/health")
    assert page.locator('#nodes tr[data-node="node-0"] td[data-col="state"]').inner_text() == "alive"
    jobs["killed"].send_signal(signal.SIGKILL)  # no handler, no last word: live.json still says running
    until_sync(lambda: run_states(page, dashboard)["killed"] == "crashed", "the killed run shown crashed", timeout_s=15,
               poll_s=0.5)
    assert json.loads((runs / "killed" / "live.json").read_text())["state"] == "running"


def test_killed_and_crashed_runs_show_their_last_state(root: Path, dashboard: str,
                                                                   ended: dict[str, tuple[int, str]], context: Any) -> None:
    runs = root / "runs"
    assert ended["killed"][0] == -signal.SIGKILL and not (runs / "killed" / "report.json").exists()
    code, text = ended["crashed"]
    assert code != 0 and not (runs / "crashed" / "report.json").exists(), text[-2000:]
    assert "Is a directory" in text, text[-2000:]
    page = context.new_page()
    states = run_states(page, dashboard)
    assert states == {"finished": "done", "killed": "crashed", "stopped": "interrupted", "crashed": "crashed"}, states
    resume = page.locator('#runs tr[data-run="killed"] .resume').inner_text()
    assert resume == f"polar-env rollout --resume {runs / 'killed'}"
    shot(page, "runs-states")

    goto(page, dashboard, "#/run/killed")  # its last state: the stages live.json last had, stopped in time
    assert page.locator("#live-state").inner_text() == "crashed"
    assert page.locator('[data-stage="running"] b').first.inner_text() == "1"
    assert "is gone" in page.locator("#live-note").inner_text()
    assert page.locator("#live-resume").inner_text() == resume
    chip = page.locator('#in-flight a.chip[data-stage="running"]')
    assert chip.count() == 1 and "when the job stopped" in page.locator("#in-flight h2").inner_text()
    end = page.locator("#timeline").get_attribute("data-t-end")
    page.wait_for_timeout(2500)  # the live page is pushed each second: a dead job's timeline does not grow
    assert page.locator("#timeline").get_attribute("data-t-end") == end
    sid = chip.get_attribute("data-session")
    chip.click()
    wait_ready(page, f"#/run/killed/session/{sid}")
    assert page.locator("h1 .badge").first.inner_text() == "crashed"
    detail = page.locator("#failure-detail").inner_text()
    assert detail.startswith("the job crashed in running") and resume in detail
    assert page.locator("#in-flight-note").count() == 0

    goto(page, dashboard, "#/run/killed/sessions")
    assert statuses(page) == ["crashed"]

    goto(page, dashboard, "#/run/crashed")
    assert page.locator("#live-state").inner_text() == "crashed"
    assert "IsADirectoryError" in page.locator("#live-note").inner_text()
    beat = json.loads((runs / "crashed" / "heartbeat.json").read_text())
    assert beat["state"] == "crashed" and beat["error"].startswith("IsADirectoryError: [Errno 21] Is a directory")

    for run in ("killed", "crashed"):  # their nodes went with the job
        goto(page, dashboard, f"#/run/{run}/health")
        node = page.locator('#nodes tr[data-node="node-0"]')
        assert node.locator('td[data-col="state"]').inner_text() == "stopped"
        assert "/metrics" not in node.inner_text()
        assert page.locator("#h-nodes").inner_text().startswith("0 alive / 1")
        assert "crashed" in page.locator("#health-source").inner_text()


def test_stopped_and_finished_runs(root: Path, dashboard: str, ended: dict[str, tuple[int, str]], context: Any) -> None:
    runs = root / "runs"
    code, text = ended["stopped"]
    assert code == 128 + signal.SIGTERM, text[-2000:]
    assert ended["finished"][0] == 0, ended["finished"][1][-2000:]
    page = context.new_page()
    goto(page, dashboard, "#/run/stopped")
    assert page.locator("#live-state").inner_text() == "interrupted"
    assert "SIGTERM" in page.locator("#live-note").inner_text()
    assert page.locator("#live-resume").inner_text() == f"polar-env rollout --resume {runs / 'stopped'}"
    goto(page, dashboard, "#/run/finished")
    assert page.locator("#live-state").inner_text() == "done" and not page.locator("#live-note").is_visible()
    for run in ("finished", "stopped"):
        goto(page, dashboard, f"#/run/{run}/health")
        node = page.locator('#nodes tr[data-node="node-0"]')
        assert node.locator('td[data-col="state"]').inner_text() == "stopped"
        assert "/metrics" not in node.inner_text()  # recorded, but nothing serves it now
        assert page.locator("#h-nodes").inner_text().startswith("0 alive / 1")
    report = json.loads((runs / "finished" / "report.json").read_text())
    assert report["nodes"][0]["metrics_url"].endswith("/metrics")


def test_a_rollout_servers_sessions_show_their_stage(root: Path, context: Any) -> None:
    from tests.staging.test_serve_cli import free_port

    port, store = free_port(), root / "serve"
    (root / "serve.script.json").write_text(json.dumps({"steps": [{"command": "sleep 30; echo hi", "reasoning": "wait"},
                                                                  {"text": "printed {tool_output}", "reasoning": "done"}]}))
    server = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "serve", "--local", "--port", str(port), "--store",
                               str(store), "--engine", "embedded", "--engine-script", str(root / "serve.script.json"),
                               "--harness", "loop", "--max-running", "1"], env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    dash: subprocess.Popen[str] | None = None
    page: Any = None
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline()]
        while lines[-1] and "polar-env serve ready" not in lines[-1]:  # after any note on leftovers it cleaned
            lines.append(server.stdout.readline())
        assert "polar-env serve ready" in lines[-1], "".join(lines)
        url, token = f"http://127.0.0.1:{port}", (store / "rollout_token").read_text().strip()
        tasks = root / "serve.tasks.jsonl"
        tasks.write_text(json.dumps({"task_id": "echo", "instruction": "run echo hi",
                                     "evaluator": {"name": "output", "regex": "printed"}}) + "\n")
        sub = subprocess.run([sys.executable, "-m", "polar_env.cli", "submit", str(tasks), "--samples", "3", "--harness",
                              "loop", "--server", url, "--token", token], env=env(), capture_output=True, text=True,
                             timeout=120, check=False)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        dash = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "dashboard", str(store), "--port", "0", "--server",
                                 url, f"--server-token={token}"], env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert dash.stdout is not None
        address = dash.stdout.readline().split(" ", 1)[1].strip()
        page = context.new_page()
        seen: list[str] = []

        def one_running_others_waiting() -> bool:
            page.goto("about:blank")
            goto(page, address, "#/run/server/sessions")
            seen[:] = statuses(page)
            return len(seen) == 3 and seen.count("running") == 1 and set(seen) <= STAGES

        until_sync(one_running_others_waiting, "the server's 3 sessions, one running and two waiting", timeout_s=240,
                   poll_s=1.0)
        assert set(seen) - {"running"} <= {"queued", "init", "ready"}, seen
        assert json.loads((store / "heartbeat.json").read_text())["kind"] == "serve"
        goto(page, address, "#/")
        assert page.locator('#runs tr[data-run="server"] td[data-col="state"]').inner_text() == "running"
        goto(page, address, "#/run/server/sessions?status=running")
        page.locator("#sessions tbody tr").first.click()
        page.wait_for_selector("#in-flight-note", timeout=60_000)  # a session on a live node: no verdict
        assert page.locator("#failure-detail").count() == 0
        assert page.locator("h1 .badge").first.inner_text() == "running"
        goto(page, address, "#/run/server/health")
        assert page.locator('#nodes tr[data-node="node-0"] td[data-col="state"]').inner_text() == "alive"
    finally:
        if page is not None:
            page.close()  # before its dashboard goes: the live pages poll it
        if dash is not None:
            dash.terminate()
            dash.communicate(timeout=30)
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=120)
    assert json.loads((store / "heartbeat.json").read_text())["state"] == "done"
