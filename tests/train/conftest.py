from __future__ import annotations

import asyncio
import copy

import pytest

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.evaluators import EvaluatorSpec
from polar_env.records import Trajectory
from polar_env.train.rollout import LocalGateway, ToyTask

TASK = ToyTask(task_id="k-word", instruction="Say a word with the letter k in it.",
               follow_ups=["Another one, with a k again."],
               evaluator=EvaluatorSpec.model_validate({"name": "output", "regex": "k", "ignore_case": True}))
TEMPERATURE = 0.1  # the toy recipe's: the trainer must divide by it to reproduce the logprobs


@pytest.fixture
def task() -> ToyTask:
    return TASK


@pytest.fixture(scope="module")
def captured() -> tuple[EmbeddedEngine, list[Trajectory]]:
    """Four real two-call sessions through the gateway (continuation, strict prefix merge), and
    the engine that sampled them (still at its sampling weights)."""
    engine = EmbeddedEngine(max_tokens=6)

    async def run() -> list[Trajectory]:
        async with LocalGateway(engine, temperature=TEMPERATURE, max_tokens=6) as gateway:
            return await gateway.rollout(TASK, 4)

    return engine, asyncio.run(run())


@pytest.fixture
def policy(captured: tuple[EmbeddedEngine, list[Trajectory]]):  # type: ignore[no-untyped-def]
    """A trainer-side copy of the sampling weights."""
    return copy.deepcopy(captured[0].model)
