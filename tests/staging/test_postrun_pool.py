"""POSTRUN's read + build: a journal of a few calls builds in the node, with no worker process
started (the hand-off, and a niced worker on a busy machine, cost more than the build); a larger
one builds in a worker process, with the same result as building inline."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

from polar_env.journal.store import JournalStore
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from polar_env.staging.postrun_pool import INLINE_JOURNAL_BYTES, PostrunPool, journal_bytes, read_and_build


def _journal(root: Path, calls: int, pad: int) -> None:
    store = JournalStore(root)
    for seq in range(calls):
        store.append(CompletionRecord(
            message=AssistantMessage(content=f"answer {seq}"), prompt_ids=[1, 2, 3 + seq], response_ids=[7, 8],
            response_logprobs=[-0.5, -0.25], finish_reason="stop", session_id="s", seq=seq,
            provider_api=ProviderAPI.OPENAI_CHAT, provider_request={"pad": str(seq) * pad},
            chat_request=ChatRequest(messages=[{"role": "user", "content": "q"}]), timings=Timings(received_at=0.0)))
    store.close()


async def test_a_small_journal_builds_in_the_node(tmp_path: Path) -> None:
    _journal(tmp_path, 2, 0)
    assert journal_bytes(JournalStore(tmp_path), "s") <= INLINE_JOURNAL_BYTES
    pool = PostrunPool(1)
    built = await pool.build(partial(JournalStore, tmp_path), "s", "prefix_merge")
    assert built.error is None and built.records == 2 and built.trajectory is not None
    assert pool._pool is None  # no worker process was started


async def test_a_larger_journal_builds_in_a_worker_process(tmp_path: Path) -> None:
    _journal(tmp_path, 3, INLINE_JOURNAL_BYTES // 2)
    assert journal_bytes(JournalStore(tmp_path), "s") > INLINE_JOURNAL_BYTES
    pool = PostrunPool(1)
    try:
        built = await pool.build(partial(JournalStore, tmp_path), "s", "prefix_merge")
        assert pool._pool is not None  # it went to the pool
    finally:
        await asyncio.to_thread(pool.close)
    assert built.error is None and built.records == 3
    assert built == read_and_build(partial(JournalStore, tmp_path), "s", "prefix_merge")


def test_no_journal_is_no_records(tmp_path: Path) -> None:
    assert journal_bytes(JournalStore(tmp_path), "absent") == 0
    assert read_and_build(partial(JournalStore, tmp_path), "absent", "prefix_merge").records == 0
