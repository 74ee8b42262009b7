"""Prefix merging on readable synthetic ids.

Bands: 1xx system/user text, 3xx tool results, 5xx sampled assistant tokens, 7 = generation
prompt, 8 = the template's newline after a turn, 9 = end of turn.
"""

from __future__ import annotations

from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Status, Timings
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged, detect_eot_ids

EOT, NL, GEN = 9, 8, 7


def rec(seq: int, prompt: list[int], response: list[int], finish: str = "stop", session: str = "s") -> CompletionRecord:
    return CompletionRecord(
        session_id=session, seq=seq, provider_api=ProviderAPI.OPENAI_CHAT, provider_request={},
        chat_request=ChatRequest(messages=[{"role": "user", "content": "x"}], temperature=1.0),
        timings=Timings(received_at=0.0), message=AssistantMessage(content="x"),
        prompt_ids=prompt, response_ids=response, response_logprobs=[-0.1 * (i + 1) for i in range(len(response))],
        finish_reason=finish,
    )


def dump(trace) -> str:  # printed by assertion messages: ids, mask and logprobs aligned
    rows = enumerate(zip(trace.response_ids, trace.loss_mask, trace.response_logprobs, strict=True))
    return "\n".join(f"{i:4d} {t:5d} {m} {lp:+.2f}" for i, (t, m, lp) in rows)


SYS = [101, 102, 103]
P1 = SYS + [110, 111, GEN]
R1 = [501, 502, EOT]
P2 = P1 + R1 + [NL, 301, 302, GEN]
R2 = [511, EOT]
P3 = P2 + R2 + [NL, 303, GEN]
R3 = [521, 522, 523, EOT]


def test_exact_chain_merges_into_one_trace() -> None:
    traj = build_prefix_merged([rec(0, P1, R1), rec(1, P2, R2, "tool_calls"), rec(2, P3, R3)])
    (trace,) = traj.traces
    assert trace.prompt_ids == P1
    assert P1 + trace.response_ids == P3 + R3, dump(trace)  # no token dropped or duplicated
    assert trace.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1], dump(trace)
    assert trace.response_logprobs[:4] == [-0.1, -0.2, -0.30000000000000004, 0.0]
    assert [lp for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True) if m == 0] == [0.0] * 7
    stats = traj.metadata["stats"]
    assert (stats["chains"], stats["traces"], stats["completions_merged"], stats["drift_boundaries"]) == (1, 1, 2, 0)
    assert trace.metadata["seqs"] == [0, 1, 2] and trace.status == Status.COMPLETED


def test_truncated_turn_gets_the_end_of_turn_inserted_unmasked() -> None:
    r1 = [501, 502]  # cut by max_tokens: no EOT sampled
    p2 = P1 + r1 + [EOT, NL, 301, GEN]
    (trace,) = build_prefix_merged([rec(0, P1, r1, "length"), rec(1, p2, R2)], eot_ids={EOT}).traces
    assert P1 + trace.response_ids == p2 + R2
    assert trace.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1], dump(trace)


def test_drift_is_counted_and_strict_cuts() -> None:
    # The template re-rendered turn 1 without its reasoning token 502 (think stripping).
    p2 = P1 + [501, EOT, NL, 120, GEN]
    records = [rec(0, P1, R1), rec(1, p2, R2)]
    loose = build_prefix_merged(records)
    (trace,) = loose.traces
    assert trace.metadata["drift"] == [{"seq": 1, "at": len(P1), "span": 1}]
    assert loose.metadata["stats"]["drift_tokens"] == 1
    assert P1 + trace.response_ids == P1 + R1 + [NL, 120, GEN] + R2  # raw ids kept, inserted from p2
    strict = build_prefix_merged(records, strict=True)
    assert [t.prompt_ids for t in strict.traces] == [P1, p2]
    assert strict.traces[0].metadata["cut"] == "drift" and strict.traces[0].status == Status.TRUNCATED
    assert strict.metadata["stats"]["chains_cut"] == 1


def test_interleaved_subagent_and_compaction_form_separate_chains() -> None:
    sub1 = [201, 202, GEN]
    sub2 = sub1 + [601, EOT, NL, 310, GEN]
    compacted = [101, 102, 199, GEN]  # history rewritten: shares a prefix but not the tip
    records = [
        rec(0, P1, R1), rec(1, sub1, [601, EOT]), rec(2, P2, R2), rec(3, sub2, [602, EOT]),
        rec(4, P3, R3), rec(5, compacted, [701, EOT]),
    ]
    traj = build_prefix_merged(records)
    assert [t.metadata["seqs"] for t in traj.traces] == [[0, 2, 4], [1, 3], [5]]
    assert traj.metadata["stats"]["chains"] == 3


def test_retry_of_the_same_prompt_does_not_join() -> None:
    traj = build_prefix_merged([rec(0, P1, [501], "length"), rec(1, P1, R1)])
    assert [t.metadata["seqs"] for t in traj.traces] == [[0], [1]]


def test_longest_matching_tip_wins() -> None:
    # Two chains share P1; the second already extended it, so P3 belongs to the longer tip.
    traj = build_prefix_merged([rec(0, P1, R1), rec(1, P1, [505, EOT]), rec(2, P2, R2), rec(3, P3, R3)])
    assert [t.metadata["seqs"] for t in traj.traces] == [[0, 2, 3], [1]]


def test_eot_detection() -> None:
    assert detect_eot_ids([rec(0, P1, R1), rec(1, P2, [5, 77], "tool_calls")]) == {EOT, 77}
    assert detect_eot_ids([rec(0, P1, [1, 2], "length")]) == frozenset()  # nothing shows what closes a turn
    # every call cut short: the token a later prompt put right after the earlier sampled ids
    assert detect_eot_ids([rec(0, P1, [1, 2], "length"), rec(1, [*P1, 1, 2, EOT, 9], [3], "length")]) == {EOT}


def test_malformed_input_gives_error_trajectories() -> None:
    assert build_prefix_merged([], "s").status == Status.ERROR
    assert "several sessions" in build_prefix_merged([rec(0, P1, R1), rec(1, P2, R2, session="t")]).metadata["error"]
    bad = rec(0, P1, R1).model_copy(update={"response_logprobs": [-1.0]})
    out = build_prefix_merged([bad])
    assert out.status == Status.ERROR and "1 logprobs for 3 response ids" in out.metadata["error"]
    assert build_per_request([rec(0, [], R1)]).metadata["error"].endswith("no prompt ids")
    assert "duplicate" in build_prefix_merged([rec(0, P1, R1), rec(0, P2, R2)]).metadata["error"]


def test_per_request_builder() -> None:
    traj = build_per_request([rec(1, P2, R2), rec(0, P1, R1, "length")])
    assert [t.prompt_ids for t in traj.traces] == [P1, P2]
    assert all(t.loss_mask == [1] * len(t.response_ids) for t in traj.traces)
    assert traj.traces[0].status == Status.TRUNCATED


def test_rerendered_last_turn_joins_at_the_generation_prompt_with_drift() -> None:
    """A harness that drops the reasoning echo changes the re-render from the generation prompt on
    (turn start 6, "assistant" 70, "<think>\\n" 71 vs "<think>\\n\\n" 72): same chain, drift reported."""
    start = 6
    p1 = SYS + [110, start, 70, 71]
    r1 = [501, 502, EOT]
    p2 = SYS + [110, start, 70, 72, 502, EOT, NL, 301, start, 70, 71]
    records = [rec(0, p1, r1), rec(1, p2, R2)]
    traj = build_prefix_merged(records, turn_start_ids={start})
    (trace,) = traj.traces
    assert p1 + trace.response_ids == p1 + r1 + [NL, 301, start, 70, 71] + R2, dump(trace)
    assert trace.metadata["drift"] == [{"seq": 1, "at": len(p1) - 3, "span": 2}]
    assert trace.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1], dump(trace)
    assert [t.metadata["seqs"] for t in build_prefix_merged(records, turn_start_ids={start}, strict=True).traces] == [[0], [1]]
    assert len(build_prefix_merged(records).traces) == 2  # without the anchor id: two chains
