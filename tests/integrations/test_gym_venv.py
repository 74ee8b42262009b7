"""The Gym side, in a real nemo-gym 0.7.0 venv (Python 3.13), when one exists: the manifest passes
``gym env validate`` with the declared profile, and the agent's ``/run`` result validates as Gym's
own response model with the token fields intact. ``scripts/check_nemo_gym.sh`` builds that venv
(and runs a whole rollout through Gym); this test reuses it and otherwise skips."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from polar_env.integrations.nemo_gym import GYM_ROOT

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("POLAR_NEMO_GYM_VENV", "/tmp/polar_nemo_gym_check/venv"))
PYTHON = VENV / "bin" / "python"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (PYTHON.exists() and (VENV / ".polar-ready").exists()),
    reason=f"no nemo-gym 0.7.0 venv at {VENV}: run scripts/check_nemo_gym.sh once (or set POLAR_NEMO_GYM_VENV)")]

SCHEMA_CHECK = f"""
import sys
sys.path[:0] = [{str(REPO_ROOT)!r}, {str(GYM_ROOT / "responses_api_agents" / "polar_agent")!r},
                {str(REPO_ROOT / "tests" / "integrations")!r}]
from types import SimpleNamespace
from app import PolarRunResponse
from integration_doubles import multi_turn_trace, trajectory
from polar_env.integrations.nemo_gym.agent import build_result
from polar_env.integrations.nemo_gym.convert import check_contiguous
row = {{"responses_create_params": {{"input": [{{"role": "user", "content": "fix"}}]}}, "instance_id": "x"}}
result = SimpleNamespace(session_id="s", status="completed", reward=1.0, evaluation={{"resolved": True}},
                         failure_kind=None, failure_detail=None, mask=False, trajectory=trajectory([multi_turn_trace()]))
out = PolarRunResponse.model_validate(build_result(row, result, model="m")).model_dump(mode="json")
items = out["response"]["output"]
assert len(items) == 3 and all("generation_token_ids" in i for i in items), items
assert check_contiguous(items) == [1, 2, 3, 10, 11, 99, 7, 8, 12, 99, 7, 9, 9, 13, 14]
assert out["reward"] == 1.0 and out["mask_sample"] is False and out["instance_id"] == "x"
print("ok")
"""


def test_run_result_validates_as_gym_response() -> None:
    proc = subprocess.run([str(PYTHON), "-c", SCHEMA_CHECK], capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_manifest_passes_gym_env_validate(tmp_path: Path) -> None:
    env = {**os.environ, "NEMO_GYM_EXTRA_ROOTS": str(GYM_ROOT), "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.run([str(VENV / "bin" / "gym"), "env", "validate", "--manifest",
                           str(GYM_ROOT / "environments" / "polar_swegym" / "manifest.yaml")],
                          capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "profile=external-agent-loop" in text and "inferred=external-agent-loop" in text and "Warning" not in text
