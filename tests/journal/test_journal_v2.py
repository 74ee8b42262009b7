"""Journal v2: exact round trips, linear size, v1 journals still read and build, references that
cannot be resolved are refused, torn tails skipped, and the writer thread keeps order."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import orjson
import pytest

from polar_env.journal.format import PromptRef, common_prefix
from polar_env.journal.reader import JournalError
from polar_env.journal.store import JournalStore
from polar_env.journal.writer import JournalWriter
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from polar_env.trajectory.prefix_merge import build_prefix_merged

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def session_records(turns: int, turn_tokens: int = 200, sid: str = "s") -> list[CompletionRecord]:
    """An append-only session: each prompt is the previous prompt + its response + new ids."""
    records: list[CompletionRecord] = []
    prompt = list(range(1000, 1000 + turn_tokens))
    messages: list[dict] = [{"role": "user", "content": "task " * 50}]
    for seq in range(turns):
        response = [5000 + seq, 248046]
        body = {"model": "m", "system": "you are an agent " * 40, "tools": TOOLS, "messages": list(messages)}
        records.append(CompletionRecord(
            message=AssistantMessage(content=f"step {seq}"), prompt_ids=list(prompt), response_ids=response,
            response_logprobs=[-0.5, -0.25], finish_reason="stop", session_id=sid, seq=seq,
            provider_api=ProviderAPI.ANTHROPIC, provider_request=body,
            chat_request=ChatRequest(model="m", messages=list(messages), tools=TOOLS, temperature=1.0),
            timings=Timings(received_at=float(seq)), notes=[f"n{seq}"],
        ))
        messages += [{"role": "assistant", "content": f"step {seq}"}, {"role": "user", "content": "out " * 40}]
        prompt = prompt + response + list(range(2000 + seq * turn_tokens, 2000 + (seq + 1) * turn_tokens))
    return records


def dump(r: CompletionRecord) -> dict:
    return orjson.loads(r.to_json())


def test_v2_round_trips_exactly_and_is_linear(tmp_path: Path) -> None:
    records = session_records(40)
    v1, v2 = JournalStore(tmp_path / "v1", version=1), JournalStore(tmp_path / "v2")
    for r in records:
        v1.append(r)
        v2.append(r)
    assert [dump(r) for r in v2.read("s")] == [dump(r) for r in records] == [dump(r) for r in v1.read("s")]
    lines = (tmp_path / "v2" / "s.jsonl").read_bytes().splitlines()
    assert all(orjson.loads(line)["v"] == 2 for line in lines)
    late = orjson.loads(lines[-1])
    assert late["prompt"]["parent"] == 38 and late["prompt"]["keep"] == len(records[38].prompt_ids) + 2
    assert set(late["provider_request"]) == {"base", "append"}  # system, tools, model unchanged
    assert len(late["provider_request"]["append"]["messages"]) == 2
    size1, size2 = (tmp_path / "v1" / "s.jsonl").stat().st_size, (tmp_path / "v2" / "s.jsonl").stat().st_size
    assert size2 * 8 < size1, (size1, size2)
    # linear: the last line costs about what the first did, not 40x
    assert len(lines[-1]) < 3 * len(lines[1])


def test_a_v1_journal_still_reads_and_builds_and_may_continue_in_v2(tmp_path: Path) -> None:
    records = session_records(6)
    old = JournalStore(tmp_path, version=1)
    for r in records[:3]:
        old.append(r)
    old.close()
    new = JournalStore(tmp_path)  # a gateway restarted on the new format appends v2 lines
    for r in records[3:]:
        new.append(r)
    lines = (tmp_path / "s.jsonl").read_bytes().splitlines()
    assert ["v" in orjson.loads(x) for x in lines] == [False] * 3 + [True] * 3
    got = JournalStore(tmp_path).read("s")
    assert [dump(r) for r in got] == [dump(r) for r in records]
    trajectory = build_prefix_merged(got)
    assert trajectory.metadata["stats"]["chains"] == 1 and trajectory.metadata["stats"]["drift_boundaries"] == 0


def test_rewritten_history_is_stored_whole_and_exact(tmp_path: Path) -> None:
    records = session_records(3)
    compacted = records[2].model_copy(update={
        "prompt_ids": [7, 8, 9],
        "provider_request": {**records[2].provider_request, "messages": [{"role": "user", "content": "summary"}]},
    })
    store = JournalStore(tmp_path)
    for r in (*records[:2], compacted):
        store.append(r)
    last = orjson.loads((tmp_path / "s.jsonl").read_bytes().splitlines()[-1])
    assert last["prompt"] == {"ids": [7, 8, 9]}
    assert last["provider_request"]["set"]["messages"] == [{"role": "user", "content": "summary"}]
    assert [dump(r) for r in store.read("s")] == [dump(r) for r in (*records[:2], compacted)]


def test_continuation_reference_is_used_only_when_it_matches(tmp_path: Path) -> None:
    records = session_records(3)
    store = JournalStore(tmp_path)
    store.append(records[0])
    store.append(records[1])
    keep = len(records[0].prompt_ids) + 2
    store.append(records[2], PromptRef(0, keep, [1, 2, 3]))  # the engine did not get the planned ids
    third = orjson.loads((tmp_path / "s.jsonl").read_bytes().splitlines()[-1])
    assert third["prompt"]["parent"] == 1  # so the reference is not trusted: prefix check instead
    assert [dump(r) for r in store.read("s")] == [dump(r) for r in records]
    honest = JournalStore(tmp_path / "h")
    honest.append(records[0])
    honest.append(records[1], PromptRef(0, keep, records[1].prompt_ids))
    second = orjson.loads((tmp_path / "h" / "s.jsonl").read_bytes().splitlines()[-1])
    assert second["prompt"] == {"parent": 0, "keep": keep, "suffix": records[1].prompt_ids[keep:]}


def test_a_dangling_reference_is_a_journal_error(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    for r in session_records(3):
        store.append(r)
    lines = (tmp_path / "s.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "s.jsonl").write_bytes(lines[0] + lines[2])  # the record line 2 refers to is gone
    with pytest.raises(JournalError, match="line 2"):
        JournalStore(tmp_path).read("s")


def test_a_torn_v2_tail_is_skipped_and_repaired(tmp_path: Path) -> None:
    records = session_records(4)
    store = JournalStore(tmp_path)
    for r in records[:3]:
        store.append(r)
    store.close()
    with open(tmp_path / "s.jsonl", "ab") as f:
        f.write(b'{"v":2,"session_id":"s","seq":3,"prompt":{"par')  # kill -9 mid-write
    assert [r.seq for r in JournalStore(tmp_path).read("s")] == [0, 1, 2]
    again = JournalStore(tmp_path)
    again.append(records[3])
    assert [dump(r) for r in again.read("s")] == [dump(r) for r in records]
    assert (tmp_path / "s.jsonl.torn").exists()


def test_streamed_reading_from_an_offset(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    records = session_records(10)
    for r in records:
        store.append(r)
    assert [r.seq for r in store.iter_records("s", start=7)] == [7, 8, 9]
    assert dump(next(store.iter_records("s", start=9))) == dump(records[9])


def test_common_prefix() -> None:
    a = list(range(1000))
    assert common_prefix(a, a + [5]) == 1000
    assert common_prefix(a, a[:500] + [-1] + a[501:]) == 500
    assert common_prefix(a, [9]) == 0
    assert common_prefix([], a) == 0


async def test_writer_keeps_order_runs_off_the_loop_and_delivers_errors() -> None:
    seen: list[tuple[int, str]] = []

    def write(n: int) -> None:
        seen.append((n, threading.current_thread().name))
        if n == 3:
            raise OSError("disk full")

    writer = JournalWriter(write, name="test-journal")
    try:
        results = await asyncio.gather(*(writer.append(n) for n in range(6)), return_exceptions=True)
    finally:
        writer.close()
    assert [n for n, _ in seen] == list(range(6))
    assert {name for _, name in seen} == {"test-journal"}
    assert [type(r).__name__ for r in results] == ["NoneType"] * 3 + ["OSError"] + ["NoneType"] * 2


async def test_inline_appends_run_on_the_caller_only_when_the_writer_is_idle() -> None:
    seen: list[tuple[int, str]] = []
    release = threading.Event()

    def write(n: int) -> int:
        if n == 0:
            release.wait(5)  # the writer is busy with record 0 while 1 and 2 arrive
        seen.append((n, threading.current_thread().name))
        if n == 4:
            raise OSError("disk full")
        return n

    writer = JournalWriter(write, name="test-journal")
    try:
        assert await writer.append(9, inline=True) == 9  # idle: written here, before returning
        first = asyncio.ensure_future(writer.append(0))
        await asyncio.sleep(0.05)
        assert not writer.idle
        second = asyncio.ensure_future(writer.append(1, inline=True))  # must queue behind 0
        await asyncio.sleep(0.05)
        assert not second.done()
        release.set()
        assert await asyncio.gather(first, second) == [0, 1]
        assert writer.idle
        assert await writer.append(2, inline=True) == 2
        with pytest.raises(OSError):
            await writer.append(4, inline=True)  # errors reach the caller as from the thread
    finally:
        writer.close()
    main = threading.current_thread().name
    assert seen == [(9, main), (0, "test-journal"), (1, "test-journal"), (2, main), (4, main)]
