"""The polar_swegym agent as NeMo RL starts it: ``policy_base_url`` is a list, one URL per
data-parallel vLLM server. Two real ``polar-env engine`` processes (the embedded CPU engine, vLLM's
HTTP shape, a scripted policy forcing a toy task's fix) serve four concurrent sessions; once both
engines have served calls, one is killed. Every session still completes with reward 1.0: the
pool moved the dead server's sessions to the live one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from polar_env.integrations.nemo_gym import GYM_ROOT
from polar_env.integrations.nemo_gym.agent import PolarGymAgent, polar_env_config
from polar_env.journal.store import JournalStore

pytestmark = pytest.mark.slow  # two engines and real sessions

REPO = Path(__file__).resolve().parents[2]
SESSIONS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve(node: Any, policy_base_url: list[str]) -> Any:
    """The config as Gym resolves it (OmegaConf, when installed): a value that is exactly one
    interpolation takes the referenced node's type, so ``"${policy_base_url}"`` becomes NeMo RL's
    list, not a string. Without omegaconf, that rule is applied by hand."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return _by_hand(node, policy_base_url)
    conf = OmegaConf.create({**node, "policy_base_url": policy_base_url, "policy_model_name": "polar-tiny-qwen3"})
    return OmegaConf.to_container(conf, resolve=True)


def _by_hand(node: Any, policy_base_url: list[str]) -> Any:
    if isinstance(node, dict):
        return {k: _by_hand(v, policy_base_url) for k, v in node.items()}
    if node == "${policy_base_url}":
        return policy_base_url
    if node == "${policy_model_name}":
        return "polar-tiny-qwen3"
    return node


def _calls(log: Path) -> int:
    return log.read_text().count("/v1/chat/completions") if log.exists() else 0


async def test_two_engines_one_killed_mid_run_loses_no_session(tmp_path: Path) -> None:
    from integration_env import require_sandbox

    from polar_env import PolarEnv
    from polar_env.tasks.toy import toy_tasks

    require_sandbox()
    (calc,) = toy_tasks(ids=["toy__calc-1"])
    apply = f"cat > /tmp/fix.diff <<'POLAR_EOF'\n{calc.patch}POLAR_EOF\ngit apply /tmp/fix.diff && echo applied"
    steps = [{"command": f"sleep 1; echo step {i}", "reasoning": "Look around."} for i in range(3)]
    steps += [{"command": apply, "reasoning": "Apply the fix."}, {"text": "Done: {tool_output}", "reasoning": "Ok."}]
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"steps": steps}))
    ports = [_free_port(), _free_port()]
    logs = [tmp_path / f"engine{i}.log" for i in range(2)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    files = [open(log, "wb") for log in logs]  # noqa: SIM115 - closed in finally
    procs = [subprocess.Popen([sys.executable, "-m", "polar_env.cli", "engine", "--port", str(p), "--script", str(script),
                               "--log-level", "info"], stdout=subprocess.DEVNULL, stderr=f, env=env)
             for p, f in zip(ports, files, strict=True)]
    try:
        for p in ports:
            deadline = time.monotonic() + 120
            while True:
                try:
                    socket.create_connection(("127.0.0.1", p), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "polar-env engine did not start"
                    await asyncio.sleep(0.2)
        gym = yaml.safe_load((GYM_ROOT / "environments" / "polar_swegym" / "config.yaml").read_text())
        block = _resolve(gym, [f"http://127.0.0.1:{p}/v1" for p in ports])
        polar = block["polar_swegym_agent"]["responses_api_agents"]["polar_agent"]["polar"]
        assert isinstance(polar["engine"]["url"], list)  # NeMo RL's list reaches the engine config
        config = polar_env_config({**polar, "harness": "loop", "store": str(tmp_path / "store")})
        agent = PolarGymAgent(PolarEnv(config), open_journal=JournalStore, model="polar-tiny-qwen3")
        rows = [{"responses_create_params": {"input": [{"role": "user", "content": calc.problem_statement}]},
                 "toy_task": "toy__calc-1", "_ng_rollout_id": f"r-{i}", "_ng_task_index": i} for i in range(SESSIONS)]
        runs = [asyncio.ensure_future(agent.run(row)) for row in rows]
        deadline = time.monotonic() + 240
        while min(_calls(log) for log in logs) < 1:  # sessions spread over both servers
            assert time.monotonic() < deadline and not all(r.done() for r in runs), [_calls(x) for x in logs]
            await asyncio.sleep(0.1)
        before = [_calls(log) for log in logs]
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        try:
            outs = await asyncio.wait_for(asyncio.gather(*runs), timeout=300)
        finally:
            await agent.close()
        after = [_calls(log) for log in logs]
        print(f"chat calls per engine: at the kill {before}, at the end {after}")
        calls_per_session = len(steps)
        assert before[1] < calls_per_session * SESSIONS / 2  # killed while its sessions had calls left
        assert sum(after) >= SESSIONS * calls_per_session  # the dead server's calls were redone on the live one
        for out in outs:
            assert out["mask_sample"] is False and out["reward"] == 1.0, out.get("failure_reason")
            assert out["polar"]["status"] == "completed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
        for f in files:
            f.close()
