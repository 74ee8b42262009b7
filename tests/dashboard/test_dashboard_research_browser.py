"""The researcher's views in a real browser (Debian's chromium through Playwright, as
``test_dashboard_browser.py``), over run folders written by real ``polar-env rollout --runtime
sandbox --harness loop`` runs on the swebench-graded toy tasks:

* ``mixed``: the README's scripted fix on ``toy__calc-1`` (reward 1, resolved) and
  ``toy__textkit-1`` (the same script changes nothing there: reward 0, empty patch), 2 samples each;
* ``control``: a script that only appends to a test file on ``toy__calc-1`` (reward 0, the test
  file a dropped path).

Every page is checked with the browser console free of errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.dashboard.test_dashboard_browser import CHROMIUM, env, require_browser, shot, wait_ready
from tests.staging.test_readme_script import readme_script

pytestmark = pytest.mark.slow
CONTROL = {"steps": [{"command": "cd /testbed && echo '# looked' >> tests/test_calc.py && git status --short",
                      "reasoning": "Touch only the tests."},
                     {"text": "Nothing changed:\n{tool_output}", "reasoning": "Done."}]}


def rollout(root: Path, name: str, script: dict[str, Any], tasks: list[str]) -> subprocess.Popen[str]:
    (root / f"{name}.json").write_text(json.dumps(script))
    argv = [sys.executable, "-m", "polar_env.cli", "rollout", *[a for t in tasks for a in ("--task-id", t)],
            "--samples", "2", "--harness", "loop", "--runtime", "sandbox", "--engine-script", str(root / f"{name}.json"),
            "--out", str(root / "runs"), "--run-id", name, "--no-progress"]
    return subprocess.Popen(argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_browser()
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        unavailable("the swebench extra is not installed (pip install -e '.[swebench]')")
    root = tmp_path_factory.mktemp("research")
    jobs = [rollout(root, "mixed", readme_script()["script"], ["toy__calc-1", "toy__textkit-1"]),  # type: ignore[arg-type]
            rollout(root, "control", CONTROL, ["toy__calc-1"])]
    for job in jobs:
        out, _ = job.communicate(timeout=900)
        assert job.returncode == 0, out[-3000:]
    return root / "runs"


@pytest.fixture(scope="module")
def dashboard(runs: Path) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "dashboard", str(runs), "--port", "0"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line
        yield line.split(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.fixture
def context() -> Iterator[Any]:
    """A fresh browser context whose pages record console errors; the test fails on any."""
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


def sessions_of(runs: Path, name: str) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in (runs / name / "sessions.jsonl").read_text().splitlines()]
    return {r["session_id"]: r for r in rows}


def test_tasks_then_a_group_then_its_samples(runs: Path, dashboard: str, context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/run/mixed/tasks")
    calc, textkit = page.locator('#tasks tr[data-task="toy__calc-1"]'), page.locator('#tasks tr[data-task="toy__textkit-1"]')
    assert calc.locator('td[data-col="mean_reward"]').inner_text() == "1.000"
    assert textkit.locator('td[data-col="mean_reward"]').inner_text() == "0.000"
    assert calc.locator('td[data-col="completed"]').inner_text() == "2" and calc.locator('td[data-col="errored"]').inner_text() == "0"
    assert "loop" in calc.inner_text() and "polar-tiny-qwen3" in calc.inner_text()
    shot(page, "tasks")
    # a real link: ctrl-click opens the task's sessions in a new tab, the first tab stays put
    with context.expect_page() as opened:
        calc.locator("td a").first.click(modifiers=["Control"])
    tab = opened.value
    wait_ready(tab, "#/run/mixed/sessions?task=toy__calc-1")
    assert tab.locator("#sessions tbody tr").count() == 2 and page.url.endswith("#/run/mixed/tasks")
    tab.close()

    calc.locator("a.group-link").click()
    wait_ready(page, "#/run/mixed/group/toy__calc-1-mixed")
    rows = sessions_of(runs, "mixed")
    cards = page.locator("#samples .sample")
    assert cards.count() == 2
    rewards = [rows[sid]["reward"] for sid in cards.evaluate_all("els => els.map(e => e.dataset.session)")]
    mean = sum(rewards) / len(rewards)
    shown = [float(t) for t in page.locator('#samples td[data-col="advantage"]').all_inner_texts()]
    assert shown == [round(r - mean, 3) for r in rewards]  # reward minus the group mean
    assert "reward minus the mean reward" in page.locator("#advantage-rule").inner_text()
    assert page.locator('#samples td[data-col="mask"]').all_inner_texts() == ["false", "false"]
    assert page.locator('#samples td[data-col="reason"]').all_inner_texts() == ["resolved", "resolved"]
    shot(page, "group")
    page.locator("#group-next").click()  # step to the next group: textkit's
    wait_ready(page, "#/run/mixed/group/toy__textkit-1-mixed")
    assert page.locator('#samples td[data-col="reason"]').all_inner_texts() == ["empty patch", "empty patch"]
    page.locator("#group-prev").click()
    wait_ready(page, "#/run/mixed/group/toy__calc-1-mixed")

    first = cards.first.get_attribute("data-session")
    cards.first.locator("h2 a").click()
    wait_ready(page, f"#/run/mixed/session/{first}")
    page.locator("#sib-next").click()  # step to its sibling sample
    second = next(s for s in rows if s != first and rows[s]["group_id"] == rows[first]["group_id"])
    wait_ready(page, f"#/run/mixed/session/{second}")
    assert page.locator("#group-link").inner_text() == f"group {rows[first]['group_id']}"


def test_why_histogram_filters_and_the_url_keeps_the_view(runs: Path, dashboard: str, context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/run/mixed/sessions")
    rows = page.locator("#sessions tbody tr")
    assert rows.count() == 4
    bars = dict(zip(page.locator("#hist-reason .bar").evaluate_all("els => els.map(e => e.dataset.value)"),
                    page.locator("#hist-reason .bar .n").all_inner_texts(), strict=True))
    assert bars == {"resolved": "2", "empty patch": "2"}
    assert page.locator("#hist-failure .bar").evaluate_all("els => els.map(e => e.dataset.value)") == ["-"]
    page.locator('#hist-reason .bar[data-value="empty patch"]').click()
    page.wait_for_selector('#hist-reason .bar.on[data-value="empty patch"]')
    assert rows.count() == 2 and "reason=empty+patch" in page.url
    assert set(page.locator('#sessions td[data-col="reason"]').all_inner_texts()) == {"empty patch"}
    shot(page, "why")
    page.locator('#sessions th[data-sort="session_id"]').click()  # descending: a second history entry
    page.wait_for_selector("#sessions th.sorted.desc")
    assert "desc=1" in page.url and "reason=empty+patch" in page.url
    ids = page.locator('#sessions td[data-col="session_id"]').all_inner_texts()
    assert ids == sorted(ids, reverse=True)

    page.reload()  # the URL alone reproduces the view
    wait_ready(page, page.url[page.url.index("#"):])
    assert page.locator('#sessions td[data-col="session_id"]').all_inner_texts() == ids
    page.go_back()  # Back: the filter without the sort
    page.wait_for_selector("#sessions th.sorted:not(.desc)")
    assert "desc" not in page.url and rows.count() == 2
    page.go_back()  # Back again: the unfiltered table
    page.wait_for_selector("#sessions tbody tr >> nth=3")
    assert page.locator("#hist-reason .bar.on").count() == 0 and rows.count() == 4


def test_evaluator_tests_diff_and_what_the_trainer_gets(runs: Path, dashboard: str, context: Any) -> None:
    rows = sessions_of(runs, "mixed")
    sid = next(s for s, r in rows.items() if r["task_id"] == "toy__calc-1")
    evaluation = rows[sid]["evaluation"]
    trajectory = json.loads(next(line for line in (runs / "mixed" / "trajectories.jsonl").read_text().splitlines()
                                 if json.loads(line)["session_id"] == sid))
    page = context.new_page()
    goto(page, dashboard, f"#/run/mixed/session/{sid}")
    status = evaluation["swebench"]["tests_status"]
    expected = sorted((g, t) for g in ("FAIL_TO_PASS", "PASS_TO_PASS") for t in status[g]["success"])
    shown = page.locator("#tests tbody tr").evaluate_all("els => els.map(e => [e.dataset.group, e.children[2].textContent])")
    assert sorted(map(tuple, shown)) == expected and len(expected) >= 2
    assert set(page.locator("#tests tbody td:nth-child(2)").all_inner_texts()) == {"passed"}
    assert page.locator("#tamper-verdict").inner_text().startswith("no tampering found")
    shot(page, "verdict")
    # the graded patch, line by line, added lines green and removed ones red
    diff = page.locator("#diff .dl")
    assert "\n".join(diff.all_inner_texts()) == evaluation["graded_patch"].rstrip("\n")
    added = page.locator("#diff .dl.add")
    patch_lines = evaluation["graded_patch"].splitlines()
    assert added.count() == sum(1 for line in patch_lines if line.startswith("+") and not line.startswith("+++"))
    assert "if b == 0:" in added.first.inner_text()
    bg = added.first.evaluate("e => getComputedStyle(e).backgroundColor")
    r, g, b = (int(v) for v in bg[bg.index("(") + 1: bg.index(")")].split(",")[:3])
    assert g > r and g > b, bg
    shot(page, "evaluation", "#diff-box")
    # what the trainer gets: the mask, each trace's trainable flag and role, the trained tokens
    trained = sum(sum(t["loss_mask"]) for t in trajectory["traces"] if t["trainable"])
    assert page.locator("#t-mask").inner_text() == ("dropped" if rows[sid]["mask"] else "kept")
    assert page.locator("#t-trained").inner_text() == str(trained) and trained > 0
    flags = page.locator('#trainer-traces td[data-col="trainable"]').all_inner_texts()
    assert flags == [str(t["trainable"]).lower() for t in trajectory["traces"]]
    assert page.locator('#trainer-traces td[data-col="role"]').all_inner_texts() == [t["role"] for t in trajectory["traces"]]

    control = sessions_of(runs, "control")
    csid = sorted(control)[0]
    goto(page, dashboard, f"#/run/control/session/{csid}")
    assert control[csid]["reward"] == 0.0 and page.locator("#s-reward").inner_text() == "0.00"
    dropped = [d["path"] for d in control[csid]["evaluation"]["dropped_paths"]]
    assert dropped == ["tests/test_calc.py"]  # a test location: changed by the agent, never graded
    assert page.locator("#dropped tr").evaluate_all("els => els.map(e => e.dataset.path)") == dropped
    assert "test location" in page.locator("#dropped").inner_text()
    assert control[csid]["evaluation"]["graded_patch"] == "" and page.locator("#diff .dl").count() == 0
    assert "graded patch is empty" in page.locator("#diff-box").inner_text()


def test_a_late_session_answer_does_not_replace_the_page_back_returned_to(runs: Path, dashboard: str, context: Any) -> None:
    sid = sorted(sessions_of(runs, "mixed"))[0]
    page = context.new_page()
    goto(page, dashboard, "#/run/mixed/sessions")
    held: list[Any] = []
    page.route(f"**/api/runs/mixed/sessions/{sid}", lambda route: held.append(route))  # answered when we say
    page.locator(f'#sessions tr[data-session="{sid}"] td[data-col="tokens"]').click()
    page.wait_for_timeout(300)
    assert held and page.locator("#sessions").count() == 1  # the session page is still loading
    page.go_back()
    wait_ready(page, "#/run/mixed/sessions")
    page.wait_for_selector("#sessions tbody tr >> nth=3")
    later: list[str] = []
    page.on("request", lambda request: later.append(request.url))
    with page.expect_response(f"**/api/runs/mixed/sessions/{sid}"):
        held[0].continue_()  # the late answer arrives
    # a page that used it would at once ask for the session's trace and transcript, then draw it
    page.wait_for_timeout(3000)
    assert not [u for u in later if "/trace/" in u or "/transcript" in u], later
    assert page.locator("#sessions tbody tr").count() == 4 and page.locator("#s-reward").count() == 0
    assert page.url.endswith("#/run/mixed/sessions")


def test_runs_list_rows_are_links(runs: Path, dashboard: str, context: Any) -> None:
    page = context.new_page()
    goto(page, dashboard, "#/")
    assert page.locator('#runs tr[data-run="mixed"] a').first.get_attribute("href") == "#/run/mixed"
    page.locator('#runs tr[data-run="mixed"] td.num').first.click()  # anywhere on the row
    wait_ready(page, "#/run/mixed")
