"""A journal line that is not a record spoils only its own session's trajectory."""

from __future__ import annotations

from pathlib import Path

from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.records import Status
from polar_env.trajectory.builders import BUILDERS
from polar_env.trajectory.reader import build_store
from tests.journal.test_store import record


def test_bad_line_is_an_error_trajectory_for_that_session_only(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    for sid in ("good", "poisoned"):
        store.append(record(sid, 0))
        store.append(record(sid, 1))
    text = store.path("poisoned").read_bytes().split(b"\n")
    text[0] = text[0].replace(b"-0.5", b"null")  # a NaN logprob as orjson used to write it
    store.path("poisoned").write_bytes(b"\n".join(text))
    store.write_session_meta(SessionMeta(session_id="good", key_sha256="00" * 32, created_at=0.0, metadata={"task": "t"}))
    for name, build in BUILDERS.items():
        by_id = {t.session_id: t for t in build_store(JournalStore(tmp_path), build)}
        assert by_id["poisoned"].status == Status.ERROR, name
        assert "poisoned.jsonl line 1" in by_id["poisoned"].metadata["error"]
        assert by_id["good"].status != Status.ERROR and by_id["good"].metadata["session"] == {"task": "t"}


def test_outcomes_written_before_failure_kinds_still_rebuild_typed(tmp_path: Path) -> None:
    """Outcome files of older runs say ``error`` (text) and no kind; rebuilt trajectories get a kind
    from their status and text, old ``aborted`` / new ``cancelled`` agree, and a rollout session
    with an outcome but no journal (it ended before its first call) is rebuilt as an empty row."""
    import orjson

    from polar_env.journal.store import RESULT_SUFFIX
    from polar_env.records import FailureKind

    store = JournalStore(tmp_path)
    store.append(record("ran", 0))
    outcomes = {
        "ran": {"status": "cancelled", "reward": 0.0, "error": "cancelled", "metadata": {"group_id": "g", "sample_index": 0}},
        "never": {"status": "error", "reward": 0.0, "error": "INIT failed: RuntimeError: no bwrap",
                  "metadata": {"group_id": "g", "sample_index": 1}},
        "slow": {"status": "timeout", "reward": 0.0, "error": "agent exceeded 5 s", "metadata": {"group_id": "g", "sample_index": 2}},
    }
    for sid, outcome in outcomes.items():
        (tmp_path / f"{sid}{RESULT_SUFFIX}").write_bytes(orjson.dumps({"session_id": sid, **outcome}))
    by_id = {t.session_id: t for t in build_store(JournalStore(tmp_path), BUILDERS["prefix_merge"])}
    assert set(by_id) == {"ran", "never", "slow"}
    assert (by_id["ran"].status, by_id["ran"].failure_kind, by_id["ran"].mask) == (Status.CANCELLED, FailureKind.CANCELLED, True)
    assert by_id["ran"].traces and by_id["ran"].traces[0].status is Status.CANCELLED
    never = by_id["never"]
    assert (never.status, never.failure_kind, never.mask, never.traces) == (Status.ERROR, FailureKind.INIT_ERROR, True, [])
    assert never.failure_detail == "INIT failed: RuntimeError: no bwrap" and "error" not in never.metadata
    assert (never.group_id, never.sample_index) == ("g", 1)
    assert by_id["slow"].failure_kind is FailureKind.AGENT_TIMEOUT and by_id["slow"].mask  # nothing sampled
