"""Per-request builder: one trace per captured call. Lossless and simple, but a session of N calls
becomes N trainer rows that each repeat the whole growing prompt. Each trace is trainable and has
the role of the chain its call belongs to (``lineage.py``: side requests, calls whose client went
away and calls nobody continued are kept but not trained with the task's reward)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from polar_env.records import CompletionRecord, Status, Trace, Trajectory
from polar_env.trajectory.checks import check_records, error_trajectory
from polar_env.trajectory.lineage import TRAINABLE_ROLES, lineage
from polar_env.trajectory.prefix import detect_eot_ids, detect_turn_start_ids, prompts_of

if TYPE_CHECKING:
    from polar_env.harnesses.spec import SideRequest


def build_per_request(records: Sequence[CompletionRecord], session_id: str | None = None, *,
                      side_requests: Sequence[SideRequest] | None = None,
                      prompt_refs: Mapping[int, tuple[int, int]] | None = None) -> Trajectory:
    """One trace per call; ``prompt_refs`` (the journal's, when known) spare lineage's prefix tests."""
    problem = check_records(records, session_id)
    if problem is not None:
        return error_trajectory(records, session_id, problem)
    ordered = sorted(records, key=lambda r: r.seq)
    eot = detect_eot_ids(ordered)
    found = lineage(ordered, eot, detect_turn_start_ids(ordered, eot), prompts_of(ordered, prompt_refs), side_requests)
    roles = found.role_of()
    traces = [
        Trace(
            prompt_ids=r.prompt_ids,
            response_ids=r.response_ids,
            loss_mask=[1] * len(r.response_ids),
            response_logprobs=r.response_logprobs,
            status=Status.TRUNCATED if r.finish_reason == "length" else Status.COMPLETED,
            trainable=roles[r.seq] in TRAINABLE_ROLES,
            role=roles[r.seq],
            metadata={"seqs": [r.seq], "finish_reason": r.finish_reason, "temperature": r.chat_request.temperature,
                      "logprobs_mode": r.logprobs_mode,
                      "weight_versions": [r.weight_version]},
        )
        for r in ordered
    ]
    return Trajectory(
        session_id=ordered[0].session_id,
        traces=traces,
        metadata={"builder": "per_request", "stats": {"completions": len(ordered), "traces": len(traces),
                                                             **found.stats()}},
    )
