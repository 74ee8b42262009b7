from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from polar_env.records import (
    MASKED_KINDS,
    AssistantMessage,
    ChatRequest,
    CompletionRecord,
    FailureKind,
    Generation,
    ProviderAPI,
    Status,
    Timings,
    ToolCall,
    Trace,
    Trajectory,
    masked,
)


def big_record(n: int = 120_000) -> CompletionRecord:
    rng = random.Random(0)
    return CompletionRecord(
        session_id="s-1",
        seq=3,
        provider_api=ProviderAPI.ANTHROPIC,
        provider_request={"model": "claude", "messages": [{"role": "user", "content": "hi"}], "unknown": {"x": [1, None]}},
        chat_request=ChatRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.7, prompt_ids=None),
        message=AssistantMessage(content=None, reasoning="r", tool_calls=[ToolCall(id="t", name="bash", arguments='{"command": "ls"}')]),
        prompt_ids=[rng.randrange(248_077) for _ in range(n)],
        response_ids=[rng.randrange(248_077) for _ in range(n // 10)],
        response_logprobs=[-rng.random() * 20 for _ in range(n // 10)] ,
        finish_reason="tool_calls",
        stop_reason=None,
        model="m",
        engine="vllm",
        weight_version="7",
        timings=Timings(received_at=1.5, engine_ms=12.25, total_ms=13.0),
    )


def test_completion_record_roundtrip_is_lossless() -> None:
    rec = big_record()
    back = CompletionRecord.from_json(rec.to_json())
    assert back == rec
    assert back.response_logprobs == rec.response_logprobs  # float64 exact


def test_logprobs_must_align() -> None:
    with pytest.raises(ValidationError, match="align 1:1"):
        Generation(message=AssistantMessage(), prompt_ids=[1], response_ids=[1, 2], response_logprobs=[-1.0], finish_reason="stop")


def test_trace_invariants() -> None:
    Trace(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 0], response_logprobs=[-0.5, 0.0])
    with pytest.raises(ValidationError, match="must both match"):
        Trace(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1], response_logprobs=[-0.5, 0.0])
    with pytest.raises(ValidationError, match="0 or 1"):
        Trace(prompt_ids=[1], response_ids=[2], loss_mask=[2], response_logprobs=[0.0])


def test_trajectory_roundtrip_and_status() -> None:
    traj = Trajectory(
        session_id="s",
        traces=[Trace(prompt_ids=[1], response_ids=[2], loss_mask=[1], response_logprobs=[-0.1], status=Status.TRUNCATED)],
        reward=1.0,
        status=Status.TIMEOUT,
        metadata={"chains": 1},
    )
    assert Trajectory.from_json(traj.to_json()) == traj
    assert b'"timeout"' in traj.to_json()


def test_unknown_fields_rejected() -> None:
    with pytest.raises(ValidationError):
        ChatRequest(messages=[], bogus=1)  # type: ignore[call-arg]


def test_old_aborted_files_load_as_cancelled() -> None:
    """Trajectory files written before the one vocabulary said ``aborted`` (sessions said ``cancelled``)."""
    old = (b'{"session_id": "s", "status": "aborted", "reward": 0.0, "metadata": {}, "traces": [{"prompt_ids": [1],'
           b' "response_ids": [2], "loss_mask": [1], "response_logprobs": [-0.1], "status": "aborted"}]}')
    traj = Trajectory.from_json(old)
    assert traj.status is Status.CANCELLED and traj.traces[0].status is Status.CANCELLED
    assert traj.failure_kind is None and traj.mask is False  # old files carry no kind: the defaults
    assert b'"aborted"' not in traj.to_json() and Status("aborted") is Status.CANCELLED
    with pytest.raises(ValidationError):
        Trajectory.model_validate({"session_id": "s", "traces": [], "status": "exploded"})


@pytest.mark.parametrize("kind", list(FailureKind))
def test_the_mask_rule(kind: FailureKind) -> None:
    """Environment failures and unfinished runs are dropped; the policy's own failures train with reward 0;
    a sample with nothing sampled is always dropped."""
    policy_made = {FailureKind.AGENT_TIMEOUT, FailureKind.HARNESS_ERROR, FailureKind.LIMIT_EXCEEDED,
                   FailureKind.EVALUATION_TIMEOUT, FailureKind.TAMPERED}
    assert masked(kind, 10) is (kind not in policy_made)
    assert masked(kind, 0) is True
    assert (kind in MASKED_KINDS) is (kind not in policy_made)


def test_a_completed_session_is_masked_only_without_tokens() -> None:
    assert masked(None, 5) is False and masked(None, 0) is True
