"""PolarEnvSource on the staged pipeline: the loop harness with thinking off gives the output
evaluator a final answer to grade, and the group comes back as GRPO-ready trajectories."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_env.env import PolarEnv, PolarEnvConfig
from polar_env.train.rollout import PolarEnvSource, ToyTask
from tests.conftest import require_bwrap


def test_polar_env_rollout_is_graded_on_the_answer(tmp_path: Path, task: ToyTask) -> None:
    require_bwrap()
    config = PolarEnvConfig.model_validate({
        "engine": {"kind": "embedded"}, "harness": "loop", "sampling": {"temperature": 0.1, "max_tokens": 4},
        "agent_settings": {"tools": False, "max_turns": 1, "max_tokens": 4, "thinking": False},
        "builder": "prefix_merge_strict", "store": str(tmp_path / "store")})

    async def run() -> None:
        async with PolarEnv(config) as env:
            trajectories = await PolarEnvSource(env).rollout(task.model_copy(update={"follow_ups": []}), 3)
            assert len(trajectories) == 3 and len({t.metadata["group_id"] for t in trajectories}) == 1
            for traj in trajectories:
                evaluation = traj.metadata["evaluation"]
                assert "regex 'k'" in evaluation["reason"], evaluation  # graded, not "no final answer"
                assert traj.reward == (1.0 if evaluation["passed"] else 0.0)
                (trace,) = traj.traces
                assert len(trace.response_ids) == 4 and trace.metadata["temperature"] == 0.1

    asyncio.run(run())
