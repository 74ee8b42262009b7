"""PolarEnv, the trainer-facing API, on the real embedded engine in-process (scripted policy so the
turns are deterministic; the logprobs are the model's) with the loop harness in bwrap sandboxes."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_env import PolarEnv, PolarEnvConfig, TaskRequest
from polar_env.errors import ConfigError
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow


def config(tmp_path: Path) -> PolarEnvConfig:
    script = tmp_path / "script.json"
    script.write_text('{"steps": [{"command": "echo 6*7=$((6*7))", "reasoning": "compute"}, '
                      '{"text": "The answer is {tool_output}", "reasoning": "done"}]}')
    return PolarEnvConfig.model_validate({
        "engine": {"kind": "embedded", "script": str(script)}, "harness": "loop",
        "evaluator": {"name": "output", "regex": "6\\*7=42"}, "store": str(tmp_path / "store"),
        "limits": {"max_running": 2}})


def test_rollout_sync_and_weight_updates(tmp_path: Path) -> None:
    require_bwrap()
    env = PolarEnv(config(tmp_path))
    try:
        group = env.rollout_sync({"task_id": "mult", "instruction": "What is 6*7? Use bash."}, n=2)
        assert group.rewards == [1.0, 1.0]
        trajs = group.trajectories
        assert len(trajs) == 2 and all(t.metadata["weight_versions"] == ["0"] for t in trajs)
        assert {t.metadata["sample_index"] for t in trajs} == {0, 1}
        assert len({t.metadata["group_id"] for t in trajs}) == 1

        engine = env.engine
        state = {k: v.clone() * 1.0 for k, v in engine.model.state_dict().items()}
        assert env.update_weights_sync(state, version="step-1") == "step-1"
        assert engine.weight_version == 1
        after = env.rollout_sync(TaskRequest(task_id="mult", instruction="What is 6*7? Use bash.", num_samples=1,
                                             agent={"harness": "loop"},
                                             evaluator={"name": "output", "regex": "6\\*7=42"}))
        traj = after.trajectories[0]
        assert traj.metadata["weight_versions"] == ["step-1"] and after.rewards == [1.0]
    finally:
        env.close()


def test_config_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {kind: nope}\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        PolarEnvConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        PolarEnvConfig.from_yaml(tmp_path / "missing.yaml")
    env = PolarEnv({"harness": "loop"})
    with pytest.raises(ConfigError, match="task_id"):
        env.rollout_sync({"instruction": "no id"})
    env.close()
