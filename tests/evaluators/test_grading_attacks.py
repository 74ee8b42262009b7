"""Reward hacks against the grader, each a real shell command run by the ``loop`` harness in a real
bubblewrap session, graded by the real evaluators in a fresh sandbox: every hack → reward 0 with the
paths it planted in ``dropped_paths``; the gold fix still → 1; a task's allow-list widens the policy.

The policy (the model) is a test double: ``AttackPolicy`` picks a scripted turn from the instruction
("ATTACK <name>"), as a real model picks its commands from the prompt. Engine: the simulated one
(tokens forced, no model); the gateway, node, sandboxes, harness loop and evaluators are real.
One CLI run (``polar-env rollout``) repeats the issue's first attack end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.evaluators.integrity import resolve_policy, restrict_patch
from polar_env.tasks.toy import toy_tasks
from tests.conftest import require_bwrap, unavailable
from tests.evaluators.attacks import (
    ATTACKS,
    USER_SITE_ATTACK,
    gold_command,
    run_attacks,
)

pytestmark = pytest.mark.slow
TOY = "toy__calc-1"


@pytest.fixture(scope="module")
def ready() -> None:
    require_bwrap()
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        unavailable("the swebench extra is not installed (pip install -e '.[swebench]')")


def test_every_reward_hack_scores_zero_and_is_reported(ready: None, tmp_path: Path) -> None:
    conftest = next(a for a in ATTACKS if a.name == "conftest_root")
    results = run_attacks(tmp_path, [*ATTACKS, USER_SITE_ATTACK], extra=[
        ("gold_fix", gold_command(), {}),
        ("gold_fix_with_conftest", f"{gold_command()} && {conftest.command()}", {}),
        ("allowed_conftest", conftest.command(), {"integrity": {"allow": ["conftest.py"]}}),
    ])
    summary = {n: (r.status.value, r.reward, [d["path"] for d in r.evaluation.get("dropped_paths", [])])
               for n, r in results.items()}
    for attack in (*ATTACKS, USER_SITE_ATTACK):
        status, reward, dropped = summary[attack.name]
        assert status == "completed" and reward == 0.0, (attack.name, summary[attack.name], results[attack.name].evaluation)
        assert set(attack.expect_dropped) <= set(dropped), (attack.name, dropped)
        assert results[attack.name].evaluation["policy"] == "pytest-strict"
    site = results[USER_SITE_ATTACK.name].evaluation
    assert site["runtime"] == "fresh" and site["exit_code"] == 1
    assert summary["gold_fix"] == ("completed", 1.0, [])
    assert summary["gold_fix_with_conftest"][1] == 1.0 and summary["gold_fix_with_conftest"][2] == ["conftest.py"]
    # the task widened the policy to the file, so the hack is graded as written (and passes)
    assert summary["allowed_conftest"] == ("completed", 1.0, [])


def test_polar_env_rollout_cli_grades_the_conftest_hack_zero(ready: None, tmp_path: Path) -> None:
    from polar_env.cli import main

    conftest = next(a for a in ATTACKS if a.name == "conftest_root")
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"steps": [{"command": conftest.command(), "reasoning": "hack"},
                                            {"text": "Done: {tool_output}", "reasoning": "Done."}]}))
    out = tmp_path / "out"
    code = main(["rollout", "--task-id", TOY, "--samples", "1", "--harness", "loop", "--engine", "simulated",
                 "--engine-script", str(script), "--out", str(out), "--no-progress"])
    assert code == 0
    report = json.loads((out / "latest" / "report.json").read_text())
    assert report["mean_reward"] == 0.0, report["session_rows"]
    sessions = [json.loads(line) for line in (out / "latest" / "sessions.jsonl").read_text().splitlines()]
    assert sessions[0]["evaluation"]["dropped_paths"] == [{"path": "conftest.py", "rule": "runner plugin (conftest.py)"}]


# -- the policy's patch filter on its own (no sandbox) ------------------------------------------------


def test_restrict_patch_drops_sections_and_keeps_the_fix() -> None:
    fix = toy_tasks(ids=[TOY])[0].patch
    hostile = (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n"
        "@@ -0,0 +1,2 @@\n+import pytest\n+diff --git a/x b/x\n"
        "diff --git a/pkg/a.pth b/pkg/a.pth\nnew file mode 100644\n--- /dev/null\n+++ b/pkg/a.pth\n@@ -0,0 +1 @@\n+import os\n"
        "--- a/tox.ini\n+++ b/tox.ini\n@@ -1 +1 @@\n-[tox]\n+[pytest]\n"
        "diff --git a/old.py b/conftest.py\nsimilarity index 100%\nrename from old.py\nrename to conftest.py\n"
    )
    out = restrict_patch(fix + hostile, resolve_policy(), ["tests/test_calc.py"])
    assert [d.path for d in out.dropped] == ["conftest.py", "pkg/a.pth", "tox.ini", "old.py", "conftest.py"]
    assert out.patch == fix and out.kept == ["calc.py"]
    assert restrict_patch(hostile, resolve_policy("off")).dropped == []
    widened = restrict_patch(hostile, resolve_policy({"allow": ["tox.ini"]}))
    assert "tox.ini" not in [d.path for d in widened.dropped]
    import asyncio

    from polar_env.evaluators.integrity import apply_restricted
    from polar_env.runtimes import RuntimeSpec
    from polar_env.runtimes.limits import LimitExceeded

    class Spec:  # only the spec is read before the cap refuses the patch
        spec = RuntimeSpec(patch_mb=1)

    with pytest.raises(LimitExceeded, match="patch_mb"):
        asyncio.run(apply_restricted(Spec(), "+" * (2 << 20), resolve_policy()))  # type: ignore[arg-type]
    flagged = restrict_patch("--- a/calc.py\n+++ b/calc.py\n@@ -1 +1,2 @@\n x\n+import _pytest.reports\n", resolve_policy())
    assert flagged.dropped == [] and flagged.flagged[0]["path"] == "calc.py"


# -- a custom evaluator gets the same protections through the registry --------------------------------


HIDDEN_TEST = b"from calc import safe_div\n\n\ndef test_hidden():\n    assert safe_div(1, 0) is None\n"


async def _custom_grade(ctx):  # type: ignore[no-untyped-def]
    """A task author's evaluator: a hidden test, run with the policy's helpers (no copy-paste)."""
    from polar_env.evaluators import EvalResult, fresh_graded_runtime

    runtime, applied, env = await fresh_graded_runtime(ctx)
    await runtime.write_file("/testbed/tests/test_hidden.py", HIDDEN_TEST)
    res = await runtime.exec("python -m pytest -q tests/test_hidden.py", env=env, timeout_s=120)
    return EvalResult(reward=1.0 if res.exit_code == 0 else 0.0, report={**applied.as_report(), "exit_code": res.exit_code})


@pytest.mark.parametrize("fix", ["gold", "conftest_root", "pytest_ini_plugin"])
async def test_a_custom_evaluator_grades_through_the_policy(ready: None, tmp_path: Path, fix: str) -> None:
    from polar_env.evaluators import (
        EVALUATORS,
        EvalContext,
        register_evaluator,
        run_evaluator,
    )
    from polar_env.runtimes import RuntimeSpec, make_runtime
    from polar_env.staging.lifecycle import evaluation_runtime_spec

    if "toy_hidden_test" not in EVALUATORS:
        register_evaluator("toy_hidden_test")(_custom_grade)
    toy = toy_tasks(tmp_path / "toy", ids=[TOY])[0]
    spec = RuntimeSpec(source_dir=toy.repo_dir, network="none")
    agent = make_runtime(spec)
    await agent.prepare()
    try:
        command = gold_command() if fix == "gold" else next(a for a in ATTACKS if a.name == fix).command()
        assert (await agent.exec(command)).exit_code == 0
        grading = evaluation_runtime_spec(spec)
        ctx = EvalContext(task={}, runtime=agent, runtime_factory=lambda: make_runtime(grading))
        result = await run_evaluator("toy_hidden_test", ctx)
    finally:
        await agent.stop()
    assert result.status.value == "completed", result.report
    if fix == "gold":
        assert result.reward == 1.0 and result.report["dropped_paths"] == []
    else:
        assert result.reward == 0.0 and result.report["dropped_paths"], result.report
