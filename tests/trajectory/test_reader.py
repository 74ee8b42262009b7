"""A journal line that is not a record spoils only its own session's trajectory."""

from __future__ import annotations

from pathlib import Path

from polar_env.proxy.capture import CaptureStore, SessionMeta
from polar_env.records import Status
from polar_env.trajectory.builders import BUILDERS
from polar_env.trajectory.reader import build_store
from tests.proxy.test_capture import record


def test_bad_line_is_an_error_trajectory_for_that_session_only(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    for sid in ("good", "poisoned"):
        store.append(record(sid, 0))
        store.append(record(sid, 1))
    text = store.path("poisoned").read_bytes().split(b"\n")
    text[0] = text[0].replace(b"-0.5", b"null")  # a NaN logprob as orjson used to write it
    store.path("poisoned").write_bytes(b"\n".join(text))
    store.write_session_meta(SessionMeta(session_id="good", key_sha256="00" * 32, created_at=0.0, metadata={"task": "t"}))
    for name, build in BUILDERS.items():
        by_id = {t.session_id: t for t in build_store(CaptureStore(tmp_path), build)}
        assert by_id["poisoned"].status == Status.ERROR, name
        assert "poisoned.jsonl line 1" in by_id["poisoned"].metadata["error"]
        assert by_id["good"].status != Status.ERROR and by_id["good"].metadata["session"] == {"task": "t"}
