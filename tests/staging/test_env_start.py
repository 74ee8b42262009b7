"""``PolarEnv.start_sync``: a custom loop gets the engine, gateway and weight sync before any
rollout, and the first rollout reuses them (no throw-away rollout to reach ``env.engine``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_env import PolarEnv, PolarEnvConfig
from polar_env.errors import ConfigError
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow


def test_start_sync_gives_the_engine_and_weight_sync_before_any_rollout(tmp_path: Path) -> None:
    require_bwrap()
    script = tmp_path / "script.json"
    script.write_text('{"steps": [{"text": "done"}]}')
    env = PolarEnv(PolarEnvConfig.model_validate({
        "engine": {"kind": "embedded", "script": str(script)}, "harness": "loop",
        "evaluator": {"name": "output", "regex": "done"}, "store": str(tmp_path / "store")}))
    with pytest.raises(ConfigError, match="start_sync"):
        _ = env.engine  # not started: the one line names the sync form too
    try:
        assert env.start_sync() is env
        engine, cluster = env.engine, env.cluster
        assert engine is not None and engine.weight_version == 0
        assert env.start_sync() is env and env.cluster is cluster  # idempotent: one cluster
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        assert env.update_weights_sync(state, version="step-1") == "step-1"  # before any rollout
        assert engine.weight_version == 1

        group = env.rollout_sync({"task_id": "t", "instruction": "Say done."}, n=1)
        assert env.engine is engine and env.cluster is cluster  # the rollout reused them
        assert group.rewards == [1.0]
        assert group.trajectories[0].metadata["weight_versions"] == ["step-1"]
    finally:
        env.close()
