"""opencode's real captured session (title request, then the main agent's tool round trip; the
capture helper of test_gym_delivery.py replays the recorded bodies through the real gateway):
the title chain is kept in the trajectory but gets no reward and is in no export — SFT rows,
slime samples, NeMo Gym delivery — with either builder, and the run report sums captured vs
trainable tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from integration_doubles import SampleDouble
from test_gym_delivery import opencode_capture

from polar_env.integrations.credit import CreditScheme, trace_weights
from polar_env.integrations.delivery import choose_delivered
from polar_env.integrations.sft import sft_rows
from polar_env.integrations.slime import POLAR_METADATA_KEY, trajectory_to_samples
from polar_env.records import CompletionRecord, Trajectory
from polar_env.staging.models import SessionResult, SessionStatus
from polar_env.staging.report import build_report
from polar_env.trajectory.export import trace_rows
from polar_env.trajectory.outcome import with_outcome
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

pytestmark = pytest.mark.slow  # real Polar sessions

OUTCOME = {"session_id": "oc", "status": "completed", "reward": 1.0, "metadata": {"task_id": "t"}}


def _base() -> Any:
    return SampleDouble(index=0, group_index=0, prompt="echo hi", metadata={}, session_id="oc")


def _check(traj: Trajectory, records: list[CompletionRecord]) -> None:
    title_seq = 0  # opencode sends its title request first
    title = [t for t in traj.traces if title_seq in t.metadata["seqs"]]
    main = [t for t in traj.traces if title_seq not in t.metadata["seqs"]]
    assert [(t.trainable, t.role, t.reward) for t in title] == [(False, "side_request:title", None)]
    assert all(t.trainable and t.reward == 1.0 for t in main) and main
    assert title[0].loss_mask == [1] * len(records[0].response_ids)  # kept as captured, just not trained

    rows = sft_rows(traj, records)
    assert len(rows) == len(main) and all(r["messages"][0]["content"].startswith("You are opencode") for r in rows)
    assert [r["input_ids"] for r in rows] == [[*t.prompt_ids, *t.response_ids] for t in main]
    assert abs(sum(r["loss_weight"] for r in rows) - 1.0) < 1e-9

    samples = trajectory_to_samples(traj, _base())
    assert [s.tokens for s in samples] == [[*t.prompt_ids, *t.response_ids] for t in main]
    assert all(s.reward == 1.0 and not s.remove_sample for s in samples)
    assert all(title_seq not in s.metadata[POLAR_METADATA_KEY]["seqs"] for s in samples)

    delivery = choose_delivered(traj)
    assert delivery.index is not None and traj.traces[delivery.index].trainable
    assert delivery.untrained_tokens == len(records[0].response_ids)
    assert delivery.trainable_tokens == sum(sum(t.loss_mask) for t in main)
    assert trace_weights(traj.traces, CreditScheme.SESSION)[traj.traces.index(title[0])] == 0.0

    rows = trace_rows([traj])  # the Parquet export's rows
    assert [(r["trainable"], r["role"], r["reward"]) for r in rows] == [(t.trainable, t.role, t.reward) for t in traj.traces]

    stats = traj.metadata["stats"]
    assert stats["captured_tokens"] == sum(len(r.response_ids) for r in records)
    assert stats["trainable_tokens"] == stats["captured_tokens"] - len(records[0].response_ids)


async def test_opencode_title_chain_gets_no_reward_and_is_in_no_export(tmp_path: Path) -> None:
    records = await opencode_capture(tmp_path)
    for build in (build_prefix_merged, build_per_request):
        _check(with_outcome(build(records), OUTCOME), records)


async def test_a_session_of_side_requests_only_trains_nothing(tmp_path: Path) -> None:
    records = (await opencode_capture(tmp_path))[:1]  # the title call alone
    traj = with_outcome(build_prefix_merged(records), OUTCOME)
    assert [t.trainable for t in traj.traces] == [False]
    assert sft_rows(traj, records) == []
    (placeholder,) = trajectory_to_samples(traj, _base())
    assert placeholder.remove_sample and placeholder.loss_mask == [0]
    assert choose_delivered(traj).index is None


async def test_run_report_sums_captured_and_trainable_tokens(tmp_path: Path) -> None:
    records = await opencode_capture(tmp_path)
    traj = with_outcome(build_prefix_merged(records), OUTCOME)
    results = [SessionResult(session_id=f"oc{i}", task_id="t", group_id="g", sample_index=i, status=SessionStatus.COMPLETED,
                             reward=1.0, trajectory=traj, records=len(records)) for i in range(2)]
    report = build_report(results, [], 1.0)
    stats = traj.metadata["stats"]
    assert report["captured_tokens"] == 2 * stats["captured_tokens"]
    assert report["trainable_tokens"] == 2 * stats["trainable_tokens"] < report["captured_tokens"]
    assert report["session_rows"][0]["trainable_tokens"] == stats["trainable_tokens"]
