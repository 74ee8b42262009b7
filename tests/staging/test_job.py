"""``polar-env eval`` / the job module on plain task rows: pass@k per task and repo, cost, files.
Simulated engine (a test double) and the loop harness in real bwrap sandboxes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.cli import main
from polar_env.staging.job import pass_at_k
from tests.conftest import require_bwrap


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong than k: some draw always passes


@pytest.mark.slow
def test_eval_reports_pass_at_k_per_repo(tmp_path: Path) -> None:
    require_bwrap()
    rows = [
        {"task_id": "alpha__one", "instruction": "run echo hi", "repo": "alpha",
         "evaluator": {"name": "output", "regex": "printed"}},   # the simulated turn always matches
        {"task_id": "beta__two", "instruction": "run echo hi", "repo": "beta",
         "evaluator": {"name": "output", "regex": "never"}},     # and never matches this
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(["eval", "--tasks", str(tasks), "--samples", "3", "-k", "1", "-k", "3", "--engine", "simulated",
                 "--harness", "loop", "--out", str(out), "--no-progress"])
    assert code == 0
    report = json.loads((out / "latest" / "report.json").read_text())
    ev = report["eval"]
    assert ev["per_task"]["alpha__one"] == {"pass@1": 1.0, "pass@3": 1.0, "n": 3, "correct": 3}
    assert ev["per_task"]["beta__two"]["correct"] == 0
    assert ev["per_repo"] == {"alpha": {"tasks": 1, "pass@1": 1.0, "pass@3": 1.0},
                              "beta": {"tasks": 1, "pass@1": 0.0, "pass@3": 0.0}}
    assert ev["overall"] == {"pass@1": 0.5, "pass@3": 0.5}
    assert report["cost"]["sampled_tokens"] > 0 and report["cost"]["engine_seconds"] > 0
    assert report["statuses"] == {"completed": 6}
