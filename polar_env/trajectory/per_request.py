"""Per-request builder: one trace per captured call. Lossless and simple, but a session of N calls
becomes N trainer rows that each repeat the whole growing prompt."""

from __future__ import annotations

from collections.abc import Sequence

from polar_env.records import CompletionRecord, Status, Trace, Trajectory
from polar_env.trajectory.checks import check_records, error_trajectory


def build_per_request(records: Sequence[CompletionRecord], session_id: str | None = None) -> Trajectory:
    problem = check_records(records, session_id)
    if problem is not None:
        return error_trajectory(records, session_id, problem)
    ordered = sorted(records, key=lambda r: r.seq)
    traces = [
        Trace(
            prompt_ids=r.prompt_ids,
            response_ids=r.response_ids,
            loss_mask=[1] * len(r.response_ids),
            response_logprobs=r.response_logprobs,
            status=Status.TRUNCATED if r.finish_reason == "length" else Status.COMPLETED,
            metadata={"seqs": [r.seq], "finish_reason": r.finish_reason, "temperature": r.chat_request.temperature,
                      "logprobs_mode": r.logprobs_mode,
                      "weight_versions": [r.weight_version]},
        )
        for r in ordered
    ]
    return Trajectory(
        session_id=ordered[0].session_id,
        traces=traces,
        metadata={"builder": "per_request", "stats": {"completions": len(ordered), "traces": len(traces)}},
    )
