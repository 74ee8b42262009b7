"""The step-0 check on real captured, merged trajectories: it passes on the data as captured and
fails, naming trace and position, on each corruption that silently poisons training."""

from __future__ import annotations

import asyncio
import copy
import re
from typing import Any

import pytest
import torch

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.records import Trace, Trajectory
from polar_env.train.rollout import LocalGateway
from polar_env.train.step0 import Step0Mismatch, check_step0
from polar_env.train.trainer import GRPOTrainer, TrainerConfig

pytestmark = pytest.mark.slow  # trainer logprobs on the embedded model


def _interstitial(trace: Trace) -> int:
    """Index of a mask-0 token between two sampled turns (a template token the harness inserted)."""
    ones = [i for i, m in enumerate(trace.loss_mask) if m]
    gap = next(i for i in range(ones[0], ones[-1]) if trace.loss_mask[i] == 0)
    return gap


def _replace(trajectories: list[Trajectory], trace: Trace) -> list[Trajectory]:
    first = trajectories[0]
    return [first.model_copy(update={"traces": [trace, *first.traces[1:]]}), *trajectories[1:]]


def _shift_mask(trace: Trace) -> Trace:
    mask = [0, *trace.loss_mask[:-1]]
    logprobs = [0.0, *trace.response_logprobs[:-1]]
    return trace.model_copy(update={"loss_mask": mask, "response_logprobs": logprobs})


def _drop_interstitial(trace: Trace) -> Trace:
    i = _interstitial(trace)

    def cut(xs: list[Any]) -> list[Any]:
        return xs[:i] + xs[i + 1 :]

    return trace.model_copy(update={"response_ids": cut(trace.response_ids), "loss_mask": cut(trace.loss_mask),
                                    "response_logprobs": cut(trace.response_logprobs)})


def _swap_logprobs(trace: Trace) -> Trace:
    ones = [i for i, m in enumerate(trace.loss_mask) if m]
    a, b = next((x, y) for x in ones for y in ones if abs(trace.response_logprobs[x] - trace.response_logprobs[y]) > 1e-3)
    lps = list(trace.response_logprobs)
    lps[a], lps[b] = lps[b], lps[a]
    return trace.model_copy(update={"response_logprobs": lps})


def test_captured_merged_traces_are_multi_turn_and_pass(captured, policy) -> None:  # type: ignore[no-untyped-def]
    _, trajectories = captured
    trace = trajectories[0].traces[0]
    assert trajectories[0].metadata["stats"]["completions"] == 2 and len(trajectories[0].traces) == 1
    assert _interstitial(trace) > 0  # template tokens between the two sampled turns, mask 0
    stats = GRPOTrainer(policy).step(trajectories)
    assert stats.step0.tokens == sum(sum(t.loss_mask) for tr in trajectories for t in tr.traces)
    assert stats.step0.max_abs_delta <= 1e-4
    assert all(abs(r - 1.0) < 1e-3 for r in stats.ratios)


@pytest.mark.parametrize("corrupt", [_shift_mask, _drop_interstitial, _swap_logprobs],
                         ids=["mask shifted by one", "interstitial token dropped", "two logprobs swapped"])
def test_each_corruption_fails_loudly_and_updates_nothing(captured, policy, corrupt) -> None:  # type: ignore[no-untyped-def]
    _, trajectories = captured
    bad = _replace(trajectories, corrupt(trajectories[0].traces[0]))
    trainer = GRPOTrainer(policy, TrainerConfig(lr=0.1))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with pytest.raises(Step0Mismatch) as failure:
        trainer.step(bad)
    message = str(failure.value)
    session = trajectories[0].session_id
    assert re.search(rf"trace {re.escape(session)}/0 response position \d+ \(token id \d+\)", message), message
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # nothing was updated


def test_the_sampling_temperature_must_be_honoured(captured, policy) -> None:  # type: ignore[no-untyped-def]
    _, trajectories = captured
    trace = trajectories[0].traces[0]
    wrong = trace.model_copy(update={"metadata": {**trace.metadata, "temperature": 1.0}})
    with pytest.raises(Step0Mismatch, match="temperature"):
        GRPOTrainer(policy).step(_replace(trajectories, wrong))


def test_check_names_the_first_failure_and_counts_all() -> None:
    trace = Trace(prompt_ids=[1], response_ids=[5, 6, 7], loss_mask=[1, 0, 1], response_logprobs=[-1.0, 0.0, -2.0])
    report = check_step0([("s/0", trace)], [[-1.0, -9.0, -2.00001]])
    assert report.tokens == 2 and report.max_abs_delta == pytest.approx(1e-5, rel=1e-3)  # mask-0 ignored
    with pytest.raises(Step0Mismatch, match=r"2 of 2 mask-1 tokens; first: trace s/0 response position 0 \(token id 5\)"):
        check_step0([("s/0", trace)], [[-1.5, 0.0, float("nan")]])


def test_below_temperature_one_the_tolerance_grows_as_the_logits_are_scaled() -> None:
    """Logits divided by T carry their float noise times 1/T: SmolLM2 sampled at 0.4 differed by
    up to 1.6e-4 between the engine's batched decode and the trainer's forward."""
    trace = Trace(prompt_ids=[1], response_ids=[5, 6], loss_mask=[1, 1], response_logprobs=[-1.0, -2.0],
                  metadata={"temperature": 0.4})
    assert check_step0([("s/0", trace)], [[-1.0002, -2.0]]).max_abs_delta == pytest.approx(2e-4, rel=1e-3)
    with pytest.raises(Step0Mismatch, match=r"\|Δ\| 0.0003 > 0.00025 \(0.0001 at temperature 0.4\)"):
        check_step0([("s/0", trace)], [[-1.0003, -2.0]])
    hot = trace.model_copy(update={"metadata": {"temperature": 1.3}})  # above 1: never looser than at 1
    with pytest.raises(Step0Mismatch, match=r"> 0.0001$|> 0.0001\b"):
        check_step0([("s/0", hot)], [[-1.0002, -2.0]])


def test_raw_logprobs_are_scored_at_temperature_one(task) -> None:  # type: ignore[no-untyped-def]
    """vLLM's default ``raw_logprobs``: the engine reports the unscaled log-softmax even when it
    samples at 0.1, so the trainer must not divide by the temperature to reproduce them."""
    engine = EmbeddedEngine(max_tokens=4, logprobs_mode="raw")

    async def run() -> list[Trajectory]:
        async with LocalGateway(engine, temperature=0.1, max_tokens=4) as gateway:
            return await gateway.rollout(task, 2)

    trajectories = asyncio.run(run())
    assert trajectories[0].traces[0].metadata["logprobs_mode"] == "raw"
    stats = GRPOTrainer(copy.deepcopy(engine.model)).step(trajectories)
    assert stats.step0.tokens > 0 and stats.step0.max_abs_delta <= 1e-4


def test_kl_to_the_frozen_start_is_zero_on_the_first_step(captured, policy) -> None:  # type: ignore[no-untyped-def]
    _, trajectories = captured
    trainer = GRPOTrainer(policy, TrainerConfig(kl_coef=0.1))
    assert trainer.reference is not None and trainer.reference is not policy
    stats = trainer.step(trajectories)
    assert stats.kl == pytest.approx(0.0, abs=1e-6)
