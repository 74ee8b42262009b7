"""The offline toy SWE task set: deterministic repos, real bugs, swebench-layout eval scripts.

These run each eval script directly (bash in a scratch copy), so they need neither swebench nor a
runtime; grading through the evaluator is tests/evaluators/test_swebench_evaluator.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from polar_env.errors import ConfigError
from polar_env.tasks.swe import SweTask
from polar_env.tasks.toy import TOY_SOURCES, toy_tasks

pytestmark = pytest.mark.slow  # runs the toy tasks' test suites

# Pinned: the toy repos are committed with fixed identities and dates, so these never change
# unless a toy source does (then update them on purpose).
BASE_COMMITS = {
    "toy__calc-1": "fa66e8c490944a0803897ef9f6f71c1c9bf57335",
    "toy__textkit-1": "a6925b7577d16970acb9eeae23380e9ec82f8669",
    "toy__bsearch-1": "856a9b912229c70bdf900267130dd39077dee50e",
}
PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)", re.MULTILINE)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SweTask]:
    return {t.instance_id: t for t in toy_tasks(tmp_path_factory.mktemp("toy"))}


def run_eval(task: SweTask, workdir: Path, patch: str = "", timeout_s: float = 60) -> dict[str, str] | None:
    """Copy the repo, apply ``patch``, run the eval script; test id → status, or None on timeout."""
    assert task.repo_dir is not None and task.eval_script is not None
    shutil.copytree(task.repo_dir, workdir)
    if patch:
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=workdir, check=True)
    proc = subprocess.Popen(
        ["bash", "-c", task.eval_script],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    body = out.split(">>>>> Start Test Output", 1)[1].split(">>>>> End Test Output", 1)[0]
    return {name: status for status, name in PYTEST_LINE.findall(body)}


def test_three_tasks_with_the_swebench_fields(tasks: dict[str, SweTask]) -> None:
    assert sorted(tasks) == sorted(TOY_SOURCES) and len(tasks) == 3
    for task in tasks.values():
        assert (task.log_parser, task.eval_type, task.image) == ("parse_log_pytest", "pass_and_fail", None)
        assert task.patch.startswith("diff --git") and task.test_patch.startswith("diff --git")
        assert task.problem_statement and task.FAIL_TO_PASS and task.PASS_TO_PASS
        assert task.extra["variants"]["breaks_pass_to_pass"].startswith("diff --git")
        assert task.runtime_spec().source_dir == task.repo_dir


def test_base_commits_are_deterministic(tasks: dict[str, SweTask], tmp_path: Path) -> None:
    assert {i: t.base_commit for i, t in tasks.items()} == BASE_COMMITS
    rebuilt = {t.instance_id: t for t in toy_tasks(tmp_path / "elsewhere")}
    for task_id, task in tasks.items():
        assert rebuilt[task_id].model_dump(exclude={"repo_dir"}) == task.model_dump(exclude={"repo_dir"})


def test_builds_are_cached(tasks: dict[str, SweTask], tmp_path: Path) -> None:
    [first] = toy_tasks(tmp_path, ids=["toy__calc-1"])
    assert first.repo_dir is not None
    stamp = (first.repo_dir / ".git" / "HEAD").stat().st_mtime_ns
    [again] = toy_tasks(tmp_path, ids=["toy__calc-1"])
    assert again.repo_dir == first.repo_dir and (again.repo_dir / ".git" / "HEAD").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.repo_dir.parent.name]  # no scratch left behind
    with pytest.raises(ConfigError, match=r"unknown task id 'toy__nope-1', in the toy task set; pass one of: toy__bsearch-1"):
        toy_tasks(tmp_path, ids=["toy__nope-1"])


def test_repo_is_clean_at_base_commit(tasks: dict[str, SweTask]) -> None:
    for task in tasks.values():
        git = ["git", "-C", str(task.repo_dir)]
        assert (
            subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
            == task.base_commit
        )
        assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, check=True).stdout == ""


def test_eval_scripts_follow_the_swebench_layout(tasks: dict[str, SweTask]) -> None:
    for task in tasks.values():
        lines = task.eval_script.splitlines()  # type: ignore[union-attr]
        assert lines[:2] == ["#!/bin/bash", "set -uxo pipefail"]
        assert "git apply -v - <<'EOF_POLAR_TEST_PATCH'" in lines
        start = lines.index(": '>>>>> Start Test Output'")
        assert lines[start + 1].startswith("python3 -m pytest -rA -p no:cacheprovider tests/")
        assert lines[start + 2] == ": '>>>>> End Test Output'"


@pytest.mark.parametrize("toy_id", ["toy__calc-1", "toy__textkit-1"])
def test_the_bug_is_real_and_the_gold_patch_fixes_it(tasks: dict[str, SweTask], tmp_path: Path, toy_id: str) -> None:
    task = tasks[toy_id]
    at_base = run_eval(task, tmp_path / "base")
    assert at_base is not None
    assert {t: at_base.get(t) for t in task.FAIL_TO_PASS} == {t: "FAILED" for t in task.FAIL_TO_PASS}
    assert {t: at_base.get(t) for t in task.PASS_TO_PASS} == {t: "PASSED" for t in task.PASS_TO_PASS}
    fixed = run_eval(task, tmp_path / "gold", task.patch)
    assert fixed == {t: "PASSED" for t in (*task.PASS_TO_PASS, *task.FAIL_TO_PASS)}


def test_bsearch_hangs_until_fixed(tasks: dict[str, SweTask], tmp_path: Path) -> None:
    task = tasks["toy__bsearch-1"]
    assert run_eval(task, tmp_path / "base", timeout_s=3) is None
    fixed = run_eval(task, tmp_path / "gold", task.patch)
    assert fixed == {t: "PASSED" for t in (*task.PASS_TO_PASS, *task.FAIL_TO_PASS)}
