"""submit sends only what a row or the user chose; serve fills the rest from its own settings."""

from __future__ import annotations

import argparse

from polar_env.cli.options import chosen_settings, env_config
from polar_env.env import PolarEnvConfig, task_request
from polar_env.staging.models import TaskRequest
from polar_env.staging.submission import server_defaults, submission_body, with_defaults

ROW = {"task_id": "t", "instruction": "x", "evaluator": {"name": "output", "regex": "ok"}}


def _args(**given: object) -> argparse.Namespace:
    names = ("harness", "api", "builder", "evaluator", "timeout_s", "runtime", "config")
    return argparse.Namespace(**{n: given.get(n) for n in names}, canonical=bool(given.get("canonical")))


def test_submit_does_not_send_its_own_defaults() -> None:
    req = task_request(ROW, PolarEnvConfig(), 3)
    body = submission_body(req, ROW, chosen_settings(env_config(_args())))
    assert "agent" not in body and "builder" not in body and "runtime" not in body and "continuation" not in body
    assert body["evaluator"]["name"] == "output" and body["num_samples"] == 3  # the row's own and --samples
    served = TaskRequest.model_validate(with_defaults(body, server_defaults(PolarEnvConfig(harness="loop", builder="per_request"))))
    assert served.agent.harness == "loop" and served.builder == "per_request" and served.evaluator is not None


def test_what_the_user_chose_wins_over_the_server() -> None:
    config = PolarEnvConfig(harness="qwen_code", continuation=False)
    body = submission_body(task_request(ROW, config), ROW, chosen_settings(env_config(_args(harness="qwen_code", canonical=True))))
    assert body["agent"] == {"harness": "qwen_code"} and body["continuation"] is False
    served = TaskRequest.model_validate(with_defaults(body, server_defaults(PolarEnvConfig(harness="loop"))))
    assert served.agent.harness == "qwen_code" and served.continuation is False


def test_a_rows_agent_settings_merge_over_the_servers_harness() -> None:
    row = {**ROW, "agent": {"settings": {"max_turns": 2}}}
    body = submission_body(task_request(row, PolarEnvConfig()), row, set())
    served = TaskRequest.model_validate(with_defaults(body, server_defaults(PolarEnvConfig(harness="loop"))))
    assert served.agent.harness == "loop" and served.agent.settings == {"max_turns": 2}
