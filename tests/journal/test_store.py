"""The journal store under real failures: torn tails from a crash, a file-size limit (a disk that
fills up), a 1,024-fd limit, corrupt lines, and the sequence a restarted gateway continues."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from polar_env.journal.reader import JournalError
from polar_env.journal.store import CaptureError, JournalStore, SessionMeta
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from tests.conftest import REPO_ROOT


def record(session_id: str, seq: int, pad: int = 0) -> CompletionRecord:
    return CompletionRecord(
        message=AssistantMessage(content="ok"), prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5],
        finish_reason="stop", session_id=session_id, seq=seq, provider_api=ProviderAPI.OPENAI_CHAT,
        provider_request={"pad": "x" * pad}, chat_request=ChatRequest(messages=[{"role": "user", "content": "q"}]),
        timings=Timings(received_at=0.0),
    )


def test_torn_tail_is_cut_off_before_the_next_append(tmp_path: Path) -> None:
    """kill -9 in the middle of a large write leaves a fragment; the next record must not glue onto it."""
    store = JournalStore(tmp_path)
    store.append(record("s", 0))
    store.close()
    whole = store.path("s").read_bytes()
    torn = record("s", 1, pad=8 << 20).to_json()[: 5 << 20]  # 5 MB of an 8 MB record
    store.path("s").write_bytes(whole + torn)
    assert [r.seq for r in JournalStore(tmp_path).read("s")] == [0]
    again = JournalStore(tmp_path)
    assert again.next_seq("s") == 1
    again.append(record("s", 1))
    assert [r.seq for r in again.read("s")] == [0, 1]
    assert (tmp_path / "s.jsonl.torn").read_bytes() == torn + b"\n"  # kept aside, not lost


def test_next_seq_reads_the_last_whole_record(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    assert store.next_seq("s") == 0
    for seq in (0, 1, 5):
        store.append(record("s", seq, pad=100_000))
    assert store.next_seq("s") == 6


def test_bad_middle_line_names_file_and_line(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    store.append(record("s", 0))
    good = store.path("s").read_bytes()
    bad = good.replace(b"-0.5", b"null")  # what a NaN logprob used to be written as
    store.path("s").write_bytes(good + bad + good)
    with pytest.raises(JournalError, match=r"s\.jsonl line 2"):
        store.read("s")


def test_session_meta_round_trip(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    assert store.read_session_meta("s") is None
    store.write_session_meta(SessionMeta(session_id="s", key_sha256="00" * 32, created_at=1.0, metadata={"a": 1}))
    assert store.read_session_meta("s") == {"session_id": "s", "key_sha256": "00" * 32, "created_at": 1.0,
                                            "metadata": {"a": 1}, "continuation": False, "closed": False,
                                            "sampling": None}
    assert store.session_ids() == []  # state alone is not a journal


def test_unserializable_record_is_a_capture_error(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    deep: object = "x"
    for _ in range(300):
        deep = {"a": deep}
    bad = record("s", 0).model_copy(update={"provider_request": {"deep": deep}})
    with pytest.raises(CaptureError, match="cannot be serialized"):
        store.append(bad)
    assert store.read("s") == []


CHILD = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from polar_env.journal.store import CaptureError, JournalStore
    from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, Timings

    def record(session_id, seq, pad=0):  # as record() in the test module (which imports torch via conftest)
        return CompletionRecord(
            message=AssistantMessage(content="ok"), prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5],
            finish_reason="stop", session_id=session_id, seq=seq, provider_api="openai_chat",
            provider_request={{"pad": str(seq % 10) * pad}}, chat_request=ChatRequest(messages=[{{"role": "user", "content": "q"}}]),
            timings=Timings(received_at=0.0),
        )
    mode = sys.argv[1]
    store = JournalStore(Path(sys.argv[2]))
    if mode == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # the disk is full at 300 kB
        ok = failed = 0
        for seq in range(20):
            try:
                store.append(record("s", ok, pad=40_000))
                ok += 1
            except CaptureError as exc:
                failed += 1
                reason = str(exc)
        print(ok, failed, reason)
    else:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        for i in range(3000):
            store.append(record(f"s{{i}}", 0))
        for i in range(0, 3000, 7):
            store.append(record(f"s{{i}}", 1))
        import os
        print(len(os.listdir("/proc/self/fd")), store.open_fds())
""")


def run_child(mode: str, store: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=str(REPO_ROOT)), mode, str(store)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_write_past_a_file_size_limit_fails_whole(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (``ulimit -f``): the write that crosses it is short; it must raise and leave
    only whole records (Python ignores SIGXFSZ, so the write returns short / EFBIG)."""
    ok, failed, reason = run_child("fsize", tmp_path).split(" ", 2)
    assert int(ok) > 0 and int(failed) > 0, reason
    data = (tmp_path / "s.jsonl").read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == int(ok)
    assert [r.seq for r in JournalStore(tmp_path).read("s")] == list(range(int(ok)))
    assert "cut short" in reason or "File too large" in reason


def test_3000_sessions_under_a_1024_fd_limit(tmp_path: Path) -> None:
    fds, open_journals = map(int, run_child("nofile", tmp_path).split())
    assert open_journals <= 64 and fds < 100
    store = JournalStore(tmp_path)
    assert len(store.session_ids()) == 3000
    assert [r.seq for r in store.read("s7")] == [0, 1] and [r.seq for r in store.read("s8")] == [0]
    assert orjson.loads(store.path("s0").read_bytes().splitlines()[0])["seq"] == 0
