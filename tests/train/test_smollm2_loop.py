"""``polar-env train`` from real weights: SmolLM2-135M-Instruct (template ``smollm2``) through the
local gateway source, multi-call sessions, token-in. The step-0 check (the trainer's fp32 forward
vs the logprobs the engine captured while sampling) holds on real weights, and the engine serves
the trainer's weights after the sync."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polar_env.chat.hf import HFChatFormat
from polar_env.train.loop import run_recipe
from polar_env.train.recipe import Recipe
from tests.conftest import REPO_ROOT, require_bwrap

pytestmark = pytest.mark.slow  # a 135 M-parameter GRPO step on CPU


def test_a_grpo_step_on_smollm2_passes_step0(tmp_path: Path, smollm2: HFChatFormat) -> None:
    recipe = Recipe.model_validate({
        "name": "smol", "steps": 2, "rollouts_per_task": 2, "source": "local",
        "tasks": [{"task_id": "k", "instruction": "Say a word with the letter k in it.", "follow_ups": ["Another."]}],
        "evaluator": {"name": "output", "regex": "k", "ignore_case": True},
        "engine": {"template": "smollm2"}, "sampling": {"temperature": 1.0, "max_tokens": 4},
        "trainer": {"lr": 1e-5}, "out_dir": str(tmp_path / "run")})
    result = asyncio.run(run_recipe(recipe))
    assert [s.weight_versions for s in result.steps] == [["0"], ["1"]]
    assert all(s.step0_max_abs_delta <= 1e-4 and s.sampled_tokens > 0 for s in result.steps), result.steps
    assert result.per_request_traces == 2 * result.merged_traces == 2 * 2 * 2  # two calls per session, one trace


def test_the_agentic_recipe_runs_a_reduced_step_on_smollm2(tmp_path: Path, smollm2: HFChatFormat) -> None:
    """recipes/cpu_grpo_smollm2_tools.yaml cut to one task, one step: sandboxed sessions where SmolLM2
    may call bash, a held-out task before and after. Whatever it samples, each session is one merged
    trace (token-in continuation across its tool turns) and the step-0 check holds on real weights."""
    require_bwrap()
    full = Recipe.load(REPO_ROOT / "recipes" / "cpu_grpo_smollm2_tools.yaml")
    recipe = full.model_copy(update={"steps": 1, "rollouts_per_task": 3, "held_out_rollouts": 2,
                                     "tasks": full.tasks[:1], "held_out": full.held_out[:1],
                                     "out_dir": str(tmp_path / "run")})
    result = asyncio.run(run_recipe(recipe))
    assert [s.weight_versions for s in result.steps] == [["0"]]
    assert result.steps[0].step0_max_abs_delta <= 1e-4 and result.steps[0].sampled_tokens > 0
    assert result.merged_traces == 3 <= result.per_request_traces  # one trace per session, however many calls
    assert set(result.held_out_before) == set(result.held_out_after) == {full.held_out[0].task_id}
