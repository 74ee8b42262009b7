"""Prefix-merge build time and compression on synthetic sessions of realistic shape.

Each session: a 6k-token shared system prompt, a main tool loop whose prompt grows by a sampled
turn plus a tool result per call, an interleaved sub-agent (every 8th call) with its own chain,
and one compaction at 60% of the calls that restarts the main history from a summary. The largest
session has 200 calls with prompts reaching ~32k tokens. Prints build time and tokens/s against
the per-request builder (the baseline) and the compression: traces and trained tokens.
Records are round-tripped through JSON first, exactly as builders receive them from the store.
The last columns time the builder on the same session read back from a v2 journal, once
comparing token lists (the v1 path) and once on the journal's prompt references (``refs``),
and check the two trajectories are equal.

    python scripts/bench_merge.py
"""

from __future__ import annotations

import functools
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from polar_env.journal.reader import read_with_refs
from polar_env.journal.store import JournalStore
from polar_env.records import (
    AssistantMessage,
    ChatRequest,
    CompletionRecord,
    ProviderAPI,
    Timings,
)
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

EOT, NL, IM_START = 248046, 198, 248045
GEN_PROMPT = [IM_START, 74455, NL, 248068, NL]


def session(calls: int, seed: int = 0) -> list[CompletionRecord]:
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(1000, 240000) for _ in range(n)]

    chat = ChatRequest(messages=[{"role": "user", "content": "x"}])
    system = words(6000)
    main = system + words(300) + GEN_PROMPT
    sub = words(1500) + words(200) + GEN_PROMPT
    records: list[CompletionRecord] = []
    compact_at, compacted = int(calls * 0.6), False
    for seq in range(calls):
        is_sub = seq % 8 == 7
        prompt = sub if is_sub else main
        response = words(rng.randrange(40, 160)) + [EOT]
        records.append(CompletionRecord.model_construct(
            session_id="bench", seq=seq, provider_api=ProviderAPI.OPENAI_CHAT, provider_request={}, chat_request=chat,
            timings=Timings(received_at=0.0), notes=[], message=AssistantMessage(), prompt_ids=prompt, response_ids=response,
            response_logprobs=[-1.0] * len(response), finish_reason="tool_calls", stop_reason=None, model="m", engine="bench",
            weight_version="0", logprobs_mode="processed",
        ))
        grown = prompt + response + [NL] + [IM_START] + words(rng.randrange(60, 200)) + [EOT, NL] + GEN_PROMPT
        if is_sub:
            sub = grown
        elif seq >= compact_at and not compacted:
            main = system + words(800) + GEN_PROMPT  # compaction: history replaced by a summary
            compacted = True
        else:
            main = grown
    return records


def timed(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1000


def ref_path(records: list[CompletionRecord]) -> tuple[float, float]:
    """(compare ms, refs ms) for the session read back from a v2 journal; the trajectories must agree."""
    with tempfile.TemporaryDirectory() as tmp:
        store = JournalStore(Path(tmp))
        for record in records:
            store.append(record)
        store.close()
        read, refs = read_with_refs(store.path("bench"))
    assert refs and build_prefix_merged(read, prompt_refs=refs).model_dump() == build_prefix_merged(read).model_dump()
    return timed(lambda: build_prefix_merged(read)), timed(lambda: build_prefix_merged(read, prompt_refs=refs))


def main() -> None:
    print(f"{'calls':>5} {'max prompt':>10} {'prompt tokens':>13} | {'merge ms':>8} {'Mtok/s':>7} | {'per-req ms':>10} | "
          f"{'traces per-req':>14} {'merged':>6} {'ratio':>6} | {'tokens per-req':>14} {'merged':>9} {'ratio':>6} | "
          f"{'v2 compare ms':>13} {'refs ms':>7} {'ratio':>6}")
    for calls in (25, 50, 100, 200):
        # Through JSON, as records come back from the capture store: every id is its own int
        # object, so list comparison cannot short-cut on identity.
        records = [CompletionRecord.from_json(r.to_json()) for r in session(calls)]
        total = sum(len(r.prompt_ids) for r in records)
        merged = build_prefix_merged(records)
        per = build_per_request(records)
        merge_ms = timed(functools.partial(build_prefix_merged, records))
        per_ms = timed(functools.partial(build_per_request, records))
        cmp_ms, refs_ms = ref_path(session(calls))

        def tok(traj: Any) -> int:
            return sum(len(t.prompt_ids) + len(t.response_ids) for t in traj.traces)

        print(f"{calls:>5} {max(len(r.prompt_ids) for r in records):>10,} {total:>13,} | {merge_ms:>8.1f} {total / merge_ms / 1e3:>7.1f} | "
              f"{per_ms:>10.1f} | {len(per.traces):>14} {len(merged.traces):>6} {len(per.traces) / len(merged.traces):>6.1f} | "
              f"{tok(per):>14,} {tok(merged):>9,} {tok(per) / tok(merged):>6.1f} | "
              f"{cmp_ms:>13.1f} {refs_ms:>7.1f} {cmp_ms / refs_ms:>6.1f}")
        assert merged.metadata["stats"]["chains"] == 3, merged.metadata["stats"]


if __name__ == "__main__":
    main()
