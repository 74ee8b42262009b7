"""Where a SWE row's eval script comes from (``polar_env.tasks.eval_scripts``), on the real rows of
``../shared/swe-real``: each source in order, the built script run by bash against a real repo whose
only commit is not the row's upstream base (as in images built from a ``git archive`` tarball), the
preflight refusal listing every row nothing can grade, the spec-table source through a real
swebench 4.1.0 in a subprocess, and the whole-evaluation timeout that follows the evaluator's own."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from polar_env.errors import ConfigError
from polar_env.evaluators import EvaluatorSpec
from polar_env.staging.lifecycle import EVAL_MARGIN_S, EVAL_TIMEOUT_S, evaluation_timeout_s
from polar_env.staging.models import TaskRequest
from polar_env.tasks.eval_scripts import NoEvalScript, _swebench_table, check_gradable, resolve_eval_script
from polar_env.tasks.swe import END_TEST_OUTPUT, START_TEST_OUTPUT, SweTask, build_eval_script
from tests.conftest import REPO_ROOT, require_swebench, unavailable

SHARED = REPO_ROOT.parent / "shared" / "swe-real"
SWEBENCH_4 = Path.home() / ".cache" / "polar_env" / "swebench-4.1.0"  # pip install --target, no deps
NOT_IN_ANY_TABLE = ("python-attrs__attrs-887", "pallets__click-2223", "pydantic__pydantic-6563")
GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "commit.gpgsign=false"]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    """The real rows, as published SWE-bench rows are: no ``eval_script``."""
    path = SHARED / "instances.jsonl"
    if not path.is_file():
        unavailable(f"the swe-real set is not at {SHARED} (the shared folder beside the checkout)")
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        row.pop("eval_script", None)
        out[row["instance_id"]] = row
    return out


def _bare(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "environment_setup"}


def _request(row: dict[str, Any], evaluator: str = "swebench", **params: Any) -> TaskRequest:
    return TaskRequest(task_id=row["instance_id"], instruction="fix it", task=SweTask.from_row(row).model_dump(mode="json"),
                       evaluator=EvaluatorSpec(name=evaluator, params=params))


def test_each_source_in_order(rows: dict[str, dict[str, Any]]) -> None:
    row = rows["pallets__click-2223"]
    own = resolve_eval_script(SweTask.from_row({**row, "eval_script": "#!/bin/bash\necho own\n"}), "pytest -x")
    assert (own.source, own.script) == ("row", "#!/bin/bash\necho own\n")  # the row's own script wins over all

    setup = resolve_eval_script(SweTask.from_row(row), test_command="pytest -x")  # the row's command beats the evaluator's
    assert setup.source == "environment_setup"
    lines = setup.script.splitlines()
    assert lines[2] == "cd /testbed" and row["environment_setup"]["test_command"] in lines
    assert "pytest -x" not in lines and not any("conda" in line or "activate" in line for line in lines)
    assert resolve_eval_script(SweTask.from_row(row), "pytest -x") is setup  # cached: 256 sessions of a row build it once

    for instance_id in rows:  # every real row resolves from its environment_setup
        assert resolve_eval_script(SweTask.from_row(rows[instance_id])).source == "environment_setup"

    # no table in the installed swebench (5.x) for the spec-table step: the evaluator's command is last
    last = resolve_eval_script(SweTask.from_row(_bare(row)), test_command="pytest -rA tests/test_options.py")
    assert last.source == "test_command" and "pytest -rA tests/test_options.py" in last.script.splitlines()
    assert "cd /testbed" not in last.script  # run where the evaluator runs it, as before
    with pytest.raises(NoEvalScript, match=r"^pallets__click-2223: no eval_script, no environment_setup\.test_command, "
                                           r"pallets/click 8\.1 .*; give the row an eval_script"):
        resolve_eval_script(SweTask.from_row(_bare(row)))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _run(script: str, repo: Path, env: dict[str, str] | None = None) -> str:
    """The script as the grader runs it: bash, its xtrace (the markers) on stderr, collected with stdout."""
    assert script.count("cd /testbed\n") == 1
    path = repo.parent / "eval.sh"
    path.write_text(script.replace("cd /testbed\n", f"cd {shlex.quote(str(repo))}\n"))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(["bash", str(path)], cwd=repo.parent, env={**clean, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return done.stdout


def test_built_script_runs_on_a_repo_without_the_upstream_base(rows: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """click-2223's tarball with one local commit (as build_env.sh makes it): the reset falls back to
    HEAD, an agent's rewrite of the test file is undone, the test patch applies, the row's own test
    command runs between the markers, and FAIL_TO_PASS fails without the gold patch and passes with it."""
    row = rows["pallets__click-2223"]
    repo = tmp_path / "repo"
    repo.mkdir()
    with tarfile.open(SHARED / "repos" / f"{row['instance_id']}.tar.gz") as tar:
        tar.extractall(repo, filter="data")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    assert subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{row['base_commit']}^{{commit}}"]).returncode != 0
    script = resolve_eval_script(SweTask.from_row(row)).script
    # the repo's click on the path, the test process's interpreter (and its pytest) first on PATH: the image's venv
    env = {"PYTHONPATH": str(repo / "src"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    f2p = row["FAIL_TO_PASS"][0]

    (repo / "tests" / "test_options.py").write_text("def test_empty_envvar():\n    pass\n")  # the agent's forgery
    before = _run(script, repo, env)
    assert f"+ : '{START_TEST_OUTPUT}'" in before and f"+ : '{END_TEST_OUTPUT}'" in before, before[-3000:]
    assert "git checkout HEAD -- tests/test_options.py" in before and "Applied patch tests/test_options.py cleanly" in before
    assert f"FAILED {f2p}" in before, before[-3000:]
    assert _git(repo, "status", "--porcelain") == ""  # the closing reset left the test file at HEAD

    subprocess.run(["git", "-C", str(repo), "apply", "-"], input=row["patch"], text=True, check=True)  # the gold fix
    after = _run(script, repo, env)
    assert f"PASSED {f2p}" in after and "FAILED" not in after, after[-3000:]
    assert all(f"PASSED {t}" in after for t in row["PASS_TO_PASS"][:20])


def test_reset_uses_the_base_commit_when_the_repo_has_it(tmp_path: Path) -> None:
    """A repo with history (SWE-bench images): the test file goes back to base_commit, not to HEAD."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "tests" / "test_x.py").write_text("base\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "tests" / "test_x.py").write_text("later\n")
    _git(repo, "commit", "-qam", "later")
    (repo / "tests" / "test_x.py").write_text("forged\n")
    patch = ("diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n"
             "@@ -1 +1 @@\n-base\n+patched\n")
    script = build_eval_script(base_commit=base, test_patch=patch, test_command="cat tests/test_x.py", workdir="/testbed")
    out = _run(script, repo)
    assert f"git checkout {base} -- tests/test_x.py" in out
    start, end = out.index(START_TEST_OUTPUT), out.index(END_TEST_OUTPUT)
    assert "patched" in out[start:end] and "forged" not in out[start:end], out


def test_check_gradable_lists_every_row_it_cannot_grade(rows: dict[str, dict[str, Any]]) -> None:
    good = [_request(row) for row in rows.values()]
    assert check_gradable(good) == {"environment_setup": len(rows)}

    bad = [_request(_bare(rows[i])) for i in NOT_IN_ANY_TABLE]
    ignored = _request(_bare(rows["psf__requests-6057"]), evaluator="session_completion")  # not graded by swebench
    with pytest.raises(ConfigError) as caught:
        check_gradable([*good, *bad, ignored])
    lines = str(caught.value).splitlines()
    assert lines[0] == f"3 of {len(rows) + 3} swebench task(s) cannot be graded:"
    assert [line.split(":", 1)[0].strip() for line in lines[1:]] == list(NOT_IN_ANY_TABLE)  # every one, one line each
    for line, instance_id in zip(lines[1:], NOT_IN_ANY_TABLE, strict=True):
        repo, version = rows[instance_id]["repo"], rows[instance_id]["version"]
        assert line.strip().startswith(f"{instance_id}: no eval_script, no environment_setup.test_command, {repo} {version} ")
        assert "spec table" in line and "or the evaluator a test_command" in line

    # the evaluator's test_command grades the same rows
    fixed = [_request(_bare(rows[i]), test_command="pytest -rA") for i in NOT_IN_ANY_TABLE]
    assert check_gradable(fixed) == {"test_command": 3}


def test_check_gradable_names_a_row_that_is_not_a_swe_row() -> None:
    req = TaskRequest(task_id="plain-1", instruction="x", task={"question": "?"}, evaluator=EvaluatorSpec(name="swebench"))
    with pytest.raises(ConfigError, match=r"\n  plain-1: not a SWE task row \(instance_id: field required\)"):
        check_gradable([req])


def test_absent_spec_table_is_named(rows: dict[str, dict[str, Any]]) -> None:
    """swebench 5.x has no MAP_REPO_VERSION_TO_SPECS: the row's line says which release has none."""
    require_swebench()
    release, table, _ = _swebench_table()
    if table is not None:
        pytest.skip(f"the installed swebench {release} carries a spec table (the subprocess test covers it)")
    row = _bare(rows["pallets__flask-4935"])  # in swebench 4.x's table, not in this one
    with pytest.raises(NoEvalScript, match=rf"pallets/flask 2\.3 not in the installed swebench's spec table "
                                           rf"\(swebench {release} has none\)"):
        resolve_eval_script(SweTask.from_row(row))


SPEC_TABLE_PROBE = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from polar_env.errors import ConfigError
    from polar_env.tasks.eval_scripts import NoEvalScript, check_gradable, resolve_eval_script
    from polar_env.tasks.swe import SweTask
    from swebench.harness.test_spec.test_spec import make_test_spec
    out = {}
    rows = [json.loads(line) for line in sys.stdin]
    try:
        check_gradable([SimpleNamespace(task_id=r["instance_id"], task=r, evaluator=SimpleNamespace(name="swebench", params={}))
                        for r in rows])
    except ConfigError as exc:
        out["check_gradable"] = str(exc)
    for row in rows:
        task = SweTask.from_row(row)
        try:
            found = resolve_eval_script(task)
        except NoEvalScript as exc:
            out[task.instance_id] = {"error": str(exc)}
            continue
        out[task.instance_id] = {"source": found.source, "script": found.script}
        if task.repo == "psf/requests":  # packages: pytest, so make_test_spec needs no GitHub fetch
            instance = {**task.to_swebench_instance(), "test_patch": task.test_patch}
            out[task.instance_id]["make_test_spec"] = make_test_spec(instance).eval_script
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def swebench_4() -> Path:
    """swebench 4.1.0 (it carries MAP_REPO_VERSION_TO_SPECS) installed without deps into a cache
    folder; its imports resolve against this environment's (5.x) dependencies."""
    if not (SWEBENCH_4 / "swebench" / "harness" / "constants" / "__init__.py").is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SWEBENCH_4),
                               "swebench==4.1.0"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.skip(f"cannot install swebench 4.1.0 into {SWEBENCH_4}: {done.stderr.strip()[-300:]}")
    return SWEBENCH_4


def test_spec_table_source_with_swebench_4(rows: dict[str, dict[str, Any]], swebench_4: Path) -> None:
    require_swebench()  # its dependencies
    ids = ("psf__requests-6057", "pallets__flask-4935", "marshmallow-code__marshmallow-1989", "pallets__click-2223")
    stdin = "".join(json.dumps(_bare(rows[i])) + "\n" for i in ids)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(swebench_4), str(REPO_ROOT)])}
    done = subprocess.run([sys.executable, "-c", SPEC_TABLE_PROBE], input=stdin, env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    requests = out["psf__requests-6057"]
    assert requests["source"] == "spec_table" and requests["script"] == requests["make_test_spec"]  # the release's own script
    flask = out["pallets__flask-4935"]  # packages: requirements.txt; make_test_spec would fetch it from GitHub
    assert flask["source"] == "spec_table" and "conda activate testbed" in flask["script"]
    assert "pytest -rA tests/test_blueprints.py" in flask["script"] and f": '{START_TEST_OUTPUT}'" in flask["script"]
    assert out["marshmallow-code__marshmallow-1989"]["source"] == "spec_table"
    assert out["pallets__click-2223"]["error"].startswith(
        "pallets__click-2223: no eval_script, no environment_setup.test_command, pallets/click 8.1 not in the installed "
        "swebench's spec table (swebench 4.1.0); give")
    # ... but the evaluator grades with 5.x's library, which 4.1.0 lacks: preflight says so for every row
    refused = out["check_gradable"].splitlines()
    assert refused[0] == "4 of 4 swebench task(s) cannot be graded:" and refused[-1].lstrip().startswith("pallets__click-2223: no")
    for line, instance_id in zip(refused[1:4], ids[:3], strict=True):
        assert line.lstrip().startswith(f"{instance_id}: its eval script comes from swebench 4.1.0's spec table, but the "
                                        "swebench evaluator grades with swebench 5.x's library (cannot import name"), line


def test_evaluation_timeout_follows_the_evaluator() -> None:
    swebench = EvaluatorSpec(name="swebench")
    assert evaluation_timeout_s(swebench) == 1800.0 + EVAL_MARGIN_S  # SweBenchParams.timeout_s's default
    assert evaluation_timeout_s(EvaluatorSpec(name="swebench", params={"timeout_s": 3600})) == 3600.0 + EVAL_MARGIN_S
    assert evaluation_timeout_s(EvaluatorSpec(name="swebench", timeout_s=42.0)) == 42.0  # the spec's own limit wins
    assert evaluation_timeout_s(EvaluatorSpec(name="session_completion")) == EVAL_TIMEOUT_S  # no timeout of its own
    assert evaluation_timeout_s(EvaluatorSpec(name="output", params={"regex": "4"})) == EVAL_TIMEOUT_S  # 60 s: never below
