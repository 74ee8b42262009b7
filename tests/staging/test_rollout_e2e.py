"""The main job end to end, as a user runs it: ``polar-env rollout`` on the toy SWE tasks with the
real pi CLI in bwrap sandboxes, the embedded CPU engine, and the swebench evaluator grading each
workspace diff in a fresh sandbox. The engine is scripted (a test double for the *policy* only:
the tokens are forced, the model's logprobs and everything else are real) so that one run must be
resolved (reward 1) and another must not (reward 0); a last run lets the random model sample freely.

Prerequisites as in tests/e2e (bubblewrap, node, pi via scripts/install_harnesses.sh pi, the
swebench and parquet extras); missing ones skip locally and fail under CI.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_env.cli import main
from polar_env.harnesses import get_harness, install_hint, is_installed
from polar_env.tasks.toy import toy_tasks
from polar_env.trajectory.export import read_jsonl
from tests.conftest import require_bwrap, unavailable

pytestmark = pytest.mark.slow
TOY = "toy__calc-1"


@pytest.fixture(scope="module")
def ready() -> None:
    require_bwrap()
    if shutil.which("node") is None:
        unavailable("node is not on PATH (apt-get install -y nodejs npm)")
    pi = get_harness("pi")
    if not is_installed(pi):
        unavailable(f"pi is not installed; run {install_hint(pi)}")
    for module, extra in (("swebench.harness.grading", "swebench"), ("pyarrow", "parquet")):
        try:
            __import__(module)
        except ImportError:
            unavailable(f"the {extra} extra is not installed (pip install -e '.[{extra}]')")


def script(tmp: Path, steps: list[dict[str, Any]]) -> Path:
    path = tmp / "script.json"
    path.write_text(json.dumps({"steps": steps}))
    return path


def fixing_steps() -> list[dict[str, Any]]:
    patch = toy_tasks(ids=[TOY])[0].patch
    blob = base64.b64encode(patch.encode()).decode()
    return [{"command": f"cd /testbed && echo {blob} | base64 -d | git -c 'safe.directory=*' apply && git status --short",
             "reasoning": "Apply the fix."},
            {"text": "Fixed: {tool_output}", "reasoning": "Done."}]


def run(tmp: Path, *extra: str) -> tuple[int, dict[str, Any], Path]:
    out = tmp / "out"
    code = main(["rollout", "--task-id", TOY, "--samples", "2", "--out", str(out), "--no-progress",
                 "--max-running", "2", *extra])
    return code, json.loads((out / "latest" / "report.json").read_text()), out / "latest"


def test_rollout_fixes_the_toy_task_and_writes_rewarded_trajectories(ready: None, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, report, out = run(tmp_path, "--engine-script", str(script(tmp_path, fixing_steps())))
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert report["statuses"] == {"completed": 2}, report["session_rows"]
    assert report["mean_reward"] == 1.0 and all(r["resolved"] is True for r in report["session_rows"])
    assert report["per_request_traces"] == 4 and report["merged_traces"] == 2  # 2 calls per session → 1 chain
    assert report["drift_boundaries"] == 0
    assert 0 < report["engine_busy_fraction"] <= 1 and report["running_occupancy"] > 0
    assert {"capture", "trajectories.jsonl", "trajectories.parquet", "sessions.jsonl", "report.json",
            "timeline.png"} <= set(report["files"])
    assert "mean reward 1.0" in printed
    trajectories = read_jsonl(out / "trajectories.jsonl")
    assert len(trajectories) == 2
    for traj in trajectories:
        assert traj.reward == 1.0 and traj.status.value == "completed"
        assert traj.metadata["task_id"] == TOY and traj.metadata["harness"] == "pi"
        assert traj.metadata["evaluation"]["resolved"] is True and traj.metadata["weight_versions"] == ["0"]
        trace = traj.traces[0]
        assert trace.reward == 1.0 and 1 in trace.loss_mask and 0 in trace.loss_mask
        assert all(lp == 0.0 for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True) if m == 1)
    import pyarrow.parquet as pq

    table = pq.read_table(out / "trajectories.parquet")
    assert table.num_rows == 2 and table.column("reward").to_pylist() == [1.0, 1.0]
    row = table.slice(0, 1).to_pylist()[0]
    assert len(row["response_ids"]) == len(row["loss_mask"]) == len(row["response_logprobs"])
    sessions = [orjson.loads(line) for line in (out / "sessions.jsonl").read_bytes().splitlines()]
    assert [s["status"] for s in sessions] == ["completed", "completed"] and "trajectory" not in sessions[0]
    journals = sorted((out / "capture" / "node-0").glob("*.jsonl"))
    assert len(journals) == 2


def test_a_useless_agent_gets_reward_zero(ready: None, tmp_path: Path) -> None:
    steps = [{"command": "cd /testbed && echo notes > NOTES.txt && ls", "reasoning": "Look."},
             {"text": "Looked: {tool_output}", "reasoning": "Done."}]
    code, report, _ = run(tmp_path, "--engine-script", str(script(tmp_path, steps)))
    assert code == 0
    assert report["statuses"] == {"completed": 2} and report["mean_reward"] == 0.0
    assert all("FAIL_TO_PASS" in (r["reason"] or "") for r in report["session_rows"]), report["session_rows"]


def test_the_random_model_samples_freely(ready: None, tmp_path: Path) -> None:
    code, report, out = run(tmp_path, "--max-tokens", "24", "--samples", "1")
    assert code == 0, report["session_rows"]
    assert report["sessions"] == 1 and report["statuses"] == {"completed": 1}
    assert report["mean_reward"] == 0.0 and report["session_rows"][0]["reason"] == "empty patch"
    traj = read_jsonl(out / "trajectories.jsonl")[0]
    assert 0 < len(traj.traces[0].response_ids) and sum(traj.traces[0].loss_mask) <= 24
