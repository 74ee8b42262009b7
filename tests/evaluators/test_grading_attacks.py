"""Reward hacks against the grader, each a real shell command run by the ``loop`` harness in a real
bubblewrap session, graded by the real evaluators in a fresh sandbox: every hack → reward 0 with the
paths it planted in ``dropped_paths``; the gold fix still → 1; a task's allow-list widens the policy,
and what a widened path does inside the test process is caught by the canaries (``tampered``).

The policy (the model) is a test double: ``AttackPolicy`` picks a scripted turn from the instruction
("ATTACK <name>"), as a real model picks its commands from the prompt. Engine: the simulated one
(tokens forced, no model); the gateway, node, sandboxes, harness loop and evaluators are real.
One CLI run (``polar-env rollout``) repeats the issue's first attack end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.evaluators.integrity import admit, resolve_policy
from polar_env.evaluators.scan import RUNNER_RULES
from polar_env.evaluators.workspace import Change, Changes, Entry
from polar_env.tasks.toy import toy_tasks
from tests.conftest import require_bwrap, require_swebench
from tests.evaluators.attacks import (
    ATTACKS,
    USER_SITE_ATTACK,
    gold_command,
    run_attacks,
)

pytestmark = pytest.mark.slow
RUNNER = sorted(RUNNER_RULES)  # the scan's runner rules, widened where a test needs the hook to reach the run
TOY = "toy__calc-1"


@pytest.fixture(scope="module")
def ready() -> None:
    require_bwrap()
    require_swebench()


def test_every_reward_hack_scores_zero_and_is_reported(ready: None, tmp_path: Path) -> None:
    conftest = next(a for a in ATTACKS if a.name == "conftest_root")
    results = run_attacks(tmp_path, [*ATTACKS, USER_SITE_ATTACK], extra=[
        ("gold_fix", gold_command(), {}),
        ("gold_fix_with_conftest", f"{gold_command()} && {conftest.command()}", {}),
        ("allowed_conftest", conftest.command(), {"integrity": {"allow": ["conftest.py"], "scan_ignore": RUNNER}}),
        ("allowed_conftest_scanned", conftest.command(), {"integrity": {"allow": ["conftest.py"]}}),
    ])
    summary = {n: (r.status.value, r.reward, [d["path"] for d in r.evaluation.get("dropped_paths", [])])
               for n, r in results.items()}
    for attack in (*ATTACKS, USER_SITE_ATTACK):
        status, reward, dropped = summary[attack.name]
        r = results[attack.name]
        # 0 and trained on: a plain 0, or ``tampered`` where the scan found a hook in an admitted file
        assert reward == 0.0 and r.mask is False, (attack.name, summary[attack.name], r.evaluation)
        assert status == "completed" or r.failure_kind == "tampered", (attack.name, summary[attack.name], r.evaluation)
        assert set(attack.expect_dropped) <= set(dropped), (attack.name, dropped)
        want = "allowlist" if attack.evaluator == "swebench" else "allowlist-workspace"
        assert results[attack.name].evaluation["policy"] == want
    site = results[USER_SITE_ATTACK.name].evaluation
    assert site["runtime"] == "fresh" and site["exit_code"] == 1
    assert summary["gold_fix"] == ("completed", 1.0, [])
    assert summary["gold_fix_with_conftest"][1] == 1.0 and summary["gold_fix_with_conftest"][2] == ["conftest.py"]
    # the task widened the policy to the file, so the hack reaches the test run, where it flips the
    # must-fail canaries: tampered, 0, and trained on (not masked)
    allowed = results["allowed_conftest"]
    assert (allowed.reward, summary["allowed_conftest"][2], allowed.failure_kind, allowed.mask) == (0.0, [], "tampered", False)
    assert allowed.evaluation["tampered"] is True
    assert any(not c["ok"] and c["expected"] == "fail" for c in allowed.evaluation["canaries"])
    # without the scan widened, the static scan stops the hook before anything runs
    scanned = results["allowed_conftest_scanned"]
    assert (scanned.reward, scanned.failure_kind, scanned.mask) == (0.0, "tampered", False)
    assert {f["rule"] for f in scanned.evaluation["scan_findings"]} & set(RUNNER)


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
    assert sessions[0]["evaluation"]["dropped_paths"] == [{"path": "conftest.py", "rule": "runner or packaging config"}]


# -- the allow-list on its own (no sandbox) ------------------------------------------------------------


def _file(mode: int = 0o644) -> Entry:
    return Entry("file", mode, 1, "d")


BASE = {"calc.py": _file(), "pkg/__init__.py": _file(), "pkg/core.py": _file(), "tests/test_calc.py": _file(),
        "pytest.ini": _file(), "run.sh": _file(0o755), "docs/index.rst": _file()}
ADMITTED = ["calc.py", "pkg/core.py", "pkg/new_helper.py", "pkg/sub/deep.py", "pkg/data.json", "run.sh", "docs/index.rst",
            "solution.py", "notes.txt", "src/mylib/__init__.py"]
RESERVED = frozenset({"json", "traceback", "os"})
DROPPED = {
    "conftest.py": "runner or packaging config", "pkg/CONFTEST.py": "runner or packaging config",
    "pytest.ini": "runner or packaging config", "pkg/setup.cfg": "runner or packaging config",
    ".GIT/config": "dot-file or dot-folder", "pkg/.hidden.py": "dot-file or dot-folder",
    "x-1.0.DIST-INFO/entry_points.txt": "package metadata or bytecode folder",
    "pkg/__pycache__/core.cpython-311.pyc": "package metadata or bytecode folder",
    "pytest.pyc": "compiled module, bytecode or interpreter hook", "pkg/fast.so": "compiled module, bytecode or interpreter hook",
    "pkg/hook.PTH": "compiled module, bytecode or interpreter hook",
    "tests/test_calc.py": "test location (tests come from the pristine base and the test patch)",
    "pkg/tests/helper.py": "test location (tests come from the pristine base and the test patch)",
    "pkg/test_new.py": "test location (tests come from the pristine base and the test patch)",
    "pytest.py": "a new module shadowing the importable module 'pytest'",
    "xdist/__init__.py": "a new module shadowing the importable module 'xdist'",
    "json.py": "a new module shadowing the importable module 'json'",
    "src/traceback.py": "a new module shadowing the importable module 'traceback'",
    "pluggy/hooks.py": "a new module shadowing the importable module 'pluggy'",
    "pkg/tool.sh": "a new file of a kind a fix does not add",
}


def test_the_allow_list_admits_source_and_drops_the_rest() -> None:
    items = [Change(p, _file(), BASE.get(p), b"x = 1\n") for p in ADMITTED + list(DROPPED)]
    items += [Change("pkg/link.py", Entry("link", 0, 3, "t"), None), Change("pkg/core.py.bin", _file(), None, b"\0\1"),
              Change("pkg/exec.py", _file(0o755), None, b"x\n"), Change("pkg/big.py", Entry("file", 0o644, 1 << 30), None),
              Change("calc.py", None, BASE["calc.py"]), Change("pytest.ini", None, BASE["pytest.ini"])]
    out = admit(Changes(items), resolve_policy(), BASE, ["tests/test_calc.py"], RESERVED)
    assert [c.path for c in out.kept] == [*ADMITTED, "calc.py"]  # the last: calc.py's deletion
    rules = {d.path: d.rule for d in out.dropped}
    assert {p: rules[p] for p in DROPPED} == DROPPED
    assert (rules["pkg/link.py"], rules["pkg/core.py.bin"], rules["pkg/exec.py"], rules["pkg/big.py"]) == (
        "symlink", "binary content", "made executable", "over the size the grader reads")
    assert rules["pytest.ini"] == "runner or packaging config"  # deleting config is no fix either
    # without the grading interpreter's names, no new top-level module is admitted
    unknown = {d.path: d.rule for d in admit(Changes(items), resolve_policy(), BASE, ["tests/test_calc.py"]).dropped}
    assert unknown["solution.py"].endswith("could not list what it may shadow") and "notes.txt" not in unknown
    # a task widens by pattern (the name rules are lifted there; the kind rules stay) and narrows by pattern
    widened = admit(Changes(items), resolve_policy({"allow": ["conftest.py", "pkg/link.py"], "protect": ["docs/*"]}),
                    BASE, ["tests/test_calc.py"], RESERVED)
    kept = [c.path for c in widened.kept]
    assert "conftest.py" in kept and "pkg/link.py" not in kept and "docs/index.rst" not in kept
    assert {c.path for c in admit(Changes(items[:3]), resolve_policy("off"), BASE).kept} == set(ADMITTED[:3])


# -- a custom evaluator gets the same protections through the registry --------------------------------


HIDDEN_TEST = b"from calc import safe_div\n\n\ndef test_hidden():\n    assert safe_div(1, 0) is None\n"


async def _custom_grade(ctx):  # type: ignore[no-untyped-def]
    """A task author's evaluator: a hidden test, run with the policy's helpers (no copy-paste)."""
    from polar_env.evaluators import EvalResult, fresh_graded_runtime

    runtime, graded, env = await fresh_graded_runtime(ctx)
    await runtime.write_file("/testbed/tests/test_hidden.py", HIDDEN_TEST)
    res = await runtime.exec("python -m pytest -q tests/test_hidden.py", env=env, timeout_s=120)
    return EvalResult(reward=1.0 if res.exit_code == 0 else 0.0, report={**graded.as_report(), "exit_code": res.exit_code})


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
