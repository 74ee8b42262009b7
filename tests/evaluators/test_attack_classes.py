"""The task-agnostic attack classes (``CONSTRUCTION_ATTACKS`` in ``attacks.py``) against the grader:
each one → reward 0 and not masked (breaking the grader must not buy a dropped sample either), while
the gold fix still → 1 and a no-op → 0. Every case is a real shell command of the ``loop`` harness in
a real bubblewrap session, graded by the real ``swebench`` evaluator in a fresh sandbox; all of them
run in one module-scoped ``PolarEnv`` run.

The policy (the model) is a test double (``AttackPolicy``: scripted turns picked by the instruction);
the engine is the simulated one. ``scripts/attack_rewards.py`` prints the same cases as a table.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import require_bwrap, require_swebench
from tests.evaluators.attacks import (
    CONSTRUCTION_ATTACKS,
    NOOP_COMMAND,
    gold_command,
    run_attacks,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_bwrap()
    require_swebench()
    return run_attacks(tmp_path_factory.mktemp("attack_classes"), CONSTRUCTION_ATTACKS,
                       extra=[("gold_fix", gold_command(), {}), ("noop", NOOP_COMMAND, {})], max_running=8)


def _summary(r: Any) -> dict[str, Any]:
    ev = r.evaluation
    return {"status": r.status.value, "reward": r.reward, "mask": r.mask, "failure_kind": r.failure_kind,
            "reason": ev.get("reason"), "dropped": ev.get("dropped_paths"), "error": ev.get("error"),
            "log_tail": str(ev.get("log_tail", ""))[-1500:]}


@pytest.mark.parametrize("attack", CONSTRUCTION_ATTACKS, ids=[f"{a.klass}-{a.name}" for a in CONSTRUCTION_ATTACKS])
def test_attack_scores_zero_unmasked(results: dict[str, Any], attack: Any) -> None:
    r = results[attack.name]
    assert r.reward == 0.0 and r.mask is False, (attack.name, attack.note, _summary(r))


def test_gold_fix_scores_one(results: dict[str, Any]) -> None:
    r = results["gold_fix"]
    assert r.status.value == "completed" and r.reward == 1.0 and r.mask is False, _summary(r)


def test_noop_scores_zero(results: dict[str, Any]) -> None:
    r = results["noop"]
    assert r.reward == 0.0 and r.mask is False, _summary(r)
