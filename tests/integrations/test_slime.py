"""Polar trajectories → slime samples: every length/shape rule of the slime contract
(reference/trainers.md A4, A5, A12), per-group GRPO normalisation over distinct rollouts, and the
generate function against a ``FakePolarEnv`` test double. When slime itself imports (it is not on
PyPI), the same conversions are checked with the real ``Sample`` and slime's own validators."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
from integration_doubles import FakePolarEnv, SampleDouble, multi_turn_trace, trace, trajectory

from polar_env.errors import ConfigError
from polar_env.integrations.credit import CreditScheme
from polar_env.integrations.slime import (
    FAILURE_TOKENS,
    GENERATE_ERRORS_METRIC,
    POLAR_METADATA_KEY,
    SlimeRollout,
    check_slime_args,
    forced_sampling,
    grpo_normalize,
    log_rollout,
    polar_config,
    task_row,
    trajectory_to_samples,
)
from polar_env.records import FailureKind, Status

pytestmark = pytest.mark.slow  # real Polar sessions

ARGS = SimpleNamespace(advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
                       reward_key=None, rollout_max_context_len=None)


def base_sample(cls: type = SampleDouble, index: int = 7, group_index: int = 3, rollout_id: int | None = None) -> Any:
    return cls(index=index, group_index=group_index, rollout_id=rollout_id, prompt="fix the bug", label="gold",
               metadata={"instance_id": "toy__calc-1"}, session_id="route-key")


def check_contract(samples: list[Any], base: Any, traj: Any) -> None:
    """The rules every returned list must satisfy (trainers.md A12)."""
    assert isinstance(samples, list) and samples
    rid = base.rollout_id if base.rollout_id is not None else base.index
    traces = [t for t in traj.traces if t.response_ids]
    assert len(samples) == len(traces)
    for s, t in zip(samples, traces, strict=True):
        assert s.tokens == t.prompt_ids + t.response_ids  # exact engine ids, prompt then response
        assert s.response_length == len(t.response_ids) == len(s.tokens) - len(t.prompt_ids)
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        assert s.loss_mask == t.loss_mask
        for m, lp, orig in zip(s.loss_mask, s.rollout_log_probs, t.response_logprobs, strict=True):
            assert lp == (orig if m else 0.0)
        assert s.rollout_id == rid
        assert (s.index, s.group_index, s.prompt, s.label, s.session_id) == (
            base.index, base.group_index, base.prompt, base.label, base.session_id)
        assert s.reward == traj.reward and isinstance(s.reward, float)
        assert s.remove_sample is False
    assert sum(s.metadata[POLAR_METADATA_KEY]["loss_weight"] for s in samples) == pytest.approx(1.0)


def test_single_chain_session_is_one_sample() -> None:
    base = base_sample()
    traj = trajectory([multi_turn_trace()], reward=1.0, weight_versions=["2"])
    samples = trajectory_to_samples(traj, base)
    check_contract(samples, base, traj)
    (s,) = samples
    assert s.tokens == [1, 2, 3, 10, 11, 99, 7, 8, 12, 99, 7, 9, 9, 13, 14]
    assert s.response_length == 12
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert s.rollout_log_probs[:3] == [-0.5, -0.51, -0.52] and s.rollout_log_probs[3:5] == [0.0, 0.0]
    assert s.status is SampleDouble.Status.COMPLETED
    assert s.weight_versions == ["2"]  # from the trajectory when traces carry none
    assert s.metadata["instance_id"] == "toy__calc-1"  # the prompt sample's metadata is kept
    assert s.metadata[POLAR_METADATA_KEY]["session_id"] == "s-1"
    assert base.tokens == [] and base.metadata == {"instance_id": "toy__calc-1"}  # input untouched


def test_multi_chain_session_shares_rollout_id_and_full_reward() -> None:
    base = base_sample(rollout_id=0)  # 0 is a real id, not "unset"
    main = multi_turn_trace()
    side = trace([1, 5], [([20, 21, 22], [])], finish="length", weight_versions=["4", None])
    traj = trajectory([main, side], reward=0.25)
    samples = trajectory_to_samples(traj, base)
    check_contract(samples, base, traj)
    assert [s.rollout_id for s in samples] == [0, 0]
    assert [s.reward for s in samples] == [0.25, 0.25]  # full reward on each (per-rollout loss mean)
    assert [s.status for s in samples] == [SampleDouble.Status.COMPLETED, SampleDouble.Status.TRUNCATED]
    assert samples[1].weight_versions == ["4"]
    weights = [s.metadata[POLAR_METADATA_KEY]["loss_weight"] for s in samples]
    assert weights == pytest.approx([7 / 10, 3 / 10])  # trainable tokens 7 and 3
    assert samples[0].tokens is not samples[1].tokens and samples[0].metadata is not samples[1].metadata


def test_trace_weight_scheme_and_abort_status() -> None:
    traj = trajectory([trace([1], [([5], [])], finish="abort"), trace([1, 2], [([6], [])])])
    samples = trajectory_to_samples(traj, base_sample(), credit=CreditScheme.TRACE)
    assert [s.metadata[POLAR_METADATA_KEY]["loss_weight"] for s in samples] == [1.0, 1.0]
    assert samples[0].status is SampleDouble.Status.ABORTED


@pytest.mark.parametrize("traj, reason", [
    (None, "no trajectory"),
    (trajectory([], status=Status.ERROR, error="session has no completions"), "session has no completions"),
    (trajectory([]), "session produced no sampled tokens"),
])
def test_failure_is_one_placeholder(traj: Any, reason: str) -> None:
    base = base_sample()
    (s,) = trajectory_to_samples(traj, base)
    assert s.tokens == FAILURE_TOKENS and s.response_length == 1
    assert s.loss_mask == [0] and s.rollout_log_probs == [0.0]
    assert s.reward == 0.0 and s.remove_sample is True
    assert s.status is SampleDouble.Status.FAILED
    assert s.rollout_id == base.index and s.index == base.index and s.group_index == base.group_index
    assert s.metadata[POLAR_METADATA_KEY]["failed"] == reason


def test_context_limit_cuts_and_marks_truncated() -> None:
    traj = trajectory([multi_turn_trace(), trace([1] * 20, [([5, 6], [])])])
    samples = trajectory_to_samples(traj, base_sample(), max_tokens=8)
    assert len(samples) == 1  # the second trace's prompt alone exceeds the context
    (s,) = samples
    assert s.tokens == [1, 2, 3, 10, 11, 99, 7, 8] and s.response_length == 5
    assert len(s.loss_mask) == len(s.rollout_log_probs) == 5
    assert s.status is SampleDouble.Status.TRUNCATED
    (gone,) = trajectory_to_samples(trajectory([trace([1] * 20, [([5], [])])]), base_sample(), max_tokens=8)
    assert gone.remove_sample and "context" in gone.metadata[POLAR_METADATA_KEY]["failed"]


# --- group normalisation -----------------------------------------------------------------------


def _s(group: int, rollout: int | None, reward: Any, index: int, remove: bool = False) -> SampleDouble:
    return SampleDouble(group_index=group, index=index, rollout_id=rollout, reward=reward, remove_sample=remove)


def test_grpo_normalize_counts_each_rollout_once_with_uneven_samples() -> None:
    samples = [
        _s(0, 10, 1.0, 0), _s(0, 10, 1.0, 0), _s(0, 10, 1.0, 0),  # rollout 10: three traces
        _s(0, 11, 0.0, 1),
        _s(0, 12, 0.0, 2), _s(0, 12, 0.0, 2),
        _s(1, None, 0.5, 3),  # group 1: rollout ids fall back to index
        _s(1, None, 0.5, 4),
        _s(1, 5, 0.0, 5, remove=True),  # a failed rollout is left out of the statistics
    ]
    raw, norm = grpo_normalize(ARGS, samples)
    assert raw == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0]
    mean0 = 1 / 3
    std0 = math.sqrt(((1 - mean0) ** 2 + 2 * mean0**2) / 2)  # unbiased, over 3 rollouts (not 6 samples)
    hi, lo = (1 - mean0) / (std0 + 1e-6), -mean0 / (std0 + 1e-6)
    assert norm[:6] == pytest.approx([hi, hi, hi, lo, lo, lo])
    assert norm[6:] == pytest.approx([0.0, 0.0, 0.0])


def test_grpo_normalize_matches_slime_default_without_fan_out() -> None:
    torch = pytest.importorskip("torch")
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    samples = [_s(g, None, r, g * 4 + i) for g, row in enumerate(rewards) for i, r in enumerate(row)]
    _, norm = grpo_normalize(ARGS, samples)
    t = torch.tensor(rewards)  # slime's default: reshape (-1, n), centre, divide by std + 1e-6
    t = t - t.mean(dim=-1, keepdim=True)
    expected = (t / (t.std(dim=-1, keepdim=True) + 1e-6)).flatten().tolist()
    assert norm == pytest.approx(expected, rel=1e-6)


def test_grpo_normalize_flags_estimators_and_dict_rewards() -> None:
    samples = [_s(0, None, {"acc": 1.0}, 0), _s(0, None, {"acc": 0.0}, 1)]
    with pytest.raises(ConfigError, match="--reward-key"):
        grpo_normalize(ARGS, samples)
    args = SimpleNamespace(**{**vars(ARGS), "reward_key": "acc", "grpo_std_normalization": False})
    assert grpo_normalize(args, samples) == ([1.0, 0.0], [0.5, -0.5])
    rpp = SimpleNamespace(**{**vars(args), "advantage_estimator": "reinforce_plus_plus_baseline", "grpo_std_normalization": True})
    assert grpo_normalize(rpp, samples)[1] == [0.5, -0.5]  # centred only
    ppo = SimpleNamespace(**{**vars(args), "advantage_estimator": "ppo"})
    assert grpo_normalize(ppo, samples) == ([1.0, 0.0], [1.0, 0.0])
    off = SimpleNamespace(**{**vars(args), "rewards_normalization": False})
    assert grpo_normalize(off, samples)[1] == [1.0, 0.0]
    single = [_s(0, None, 1.0, 0)]
    assert grpo_normalize(ARGS, single)[1] == [0.0]  # one rollout: centred to 0, no NaN


# --- the generate function ---------------------------------------------------------------------


def test_forced_sampling_and_task_row() -> None:
    assert forced_sampling({"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512}) == {
        "temperature": 0.7, "top_p": 1.0, "max_tokens": 512}
    with pytest.raises(ConfigError, match="--rollout-top-p 1.0"):
        forced_sampling({"temperature": 1.0, "top_p": 0.9})
    with pytest.raises(ConfigError, match="top_k"):
        forced_sampling({"temperature": 1.0, "top_k": 20})
    row = task_row(SampleDouble(index=4, group_index=1, prompt=[{"role": "system", "content": "x"},
                                                               {"role": "user", "content": "do it"}], metadata={}))
    assert row["task_id"] == "slime-4" and row["instruction"] == "do it"
    assert task_row(base_sample()) == {"instance_id": "toy__calc-1"}  # a SWE row goes to PolarEnv as is
    row = task_row(SampleDouble(index=1, prompt="p", metadata={"task": {"task_id": "t", "expected": "42"}}))
    assert row == {"task_id": "t", "instruction": "p", "task": {"expected": "42"}}


def test_polar_config_points_engine_at_slime_router(tmp_path: Any) -> None:
    cfg = tmp_path / "polar.yaml"
    cfg.write_text("harness: loop\nengine: {kind: embedded, model: m, seed: 3}\nsampling: {temperature: 0.1}\n")
    args = SimpleNamespace(polar_config=str(cfg), sglang_router_ip="10.0.0.2", sglang_router_port=3000)
    out = polar_config(args)
    assert out["engine"] == {"kind": "sglang", "url": "router:http://10.0.0.2:3000", "model": "m"}  # seed: embedded's
    # the file's own sampling stays; slime's comes with each call and must agree with it
    assert (out["sampling"], out["harness"]) == ({"temperature": 0.1}, "loop")
    with pytest.raises(ConfigError, match="--custom-config-path"):
        polar_config(SimpleNamespace())


async def test_generate_refuses_sampling_that_contradicts_the_polar_config(tmp_path: Any) -> None:
    """slime at --rollout-temperature 1.0 under a polar.yaml forcing 0.1: one ConfigError naming
    both, before any session (the trainer would otherwise divide by a temperature nobody sampled at)."""
    from polar_env import PolarEnv

    env = PolarEnv({"harness": "loop", "engine": {"kind": "simulated"}, "sampling": {"temperature": 0.1},
                    "store": str(tmp_path / "store")})
    rollout = SlimeRollout(env, aborted=lambda: False)
    with pytest.raises(ConfigError, match=r"temperature 1.0 != 0.1"):
        await rollout.generate(ARGS, base_sample(), {"temperature": 1.0, "top_p": 1.0})
    assert env._cluster is None  # refused before anything started


async def test_each_generate_call_carries_its_own_sampling() -> None:
    """Rollout and evaluation calls at different temperatures: each session's TaskRequest says its own."""
    traj = trajectory([trace([1, 5], [([20], [])])], reward=1.0)
    env = FakePolarEnv({"toy__calc-1": [("completed", 1.0, traj)]})
    rollout = SlimeRollout(env, aborted=lambda: False)
    await rollout.generate(ARGS, base_sample(), {"temperature": 0.8, "top_p": 1.0, "max_new_tokens": 64})
    await rollout.generate(ARGS, base_sample(), {"temperature": 0.2}, evaluation=True)
    assert [call[2]["sampling"] for call in env.calls] == [{"temperature": 0.8, "top_p": 1.0, "max_tokens": 64},
                                                           {"temperature": 0.2, "top_p": 1.0}]


async def test_generate_with_fake_polar_env() -> None:
    good = trajectory([multi_turn_trace(), trace([1, 5], [([20], [])])], reward=1.0)
    env = FakePolarEnv({"toy__calc-1": [("completed", 1.0, good)], "bad": [("error", 0.0, good)],
                        "gone": [("cancelled", 0.0, None)], "slow": [("timeout", 0.0, good)]})
    rollout = SlimeRollout(env)
    args = SimpleNamespace(rollout_max_context_len=None)
    group = [copy.deepcopy(base_sample(index=i)) for i in range(3)]
    outs = await asyncio.gather(*(rollout.generate(args, s, {"temperature": 1.0}) for s in group))
    assert env.entered == 1  # started once although called concurrently
    for s, out in zip(group, outs, strict=True):
        check_contract(out, s, good)
        assert out[0].metadata[POLAR_METADATA_KEY]["evaluation"] == {"reward": 1.0}
    task, n, overrides = env.calls[0]
    assert n == 1 and task == {"instance_id": "toy__calc-1"}
    assert overrides["metadata"]["slime_rollout_id"] == 0 and overrides["metadata"]["slime_session_id"] == "route-key"
    (failed,) = await rollout.generate(args, SampleDouble(index=9, group_index=0, metadata={"instance_id": "bad"}), {})
    assert failed.remove_sample and failed.status is SampleDouble.Status.FAILED
    slow = await rollout.generate(args, SampleDouble(index=9, group_index=0, metadata={"instance_id": "slow"}), {})
    assert len(slow) == 2 and not slow[0].remove_sample and slow[0].reward == 0.0  # the policy ran out of time
    (aborted,) = await rollout.generate(args, SampleDouble(index=9, group_index=0, metadata={"instance_id": "gone"}), {})
    assert aborted.remove_sample and aborted.status is SampleDouble.Status.ABORTED
    crashing = SlimeRollout(FakePolarEnv(raises=RuntimeError("node lost")))
    (crashed,) = await crashing.generate(args, base_sample(), {})
    assert crashed.remove_sample and "node lost" in crashed.metadata[POLAR_METADATA_KEY]["failed"]
    await rollout.close()
    assert env.exited == 1


async def _crash_and_good(cls: type, caplog: pytest.LogCaptureFixture) -> tuple[SlimeRollout, list[Any]]:
    """A TypeError from a PolarEnv call (a signature gone stale, as a monkeypatch once was) and one
    good session: the rollout's flat samples, as slime's log function gets them."""
    good = trajectory([multi_turn_trace()], reward=1.0)
    crashing = SlimeRollout(FakePolarEnv(raises=TypeError("_run() takes 2 positional arguments but 3 were given")))
    fine = SlimeRollout(FakePolarEnv({"toy__calc-1": [("completed", 1.0, good)]}))
    args = SimpleNamespace(rollout_max_context_len=None)
    with caplog.at_level(logging.ERROR, logger="polar_env.integrations.slime"):
        crashed = await crashing.generate(args, base_sample(cls, index=0, group_index=0), {})
        kept = await fine.generate(args, base_sample(cls, index=1, group_index=0), {})
    await crashing.close()
    await fine.close()
    return crashing, [*crashed, *kept]


async def test_an_exception_in_generate_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    crashing, samples = await _crash_and_good(SampleDouble, caplog)
    (record,) = [r for r in caplog.records if r.name == "polar_env.integrations.slime"]
    assert record.levelno == logging.ERROR and record.exc_info is not None  # the traceback, not just a line
    assert isinstance(record.exc_info[1], TypeError) and "slime sample 0" in record.getMessage()
    placeholder = samples[0]
    assert placeholder.remove_sample and placeholder.status is SampleDouble.Status.FAILED
    assert placeholder.metadata[POLAR_METADATA_KEY]["generate_error"].startswith("TypeError('_run() takes")
    assert crashing.generate_errors == 1 and "generate_error" not in samples[1].metadata[POLAR_METADATA_KEY]
    metrics: dict[str, Any] = {"rollout/dynamic_filter/drop_x": 2}
    assert log_rollout(3, ARGS, samples, metrics, 1.0) is False  # slime's own logging goes on
    assert metrics == {"rollout/dynamic_filter/drop_x": 2, GENERATE_ERRORS_METRIC: 1}
    clean: dict[str, Any] = {}
    log_rollout(4, ARGS, samples[1:], clean, 1.0)
    assert clean == {GENERATE_ERRORS_METRIC: 0}  # reported every rollout, so a chart shows the zeros too


@pytest.mark.usefixtures("slime_src")
async def test_slime_logs_the_generate_error_count_with_its_rollout_metrics(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's real ``log_rollout_data`` with polar's hook (as ``polar-env slime-args`` renders it):
    the count reaches what slime hands its trackers (wandb, tensorboard)."""
    from slime.observability import logging_utils
    from slime.observability.rollout_metrics import log_rollout_data
    from slime.utils.types import Sample

    from polar_env.integrations.slime_recipe import LOG_PATH

    _, samples = await _crash_and_good(Sample, caplog)
    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(logging_utils, "log", lambda args, metrics, step_key: logged.append(dict(metrics)))
    args = SimpleNamespace(**vars(ARGS), custom_rollout_log_function_path=LOG_PATH, load_debug_rollout_data=None,
                           log_reward_category=None, rollout_num_gpus=1, wandb_always_use_train_step=False,
                           use_wandb=False, use_tensorboard=False)
    log_rollout_data(5, args, samples, {}, 2.0)
    (metrics,) = logged
    assert metrics[GENERATE_ERRORS_METRIC] == 1 and metrics["rollout/step"] == 5
    assert "rollout/response_len/mean" in metrics  # slime's own metrics, computed on the same samples


@pytest.mark.parametrize("status, kind, traj, want", [
    # environment failures and unfinished runs: the one-sample placeholder, never trained
    ("error", FailureKind.INIT_ERROR, None, "FAILED"),
    ("error", FailureKind.ENGINE_ERROR, "good", "FAILED"),
    ("error", FailureKind.EVALUATOR_ERROR, "good", "FAILED"),
    ("error", FailureKind.BUILD_ERROR, None, "FAILED"),
    ("error", FailureKind.NODE_LOST, "good", "FAILED"),
    ("cancelled", FailureKind.CANCELLED, "good", "ABORTED"),
    ("cancelled", FailureKind.INTERRUPTED, None, "ABORTED"),
    ("timeout", FailureKind.AGENT_TIMEOUT, None, "FAILED"),  # timed out before any call: nothing to train
    # the policy's own failures keep their tokens and train with reward 0
    ("timeout", FailureKind.AGENT_TIMEOUT, "good", "COMPLETED"),
    ("error", FailureKind.HARNESS_ERROR, "good", "COMPLETED"),
    ("error", FailureKind.LIMIT_EXCEEDED, "good", "COMPLETED"),
    ("timeout", FailureKind.EVALUATION_TIMEOUT, "good", "COMPLETED"),
])
async def test_sample_status_and_mask_come_from_the_failure_kind(status: str, kind: FailureKind, traj: Any, want: str) -> None:
    good = trajectory([multi_turn_trace()], reward=0.0)
    env = FakePolarEnv({"t": [(status, 0.0, good if traj else None, kind)]})
    rollout = SlimeRollout(env, aborted=lambda: False)
    samples = await rollout.generate(ARGS, SampleDouble(index=1, group_index=0, metadata={"task_id": "t"}), {})
    assert [s.status for s in samples] == [getattr(SampleDouble.Status, want)]
    (s,) = samples
    assert s.remove_sample is (want != "COMPLETED") and s.reward == 0.0
    assert s.metadata[POLAR_METADATA_KEY]["failure_kind"] == kind.value
    if want != "COMPLETED":
        assert s.loss_mask == [0] and s.tokens == FAILURE_TOKENS
    else:
        assert sum(s.loss_mask) == sum(good.traces[0].loss_mask)


# --- the real slime Sample, when slime imports -------------------------------------------------

@pytest.mark.usefixtures("slime_src")  # POLAR_SLIME_SRC (conftest.py): under CI, missing fails
def test_real_slime_samples_pass_slime_validators() -> None:
    from slime.observability.rollout_data_utils import validate_rollout_id_annotated
    from slime.utils.types import Sample

    rollouts = []
    for i, traj in enumerate([
        trajectory([multi_turn_trace(), trace([1, 5], [([20, 21], [])], finish="length")], reward=1.0),
        trajectory([multi_turn_trace()], reward=0.0),
        None,
    ]):
        base = base_sample(Sample, index=i, group_index=0)
        out = trajectory_to_samples(traj, base)
        if traj is not None:
            check_contract(out, base, traj)
        for s in out:
            assert isinstance(s, Sample)
            s._validate_response_metadata_lengths()
            assert Sample.from_dict(s.to_dict()).tokens == s.tokens
        rollouts.append(out)
    validate_rollout_id_annotated([rollouts])  # prompt × n × samples-of-one-rollout
    assert rollouts[0][1].status is Sample.Status.TRUNCATED and rollouts[2][0].status is Sample.Status.FAILED
    flat = [s for r in rollouts for s in r]
    raw, norm = grpo_normalize(ARGS, flat)
    assert raw == [1.0, 1.0, 0.0, 0.0] and norm[0] == norm[1] > 0 > norm[2] and norm[3] == 0.0


# --- the real path: PolarEnv with the embedded engine, sandbox and swebench ----------------------


async def test_generate_runs_a_real_polar_session(tmp_path: Any) -> None:
    from integration_env import env_config, require_sandbox

    from polar_env import PolarEnv
    from polar_env.tasks.toy import toy_tasks

    require_sandbox()
    (calc,) = toy_tasks(ids=["toy__calc-1"])
    rollout = SlimeRollout(PolarEnv(env_config(tmp_path, calc, sampling={"temperature": 1.0, "top_p": 1.0})))
    group = [SampleDouble(index=i, group_index=0, prompt=calc.problem_statement, session_id=f"r{i}",
                          metadata=calc.model_dump(mode="json")) for i in range(2)]
    try:
        outs = await asyncio.gather(*(rollout.generate(ARGS, s, {"temperature": 1.0, "top_p": 1.0}) for s in group))
    finally:
        await rollout.close()
    for base, out in zip(group, outs, strict=True):
        meta = out[0].metadata[POLAR_METADATA_KEY]
        assert meta["session_status"] == "completed" and meta["evaluation"]["resolved"] is True
        traj_reward = out[0].reward
        assert traj_reward == 1.0  # the swebench evaluator's verdict on the applied patch
        for s in out:
            assert s.rollout_id == base.index and s.status is SampleDouble.Status.COMPLETED
            assert len(s.tokens) - s.response_length > 0
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            assert all(lp < 0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)
            assert s.weight_versions  # the engine's weight version on every call
    raw, norm = grpo_normalize(ARGS, [s for out in outs for s in out])
    assert raw == [1.0] * len(raw) and norm == [0.0] * len(norm)  # equal rewards: zero advantage


async def test_generate_as_slime_calls_it(tmp_path: Any) -> None:
    """The module-level generate, configured the way a recipe configures it (polar_config from
    --custom-config-path), against a FakeSGLangRouter test double backed by the embedded engine."""
    import yaml
    from integration_env import FakeSGLangRouter, env_config, require_sandbox

    from polar_env.engines.config import EmbeddedEngineConfig, build_engine
    from polar_env.integrations import slime
    from polar_env.tasks.toy import toy_tasks

    require_sandbox()
    (calc,) = toy_tasks(ids=["toy__calc-1"])
    cfg = env_config(tmp_path, calc)
    router = await FakeSGLangRouter(build_engine(EmbeddedEngineConfig(script=cfg["engine"]["script"]))).start()
    polar_file = tmp_path / "polar.yaml"
    polar_file.write_text(yaml.safe_dump({"harness": "loop", "store": cfg["store"], "engine": {"model": "qwen3.5-4b"}}))
    host, port = router.url.removeprefix("http://").split(":")
    args = SimpleNamespace(**vars(ARGS), polar_config=str(polar_file), sglang_router_ip=host,
                           sglang_router_port=int(port))
    params = {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200, "no_stop_trim": True}
    group = [SampleDouble(index=i, group_index=5, prompt=calc.problem_statement,
                          metadata=calc.model_dump(mode="json")) for i in range(2)]
    try:
        outs = await asyncio.gather(*(slime.generate(args, s, dict(params)) for s in group))
    finally:
        await slime.shutdown()
        await router.stop()
    for base, out in zip(group, outs, strict=True):
        assert out[0].reward == 1.0 and out[0].metadata[POLAR_METADATA_KEY]["evaluation"]["resolved"] is True
        assert [s.rollout_id for s in out] == [base.index] * len(out)
        assert all(s.weight_versions == ["7"] for s in out)  # the engine's version, per call
    assert len(router.bodies) == 4  # two sessions, two calls each
    for body in router.bodies:  # slime's sampling, forced on every call whatever the harness sent
        assert (body["temperature"], body["top_p"]) == (0.8, 1.0) and body["max_tokens"] <= 200


# --- slime's abort flag, --partial-rollout and --group-rm ------------------------------------------


class _CancellableEnv:
    """Test double for PolarEnv whose sessions run until cancelled through cluster.server.cancel."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.started = asyncio.Event()
        self._gate: dict[str, asyncio.Event] = {}
        outer = self

        class _Server:
            async def cancel(self, group_id: str) -> None:
                outer.cancelled.append(group_id)
                outer._gate[group_id].set()

        self.cluster = SimpleNamespace(server=_Server())

    async def __aenter__(self) -> _CancellableEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def rollout(self, task: Any, n: int = 1, **overrides: Any) -> Any:
        gate = self._gate[overrides["group_id"]] = asyncio.Event()
        self.started.set()
        await gate.wait()
        result = SimpleNamespace(status="cancelled", reward=0.0, trajectory=None, evaluation={}, mask=True,
                                 failure_kind="cancelled", failure_detail="cancelled")
        return SimpleNamespace(results=[result])


@pytest.mark.parametrize("partial", [False, True])
async def test_generate_cancels_its_session_when_slime_aborts(partial: bool) -> None:
    flag = {"aborted": False}
    env = _CancellableEnv()
    rollout = SlimeRollout(env, aborted=lambda: flag["aborted"], poll_s=0.01)
    args = SimpleNamespace(**vars(ARGS), partial_rollout=partial)
    base = SampleDouble(index=4, group_index=2, metadata={"instance_id": "x"})
    run = asyncio.ensure_future(rollout.generate(args, base, {}))
    await env.started.wait()
    flag["aborted"] = True
    out = await asyncio.wait_for(run, 5)
    assert len(env.cancelled) == 1 and env.cancelled[0].startswith("slime-4-")
    if partial:  # one prompt sample, reset for slime's buffer to run again
        assert out.status is SampleDouble.Status.ABORTED and out.response_length == 0 and out.tokens == []
        assert out.metadata["instance_id"] == "x" and "aborted" in out.metadata[POLAR_METADATA_KEY]
        assert task_row(out) == {"instance_id": "x"}  # polar's own bookkeeping never reaches the task
    else:
        (placeholder,) = out
        assert placeholder.status is SampleDouble.Status.ABORTED and placeholder.remove_sample


async def test_partial_rollout_delivers_one_sample_per_session() -> None:
    traj = trajectory([trace([1, 5], [([20], [])]), multi_turn_trace()], reward=1.0)
    rollout = SlimeRollout(FakePolarEnv({"toy__calc-1": [("completed", 1.0, traj)]}), aborted=lambda: False)
    args = SimpleNamespace(**vars(ARGS), partial_rollout=True)
    out = await rollout.generate(args, base_sample(), {})
    assert not isinstance(out, list) and out.status is SampleDouble.Status.COMPLETED and out.reward == 1.0
    meta = out.metadata[POLAR_METADATA_KEY]
    assert meta["dropped_traces"] == 1 and meta["dropped_tokens"] == 1 and meta["traces"] == 1


def test_group_rm_is_refused_with_one_line() -> None:
    with pytest.raises(ConfigError, match="--group-rm: polar's generate already sets"):
        check_slime_args(SimpleNamespace(group_rm=True))
    check_slime_args(SimpleNamespace(group_rm=False, partial_rollout=True))
