"""The dashboard in a real browser: Debian's headless chromium through Playwright (started by the
test with ``executable_path``; no browser download), over run folders written by real
``polar-env rollout`` runs (the embedded engine with a scripted policy, so there is a tool call
and a reward of 1, and the ``loop`` harness in bwrap sandboxes).

Run A rolls out first (2 tasks x 2 samples; alpha's regex matches the tool's output, beta's never
does). Run B runs while the live page watches it (one RUNNING slot, so sessions finish one by
one), with a script whose tool prints the wrong product, so alpha fails too; then A and B are
compared. ``POLAR_DASHBOARD_SHOTS=DIR`` also saves the README's screenshots there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_bwrap, unavailable

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
TASKS = [{"task_id": "alpha__mult", "instruction": "What is 6*7? Use bash.", "repo": "alpha",
          "evaluator": {"name": "output", "regex": "6\\*7=42"}},
         {"task_id": "beta__mult", "instruction": "What is 6*7? Use bash.", "repo": "beta",
          "evaluator": {"name": "output", "regex": "never"}}]


def script(command: str) -> dict[str, Any]:
    return {"steps": [{"command": command, "reasoning": "compute"},
                      {"text": "The answer is {tool_output}", "reasoning": "done"}]}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def rollout_argv(root: Path, name: str, command: str, *extra: str) -> list[str]:
    (root / f"{name}.script.json").write_text(json.dumps(script(command)))
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    return [sys.executable, "-m", "polar_env.cli", "rollout", "--tasks", str(tasks), "--samples", "2",
            "--engine", "embedded", "--engine-script", str(root / f"{name}.script.json"), "--harness", "loop",
            "--out", str(root / "runs"), "--run-id", name, "--no-progress", *extra]


def require_browser() -> None:
    """What the browser tests need: bwrap for their rollouts, Debian's chromium, Playwright."""
    require_bwrap()
    if not Path(CHROMIUM).exists():
        unavailable("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright", reason="pip install playwright (the Python package only)")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_browser()
    path = tmp_path_factory.mktemp("dash")
    (path / "runs").mkdir()
    return path


@pytest.fixture(scope="module")
def run_a(root: Path) -> Path:
    proc = subprocess.run(rollout_argv(root, "base", "echo 6*7=$((6*7))"), env=env(), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "runs" / "base"


@contextlib.contextmanager
def served_dashboard(*args: str) -> Iterator[str]:
    """A ``polar-env dashboard ARGS --port 0`` subprocess; yields its URL, stops it on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "dashboard", *args, "--port", "0"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line + (proc.stderr.read() if proc.poll() is not None else "")
        yield line.split(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # also closes the pipes


@pytest.fixture(scope="module")
def dashboard(root: Path) -> Iterator[str]:
    with served_dashboard(str(root / "runs")) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        yield chromium
        chromium.close()


def wait_ready(page: Any, route: str) -> None:
    """The page's router marks ``body[data-ready]`` once a route has rendered. (Selectors, not
    ``wait_for_function``: the dashboard's CSP forbids the eval that needs.)"""
    page.wait_for_selector(f'body[data-ready="{route}"]', state="attached", timeout=60_000)


def open_page(browser: Any, url: str, route: str) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url + route)
    wait_ready(page, route)
    assert page.locator("#error").count() == 0, page.locator("#error").inner_text()
    return page


def shot(page: Any, name: str, locator: str | None = None) -> None:
    folder = os.environ.get("POLAR_DASHBOARD_SHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        target = page.locator(locator) if locator else page
        target.screenshot(path=str(Path(folder) / f"{name}.png"))


def trajectories(run: Path) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    return {t["session_id"]: t for t in rows}


def test_sessions_table_and_session_page(run_a: Path, dashboard: str, browser: Any) -> None:
    from playwright.sync_api import expect

    page = open_page(browser, dashboard, "#/")
    assert page.locator('#runs tr[data-run="base"]').count() == 1
    page.locator('#runs tr[data-run="base"]').click()
    wait_ready(page, "#/run/base")
    page.locator(".tabs a", has_text="Sessions").click()
    page.wait_for_selector('body[data-ready^="#/run/base/sessions"]', state="attached")
    rows = page.locator("#sessions tbody tr")
    assert rows.count() == 4
    # sort by reward, highest first: the two alpha sessions (reward 1) lead
    page.locator('#sessions th[data-sort="reward"]').click()
    page.locator('#sessions th[data-sort="reward"]').click()
    page.wait_for_selector("#sessions th.sorted.desc")
    rewards = page.locator('#sessions td[data-col="reward"]').all_inner_texts()
    assert rewards == ["1.00", "1.00", "0.00", "0.00"]
    page.locator("#filter").fill("beta")
    expect(rows).to_have_count(2)
    assert page.locator("#page-info").inner_text() == "1–2 of 2"
    page.locator("#filter").fill("")
    expect(rows).to_have_count(4)
    shot(page, "sessions")

    trajs = trajectories(run_a)
    sid = next(s for s, t in trajs.items() if t["reward"] == 1.0)
    page.locator(f'#sessions tr[data-session="{sid}"]').click()
    wait_ready(page, f"#/run/base/session/{sid}")
    assert page.locator("#s-reward").inner_text() == "1.00"
    assert page.locator("#s-calls").inner_text() == "2"
    # the transcript as the harness saw it: the tool call, its result, the final answer
    transcript = page.locator("#transcript").inner_text()
    assert "→ bash" in transcript and "echo 6*7=$((6*7))" in transcript and "6*7=42" in transcript
    assert "The answer is 6*7=42" in transcript
    assert "regex" in page.locator("#evaluation").inner_text()
    assert "running" in page.locator("#stages").inner_text()

    # every token on the page against the trajectory: id, mask, and the colour the mask gets
    trace = trajs[sid]["traces"][0]
    n_prompt = len(trace["prompt_ids"])
    tokens = page.evaluate("""() => [...document.querySelectorAll('#tokens .tok')].map((el) =>
        [Number(el.dataset.i), Number(el.dataset.id), el.dataset.mask, el.className, getComputedStyle(el).backgroundColor])""")
    assert len(tokens) == n_prompt + len(trace["response_ids"])  # a 392-token trace fits one page
    assert [t[0] for t in tokens] == list(range(len(tokens)))
    assert [t[1] for t in tokens] == trace["prompt_ids"] + trace["response_ids"]
    assert {t[2] for t in tokens[:n_prompt]} == {""} and all("prompt" in t[3] for t in tokens[:n_prompt])
    assert [int(t[2]) for t in tokens[n_prompt:]] == trace["loss_mask"]
    assert 0 in trace["loss_mask"] and 1 in trace["loss_mask"]  # the tool result sits between the calls

    def rgb(css: str) -> tuple[int, ...]:
        return tuple(int(float(v)) for v in css[css.index("(") + 1: css.index(")")].split(",")[:3])

    for (_, _, mask, cls, bg), logprob in zip(tokens[n_prompt:], trace["response_logprobs"], strict=True):
        r, g, b = rgb(bg)
        if mask == "1":
            assert "m1" in cls and g > r and g > b, (cls, bg)  # sampled: green
        else:
            assert "m0" in cls and b > r and b >= g and logprob == 0.0, (cls, bg)  # harness-inserted: blue
    calls = page.locator("#tokens .marker.call")
    assert calls.count() == 2 == len(trace["metadata"]["seqs"])
    first_sampled = n_prompt + trace["loss_mask"].index(1)
    assert page.locator(f'#tokens .tok[data-i="{first_sampled}"]').get_attribute("title").endswith(
        f"logprob {round(trace['response_logprobs'][0], 5)} (p {__import__('math').exp(round(trace['response_logprobs'][0], 5)):.3f})")
    shot(page, "session")
    shot(page, "trace", "#trace")

    page.locator("#journal-link").click()
    wait_ready(page, f"#/run/base/session/{sid}/journal")
    raw = [json.loads(t) for t in page.locator("pre.raw").all_inner_texts()]
    assert [r["seq"] for r in raw] == [0, 1] and raw[0]["session_id"] == sid
    assert raw[1]["response_ids"] == trace["response_ids"][-len(raw[1]["response_ids"]):]
    page.close()


def test_live_count_changes_while_a_job_runs(run_a: Path, root: Path, dashboard: str, browser: Any) -> None:
    from playwright.sync_api import expect

    job = subprocess.Popen(rollout_argv(root, "trained", "echo 6*7=$((6*7-1))", "--max-running", "1"), env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        live = root / "runs" / "trained" / "live.json"
        deadline = time.monotonic() + 300
        while not live.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert live.exists(), job.stdout.read() if job.stdout and job.poll() is not None else "no live.json"
        page = open_page(browser, dashboard, "#/run/trained")
        first = page.locator("#live-done").inner_text()
        assert int(first) < 4, "the job finished before the page opened"
        expect(page.locator("#live-done")).not_to_have_text(first, timeout=300_000)  # pushed by SSE, no reload
        assert int(page.locator("#live-done").inner_text()) > int(first)
        assert page.locator("#live-state").inner_text() in ("running", "done")
        assert page.locator("#timeline path").count() == 5  # the stage timeline, one band per stage
        shot(page, "live")
        expect(page.locator("#live-state")).to_have_text("done", timeout=300_000)
        assert page.locator("#live-done").inner_text() == "4"
        page.close()
    finally:
        out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out[-3000:]


def test_compare_two_runs(run_a: Path, root: Path, dashboard: str, browser: Any) -> None:
    trained = root / "runs" / "trained"
    if not (trained / "report.json").exists():  # run on its own, without the live test
        proc = subprocess.run(rollout_argv(root, "trained", "echo 6*7=$((6*7-1))"), env=env(), capture_output=True,
                              text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:]
    page = open_page(browser, dashboard, "#/")
    assert page.locator("#runs tbody tr").count() == 2
    shot(page, "runs")
    page.locator('input[data-pick="base"]').check()
    page.locator('input[data-pick="trained"]').check()
    page.locator("#compare").click()
    wait_ready(page, "#/compare/base/trained")

    def cell(section: str, name: str, key: str) -> str:
        return page.locator(f'table[data-section="{section}"] tr[data-name="{name}"] td[data-cell="{key}"]').inner_text()

    assert (cell("overall", "all", "pass@1:a"), cell("overall", "all", "pass@1:b")) == ("0.500", "0.000")
    assert (cell("per_repo", "alpha", "pass@2:a"), cell("per_repo", "alpha", "pass@2:b")) == ("1.000", "0.000")
    assert cell("per_repo", "beta", "pass@1:a") == "0.000"
    assert cell("per_harness", "loop", "pass@1:a") == "0.500"
    shot(page, "compare")
    page.close()
