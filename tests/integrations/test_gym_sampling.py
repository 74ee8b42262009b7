"""NeMo RL's GRPO rows set ``responses_create_params.temperature`` (and top_p, max_output_tokens):
the engine must sample every call of the row's session with them, the journal must say so, and a
row that contradicts the environment's own ``sampling`` is refused with one error, not masked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.engines.simulated import SimulatedEngine
from polar_env.errors import ConfigError
from polar_env.integrations.nemo_gym.agent import PolarGymAgent, sampling_of
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import Sampling
from polar_env.records import ChatRequest, Generation

pytestmark = pytest.mark.slow  # real Polar sessions


class RecordingEngine:
    """The simulated engine (a named test double), keeping every request the gateway sent it."""

    def __init__(self, inner: SimulatedEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[ChatRequest] = []

    async def generate(self, request: ChatRequest) -> Generation:
        self.seen.append(request)
        return await self.inner.generate(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def gym_row(prompt: str, **params: Any) -> dict[str, Any]:
    """A /run body as Gym's collector posts it for NeMo RL (its generation config in the params)."""
    return {"responses_create_params": {"input": [{"role": "user", "content": prompt}], **params},
            "toy_task": "toy__calc-1", "_ng_rollout_id": "r-1", "_ng_task_index": 0}


def test_sampling_of_a_gym_row() -> None:
    assert sampling_of(gym_row("x", temperature=0.7, top_p=1.0, max_output_tokens=512)) == Sampling(
        temperature=0.7, top_p=1.0, max_tokens=512)
    assert sampling_of(gym_row("x", temperature=None)) is None  # Gym's model_dump keeps unset fields as None
    with pytest.raises(ValueError, match=r"responses_create_params: temperature"):
        sampling_of(gym_row("x", temperature=-1))


async def test_a_conflicting_row_is_refused_before_any_session(tmp_path: Path) -> None:
    from polar_env import PolarEnv

    env = PolarEnv({"harness": "loop", "engine": {"kind": "simulated"}, "sampling": {"temperature": 1.0},
                    "store": str(tmp_path / "store")})
    agent = PolarGymAgent(env, open_journal=JournalStore)
    with pytest.raises(ConfigError, match=r"contradicts the environment's \(sampling: temperature=1.0\): "
                                          r"temperature 0.7 != 1.0"):
        await agent.run(gym_row("Fix it.", temperature=0.7))
    assert env._cluster is None  # refused before anything started


async def test_gym_row_temperature_reaches_every_engine_call(tmp_path: Path) -> None:
    from integration_env import env_config, require_sandbox

    from polar_env import PolarEnv
    from polar_env.tasks.toy import toy_tasks

    require_sandbox()
    (calc,) = toy_tasks(ids=["toy__calc-1"])
    apply = f"cat > /tmp/fix.diff <<'POLAR_EOF'\n{calc.patch}POLAR_EOF\ngit apply /tmp/fix.diff && echo applied"
    policy = ScriptedPolicy(steps=(ScriptStep(command=apply, reasoning="Apply the fix."),
                                   ScriptStep(text="Done: {tool_output}", reasoning="It applied.")))
    engine = RecordingEngine(SimulatedEngine(latency_s=0.0, policy=policy))
    config = env_config(tmp_path, calc)
    env = PolarEnv(config, engine=engine)
    agent = PolarGymAgent(env, open_journal=JournalStore, model="polar-tiny-qwen3")
    try:
        out = await agent.run(gym_row(calc.problem_statement, temperature=0.7, top_p=1.0, max_output_tokens=300))
    finally:
        await agent.close()
    assert out["reward"] == 1.0 and out["mask_sample"] is False, out.get("failure_reason")
    assert len(engine.seen) == 2  # the tool call, then the answer
    for request in engine.seen:  # the loop harness sends its own values; the row's win
        assert (request.temperature, request.top_p, request.max_tokens) == (0.7, 1.0, 300)
    node_store = Path(config["store"]) / "node-0"
    records = JournalStore(node_store).read(out["polar"]["session_id"])
    assert len(records) == 2
    for record in records:
        assert (record.chat_request.temperature, record.chat_request.max_tokens) == (0.7, 300)
        assert "session sampling temperature=0.7 top_p=1.0 max_tokens=300" in record.notes
