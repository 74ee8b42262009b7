"""A SWE-Gym-shaped task graded under the default contract in a real bubblewrap sandbox: a moto-like
repo (``setup.py``, ``setup.cfg``, a ``moto/`` package with subpackages, tests under
``tests/test_core/``), an eval script in the SWE-Gym fork's layout (no Start/End markers, ``pytest
-rA`` on the test patch's file), and a gold fix that edits a module and adds a new one inside the
package. The gold fix scores 1, with or without planted runner files next to it; a no-op 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("swebench.harness.grading", reason="the swebench extra is not installed: pip install -e '.[swebench]'",
                    exc_type=ImportError)

from polar_env.evaluators import EvalContext, run_evaluator
from polar_env.runtimes import RuntimeSpec, make_runtime
from polar_env.runtimes.sandbox import DEFAULT_PATH
from polar_env.tasks.swe import SweTask
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow  # grades in real sandboxes

FILES = {
    "setup.py": "from setuptools import setup\nsetup()\n",
    "setup.cfg": "[metadata]\nname = moto\n\n[tool:pytest]\nmarkers =\n    network: needs a network\n",
    "moto/__init__.py": "__version__ = '5.0.0'\n",
    "moto/core/__init__.py": "",
    "moto/core/utils.py": "def camelcase_to_underscores(name):\n    return name.lower()\n",
    "tests/__init__.py": "",
    "tests/test_core/__init__.py": "",
    "tests/test_core/test_utils.py": (
        "from moto.core.utils import camelcase_to_underscores\n\n\n"
        "def test_lower():\n    assert camelcase_to_underscores('abc') == 'abc'\n"
    ),
}
FIXED_UTILS = (
    "from moto.core._case import split_words\n\n\n"
    "def camelcase_to_underscores(name):\n    return '_'.join(w.lower() for w in split_words(name))\n"
)
NEW_MODULE = "import re\n\n\ndef split_words(name):\n    return re.findall('[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])', name) or [name]\n"
NEW_TEST = (
    "\n\ndef test_camel():\n    assert camelcase_to_underscores('ListBuckets') == 'list_buckets'\n\n\n"
    "def test_acronym():\n    assert camelcase_to_underscores('GetHTTPCode') == 'get_http_code'\n"
)


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": DEFAULT_PATH}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True, env=env).stdout


def _diff(repo: Path, files: dict[str, str]) -> str:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo, "add", "-A")
    patch = _git(repo, "diff", "--cached")
    _git(repo, "reset", "-q", "--hard")
    _git(repo, "clean", "-fdq")
    return patch


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> SweTask:
    repo = tmp_path_factory.mktemp("moto")
    for path, text in FILES.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    test_file = "tests/test_core/test_utils.py"
    test_patch = _diff(repo, {test_file: FILES[test_file] + NEW_TEST})
    gold = _diff(repo, {"moto/core/utils.py": FIXED_UTILS, "moto/core/_case.py": NEW_MODULE})
    script = (  # the SWE-Gym fork's layout: no markers
        f"#!/bin/bash\nset -uxo pipefail\ncd /testbed\ngit checkout {base} {test_file}\n"
        f"git apply -v - <<'EOF_114329324912'\n{test_patch}EOF_114329324912\n"
        f"pytest -rA {test_file}\ngit checkout {base} {test_file}\n"
    )
    return SweTask.from_row({
        "instance_id": "getmoto__moto-9999", "repo": "getmoto/moto", "version": "5.0", "base_commit": base,
        "patch": gold, "test_patch": test_patch, "problem_statement": "camelcase_to_underscores ignores case",
        "FAIL_TO_PASS": [f"{test_file}::test_camel", f"{test_file}::test_acronym"],
        "PASS_TO_PASS": [f"{test_file}::test_lower"], "eval_script": script, "repo_dir": str(repo),
    })


async def _grade(task: SweTask, patch: str) -> dict:  # type: ignore[type-arg]
    require_bwrap()
    prefixes = sorted({sys.base_prefix, sys.prefix})
    spec = RuntimeSpec(source_dir=task.repo_dir, network="none", binds=[(Path(p), p) for p in prefixes],
                       env={"PATH": f"{Path(sys.executable).parent}:{DEFAULT_PATH}"})
    ctx = EvalContext(task=task, patch=patch, runtime_factory=lambda: make_runtime(spec))
    result = await run_evaluator("swebench", ctx)
    return {"reward": result.reward, **result.report}


async def test_the_gold_fix_of_a_swegym_shaped_task_scores_one(task: SweTask) -> None:
    report = await _grade(task, task.patch)
    assert report["reward"] == 1.0, (report.get("reason"), report.get("log_tail", "")[-2000:])
    assert report["graded_paths"] == ["moto/core/_case.py", "moto/core/utils.py"] and report["dropped_paths"] == []
    assert all(c["ok"] for c in report["canaries"]) and len(report["canaries"]) == 6


async def test_planted_runner_files_next_to_the_fix_are_dropped(task: SweTask, tmp_path: Path) -> None:
    planted = task.patch + (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n"
        "@@ -0,0 +1 @@\n+import os\n"
        "diff --git a/setup.cfg b/setup.cfg\n--- a/setup.cfg\n+++ b/setup.cfg\n@@ -4,2 +4,3 @@\n"
        " markers =\n     network: needs a network\n+addopts = -p no:python\n"
    )
    report = await _grade(task, planted)
    assert report["reward"] == 1.0, report.get("reason")
    assert {d["path"] for d in report["dropped_paths"]} == {"conftest.py", "setup.cfg"}


async def test_no_fix_scores_zero(task: SweTask) -> None:
    report = await _grade(task, "")
    assert (report["reward"], report["reason"]) == (0.0, "empty patch")
    broken = await _grade(task, _diff(Path(str(task.repo_dir)), {"moto/core/utils.py": "def camelcase_to_underscores(n):\n"
                                                                  "    return n\n"}))
    assert broken["reward"] == 0.0 and "FAIL_TO_PASS failed" in broken["reason"]


async def test_a_workspace_the_grader_cannot_take_is_zero_not_a_grader_error(task: SweTask, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """More entries than the walk takes (lowered here from 300,000): the agent's doing, reward 0 with
    the reason, COMPLETED (so unmasked), never an evaluator error."""
    from polar_env.evaluators import workspace
    from polar_env.records import Status

    require_bwrap()
    prefixes = sorted({sys.base_prefix, sys.prefix})
    spec = RuntimeSpec(source_dir=task.repo_dir, network="none", binds=[(Path(p), p) for p in prefixes],
                       env={"PATH": f"{Path(sys.executable).parent}:{DEFAULT_PATH}"})
    agent = make_runtime(spec)
    await agent.prepare()
    try:
        base = await workspace.snapshot(agent)
        assert (await agent.exec("mkdir -p moto/junk && cd moto/junk && touch $(seq 1 200)")).exit_code == 0
        monkeypatch.setattr(workspace, "MAX_ENTRIES", len(base) + 50)
        ctx = EvalContext(task=task, runtime=agent, base=base, runtime_factory=lambda: make_runtime(spec))
        result = await run_evaluator("swebench", ctx)
    finally:
        await agent.stop()
    assert (result.status, result.reward) == (Status.COMPLETED, 0.0), result.report
    assert "too many entries" in result.report["reason"]
