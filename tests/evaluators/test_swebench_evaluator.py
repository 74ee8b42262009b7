"""The ``swebench`` evaluator on the toy task set, through the LocalRuntime test double (see
test_swebench_real_runtimes.py for the sandbox and Docker runtimes)."""

from __future__ import annotations

import pytest

pytest.importorskip("swebench.harness.grading", reason="the swebench extra is not installed: pip install -e '.[swebench]'",
                    exc_type=ImportError)

from polar_env.evaluators import EvalContext, prewarm, run_evaluator
from polar_env.records import Status
from polar_env.tasks.swe import END_TEST_OUTPUT, START_TEST_OUTPUT, SweTask, patch_files
from polar_env.tasks.toy.calc import _CALC_FIXED

pytestmark = pytest.mark.slow  # grades in real sandboxes

TOY_IDS = ["toy__calc-1", "toy__textkit-1", "toy__bsearch-1"]
HANG_TIMEOUT_S = 4.0  # the bsearch bug loops forever; this bounds each test that trips it

# Edits only test files, in ways that would pass if the eval script trusted the workspace:
# calc and bsearch get a trivial copy of the FAIL_TO_PASS test, textkit writes the new test file
# the test patch adds (which must be removed, or the test patch would fail to apply and leave it).
TEST_EDITS = {
    "toy__calc-1": {
        "tests/test_calc.py": "def test_add():\n    pass\n\n\ndef test_div():\n    pass\n\n\ndef test_div_zero():\n    pass\n"
    },
    "toy__textkit-1": {
        "tests/test_slug_edges.py": (
            "import pytest\n\n\n@pytest.mark.parametrize('x', [1, 2], ids=['comma', 'dashes'])\n"
            "def test_collapse_runs(x):\n    pass\n\n\ndef test_strip_ends():\n    pass\n"
        )
    },
    "toy__bsearch-1": {
        "tests/test_bsearch.py": "def test_find_each():\n    pass\n\n\ndef test_missing_below():\n    pass\n\n\n"
                                 "def test_missing_above():\n    pass\n"
    },
}


async def grade(task: SweTask, fresh_factory, *, patch: str | None, runtime=None, **params):  # type: ignore[no-untyped-def]
    factory = fresh_factory(task)
    ctx = EvalContext(task=task.model_dump(), params=params, patch=patch, runtime=runtime, runtime_factory=factory)
    result = await run_evaluator("swebench", ctx)
    assert all(rt.stopped for rt in factory.made), "run_evaluator must stop the fresh runtime"
    return result


async def agent_with_files(local_runtimes, task: SweTask, files: dict[str, str]):  # type: ignore[no-untyped-def]
    agent = local_runtimes(source_dir=task.repo_dir)
    await agent.prepare()
    for path, text in files.items():
        await agent.write_file(f"/testbed/{path}", text.encode())
    return agent


@pytest.mark.parametrize("toy_id", TOY_IDS)
async def test_gold_patch_resolves(toys, fresh_factory, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    result = await grade(task, fresh_factory, patch=task.patch)
    assert result.status is Status.COMPLETED, result.report
    assert result.reward == 1.0, result.report.get("reason")
    report = result.report
    assert report["resolved"] is True and report["reason"] == "resolved"
    assert report["change_source"] == "patch (git apply --verbose)"
    assert report["graded_paths"] == sorted(patch_files(task.patch)) and report["dropped_paths"] == []
    assert report["results_from"].startswith("grader plugin") and report["forged_lines"] == 0
    assert len(report["canaries"]) == 6 and all(c["ok"] for c in report["canaries"]), report["canaries"]
    assert {c["expected"] for c in report["canaries"]} == {"same as original", "fail"}
    assert report["grader_state"] == "finished" and report["runner"]["pytest"]
    tests = report["swebench"]["tests_status"]
    assert tests["FAIL_TO_PASS"]["success"] == task.FAIL_TO_PASS
    assert tests["PASS_TO_PASS"]["success"] == task.PASS_TO_PASS
    assert START_TEST_OUTPUT in report["log_tail"] and END_TEST_OUTPUT in report["log_tail"]
    assert set(report["timings_s"]) == {"change", "eval", "grade"}


@pytest.mark.parametrize("toy_id", TOY_IDS)
async def test_empty_patch_is_not_resolved(toys, fresh_factory, toy_id):  # type: ignore[no-untyped-def]
    result = await grade(toys[toy_id], fresh_factory, patch="")
    assert (result.status, result.reward, result.report["reason"]) == (Status.COMPLETED, 0.0, "empty patch")
    assert result.report["resolved"] is False


@pytest.mark.parametrize("toy_id", ["toy__calc-1", "toy__textkit-1"])
async def test_empty_patch_run_anyway_fails_the_new_tests(toys, fresh_factory, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    result = await grade(task, fresh_factory, patch="", skip_empty_patch=False)
    assert result.status is Status.COMPLETED and result.reward == 0.0
    tests = result.report["swebench"]["tests_status"]
    assert tests["FAIL_TO_PASS"]["failure"] == task.FAIL_TO_PASS
    assert tests["PASS_TO_PASS"]["success"] == task.PASS_TO_PASS
    assert result.report["reason"].startswith("FAIL_TO_PASS failed")


async def test_hanging_test_is_a_timeout(toys, fresh_factory):  # type: ignore[no-untyped-def]
    task = toys["toy__bsearch-1"]
    result = await grade(task, fresh_factory, patch="", skip_empty_patch=False, timeout_s=HANG_TIMEOUT_S)
    assert result.status is Status.TIMEOUT and result.reward == 0.0
    assert result.report["reason"] == f"eval script exceeded {HANG_TIMEOUT_S} s"
    assert result.report["resolved"] is False
    assert START_TEST_OUTPUT in result.report["log_tail"]  # it got as far as the tests
    assert result.report["timings_s"]["eval"] < HANG_TIMEOUT_S + 5


@pytest.mark.parametrize("toy_id", TOY_IDS)
async def test_patch_breaking_pass_to_pass_is_not_resolved(toys, fresh_factory, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    result = await grade(task, fresh_factory, patch=task.extra["variants"]["breaks_pass_to_pass"])
    assert result.status is Status.COMPLETED and result.reward == 0.0, result.report
    tests = result.report["swebench"]["tests_status"]
    assert tests["FAIL_TO_PASS"]["failure"] == []
    assert tests["PASS_TO_PASS"]["failure"], tests
    assert "PASS_TO_PASS failed" in result.report["reason"]


@pytest.mark.parametrize("toy_id", TOY_IDS)
async def test_patch_that_does_not_apply(toys, fresh_factory, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    # a well-formed hunk on the file the gold patch fixes, removing a line that file does not have
    path = next(iter(patch_files(task.patch)))
    bogus = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-no such line in {path}\n+replacement\n"
    result = await grade(task, fresh_factory, patch=bogus)
    assert (result.status, result.reward) == (Status.COMPLETED, 0.0)
    assert result.report["reason"] == "patch does not apply"
    logs = result.report["apply_logs"]
    assert [log["command"].split(" .git")[0].split(" -i")[0] for log in logs] == [
        "git apply --verbose",
        "git apply --verbose --3way",
        "git apply --verbose --reject",
        "patch --batch --forward --fuzz=5 -p1",
    ]
    assert all(log["exit_code"] != 0 for log in logs)
    assert "patch does not apply" in logs[0]["output"] or "error" in logs[0]["output"]


async def test_garbage_patch_does_not_apply(toys, fresh_factory):  # type: ignore[no-untyped-def]
    result = await grade(toys["toy__calc-1"], fresh_factory, patch="this is not a diff\n")
    assert result.report["reason"] == "patch does not apply" and result.reward == 0.0


@pytest.mark.parametrize("toy_id", ["toy__calc-1", "toy__textkit-1"])
async def test_editing_the_tests_does_not_help(toys, fresh_factory, local_runtimes, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    agent = await agent_with_files(local_runtimes, task, TEST_EDITS[toy_id])
    patch = await agent.diff()
    assert patch.strip()
    result = await grade(task, fresh_factory, patch=patch)
    assert result.status is Status.COMPLETED and result.reward == 0.0, result.report
    assert result.report["reason"] == "no admitted change"
    assert {d["path"] for d in result.report["dropped_paths"]} == set(TEST_EDITS[toy_id])
    assert all(d["rule"].startswith("test location") for d in result.report["dropped_paths"])
    ran = await grade(task, fresh_factory, patch=patch, skip_empty_patch=False)  # and the tests still fail
    assert ran.reward == 0.0 and ran.report["swebench"]["tests_status"]["FAIL_TO_PASS"]["failure"] == task.FAIL_TO_PASS


async def test_editing_the_tests_does_not_stop_a_hang(toys, fresh_factory, local_runtimes):  # type: ignore[no-untyped-def]
    task = toys["toy__bsearch-1"]
    agent = await agent_with_files(local_runtimes, task, TEST_EDITS["toy__bsearch-1"])
    result = await grade(task, fresh_factory, patch=await agent.diff(), timeout_s=HANG_TIMEOUT_S, skip_empty_patch=False)
    assert result.status is Status.TIMEOUT and result.reward == 0.0


@pytest.mark.parametrize("toy_id", TOY_IDS)
async def test_gold_fix_plus_test_edits_still_resolves(toys, fresh_factory, local_runtimes, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    agent = await agent_with_files(local_runtimes, task, TEST_EDITS[toy_id])
    await agent.write_file("/testbed/.git/gold.patch", task.patch.encode())
    assert (await agent.exec("git apply .git/gold.patch")).exit_code == 0
    # no ctx.patch: the grader takes the agent runtime's change set itself (never its git)
    result = await grade(task, fresh_factory, patch=None, runtime=agent)
    assert result.reward == 1.0, result.report
    assert result.report["change_source"] == "snapshot"
    assert set(result.report["graded_paths"]) == set(patch_files(task.patch))


async def test_a_deleted_git_dir_changes_nothing(toys, fresh_factory, local_runtimes):  # type: ignore[no-untyped-def]
    task = toys["toy__calc-1"]
    agent = local_runtimes(source_dir=task.repo_dir)
    await agent.prepare()
    assert (await agent.exec("rm -rf .git")).exit_code == 0
    result = await grade(task, fresh_factory, patch=None, runtime=agent)  # no fix: 0, not a grader error
    assert (result.status, result.reward, result.report["reason"]) == (Status.COMPLETED, 0.0, "empty patch")
    await agent.write_file("/testbed/calc.py", _CALC_FIXED.encode())
    result = await grade(task, fresh_factory, patch=None, runtime=agent)  # a real fix without .git: 1
    assert result.reward == 1.0, result.report


async def test_grading_in_the_agent_runtime_is_refused(toys, local_runtimes):  # type: ignore[no-untyped-def]
    ctx = EvalContext(task=toys["toy__calc-1"], params={"refresh_runtime": False}, runtime=local_runtimes())
    result = await run_evaluator("swebench", ctx)
    assert result.status is Status.ERROR and "grades in a fresh runtime only" in result.report["error"]


async def test_prewarmed_runtime_is_the_one_graded_in(toys, fresh_factory):  # type: ignore[no-untyped-def]
    task = toys["toy__calc-1"]
    factory = fresh_factory(task)
    ctx = EvalContext(task=task, patch=task.patch, runtime_factory=factory)
    warm = await prewarm("swebench", ctx)
    assert warm is not None and warm.prepared and not warm.stopped
    result = await run_evaluator("swebench", ctx)
    assert result.reward == 1.0
    assert factory.made == [warm] and warm.stopped


async def test_no_eval_script_is_an_error_unless_a_test_command_is_given(toys, fresh_factory):  # type: ignore[no-untyped-def]
    task = toys["toy__calc-1"].model_copy(update={"eval_script": None})
    result = await grade(task, fresh_factory, patch=task.patch)
    assert result.status is Status.ERROR and result.reward == 0.0
    assert "toy__calc-1: no eval_script, no environment_setup.test_command" in result.report["error"]
    result = await grade(
        task,
        fresh_factory,
        patch=task.patch,
        test_command="python3 -m pytest -rA -p no:cacheprovider tests/test_calc.py",
    )
    assert result.reward == 1.0, result.report
    assert result.report["eval_script_source"] == "test_command"


async def test_eval_script_without_markers_grades_the_whole_log(toys, fresh_factory):  # type: ignore[no-untyped-def]
    task = toys["toy__calc-1"]
    script = "\n".join(line for line in task.eval_script.splitlines() if ">>>>>" not in line) + "\n"
    task = task.model_copy(update={"eval_script": script})
    gold = await grade(task, fresh_factory, patch=task.patch)
    assert gold.reward == 1.0 and "markers_added" not in gold.report  # the verdict never came from the log
    broken = await grade(task, fresh_factory, patch=task.extra["variants"]["breaks_pass_to_pass"])
    assert broken.reward == 0.0


async def test_bad_params_are_an_error(toys, fresh_factory):  # type: ignore[no-untyped-def]
    task = toys["toy__calc-1"]
    result = await grade(task, fresh_factory, patch=task.patch, timeout=3)
    assert result.status is Status.ERROR and "ConfigError" in result.report["error"]
