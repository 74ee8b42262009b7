"""Live mode, health, curves and Compare in a real browser (Debian's chromium through Playwright, as
``test_dashboard_browser.py``), over run folders written by real ``polar-env`` subprocesses:

* ``watched``: a rollout the pages watch while it runs (embedded engine, a scripted policy whose
  tool sleeps, one RUNNING slot, the ``loop`` harness in bwrap), 2 tasks x 2 samples;
* ``alpha-only``: a rollout of one of those tasks (a different task set, for Compare), with
  ``--tracker tensorboard``;
* ``train``: a ``polar-env train`` run of the tiny CPU GRPO recipe (3 steps, ``steps.jsonl``);
* a ``polar-env serve --local`` with a submitted task, shown with ``dashboard --server``.

One dashboard process serves the first three. Every page is checked with the console free of errors.
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
import yaml

from tests.conftest import require_bwrap, unavailable
from tests.dashboard.test_dashboard_browser import CHROMIUM, TASKS, env, shot, wait_ready
from tests.waits import until_sync

pytestmark = pytest.mark.slow
def script(command: str) -> dict[str, Any]:
    return {"steps": [{"command": command, "reasoning": "compute"}, {"text": "The answer is {tool_output}", "reasoning": "done"}]}
TRAIN = {"name": "tiny", "steps": 3, "rollouts_per_task": 3, "source": "local",
         "tasks": [{"task_id": "k", "instruction": "Say a word with a k.", "follow_ups": ["Again."]}],
         "evaluator": {"name": "output", "regex": "k", "ignore_case": True},
         "sampling": {"temperature": 0.1, "max_tokens": 3}, "trainer": {"lr": 0.01}}
STAGES = {"queued", "init", "ready", "running", "postrun"}


def rollout(root: Path, name: str, command: str, tasks: list[dict[str, Any]], samples: int,
            *extra: str) -> subprocess.Popen[str]:
    (root / f"{name}.script.json").write_text(json.dumps(script(command)))
    (root / f"{name}.tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    argv = [sys.executable, "-m", "polar_env.cli", "rollout", "--tasks", str(root / f"{name}.tasks.jsonl"),
            "--samples", str(samples), "--engine", "embedded", "--engine-script", str(root / f"{name}.script.json"),
            "--harness", "loop", "--out", str(root / "runs"), "--run-id", name, "--no-progress", *extra]
    return subprocess.Popen(argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(job: subprocess.Popen[str]) -> None:
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out[-3000:]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_bwrap()
    if not Path(CHROMIUM).exists():
        unavailable("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright", reason="pip install playwright (the Python package only)")
    path = tmp_path_factory.mktemp("live")
    (path / "runs").mkdir()
    return path


@pytest.fixture(scope="module")
def dashboard(root: Path) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "dashboard", str(root / "runs"), "--port", "0"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line
        yield line.split(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def jobs(root: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The three runs, started together: the watched one spends its minute asleep in its tool, and the
    train run and the alpha-only rollout need CPU, not that minute (one after the other, they took it)."""
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TRAIN))
    started = {
        # the tool sleeps: each session holds the one RUNNING slot ~15 s, so the pages see it run
        "watched": rollout(root, "watched", "sleep 15; echo 6*7=$((6*7))", TASKS, 2, "--max-running", "1"),
        "train": subprocess.Popen([sys.executable, "-m", "polar_env.cli", "train", str(recipe), "--out-dir",
                                   str(root / "runs" / "train")], env=env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True),  # a few lines a step: the pipe never fills
        "alpha-only": rollout(root, "alpha-only", "echo 6*7=$((6*7))", TASKS[:1], 2, "--tracker", "tensorboard"),
    }
    try:
        yield started
    finally:
        for job in started.values():
            if job.poll() is None:
                job.send_signal(signal.SIGINT)
            job.communicate(timeout=600)


@pytest.fixture(scope="module")
def watched(jobs: dict[str, subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """The watched rollout, started (not finished): the first test sees it run."""
    return jobs["watched"]


@pytest.fixture(scope="module")
def finished_runs(root: Path, jobs: dict[str, subprocess.Popen[str]]) -> Path:
    """All runs written."""
    for job in jobs.values():
        finish(job)
    return root / "runs"


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


def goto(page: Any, url: str, route: str) -> None:
    page.goto(url + route)
    wait_ready(page, route)
    assert page.locator("#error").count() == 0, page.locator("#error").inner_text()


def statuses(page: Any) -> list[str]:
    return list(page.locator('#sessions td[data-col="status"]').all_inner_texts())


def test_live_sessions_show_their_stage_from_the_first_second(root: Path, dashboard: str, watched: subprocess.Popen[str],
                                                              context: Any) -> None:
    run = root / "runs" / "watched"
    until_sync(lambda: (run / "plan.json").exists() or watched.poll() is not None, "plan.json", timeout_s=120)
    page = context.new_page()
    goto(page, dashboard, "#/run/watched/sessions")
    # every planned session is listed at once (they were missing until each reached INIT)
    assert page.locator("#sessions tbody tr").count() == 4
    seen: set[str] = set()

    def stages_seen() -> bool:
        seen.update(statuses(page))
        return {"ready", "running"} <= seen

    # the page re-reads its rows every 3 s: a session waiting for the one RUNNING slot is `ready`
    # while another runs (all were `running` before)
    until_sync(stages_seen, "a ready and a running session on the sessions page", timeout_s=300, poll_s=0.5)
    assert seen <= STAGES | {"completed"}, seen
    shot(page, "live-sessions")

    goto(page, dashboard, "#/run/watched")
    chip = page.locator('#in-flight a.chip[data-stage="running"]')
    chip.first.wait_for(timeout=120_000)
    sid = chip.first.get_attribute("data-session")
    # the timeline runs to now: its end moves on while the stages stay as they are
    def ends() -> tuple[float, float]:
        box = page.locator("#timeline")
        return float(box.get_attribute("data-t-end") or 0), float(box.get_attribute("data-t-last") or 0)

    until_sync(lambda: ends()[0] > ends()[1] + 1.0, "the timeline's end past the last stage change", timeout_s=60)
    shot(page, "live")

    chip.first.click()  # a session still on its node: no "node died" banner, a note on where it is
    wait_ready(page, f"#/run/watched/session/{sid}")
    assert page.locator("#failure-detail").count() == 0
    assert page.locator("#in-flight-note").inner_text().startswith("in ")
    assert page.locator("h1 .badge").first.inner_text() in STAGES | {"completed"}
    assert page.locator("#t-mask").inner_text() in ("not yet known", "kept")

    goto(page, dashboard, "#/run/watched/health")  # the live topology: one node, its RUNNING slot held
    node = page.locator('#nodes tr[data-node="node-0"]')
    assert node.locator('td[data-col="state"]').inner_text() == "alive"
    assert node.locator('td[data-col="running"]').inner_text() in ("0 / 1", "1 / 1")
    assert "live.json" in page.locator("#health-source").inner_text()
    assert "embedded" in page.locator("#engine").inner_text()
    shot(page, "health")


def test_health_and_curves_of_finished_runs(finished_runs: Path, dashboard: str, context: Any) -> None:
    report = json.loads((finished_runs / "watched" / "report.json").read_text())
    page = context.new_page()
    goto(page, dashboard, "#/run/watched/health")
    assert "report.json" in page.locator("#health-source").inner_text()
    node = page.locator('#nodes tr[data-node="node-0"]')
    assert node.locator('td[data-col="completed"]').inner_text() == "4"
    assert node.locator('td[data-col="node_lost"]').inner_text() == "0" and page.locator("#node-deaths").count() == 0
    assert page.locator("#h-limits").inner_text().startswith("4 / 1 / 2")  # init / running / postrun
    assert report["nodes"][0]["engine_calls"] == 8

    goto(page, dashboard, "#/run/watched/curves")
    assert page.locator("#curve-reward").get_attribute("data-points") == "4,4"  # mean reward, pass rate
    assert page.locator("#curve-latency").get_attribute("data-points") == "4"
    assert page.locator("#trackers").count() == 0
    shot(page, "curves")
    goto(page, dashboard, "#/run/alpha-only/curves")
    assert "tensorboard --logdir" in page.locator('#trackers p[data-tracker="tensorboard"]').inner_text()

    steps = [json.loads(line) for line in (finished_runs / "train" / "steps.jsonl").read_text().splitlines()]
    goto(page, dashboard, "#/run/train/curves")
    assert page.locator("#steps tbody tr").count() == 3 == len(steps)
    assert page.locator('#steps td[data-col="reward"]').all_inner_texts() == [f"{s['reward_mean']:.3f}" for s in steps]
    assert page.locator("#curve-step-reward").get_attribute("data-points") == "3"
    shot(page, "curves-train")


def test_compare_warns_when_the_task_sets_differ(finished_runs: Path, dashboard: str, context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/compare/watched/alpha-only")
    warning = page.locator("#task-set-warning")
    assert "different task sets (1 shared; 1 only in watched, 0 only in alpha-only)" in warning.inner_text()
    shared = page.locator('table[data-section="overall"] tr[data-name="shared tasks"]')
    assert shared.locator('td[data-cell="pass@1:a"]').inner_text() == "1.000" == shared.locator('td[data-cell="pass@1:b"]').inner_text()
    alpha, beta = page.locator('#compare-tasks tr[data-task="alpha__mult"]'), page.locator('#compare-tasks tr[data-task="beta__mult"]')
    assert alpha.locator('td[data-cell="reward:a"]').inner_text() == "1.000" == alpha.locator('td[data-cell="reward:b"]').inner_text()
    assert alpha.locator('td[data-delta="mean_reward"]').inner_text() == "+0.000"
    assert beta.locator('td[data-cell="reward:b"]').inner_text() == "—" and "not run" in beta.inner_text()
    assert page.locator('#compare-kinds tr[data-kind="-"] td[data-cell="a"]').inner_text() == "4"
    assert page.locator('#compare-kinds tr[data-kind="-"] td[data-cell="b"]').inner_text() == "2"
    shot(page, "compare")
    alpha.locator('a[data-drill="alpha-only"]').click()  # drill down to those sessions
    wait_ready(page, "#/run/alpha-only/sessions?task=alpha__mult")
    assert page.locator("#sessions tbody tr").count() == 2

    goto(page, dashboard, "#/compare/watched/watched")  # the same task set: no warning
    assert page.locator("#task-set-warning").count() == 0


def test_a_rollout_server_is_listed_once_with_its_timeline(root: Path, context: Any) -> None:
    from tests.staging.test_serve_cli import free_port

    port, store = free_port(), root / "serve"
    server = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "serve", "--local", "--port", str(port), "--store", str(store),
                               "--engine", "simulated", "--harness", "loop"], env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    dash: subprocess.Popen[str] | None = None
    try:
        assert server.stdout is not None
        assert "polar-env serve ready" in server.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        token = (store / "rollout_token").read_text().strip()
        dash = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "dashboard", str(store), "--port", "0", "--server", url,
                                 f"--server-token={token}"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert dash.stdout is not None and dash.stderr is not None
        line = dash.stdout.readline()
        if not line:  # it exited: say how (stderr is complete once it has)
            dash.wait(timeout=30)
        assert line.startswith("dashboard: http://127.0.0.1:"), (
            f"{line!r}, exit {dash.poll()}: " + (dash.stderr.read() if dash.poll() is not None else ""))
        address = line.split(" ", 1)[1].strip()
        page = context.new_page()
        goto(page, address, "#/run/server")  # the live page polls the server from here on
        tasks = root / "serve.tasks.jsonl"
        row = {"task_id": "echo", "instruction": "run echo hi", "evaluator": {"name": "output", "regex": "printed"}}
        tasks.write_text(json.dumps(row) + "\n")
        sub = subprocess.run([sys.executable, "-m", "polar_env.cli", "submit", str(tasks), "--samples", "3", "--harness", "loop", "--wait",
                              "--server", url, "--token", token], env=env(), capture_output=True, text=True, timeout=300, check=False)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        until_sync(lambda: page.locator("#live-done").inner_text() == "3", "the server's 3 sessions done on the live page", timeout_s=60)
        assert page.locator("#timeline path").count() == 5  # a timeline, drawn from the dashboard's own polls
        assert float(page.locator("#timeline").get_attribute("data-t-end") or 0) > 0
        goto(page, address, "#/")
        assert page.locator("#runs tbody tr").count() == 1 and page.locator('#runs tr[data-run="server"]').count() == 1
        goto(page, address, "#/run/server/health")
        assert page.locator('#nodes tr[data-node="node-0"]').count() == 1
        assert f"127.0.0.1:{port}" in page.locator("#server").inner_text()
        assert "1 task(s)" in page.locator("#server").inner_text()
    finally:
        if dash is not None:
            dash.terminate()
            dash.communicate(timeout=30)
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=60)
