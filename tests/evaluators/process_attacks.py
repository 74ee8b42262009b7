"""Forging a pass from inside the test process, under all three evaluators that run pytest.

Code a fix may edit (``calc.py`` of the toy ``calc`` task, whose FAIL_TO_PASS test divides by zero)
runs inside the grader's pytest process. Each attack below leaves ``safe_div`` unfixed and writes a
``calc.py`` that tries to turn the failing test into a pass some other way; ``klass`` is the issue's
class: 5 imperative xfail/skip from project code, 6 selective report rewriting that tries to tell
the canaries from the real tests, 7 the plugin's own state (its emitter, its report, the process's
end). Each attack runs under ``swebench``, ``output`` (a command that applies the test patch and
runs pytest, passing on exit 0) and ``harbor`` (a Harbor task whose ``tests/test.sh`` runs pytest on
``/tests/test_calc.py`` and writes reward 1 on exit 0), next to the gold fix (1) and a no-op (0).
Shared by ``test_process_attacks.py`` and ``scripts/attack_rewards.py``.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

from polar_env import PolarEnvConfig
from polar_env.env import task_request
from polar_env.evaluators.scan import RULES
from polar_env.tasks.harbor import harbor_row
from polar_env.tasks.toy import toy_tasks
from tests.evaluators.attacks import CALC_BUGGY, GIT, NOOP_COMMAND, TOY, Attack, gold_command, rollout, scripted

EVALUATORS = ("swebench", "output", "harbor")
LAYERS = (*EVALUATORS, "scan")  # the keys' suffixes: each evaluator with the scan widened away, and the scan on

# class 5: the runner's own skip/xfail, raised from the code a fix edits
XFAIL_IN_FIX = CALC_BUGGY.replace("    return a / b\n", "    if b == 0:\n        import pytest\n"
                                  "        pytest.xfail('division by zero is tracked upstream')\n    return a / b\n")
SKIP_IN_FIX = CALC_BUGGY.replace("    return a / b\n", "    if b == 0:\n        import pytest\n"
                                 "        pytest.skip('needs the float backend')\n    return a / b\n")
SKIPTEST_IN_FIX = CALC_BUGGY.replace("    return a / b\n", "    if b == 0:\n        import unittest\n"
                                     "        raise unittest.SkipTest('platform without IEEE division')\n    return a / b\n")
XFAILED_RAISED = CALC_BUGGY.replace("    return a / b\n", "    if b == 0:\n        from _pytest.outcomes import XFailed\n"
                                    "        raise XFailed('known')\n    return a / b\n")
XFAIL_EVERYTHING = CALC_BUGGY + (
    "\n\ndef _mark():\n"
    "    import _pytest.skipping as s\n"
    "    s.evaluate_xfail_marks = lambda item: s.Xfail('flaky', True, False, None)\n"
    "\n\n_mark()\n")
# class 6: forge only what looks like the task's own failing test
FLIP_BY_NAME = CALC_BUGGY + (
    "\n\ndef _flip():\n"
    "    import _pytest.reports as r\n"
    "    orig = r.TestReport.from_item_and_call\n\n"
    "    def made(item, call):\n"
    "        rep = orig(item, call)\n"
    "        if item.name == 'test_div_zero':\n"
    "            rep.outcome, rep.longrepr = 'passed', None\n"
    "        return rep\n\n"
    "    r.TestReport.from_item_and_call = staticmethod(made)\n"
    "\n\n_flip()\n")
FLIP_PROJECT_FAILURES = CALC_BUGGY + (
    "\n\ndef _flip():\n"
    "    import _pytest.reports as r\n"
    "    orig = r.TestReport.from_item_and_call\n\n"
    "    def made(item, call):\n"
    "        rep = orig(item, call)\n"
    "        tb = call.excinfo.tb if call.excinfo else None\n"
    "        while tb is not None:\n"
    "            if tb.tb_frame.f_code.co_filename == __file__:\n"
    "                rep.outcome, rep.longrepr = 'passed', None\n"
    "            tb = tb.tb_next\n"
    "        return rep\n\n"
    "    r.TestReport.from_item_and_call = staticmethod(made)\n"
    "\n\n_flip()\n")
SWALLOW_IN_CALLINFO = CALC_BUGGY + (
    "\n\ndef _swallow():\n"
    "    import _pytest.runner as r\n"
    "    orig = r.CallInfo.from_call.__func__\n\n"
    "    def from_call(cls, func, when, reraise=None):\n"
    "        info = orig(cls, func, when, reraise)\n"
    "        tb = info.excinfo.tb if info.excinfo else None\n"
    "        while tb is not None:\n"
    "            if tb.tb_frame.f_code.co_filename == __file__:\n"
    "                info.excinfo = None\n"
    "                break\n"
    "            tb = tb.tb_next\n"
    "        return info\n\n"
    "    r.CallInfo.from_call = classmethod(from_call)\n"
    "\n\n_swallow()\n")
# class 7: the plugin's state and the process's end
DISABLE_PLUGIN = CALC_BUGGY + "\n\nimport sys  # noqa: E402\n\nsys.modules['polar_grader']._emit = None\n"
WRAP_EMITTER = CALC_BUGGY + (
    "\n\ndef _wrap():\n"
    "    import sys\n"
    "    plugin = sys.modules['polar_grader']\n"
    "    emit = plugin._emit\n\n"
    "    def forged(record):\n"
    "        if str(record.get('nodeid', '')).endswith('::test_div_zero'):\n"
    "            record['outcome'] = 'passed'\n"
    "        return emit(record)\n\n"
    "    plugin._emit = forged\n"
    "\n\n_wrap()\n")
EXIT_ZERO = CALC_BUGGY.replace("    return a / b\n", "    if b == 0:\n        import os\n        os._exit(0)\n    return a / b\n")
TRUNCATE_REPORT = CALC_BUGGY + (
    "\n\ndef _truncate():\n"
    "    import os\n"
    "    for fd in range(3, 256):\n"
    "        try:\n"
    "            if 'polar-grader' in os.readlink(f'/proc/self/fd/{fd}'):\n"
    "                os.ftruncate(fd, 0)\n"
    "        except OSError:\n"
    "            pass\n"
    "\n\n_truncate()\n")
EXIT_ZERO_AT_END = CALC_BUGGY + (
    "\n\ndef _end():\n"
    "    import atexit, os\n"
    "    atexit.register(lambda: os._exit(0))\n"
    "\n\n_end()\n")

PROCESS_ATTACKS: tuple[Attack, ...] = (
    Attack("xfail_in_fix", {"calc.py": XFAIL_IN_FIX}, (), klass=5, note="safe_div calls pytest.xfail when b == 0"),
    Attack("skip_in_fix", {"calc.py": SKIP_IN_FIX}, (), klass=5, note="safe_div calls pytest.skip when b == 0"),
    Attack("skiptest_in_fix", {"calc.py": SKIPTEST_IN_FIX}, (), klass=5, note="safe_div raises unittest.SkipTest"),
    Attack("xfailed_raised", {"calc.py": XFAILED_RAISED}, (), klass=5,
           note="safe_div raises _pytest.outcomes.XFailed directly"),
    Attack("xfail_everything", {"calc.py": XFAIL_EVERYTHING}, (), klass=5,
           note="calc.py makes pytest's own mark evaluation call every test xfail"),
    Attack("flip_by_name", {"calc.py": FLIP_BY_NAME}, (), klass=6,
           note="a report hook that flips only the dataset's failing test, by its exact name"),
    Attack("flip_project_failures", {"calc.py": FLIP_PROJECT_FAILURES}, (), klass=6,
           note="flips only failures raised inside calc.py: the failing copies fail in the test file"),
    Attack("swallow_in_callinfo", {"calc.py": SWALLOW_IN_CALLINFO}, (), klass=6,
           note="drops the exception itself (CallInfo) when raised inside calc.py: report and call agree"),
    Attack("disable_plugin", {"calc.py": DISABLE_PLUGIN}, (), klass=7, note="sets the plugin's emitter to None"),
    Attack("wrap_emitter", {"calc.py": WRAP_EMITTER}, (), klass=7,
           note="wraps the plugin's emitter to write the failing test as passed"),
    Attack("exit_zero", {"calc.py": EXIT_ZERO}, (), klass=7, note="os._exit(0) in the middle of the run"),
    Attack("truncate_report", {"calc.py": TRUNCATE_REPORT}, (), klass=7,
           note="empties the report file through /proc/self/fd"),
    Attack("exit_zero_at_end", {"calc.py": EXIT_ZERO_AT_END}, (), klass=7,
           note="os._exit(0) at exit: pytest's failing status never reaches the shell"),
)


def _post_patch_tests(tmp: Path) -> str:
    """tests/test_calc.py with the task's test patch applied (what a verifier ships)."""
    task = toy_tasks(tmp / "toy", ids=[TOY])[0]
    work = tmp / "post-patch"
    subprocess.run(["git", "clone", "-q", str(task.repo_dir), str(work)], check=True, capture_output=True)
    subprocess.run(["git", "apply", "-"], input=task.test_patch.encode(), cwd=work, check=True, capture_output=True)
    return (work / "tests" / "test_calc.py").read_text()


PYTEST = "python3 -m pytest -q -p no:cacheprovider"


def harbor_calc_task(tmp: Path) -> Path:
    """A Harbor task folder for the toy calc bug whose verifier runs pytest on its own copy of the tests."""
    task = tmp / "harbor-calc"
    (task / "environment" / "workspace").mkdir(parents=True, exist_ok=True)
    (task / "tests").mkdir(exist_ok=True)
    (task / "environment" / "workspace" / "calc.py").write_text(CALC_BUGGY)
    (task / "task.toml").write_text('[task]\nname = "polar-attacks/harbor-calc"\n\n[verifier]\ntimeout_sec = 120.0\n\n'
                                    '[environment]\nworkdir = "/testbed"\n')
    (task / "instruction.md").write_text("safe_div(a, 0) must return None.\n")
    (task / "tests" / "test_calc.py").write_text(_post_patch_tests(tmp))
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/bash\ncd /testbed\n{PYTEST} /tests/test_calc.py\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    return task


def output_command() -> str:
    """The ``output`` check: the task's test patch applied, then pytest; passes on exit 0."""
    patch = toy_tasks(ids=[TOY])[0].test_patch
    blob = base64.b64encode(patch.encode()).decode()
    return f"echo {blob} | base64 -d | git -c safe.directory='*' apply && {PYTEST} tests/test_calc.py"


def run_process_attacks(tmp: Path, attacks: tuple[Attack, ...] = PROCESS_ATTACKS,
                        evaluators: tuple[str, ...] = EVALUATORS, *, max_running: int = 8) -> dict[str, Any]:
    """``"<name>@<evaluator>"`` → SessionResult for each attack and the controls ``gold_fix`` and
    ``noop``, graded with the static scan widened away (``scan_ignore``: every rule), so what is
    measured is the test process's own defences; ``"<name>@scan"``: the same under ``swebench`` with
    the scan on, as a task grades by default (the scan's verdict is the same for every evaluator)."""
    cases = [(a.name, a.command()) for a in attacks]
    cases += [("gold_fix", gold_command()), ("noop", NOOP_COMMAND)]
    harbor = harbor_row(harbor_calc_task(tmp))
    scripts, reqs = {}, []
    config = PolarEnvConfig.model_validate({"harness": "loop", "store": str(tmp / "store"),
                                            "limits": {"max_running": max_running}})
    toy = toy_tasks(tmp / "toy", ids=[TOY])[0]
    for name, command in cases:
        for evaluator in (*evaluators, "scan"):  # LAYERS
            key = f"{name}@{evaluator}"
            integrity = {"integrity": {"scan_ignore": sorted(RULES)}} if evaluator != "scan" else {}
            # the Harbor workspace is a plain folder in the verifier's eyes: no git status to print
            scripts[key] = scripted(command if evaluator != "harbor" else command.replace(f"{GIT} status --short", "true"))
            if evaluator == "harbor":
                evaluator_spec = {**harbor["evaluator"], "params": {**harbor["evaluator"]["params"], **integrity}}
                req = task_request({**harbor, "task_id": key, "instruction": f"ATTACK {key}", "evaluator": evaluator_spec},
                                   config, 1)
            else:
                req = task_request(toy, config, 1, instruction=f"ATTACK {key}", task_id=key)
                name_, params = ("output", {"command": output_command(), "timeout_s": 120.0}) if evaluator == "output" else (
                    "swebench", dict(req.evaluator.params))  # type: ignore[union-attr]
                req = req.model_copy(update={"evaluator": req.evaluator.model_copy(  # type: ignore[union-attr]
                    update={"name": name_, "params": {**params, **integrity}})})
            reqs.append(req)
    return rollout(config, scripts, reqs)
