"""The contract of journal storage (polar_env/journal/protocols.py), run against every store: the
file store and the memory store must behave alike for the gateway that writes through
``JournalSink`` and everything that reads through ``JournalSource``. A new store joins
``STORES`` and passes the same suite. What only files do (torn tails, fd limits, a disk that fills
up) is tests/journal/test_store.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.journal.format import CLIENT_GONE, PromptRef
from polar_env.journal.memory import MemoryJournalStore
from polar_env.journal.protocols import CaptureError, Journal, SessionMeta
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from polar_env.trajectory.builders import BUILDERS
from polar_env.trajectory.reader import all_session_ids, build_store
from tests.proxy.conftest import FakeEngine

STORES: dict[str, Callable[[Path], Journal]] = {
    "files": lambda tmp: JournalStore(tmp / "capture"),
    "memory": lambda tmp: MemoryJournalStore(),
}


@pytest.fixture(params=sorted(STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Journal:
    return STORES[request.param](tmp_path)


def record(session_id: str, seq: int, prompt: list[int] | None = None, content: str = "ok") -> CompletionRecord:
    return CompletionRecord(
        message=AssistantMessage(content=content), prompt_ids=prompt or [1, 2], response_ids=[3, 4],
        response_logprobs=[-0.5, -0.25], finish_reason="stop", session_id=session_id, seq=seq,
        provider_api=ProviderAPI.OPENAI_CHAT, provider_request={"messages": [{"role": "user", "content": "q"}] * (seq + 1)},
        chat_request=ChatRequest(messages=[{"role": "user", "content": "q"}]), timings=Timings(received_at=float(seq)),
    )


def chain(session_id: str, n: int) -> list[CompletionRecord]:
    """``n`` calls, each prompt the previous context plus two new ids (a continued conversation)."""
    out: list[CompletionRecord] = []
    prompt = [10, 11]
    for seq in range(n):
        r = record(session_id, seq, prompt)
        out.append(r)
        prompt = r.prompt_ids + r.response_ids + [20 + seq, 30 + seq]
    return out


def test_records_read_back_whole_in_order(store: Journal) -> None:
    assert store.read("s") == [] and store.next_seq("s") == 0 and store.session_ids() == []
    records = chain("s", 3)
    sizes = [store.append(r) for r in records]
    assert all(size > 0 for size in sizes)
    assert store.read("s") == records
    assert list(store.iter_records("s", start=1)) == records[1:]
    assert store.next_seq("s") == 3
    assert store.session_ids() == ["s"] and store.has_session("s") and not store.has_session("t")
    assert store.path("s").name == "s.jsonl"


def test_a_reader_gets_its_own_objects(store: Journal) -> None:
    store.append(record("s", 0))
    first = store.read("s")
    first[0].notes.append("changed by a reader")
    assert store.read("s")[0].notes == []


def test_gateway_prompt_references_come_back(store: Journal) -> None:
    """A continuation-mode reference (the gateway built the prompt as parent context + suffix)
    comes back from ``read_with_refs``, so builders need not compare token lists."""
    a, b = chain("s", 2)
    keep = len(a.prompt_ids) + len(a.response_ids)
    store.append(a)
    store.append(b, PromptRef(parent=0, keep=keep, prompt_ids=b.prompt_ids))
    records, refs = store.read_with_refs("s")
    assert records == [a, b] and refs == {1: (0, keep)}


def test_events_are_kept_apart_and_client_gone_folds_into_notes(store: Journal) -> None:
    store.append(record("s", 0))
    store.append_event("s", {"event": "aborted", "reason": "cancelled"})
    store.append_event("s", {"event": "client_gone", "seq": 0})
    assert [e["event"] for e in store.events("s")] == ["aborted", "client_gone"]
    (only,) = store.read("s")
    assert only.seq == 0 and CLIENT_GONE in only.notes
    assert store.events("t") == []


def test_an_unserializable_record_leaves_nothing(store: Journal) -> None:
    store.append(record("s", 0))
    deep: object = "x"
    for _ in range(300):
        deep = {"a": deep}
    bad = record("s", 1).model_copy(update={"provider_request": {"deep": deep}})
    with pytest.raises(CaptureError, match="cannot be serialized"):
        store.append(bad)
    assert [r.seq for r in store.read("s")] == [0] and store.next_seq("s") == 1
    store.append(record("s", 1))
    assert [r.seq for r in store.read("s")] == [0, 1]


def test_session_state_round_trip(store: Journal) -> None:
    assert store.read_session_meta("s") is None and store.session_metas() == []
    metas = [SessionMeta(session_id=sid, key_sha256="00" * 32, created_at=1.0, metadata={"task": sid})
             for sid in ("b", "a")]
    for meta in metas:
        store.write_session_meta(meta)
    store.write_session_meta(metas[0].model_copy(update={"closed": True}))  # replaced whole
    assert [m.session_id for m in store.session_metas()] == ["a", "b"]
    assert store.read_session_meta("b") == {"session_id": "b", "key_sha256": "00" * 32, "created_at": 1.0,
                                            "metadata": {"task": "b"}, "continuation": False, "closed": True,
                                            "sampling": None}
    assert store.has_session("a") and store.session_ids() == []  # state alone is not a journal


def test_outcomes_replace_whole_and_need_no_journal(store: Journal) -> None:
    assert store.read_outcome("s") is None and store.outcome_ids() == []
    store.write_outcome("s", {"status": "completed", "reward": 0.0})
    store.write_outcome("s", {"status": "completed", "reward": 1.0, "file": "bad\udcffname"})
    assert store.read_outcome("s") == {"status": "completed", "reward": 1.0, "file": "bad\\xffname"}
    assert store.outcome_ids() == ["s"] and store.session_ids() == []
    assert all_session_ids(store) == ["s"]  # a session that ended before its first call still has its row


@pytest.mark.parametrize("call", ["append", "read", "path", "write_outcome", "read_outcome", "next_seq"])
def test_every_store_refuses_the_same_session_ids(store: Journal, call: str) -> None:
    bad = "../escape"
    with pytest.raises(ValueError, match="invalid session id"):
        if call == "append":
            store.append(record(bad, 0))
        elif call == "write_outcome":
            store.write_outcome(bad, {})
        else:
            getattr(store, call)(bad)


def test_closing_loses_nothing(store: Journal) -> None:
    records = chain("s", 2)
    store.append(records[0])
    store.close_session("s")
    store.append(records[1])
    store.forget("s")  # a closed session: its encoder state goes, its lines stay
    later = record("s", 2, records[1].prompt_ids + records[1].response_ids)
    store.append(later)
    store.close()
    assert store.read("s") == [*records, later] and store.open_fds() == 0
    assert isinstance(store.fsync, bool)


def test_builders_read_both_stores_alike(tmp_path: Path) -> None:
    """The same calls in each store build the same trajectories: readers see only the seam."""
    built = []
    for make in STORES.values():
        store = make(tmp_path)
        for r in chain("s", 3) + chain("t", 1):
            store.append(r)
        store.write_outcome("t", {"status": "completed", "reward": 1.0})
        store.write_outcome("u", {"status": "error", "reward": 0.0, "failure_kind": "harness_error"})
        built.append(build_store(store, BUILDERS.get("prefix_merge")))
    files, memory = built
    assert [t.session_id for t in files] == ["s", "t", "u"]
    assert [t.model_dump() for t in memory] == [t.model_dump() for t in files]


async def test_a_gateway_journals_through_the_memory_store() -> None:
    """The gateway writes through ``JournalSink`` only: with the memory store it serves and
    journals a call with no folder anywhere."""
    store = MemoryJournalStore()
    gateway = Gateway(FakeEngine(), store, GatewayConfig(engine_model="m"))
    client = TestClient(TestServer(gateway.app))
    await client.start_server()
    try:
        session = gateway.open_session("mem-1")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {session.key}"})
        assert resp.status == 200, await resp.text()
    finally:
        await client.close()
    (recorded,) = store.read("mem-1")
    assert recorded.response_ids == [4, 5] and recorded.prompt_ids == [1, 2, 3]
    assert store.read_session_meta("mem-1") is not None  # the session's state went through the sink too
