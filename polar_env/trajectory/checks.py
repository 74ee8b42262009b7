"""Input checks shared by the builders: a malformed session yields an explicit ERROR trajectory."""

from __future__ import annotations

from collections.abc import Sequence

from polar_env.records import CompletionRecord, Status, Trajectory


def check_records(records: Sequence[CompletionRecord], session_id: str | None) -> str | None:
    """Why these records cannot be built into a trajectory, or None if they can."""
    if not records:
        return "session has no completions"
    sessions = {r.session_id for r in records}
    if len(sessions) > 1:
        return f"records from several sessions: {sorted(sessions)}"
    if session_id is not None and sessions != {session_id}:
        return f"records belong to {sessions.pop()!r}, not {session_id!r}"
    seqs = [r.seq for r in records]
    if len(set(seqs)) != len(seqs):
        return "duplicate sequence numbers"
    for r in records:
        if not r.prompt_ids:
            return f"completion seq={r.seq} has no prompt ids"
        if len(r.response_logprobs) != len(r.response_ids):
            return f"completion seq={r.seq}: {len(r.response_logprobs)} logprobs for {len(r.response_ids)} response ids"
    return None


def error_trajectory(records: Sequence[CompletionRecord], session_id: str | None, problem: str) -> Trajectory:
    sid = session_id or (records[0].session_id if records else "")
    return Trajectory(session_id=sid, traces=[], status=Status.ERROR, metadata={"error": problem})
