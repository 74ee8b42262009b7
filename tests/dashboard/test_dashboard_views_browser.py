"""Issue 44's dashboard views in a real browser (Debian's chromium through Playwright, as
``test_dashboard_live_browser.py``) at a 1,440 px window, over run folders written by real
``polar-env`` subprocesses and stores written by the real journal writer:

* ``train``: a ``polar-env train`` of the tiny recipe through ``PolarEnv`` (``source: polar_env``,
  so every session's outcome names its reward and the weight version it was sampled under), three
  steps of three rollouts, with a held-out task;
* ``watched``: a rollout the pages watch while it runs (its tool sleeps, one RUNNING slot);
* ``big`` and ``big2``: 5,000-session capture stores (1,250 tasks; ``big2`` lacks half of repo4's
  tasks and fails less often), through ``JournalStore`` and the outcome writer.

Every page is checked with the console free of errors.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboard.test_dashboard_browser import CHROMIUM, TASKS, env, require_browser, served_dashboard, shot, wait_ready
from tests.dashboard.test_dashboard_live_browser import rollout
from tests.dashboard.test_dashboard_views_api import big_store
from tests.waits import until_sync

pytestmark = pytest.mark.slow
TRAIN = {"name": "tiny", "steps": 3, "rollouts_per_task": 3,
         "tasks": [{"task_id": "k", "instruction": "Say a word with a k."}],
         "held_out": [{"task_id": "h", "instruction": "Say a word with an h."}], "held_out_rollouts": 2,
         "evaluator": {"name": "output", "regex": "k", "ignore_case": True},
         "sampling": {"temperature": 0.1, "max_tokens": 3}, "trainer": {"lr": 0.01}}
WIDTH = 1440


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_browser()
    path = tmp_path_factory.mktemp("views")
    (path / "runs").mkdir()
    return path


@pytest.fixture(scope="module")
def jobs(root: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The train run and the watched rollout, started together (the rollout sleeps in its tool)."""
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TRAIN))
    started = {
        "watched": rollout(root, "watched", "sleep 25; echo 6*7=$((6*7))", TASKS, 2, "--max-running", "1"),
        "train": subprocess.Popen([sys.executable, "-m", "polar_env.cli", "train", str(recipe), "--out-dir",
                                   str(root / "runs" / "train")], env=env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True),
    }
    try:
        yield started
    finally:
        for job in started.values():
            if job.poll() is None:
                job.send_signal(signal.SIGINT)
            job.communicate(timeout=600)


@pytest.fixture(scope="module")
def stores(root: Path) -> Path:
    big_store(root / "runs" / "big", 5000)
    big_store(root / "runs" / "big2", 5000, fail_every=11, keep=lambda task: task % 10 != 4)
    return root / "runs"


@pytest.fixture(scope="module")
def dashboard(root: Path, stores: Path) -> Iterator[str]:
    with served_dashboard(str(root / "runs")) as url:
        yield url


@pytest.fixture
def context() -> Iterator[Any]:
    """A browser context at 1,440 px whose pages record console errors; the test fails on any."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        ctx = browser.new_context(viewport={"width": WIDTH, "height": 900})
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


def widths(page: Any) -> tuple[int, int]:
    """The document's scroll width and the window's: equal when nothing scrolls sideways."""
    got = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    return int(got[0]), int(got[1])


def timed(page: Any, route: str) -> tuple[float, int]:
    """Seconds from following a link to ``route`` until it is drawn, and the page's element count."""
    started = time.monotonic()
    page.evaluate(f"location.hash = {json.dumps(route)}")
    wait_ready(page, route)
    return time.monotonic() - started, int(page.evaluate("document.getElementsByTagName('*').length"))


def test_health_fits_a_1440_px_window_while_its_nodes_run(root: Path, dashboard: str,
                                                          jobs: dict[str, subprocess.Popen[str]], context: Any) -> None:
    watched = jobs["watched"]
    until_sync(lambda: (root / "runs" / "watched" / "plan.json").exists() or watched.poll() is not None, "plan.json",
               timeout_s=120)
    page = context.new_page()
    node = page.locator('#nodes tr[data-node="node-0"]')

    goto(page, dashboard, "#/run/watched/health")

    def alive() -> bool:  # reloaded each time: a page opened before the job's first word does not refresh itself
        assert watched.poll() is None, f"the watched rollout ended first: {watched.communicate()[0][-3000:]}"
        page.reload()
        wait_ready(page, "#/run/watched/health")
        return node.count() == 1 and str(node.locator('td[data-col="state"]').inner_text()) == "alive"

    # a live node, with its /metrics URL and token file
    until_sync(alive, "node-0 alive on the Health page", timeout_s=180, poll_s=1.0)
    assert "/metrics" in page.locator("#nodes tbody").inner_text()
    scroll, window = widths(page)
    assert scroll <= window == WIDTH, f"Health is {scroll} px wide in a {window} px window"
    shot(page, "health-1440")


def test_an_in_flight_session_says_what_it_has_reached(dashboard: str, jobs: dict[str, subprocess.Popen[str]],
                                                        context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/run/watched")
    chip = page.locator('#in-flight a.chip[data-stage="running"]')
    chip.first.wait_for(timeout=120_000)
    sid = chip.first.get_attribute("data-session")
    chip.first.click()  # a session in RUNNING: no evaluator report nor stage times yet, and the page says so
    wait_ready(page, f"#/run/watched/session/{sid}")
    assert "grading not yet run" in page.locator("#grading-pending").inner_text(timeout=5_000)
    reached = page.locator("#stages-reached .chip").all_inner_texts()
    assert reached[0] == "queued" and reached[-1].endswith("(now)"), reached
    assert page.locator("#evaluation").count() == 0 and page.locator("#stages").count() == 0  # no empty cards
    shot(page, "session-in-flight")


def test_a_train_run_has_its_own_view(root: Path, dashboard: str, jobs: dict[str, subprocess.Popen[str]], context: Any) -> None:
    out, _ = jobs["train"].communicate(timeout=600)
    assert jobs["train"].returncode == 0, out[-3000:]
    run = root / "runs" / "train"
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    outcomes = [json.loads(p.read_text()) for p in (run / "capture").glob("*/*.result.json")]
    per_version: dict[str, int] = {}
    for o in outcomes:
        version = ",".join(o["weight_versions"])
        per_version[version] = per_version.get(version, 0) + 1
    page = context.new_page()
    goto(page, dashboard, "#/run/train/curves")
    assert page.locator("#train-view").count() == 1
    assert page.locator("#curve-tps").count() == 0  # the sessions' flat-0 tokens/s curve is gone
    rates = [s["sampled_tokens"] / s["rollout_s"] for s in steps]
    chart = page.locator("#curve-step-tps")
    assert chart.get_attribute("data-points") == "3" and float(chart.get_attribute("data-max") or 0) == pytest.approx(max(rates), abs=0.01)
    shown = [float(t) for t in page.locator('#steps td[data-col="tps"]').all_inner_texts()]
    assert shown == pytest.approx(rates, abs=0.051)  # one decimal (JS rounds 9.15 up, Python's format down)
    assert page.locator("#curve-step-reward").get_attribute("data-points") == "3"
    held = page.locator('#held-out tr[data-task="h"]')
    assert held.locator('td[data-col="before"]').inner_text() == f"{summary['held_out']['before']:.3f}"
    assert held.locator('td[data-col="after"]').inner_text() == f"{summary['held_out']['after']:.3f}"
    # pass@k per policy version: one row per version, each over that version's sessions only
    versions = page.locator("#pass-versions tbody tr")
    assert [versions.nth(i).get_attribute("data-version") for i in range(versions.count())] == sorted(per_version, key=int)
    assert [int(t) for t in page.locator("#pass-versions tbody tr td:nth-child(3)").all_inner_texts()] == [
        per_version[v] for v in sorted(per_version, key=int)]
    assert max(per_version.values()) < len(outcomes)  # several policies: one pooled figure would mix them
    shot(page, "curves-train")
    goto(page, dashboard, "#/")
    row = page.locator('#runs tr[data-run="train"]')
    assert row.locator('td[data-col="state"]').inner_text().split() == ["done", "train"]  # was a bare "store"
    assert f"(policy v{max(per_version, key=int)})" in row.locator('td[data-col="pass"]').inner_text()


def test_tasks_of_a_5000_session_store_are_paged(dashboard: str, context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/")  # the Runs list: every run's index built once
    seconds, elements = timed(page, "#/run/big/tasks")
    assert seconds < 3.0 and elements < 3000, (seconds, elements)  # were 21,000 elements: every task a row
    assert page.locator("#tasks tbody tr").count() == 50
    assert page.locator("#tasks-info").inner_text() == "1–50 of 1250"
    page.locator("#tasks-next").click()
    until_sync(lambda: page.locator("#tasks-info").inner_text() == "51–100 of 1250", "the second page", timeout_s=30)
    assert page.locator("#tasks tbody tr").first.get_attribute("data-task") == "repo0__task0250"
    page.go_back()  # paging is in the URL
    wait_ready(page, "#/run/big/tasks")
    until_sync(lambda: page.locator("#tasks-info").inner_text() == "1–50 of 1250", "the first page again", timeout_s=30)
    page.locator("#tasks th[data-sort=errored]").click()
    until_sync(lambda: "sort=errored" in page.url, "the sort in the URL", timeout_s=30)
    shot(page, "tasks-5000")


def test_compare_colours_by_what_is_better_and_pages_its_tasks(dashboard: str, context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/")
    seconds, elements = timed(page, "#/compare/big/big2")
    failed = page.locator('#compare-kinds tr[data-kind="engine_error"] td[data-delta="v"]')
    assert failed.inner_text().startswith("-") and failed.get_attribute("data-verdict") == "good"  # fewer failures: green
    completed = page.locator('#compare-kinds tr[data-kind="-"] td[data-delta="v"]')
    assert completed.get_attribute("data-verdict") == ("good" if completed.inner_text().startswith("+") else "bad")
    assert page.locator('#compare-totals tr[data-total="sessions"] td[data-delta]').get_attribute("data-verdict") == "neutral"
    shared = page.locator('table[data-section="per_repo"] tr[data-name="repo4 · shared tasks"]')
    assert shared.count() == 1 and page.locator('table[data-section="per_repo"] tr[data-name="repo0 · shared tasks"]').count() == 0
    assert seconds < 3.0 and elements < 3000, (seconds, elements)  # were 21,000 elements: every task a row
    assert page.locator("#compare-tasks tbody tr").count() == 50
    assert page.locator("#compare-tasks-info").inner_text() == "1–50 of 1250 task(s)"
    page.locator("#compare-tasks-next").click()
    until_sync(lambda: page.locator("#compare-tasks-info").inner_text() == "51–100 of 1250 task(s)", "the second page",
               timeout_s=30)
    shot(page, "compare-5000")
