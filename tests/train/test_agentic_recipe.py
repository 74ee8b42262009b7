"""Recipes for agentic tasks: per-task workspace files the loop harness's bash tool reads, per-task
evaluators, and held-out tasks rolled out before and after training but never trained on. The
pipeline is the real one (PolarEnv, a bwrap sandbox per session, the gateway, the output
evaluator); a scripted policy (a named test double for the model's choices: the tokens are forced,
the logprobs are the tiny model's) reads the file and answers with what the tool printed, so the
reward shows the file reached the workspace and the answer reached the evaluator."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from polar_env.env import PolarEnv, PolarEnvConfig
from polar_env.train.loop import env_settings, train_with
from polar_env.train.recipe import Recipe
from polar_env.train.rollout import PolarEnvSource
from polar_env.train.trainer import GRPOTrainer
from tests.conftest import require_bwrap


def _task(task_id: str, file: str, word: str) -> dict[str, Any]:
    return {"task_id": task_id, "instruction": f"What word is in {file}?", "files": {file: f"{word}\n"},
            "evaluator": {"name": "output", "regex": rf"\b{word}\b"}}


AGENTIC: dict[str, Any] = {
    "name": "agentic", "steps": 1, "rollouts_per_task": 2, "held_out_rollouts": 2, "source": "polar_env",
    "agent": {"tools": True, "max_turns": 3},
    "tasks": [_task("note", "note.txt", "falcon"), _task("deep", "sub/dir/word.txt", "marble")],
    "held_out": [_task("held", "held.txt", "violet")],
    "sampling": {"temperature": 1.0, "max_tokens": 64}, "trainer": {"lr": 1e-3},
}


@pytest.mark.parametrize(("change", "message"), [
    ({"source": "local"}, "files and agent settings need source: polar_env"),
    ({"agent": {"tools": True, "max_turns": 1}}, "agent.tools needs agent.max_turns >= 2"),
    ({"held_out": [_task("note", "x.txt", "w")]}, "task ids must be unique across tasks and held_out"),
    ({"tasks": [{"task_id": "bare", "instruction": "hi"}]}, "task 'bare' has no evaluator"),
    ({"tasks": [_task("up", "../escape.txt", "w")]}, "without '..'"),
    ({"tasks": [_task("abs", "/etc/word.txt", "w")]}, "relative to the workspace"),
])
def test_a_recipe_that_cannot_run_is_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Recipe.model_validate({**AGENTIC, **change})


def test_a_task_without_its_own_evaluator_takes_the_recipes() -> None:
    recipe = Recipe.model_validate({**AGENTIC, "evaluator": {"name": "output", "regex": "x"},
                                    "tasks": [{"task_id": "plain", "instruction": "hi"}]})
    assert recipe.toy_tasks()[0].evaluator.params == {"regex": "x"}
    assert recipe.held_out_tasks()[0].evaluator.params == {"regex": r"\bviolet\b"}


@pytest.mark.slow  # one sandboxed GRPO step: 8 two-call sessions, 4 of them held out
def test_files_reach_the_workspace_and_held_out_tasks_are_only_rolled_out(tmp_path: Path) -> None:
    require_bwrap()
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"steps": [
        {"command": "cat note.txt 2>/dev/null || cat held.txt 2>/dev/null || cat sub/dir/word.txt"},
        {"text": "The word is {tool_output}"}]}))
    recipe = Recipe.model_validate({**AGENTIC, "out_dir": str(tmp_path / "run")})
    settings = env_settings(recipe, model_seed=0)
    engine = settings["engine"]
    assert isinstance(engine, dict)
    settings["engine"] = {**engine, "script": str(script)}

    async def run() -> Any:
        async with PolarEnv(PolarEnvConfig.model_validate(settings)) as env:
            trainer = GRPOTrainer(copy.deepcopy(env.engine.model), recipe.trainer.config())
            return await train_with(recipe, PolarEnvSource(env, tmp_path / "workspaces"), trainer)

    result = asyncio.run(run())
    # every session read its own task's file and answered with its word: reward 1 everywhere
    assert result.held_out_before == result.held_out_after == {"held": 1.0}
    assert [s.reward_mean for s in result.steps] == [1.0]
    assert [s.rollouts for s in result.steps] == [4]  # the held-out sessions are not trained on
    assert result.steps[0].step0_max_abs_delta <= 1e-4
    assert result.merged_traces == 4 and result.per_request_traces == 8  # two calls merged into one trace
    assert result.summary()["held_out"] == {"tasks": 1, "before": 1.0, "after": 1.0, "gain": 0.0,
                                            "per_task": {"held": [1.0, 1.0]}}
    assert (tmp_path / "workspaces").is_dir() and not list((tmp_path / "workspaces").glob("*/escape*"))


def test_the_reward_figure_marks_the_held_out_tasks(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="pip install -e '.[report]'")
    from polar_env.train.loop import RunResult, StepRecord
    from polar_env.train.report import plot_rewards

    steps = [StepRecord(step=i, reward_mean=r, rollouts=4, traces=4, sampled_tokens=8, rollout_s=1.0, train_s=1.0,
                        sync_s=0.1, weight_versions=[str(i)], new_version=str(i + 1), step0_max_abs_delta=0.0,
                        ratio_min=1.0, ratio_max=1.0, loss=0.0, grad_norm=0.0) for i, r in enumerate([0.2, 0.5])]
    result = RunResult(recipe={"name": "a", "seed": 0, "control": False}, steps=steps,
                       held_out_before={"h": 0.25}, held_out_after={"h": 0.75})
    path = plot_rewards([result], tmp_path / "reward.png")
    assert path.stat().st_size > 0
    assert result.summary()["held_out"]["gain"] == 0.5


def test_a_written_run_reads_back_for_plotting(tmp_path: Path) -> None:
    from polar_env.train.loop import RunResult, StepRecord
    from polar_env.train.report import read_run, write_run

    step = StepRecord(step=0, reward_mean=0.5, rollouts=4, traces=4, sampled_tokens=8, rollout_s=1.0, train_s=1.0,
                      sync_s=0.1, weight_versions=["0"], new_version="1", step0_max_abs_delta=0.0, ratio_min=1.0,
                      ratio_max=1.0, loss=0.0, grad_norm=0.0, rss_gb=1.5)
    result = RunResult(recipe={"name": "a", "seed": 2, "control": True}, steps=[step], wall_s=9.0,
                       held_out_before={"h": 0.25, "g": 0.0}, held_out_after={"h": 0.75, "g": 0.5})
    write_run(result, tmp_path)
    back = read_run(tmp_path)
    assert back.steps == [step] and back.recipe == result.recipe and back.wall_s == 9.0
    assert (back.held_out_before, back.held_out_after) == (result.held_out_before, result.held_out_after)
