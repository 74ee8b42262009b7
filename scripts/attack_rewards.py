"""Print every grading attack's reward on this checkout, with the controls, in one run.

Every attack in ``tests/evaluators/attacks.py`` (``ATTACKS``, ``USER_SITE_ATTACK`` and the
task-agnostic ``CONSTRUCTION_ATTACKS``) runs as a real shell command of the ``loop`` harness in a
real bubblewrap session and is graded by the real evaluator in a fresh sandbox, next to two
controls: the gold fix (must be 1) and a no-op (must be 0). The table gives each one's class,
status, reward, mask, failure kind and the paths the policy dropped; the last line counts the
attacks that beat the grader (reward > 0, or a masked session: a sample a trainer drops instead of
learning its 0).

Run it from the checkout (``python scripts/attack_rewards.py``): with no ``PYTHONPATH`` this
checkout's package is graded. To grade another checkout with these attacks, put it first:
``PYTHONPATH=<other checkout> python <this checkout>/scripts/attack_rewards.py`` (the attacks are
always loaded from this file's checkout)."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("PYTHONPATH"):
    sys.path.append(str(ROOT))  # the PYTHONPATH checkout's package wins
else:
    sys.path.insert(0, str(ROOT))  # not an installed (editable) copy from elsewhere


def _module(name: str, filename: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "evaluators" / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _attacks_module() -> Any:
    return _module("polar_attack_suite", "attacks.py")


def dropped_paths(evaluation: Any) -> str:
    """The dropped paths of an evaluation report, whatever shape they come in."""
    raw = evaluation.get("dropped_paths") if isinstance(evaluation, dict) else None
    if not raw:
        return ""
    if isinstance(raw, dict):
        raw = list(raw.values()) if not {"path", "rule"} & raw.keys() else [raw]
    if isinstance(raw, str):
        raw = [raw]
    out = []
    for d in raw if isinstance(raw, list | tuple) else [raw]:
        out.append(str(d.get("path", d)) if isinstance(d, dict) else str(d))
    return ", ".join(out)


def main() -> None:
    import polar_env

    suite = _attacks_module()
    process = _module("polar_process_attacks", "process_attacks.py")
    attacks = [*suite.ATTACKS, suite.USER_SITE_ATTACK, *suite.CONSTRUCTION_ATTACKS, *suite.ESCAPE_ATTACKS]
    layers = getattr(process, "LAYERS", process.EVALUATORS)
    controls = {"gold_fix": 1.0, "noop": 0.0, **{f"{c}@{e}": w for c, w in (("gold_fix", 1.0), ("noop", 0.0))
                                                for e in layers}}
    with tempfile.TemporaryDirectory() as tmp:
        results = suite.run_attacks(Path(tmp), attacks, extra=[("gold_fix", suite.gold_command(), {}),
                                                                ("noop", suite.NOOP_COMMAND, {})], max_running=8)
        results.update(process.run_process_attacks(Path(tmp) / "process"))
    klass = {a.name: (str(a.klass) if a.klass != "" else "old") for a in attacks}
    klass.update({f"{a.name}@{e}": str(a.klass) for a in process.PROCESS_ATTACKS for e in layers})
    print(f"package: {Path(polar_env.__file__).parent}")
    print(f"{'attack':34} {'class':6} {'status':10} {'reward':>6} {'mask':5} {'failure_kind':18} {'flagged':>7}  dropped")
    beat, beat_run = 0, 0  # under the default policy; in the test process with the scan widened away
    for name, r in results.items():
        kind = r.failure_kind.value if r.failure_kind is not None else "-"
        flagged = r.evaluation.get("flagged") if isinstance(r.evaluation, dict) else None
        nflag = len(flagged) if isinstance(flagged, list) else 0
        print(f"{name:34} {klass.get(name, 'ctrl'):6} {r.status.value:10} {r.reward:6.1f} {str(r.mask):5} {kind:18} "
              f"{nflag:7d}  {dropped_paths(r.evaluation)}")
        if name in controls:
            continue
        won = r.reward > 0 or bool(r.mask)
        if "@" in name and not name.endswith("@scan"):
            beat_run += won
        else:
            beat += won
    for name, want in controls.items():
        r = results[name]
        ok = r.reward == want and not r.mask
        print(f"control {name}: reward {r.reward:.1f} (want {want:.1f}){'' if ok else '  <-- CONTROL FAILED'}")
    print(f"{beat} attacks scored > 0 or were masked under the default policy")
    print(f"{beat_run} in-process attacks (name@evaluator) scored > 0 or were masked with the static scan widened away")


if __name__ == "__main__":
    main()
