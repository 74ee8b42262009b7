"""Same recipe, seed and base weights: the same step-0 samples, whatever order the sessions reach
the engine in (each call's seed comes from its session: run seed, task, round, sample, call)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from polar_env.train.loop import run_recipe
from polar_env.train.recipe import Recipe
from polar_env.train.seeding import SessionSeeds
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow  # one-step CPU GRPO runs, two per source (random tiny weights, ~3-10 s each)

TASKS: list[dict[str, object]] = [{"task_id": "alpha", "instruction": "Say a word with a k.", "follow_ups": ["Again."]},
                                  {"task_id": "beta", "instruction": "Name a colour.", "follow_ups": ["Another."]}]


def step0_samples(tmp_path: Path, name: str, source: str, tasks: list[dict[str, object]]) -> dict[tuple[str, str, int], list[int]]:
    """(task id, sample index, call seq) -> sampled ids, from the run's capture journals."""
    recipe = Recipe.model_validate({
        "name": name, "steps": 1, "rollouts_per_task": 3, "source": source, "tasks": tasks,
        "evaluator": {"name": "output", "regex": "k"}, "sampling": {"temperature": 1.0, "max_tokens": 4},
        "out_dir": str(tmp_path / name)})
    asyncio.run(run_recipe(recipe))
    samples = {}
    for journal in (tmp_path / name / "capture").rglob("*.jsonl"):  # local: capture/; polar_env: capture/<node>/
        for line in journal.read_bytes().splitlines():
            record = orjson.loads(line)
            if "response_ids" not in record:
                continue
            group, _, index = record["session_id"].rpartition("-")
            samples[(group.split("-")[0], index, record["seq"])] = record["response_ids"]
    return samples


@pytest.mark.parametrize("source", ["local", "polar_env"])
def test_two_runs_sample_the_same_step0_rollouts_in_any_order(tmp_path: Path, source: str) -> None:
    calls = 2 if source == "local" else 1  # the local chat loop asks the follow-up; the loop harness answers once
    if source == "polar_env":
        require_bwrap()
    tasks = TASKS if source == "local" else [{k: v for k, v in t.items() if k != "follow_ups"} for t in TASKS]
    first = step0_samples(tmp_path, "first", source, tasks)
    second = step0_samples(tmp_path, "second", source, tasks[::-1])  # other groups first: another arrival order
    assert len(first) == 2 * 3 * calls  # two tasks x three samples x their calls
    assert second == first
    assert len({tuple(ids) for (task, _, seq), ids in first.items() if task == "alpha" and seq == 0}) > 1  # samples differ


def test_call_seeds_depend_on_the_session_not_on_time_or_order() -> None:
    a, b = SessionSeeds(7), SessionSeeds(7)
    assert a.nonce != b.nonce  # two runs' group ids differ ...
    ga, gb = a.group_id("t/1"), b.group_id("t/1")
    seeds = [a.call_seed(f"{ga}-0"), a.call_seed(f"{ga}-0"), a.call_seed(f"{ga}-1")]
    assert [b.call_seed(f"{gb}-0"), b.call_seed(f"{gb}-0"), b.call_seed(f"{gb}-1")] == seeds  # ... their seeds do not
    assert len(set(seeds)) == 3 and a.group_id("t/1").endswith("-1")  # per call, per sample; the next round differs
    other = SessionSeeds(8)
    assert other.call_seed(f"{other.group_id('t/1')}-0") != seeds[0]  # the run seed counts
    assert a.call_seed("someone-else-0") is None  # a session no group of ours holds keeps the engine's own draw
