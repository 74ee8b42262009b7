"""Polar trajectories → NeMo Gym ``/run`` results: items split at mask-1 runs pass NeMo RL's
contiguity rule (restated in ``nemo_rl_message_log`` below, independently of ``check_contiguous``)
and rebuild the trace token for token; the agent maps session outcomes to reward/mask_sample."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from integration_doubles import FakePolarEnv, multi_turn_trace, trace, trajectory

from polar_env.env import PolarEnvConfig
from polar_env.env import task_request as polar_task_request
from polar_env.integrations.nemo_gym import GYM_ROOT
from polar_env.integrations.nemo_gym.agent import PolarGymAgent, gym_ids, task_request
from polar_env.integrations.nemo_gym.convert import check_contiguous, generation_spans, output_items
from polar_env.journal.store import JournalStore
from polar_env.records import FailureKind

pytestmark = pytest.mark.slow  # real Polar sessions


def nemo_rl_message_log(result: dict[str, Any]) -> list[dict[str, Any]]:
    """What NeMo RL's post-processing does with a /run result: walk the output items that carry
    generation ids; each must extend the tokens seen so far; emit (prompt tail, generation) pairs."""
    log: list[dict[str, Any]] = []
    seen: list[int] = []
    for item in result["response"]["output"]:
        if not item.get("generation_token_ids"):
            continue
        assert seen == item["prompt_token_ids"][: len(seen)], "Non-contiguous messages found!"
        log.append({"role": "user", "token_ids": item["prompt_token_ids"][len(seen):]})
        log.append({"role": "assistant", "token_ids": item["generation_token_ids"],
                    "generation_logprobs": item["generation_log_probs"]})
        seen += log[-2]["token_ids"] + log[-1]["token_ids"]
    return log


def test_multi_turn_trace_splits_at_mask_runs() -> None:
    t = multi_turn_trace()
    assert [(s.start, s.end) for s in generation_spans(t)] == [(0, 3), (5, 7), (10, 12)]
    items = output_items(t)
    assert [i["generation_token_ids"] for i in items] == [[10, 11, 99], [12, 99], [13, 14]]
    assert items[1]["prompt_token_ids"] == [1, 2, 3, 10, 11, 99, 7, 8]
    assert [i["generation_log_probs"] for i in items] == [[-0.5, -0.51, -0.52], [-0.53, -0.54], [-0.55, -0.56]]
    full = check_contiguous(items)
    assert full == t.prompt_ids + t.response_ids[:12]
    log = nemo_rl_message_log({"response": {"output": items}})
    rebuilt = [tok for m in log for tok in m["token_ids"]]
    assert rebuilt == full
    trainable = [tok for m in log if m["role"] == "assistant" for tok in m["token_ids"]]
    assert trainable == [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]


def test_trailing_inserted_tokens_and_leading_mask_zero() -> None:
    t = trace([5], [([], [6, 6]), ([7, 8], [9])])  # starts with inserted tokens, ends with them
    items = output_items(t)
    assert len(items) == 1 and items[0]["prompt_token_ids"] == [5, 6, 6]
    assert check_contiguous(items) == [5, 6, 6, 7, 8]


def test_check_contiguous_rejects_a_rewritten_history() -> None:
    items = output_items(multi_turn_trace())
    items[1]["prompt_token_ids"] = [1, 2, 3, 10, 11, 98, 7, 8]  # the history was re-rendered
    with pytest.raises(ValueError, match="item 1"):
        check_contiguous(items)
    with pytest.raises(AssertionError, match="Non-contiguous"):
        nemo_rl_message_log({"response": {"output": items}})


ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "Fix the failing test."}]},
    "instance_id": "toy__calc-1", "repo": "toy/calc", "FAIL_TO_PASS": ["t::a"],
    "_ng_rollout_id": "r-17", "_ng_task_index": 3, "_ng_rollout_index": 1,
}


def test_task_request_from_a_gym_row() -> None:
    assert task_request(ROW) == {"instance_id": "toy__calc-1", "repo": "toy/calc", "FAIL_TO_PASS": ["t::a"]}
    assert gym_ids(ROW) == {"ng_rollout_id": "r-17", "ng_task_index": 3, "ng_rollout_index": 1}
    plain = task_request({"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Say 42."}]}]}, "expected": "42", "_ng_task_index": 5})
    assert plain == {"task_id": "gym-5", "instruction": "Say 42.", "task": {"expected": "42"}}
    nested = task_request({**ROW, "task": {"task_id": "x", "problem_statement": "Do X."}})
    assert nested == {"task_id": "x", "instruction": "Do X.", "task": {"problem_statement": "Do X."}}
    toy = task_request({"responses_create_params": {"input": []}, "toy_task": "toy__calc-1"})
    assert toy.instance_id == "toy__calc-1" and toy.repo_dir is not None


async def test_agent_run_multi_chain_session() -> None:
    side = trace([1, 5], [([20], [])])
    traj = trajectory([side, multi_turn_trace()], reward=1.0)
    env = FakePolarEnv({"toy__calc-1": [("completed", 1.0, traj)]})
    agent = PolarGymAgent(env, open_journal=JournalStore, model="policy")
    out = await agent.run(ROW)
    assert out["reward"] == 1.0 and out["mask_sample"] is False
    assert out["instance_id"] == "toy__calc-1" and "_ng_rollout_id" not in out  # task fields pass through
    assert out["polar"]["delivered_trace"] == 1 and out["polar"]["traces"] == 2  # the main chain
    assert (out["polar_dropped_traces"], out["polar_dropped_tokens"], out["polar_trainable_tokens"]) == (1, 1, 8)
    assert out["polar_dropped_token_share"] == 1 / 8
    assert agent.delivery.report()["dropped_traces"] == 1 and "1 of 2 traces" in agent.delivery.line()
    log = nemo_rl_message_log(out)
    assert len(log) == 6
    assert out["response"]["status"] == "completed" and out["response"]["model"] == "policy"
    await agent.close()
    assert (env.entered, env.exited) == (1, 1)


@pytest.mark.parametrize("status, traj, failure, kind, masked", [
    ("error", None, FailureKind.ENGINE_ERROR, "polar_agent:engine_error", True),
    ("error", None, FailureKind.INIT_ERROR, "polar_agent:init_error", True),
    ("error", trajectory([multi_turn_trace()], reward=0.0), FailureKind.EVALUATOR_ERROR, "polar_agent:evaluator_error", True),
    ("error", trajectory([multi_turn_trace()], reward=0.0), FailureKind.NODE_LOST, "polar_agent:node_lost", True),
    ("cancelled", None, FailureKind.CANCELLED, "polar_agent:cancelled", True),
    ("completed", trajectory([]), None, "polar_agent:no_tokens", True),
    # the policy ran out of time / broke its harness: its tokens train with reward 0, the kind is still named
    ("timeout", trajectory([multi_turn_trace()], reward=0.0), FailureKind.AGENT_TIMEOUT, "polar_agent:agent_timeout", False),
    ("error", trajectory([multi_turn_trace()], reward=0.0), FailureKind.HARNESS_ERROR, "polar_agent:harness_error", False),
    ("timeout", None, FailureKind.AGENT_TIMEOUT, "polar_agent:agent_timeout", True),  # timed out before any call
])
async def test_agent_failures(status: str, traj: Any, failure: FailureKind | None, kind: str | None, masked: bool) -> None:
    """mask_sample and failure_kind come from the session's typed outcome, not from its status text."""
    env = FakePolarEnv({"toy__calc-1": [(status, 0.0, traj, failure)]})
    out = await PolarGymAgent(env, open_journal=JournalStore).run(ROW)
    assert out["mask_sample"] is masked and out["reward"] == 0.0
    assert out.get("failure_kind") == kind
    nemo_rl_message_log(out)


async def test_agent_turns_an_env_crash_into_a_masked_sample() -> None:
    out = await PolarGymAgent(FakePolarEnv(raises=RuntimeError("node lost")), open_journal=JournalStore).run(ROW)
    assert out["mask_sample"] and "node lost" in out["failure_reason"] and out["response"]["output"] == []


def test_gym_tree_is_complete_and_consistent() -> None:
    env_dir = GYM_ROOT / "environments" / "polar_swegym"
    agent_dir = GYM_ROOT / "responses_api_agents" / "polar_agent"
    config = yaml.safe_load((env_dir / "config.yaml").read_text())
    manifest = yaml.safe_load((env_dir / "manifest.yaml").read_text())
    assert manifest["name"] == "polar_swegym" and manifest["integration_profile"] == "external-agent-loop"
    assert manifest["reward"] == {"range": [0.0, 1.0], "higher_is_better": True}
    assert manifest["agent_server"] == "polar_agent"  # the implementation folder (Gym checks it)
    agent = config["polar_swegym_agent"]["responses_api_agents"]["polar_agent"]
    assert agent["entrypoint"] == "app.py" and (agent_dir / "app.py").is_file()
    assert (agent_dir / "requirements.txt").is_file()  # Gym counts a server folder only with one
    for ds in manifest["datasets"]:
        rows = (GYM_ROOT / ds["jsonl_fpath"]).read_text().splitlines()
        assert rows
        for line in rows:
            request = polar_task_request(task_request(yaml.safe_load(line)), PolarEnvConfig())
            assert request.instruction and request.evaluator is not None and request.evaluator.name == "swebench"
    env_server = next(v for v in config.values() if "environment_servers" in v)
    assert env_server["environment_servers"]["legacy_agent"]["agent_server"]["name"] == "polar_swegym_agent"


async def test_agent_runs_a_real_polar_session(tmp_path: Any) -> None:
    from integration_env import env_config, require_sandbox

    from polar_env import PolarEnv
    from polar_env.tasks.toy import toy_tasks

    require_sandbox()
    (calc,) = toy_tasks(ids=["toy__calc-1"])
    agent = PolarGymAgent(PolarEnv(env_config(tmp_path, calc)), open_journal=JournalStore, model="polar-tiny-qwen3")
    row = {"responses_create_params": {"input": [{"role": "user", "content": calc.problem_statement}]},
           "toy_task": "toy__calc-1", "_ng_rollout_id": "r-1", "_ng_task_index": 0}
    try:
        out = await agent.run(row)
    finally:
        await agent.close()
    assert out["reward"] == 1.0 and out["mask_sample"] is False, out.get("failure_reason")
    assert out["polar"]["evaluation"]["resolved"] is True
    log = nemo_rl_message_log(out)
    assert len(log) == 4  # two assistant turns (tool call, answer) with the tool result between
    # The items Gym's own agents produce: reasoning, the tool call, its output, the final text;
    # the token fields sit on each call's last model-generated item only.
    items = out["response"]["output"]
    assert [i["type"] for i in items] == ["reasoning", "function_call", "function_call_output", "reasoning", "message"]
    assert [("generation_token_ids" in i) for i in items] == [False, True, False, False, True]
    call, result, final = items[1], items[2], items[4]
    assert call["name"] == "bash" and "git apply" in call["arguments"] and result["call_id"] == call["call_id"]
    assert "applied" in result["output"] and final["content"][0]["text"].startswith("Done:")
    assert items[0]["summary"][0]["text"] == "Apply the fix."
    assert out["toy_task"] == "toy__calc-1"
