"""Forging a pass from inside the test process (``PROCESS_ATTACKS`` in ``process_attacks.py``) under
``swebench``, ``output`` and ``harbor`` with the static scan widened away (what the test process's own
defences hold: every attack → reward 0 and not masked but ``swallow_in_callinfo``, which only the scan
stops), and under the default policy, where the scan stops every one before anything runs
(``tampered``); the gold fix → 1 and a no-op → 0 under each in the same run. Every case is a real shell command of the ``loop``
harness in a real bubblewrap session, graded by the real evaluator in a fresh sandbox; the policy is
a test double (``AttackPolicy``), the engine the simulated one.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import require_bwrap, require_swebench
from tests.evaluators.process_attacks import EVALUATORS, PROCESS_ATTACKS, run_process_attacks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_bwrap()
    require_swebench()
    return run_process_attacks(tmp_path_factory.mktemp("process_attacks"))


def _summary(r: Any) -> dict[str, Any]:
    ev = r.evaluation
    return {"status": r.status.value, "reward": r.reward, "mask": r.mask, "failure_kind": r.failure_kind,
            "reason": ev.get("reason"), "error": ev.get("error"), "state": ev.get("grader_state"),
            "log_tail": str(ev.get("log_tail", ""))[-1500:]}


# what the test process cannot hold without the scan (docs/grading.md, "What the contract cannot stop")
SCAN_ONLY = {"swallow_in_callinfo"}
CASES = [(a, e) for a in PROCESS_ATTACKS for e in EVALUATORS if a.name not in SCAN_ONLY]


@pytest.mark.parametrize(("attack", "evaluator"), CASES, ids=[f"{a.klass}-{a.name}@{e}" for a, e in CASES])
def test_attack_scores_zero_unmasked(results: dict[str, Any], attack: Any, evaluator: str) -> None:
    r = results[f"{attack.name}@{evaluator}"]
    assert r.reward == 0.0 and r.mask is False, (attack.name, attack.note, _summary(r))


@pytest.mark.parametrize("attack", PROCESS_ATTACKS, ids=[a.name for a in PROCESS_ATTACKS])
def test_the_scan_stops_every_attack_before_it_runs(results: dict[str, Any], attack: Any) -> None:
    r = results[f"{attack.name}@scan"]
    assert (r.reward, r.mask, r.failure_kind.value if r.failure_kind else None) == (0.0, False, "tampered"), _summary(r)
    assert r.evaluation["scan_findings"] and "grader_state" not in r.evaluation  # nothing ran


@pytest.mark.parametrize("evaluator", [*EVALUATORS, "scan"])
def test_controls(results: dict[str, Any], evaluator: str) -> None:
    gold, noop = results[f"gold_fix@{evaluator}"], results[f"noop@{evaluator}"]
    assert gold.status.value == "completed" and gold.reward == 1.0 and gold.mask is False, _summary(gold)
    assert noop.reward == 0.0 and noop.mask is False, _summary(noop)


def test_tampering_is_named_where_the_report_shows_it(results: dict[str, Any]) -> None:
    """Positive evidence → ``tampered``; a run that never finished or an outcome refused is a plain 0."""
    for name in ("flip_by_name", "flip_project_failures", "truncate_report"):
        for evaluator in EVALUATORS:
            r = results[f"{name}@{evaluator}"]
            assert r.failure_kind is not None and r.failure_kind.value == "tampered", (name, evaluator, _summary(r))
    for evaluator in EVALUATORS:
        r = results[f"exit_zero@{evaluator}"]
        assert r.failure_kind is None and r.evaluation["grader_state"] == "unfinished", _summary(r)
