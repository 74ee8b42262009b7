"""Print each grading attack's reward (and the paths the policy dropped) on this checkout.

Every attack in ``tests/evaluators/attacks.py`` runs as a real shell command of the ``loop`` harness
in a real bubblewrap session and is graded by the real evaluator in a fresh sandbox. Run it on two
checkouts to compare (``PYTHONPATH=<old checkout>:<this checkout> python scripts/attack_rewards.py``
grades with the old package and these attacks)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from tests.evaluators.attacks import (
    ATTACKS,
    USER_SITE_ATTACK,
    gold_command,
    run_attacks,
)


def main() -> None:
    import polar_env

    with tempfile.TemporaryDirectory() as tmp:
        results = run_attacks(Path(tmp), [*ATTACKS, USER_SITE_ATTACK], extra=[("gold_fix", gold_command(), {})])
    print(f"package: {Path(polar_env.__file__).parent}")
    print(f"{'attack':26} {'status':10} {'reward':>6}  dropped")
    for name, r in results.items():
        dropped = ", ".join(d["path"] for d in r.evaluation.get("dropped_paths", []))
        print(f"{name:26} {r.status.value:10} {r.reward:6.1f}  {dropped}")


if __name__ == "__main__":
    main()
