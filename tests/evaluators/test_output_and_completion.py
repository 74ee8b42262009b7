"""``session_completion`` and the ``output`` evaluator's modes."""

from __future__ import annotations

import pytest

from polar_env.evaluators import EvalContext, run_evaluator
from polar_env.evaluators.scan import RUNNER_RULES
from polar_env.records import Status

pytestmark = pytest.mark.slow  # grades in real sandboxes


@pytest.mark.parametrize(
    ("exit_code", "timed_out", "reward", "reason"),
    [
        (0, False, 1.0, "harness exited 0 within its budget"),
        (2, False, 0.0, "harness exited with code 2"),
        (0, True, 0.0, "harness ran out of its time budget"),
        (None, False, 0.0, "harness exit code unknown (it did not run to an exit)"),
    ],
)
async def test_session_completion(exit_code, timed_out, reward, reason) -> None:  # type: ignore[no-untyped-def]
    result = await run_evaluator("session_completion", EvalContext(task={}, exit_code=exit_code, timed_out=timed_out))
    assert (result.status, result.reward, result.report["reason"]) == (Status.COMPLETED, reward, reason)
    assert result.report["exit_code"] == exit_code


async def check(params, answer=None, runtime=None):  # type: ignore[no-untyped-def]
    return await run_evaluator("output", EvalContext(task={}, params=params, final_answer=answer, runtime=runtime))


@pytest.mark.parametrize(
    ("params", "answer", "reward"),
    [
        ({"regex": r"\b42\b"}, "The answer is 42.", 1.0),
        ({"regex": r"\b42\b"}, "The answer is 420.", 0.0),
        ({"regex": "^done$"}, "DONE", 0.0),
        ({"regex": "^done$", "ignore_case": True}, "DONE", 1.0),
        ({"exact": "paris"}, "  paris\n", 1.0),
        ({"exact": "paris", "strip": False}, "  paris\n", 0.0),
        ({"exact": "Paris", "ignore_case": True}, "paris", 1.0),
        ({"exact": "paris"}, "paris, france", 0.0),
        ({"json": {"path": "result.items.1.id", "equals": 7}}, '{"result": {"items": [{"id": 3}, {"id": 7}]}}', 1.0),
        ({"json": {"path": "result.items.-1.id", "equals": 7}}, '{"result": {"items": [{"id": 3}, {"id": 7}]}}', 1.0),
        ({"json": {"path": "ok", "equals": True}}, '{"ok": true}', 1.0),
        ({"json": {"path": "ok", "equals": True}}, '{"ok": 1}', 0.0),  # 1 is not true in JSON
        ({"json": {"path": "n", "equals": 1}}, '{"n": true}', 0.0),
        ({"json": {"path": "v", "equals": None}}, '{"v": null}', 1.0),
        ({"json": {"path": "", "equals": [1, 2]}}, "[1, 2]", 1.0),
        ({"json": {"path": "a", "equals": "x"}}, 'Here you go:\n```json\n{"a": "x"}\n```\n', 1.0),
    ],
)
async def test_output_modes_on_the_answer(params, answer, reward) -> None:  # type: ignore[no-untyped-def]
    result = await check(params, answer)
    assert result.status is Status.COMPLETED
    assert result.reward == reward, result.report
    assert result.report["passed"] is (reward == 1.0) and result.report["reason"]


@pytest.mark.parametrize(
    ("params", "answer", "reason"),
    [
        ({"json": {"path": "a", "equals": 1}}, "not json at all", "not valid JSON"),
        ({"json": {"path": "a.b", "equals": 1}}, '{"a": {"c": 1}}', "JSON has no field 'a.b'"),
        ({"json": {"path": "a.5", "equals": 1}}, '{"a": [1]}', "JSON has no field 'a.5'"),
        ({"regex": "x"}, None, "the rollout has no final answer"),
    ],
)
async def test_output_failures_carry_the_reason(params, answer, reason) -> None:  # type: ignore[no-untyped-def]
    result = await check(params, answer)
    assert (result.status, result.reward) == (Status.COMPLETED, 0.0)
    assert result.report["reason"].startswith(reason)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"regex": "a", "exact": "a"},
        {"regex": "("},
        {"command": "true", "file": "x"},
        {"regex": "a", "colour": "red"},
        {"json": {"path": "a"}},
    ],
)
async def test_bad_output_specs_are_errors(params) -> None:  # type: ignore[no-untyped-def]
    result = await check(params, "a")
    assert result.status is Status.ERROR and "ConfigError: bad output evaluator spec" in result.report["error"]


async def test_output_on_a_workspace_file(local_runtimes) -> None:  # type: ignore[no-untyped-def]
    agent = local_runtimes()
    await agent.prepare()
    await agent.write_file("/testbed/out/result.json", b'{"status": "ok", "count": 3}')
    assert (
        await check({"file": "out/result.json", "json": {"path": "count", "equals": 3}}, runtime=agent)
    ).reward == 1.0
    assert (await check({"file": "/testbed/out/result.json", "regex": '"status": "ok"'}, runtime=agent)).reward == 1.0
    missing = await check({"file": "out/nope.txt", "regex": "x"}, runtime=agent)
    assert missing.reward == 0.0 and "is missing" in missing.report["reason"]
    no_runtime = await check({"file": "out/result.json", "regex": "x"})
    assert no_runtime.status is Status.ERROR and "agent's runtime" in no_runtime.report["error"]


async def test_output_command_exit_code(local_runtimes) -> None:  # type: ignore[no-untyped-def]
    agent = local_runtimes()
    await agent.prepare()
    await agent.write_file("/testbed/answer.txt", b"42\n")
    # the task asks for the agent's own runtime, outside the grading contract, and must say so
    refused = await check({"command": "true", "refresh_runtime": False}, runtime=agent)
    assert refused.status is Status.ERROR and "integrity: {policy: off}" in refused.report["error"]
    in_place = {"refresh_runtime": False, "integrity": {"policy": "off"}}
    passed = await check({"command": "grep -qx 42 answer.txt", **in_place}, runtime=agent)
    assert passed.reward == 1.0 and passed.report["exit_code"] == 0 and passed.report["runtime"] == "agent"
    failed = await check({"command": "echo checking >&2; grep -qx 41 answer.txt", **in_place}, runtime=agent)
    assert failed.reward == 0.0 and failed.report["reason"] == "command exited 1, expected 0"
    assert "checking" in failed.report["output_tail"]
    expected_3 = await check({"command": "exit 3", "exit_code": 3, **in_place}, runtime=agent)
    assert expected_3.reward == 1.0


async def test_output_command_timeout(local_runtimes) -> None:  # type: ignore[no-untyped-def]
    agent = local_runtimes()
    await agent.prepare()
    result = await check({"command": "sleep 30", "timeout_s": 0.3, "refresh_runtime": False,
                          "integrity": {"policy": "off"}}, runtime=agent)
    assert (result.status, result.reward) == (Status.TIMEOUT, 0.0)
    assert result.report["reason"] == "command exceeded 0.3 s"


async def test_output_command_in_a_fresh_runtime(local_runtimes) -> None:  # type: ignore[no-untyped-def]
    agent = local_runtimes()
    await agent.prepare()
    base = await agent.exec("git init -q && git -c user.name=t -c user.email=t@t commit -q --allow-empty -m base")
    assert base.exit_code == 0, base.output
    await agent.write_file("/testbed/dirty.txt", b"agent was here")
    await agent.write_file("/testbed/conftest.py", b"raise SystemExit(0)\n")
    made = []

    def factory():  # type: ignore[no-untyped-def]
        made.append(local_runtimes())
        return made[-1]

    ctx = EvalContext(
        task={},
        params={"command": "test -e dirty.txt && test ! -e conftest.py"},  # fresh is the default
        runtime=agent,
        runtime_factory=factory,
    )
    result = await run_evaluator("output", ctx)
    assert result.reward == 1.0 and len(made) == 1 and made[0].stopped, result.report
    assert result.report["runtime"] == "fresh" and result.report["policy"] == "allowlist-workspace"
    assert result.report["dropped_paths"] == [{"path": "conftest.py", "rule": "runner or packaging config"}]
    assert result.report["graded_paths"] == ["dirty.txt"] and "+agent was here" in result.report["graded_patch"]


PASS_ALL = (b"import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            b"    out = yield\n    rep = out.get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")


async def test_a_command_that_runs_pytest_meets_the_canaries(local_runtimes) -> None:  # type: ignore[no-untyped-def]
    """A task that widens the allow-list to a conftest.py still cannot forge a pytest run: the
    grader's plugin rides along with the command, and its must-fail canaries pass: tampered."""
    agent = local_runtimes()
    await agent.prepare()
    await agent.write_file("/testbed/conftest.py", PASS_ALL)

    def factory():  # type: ignore[no-untyped-def]
        return local_runtimes()

    command = "mkdir -p t && printf 'def test_a():\\n    assert 1 == 2\\n' > t/test_a.py && python -m pytest -q t/test_a.py"
    honest = await run_evaluator("output", EvalContext(task={}, params={"command": command}, runtime=agent,
                                                       runtime_factory=factory))
    assert honest.reward == 0.0 and honest.report["dropped_paths"][0]["path"] == "conftest.py"
    scanned = await run_evaluator("output", EvalContext(
        task={}, params={"command": command, "integrity": {"allow": ["conftest.py"]}}, runtime=agent, runtime_factory=factory))
    assert scanned.reward == 0.0 and scanned.report["tampered"] is True and scanned.report["scan_findings"], scanned.report
    widened = await run_evaluator("output", EvalContext(  # the scan widened too: the hook reaches the run
        task={}, params={"command": command, "integrity": {"allow": ["conftest.py"], "scan_ignore": sorted(RUNNER_RULES)}},
        runtime=agent, runtime_factory=factory))
    assert widened.reward == 0.0 and widened.report["tampered"] is True, widened.report
    assert widened.report["exit_code"] == 0  # the forged run itself passed
    assert any(not c["ok"] for c in widened.report["canaries"])
