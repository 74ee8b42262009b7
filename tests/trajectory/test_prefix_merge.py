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


def test_drift_is_cut_in_every_mode_and_counted() -> None:
    # The template re-rendered turn 1 without its reasoning token 502 (think stripping): call 1 was
    # sampled after p2, not after R1, so merging would train it after a context it never saw.
    p2 = P1 + [501, EOT, NL, 120, GEN]
    records = [rec(0, P1, R1), rec(1, p2, R2)]
    for strict in (False, True):
        traj = build_prefix_merged(records, strict=strict)
        assert [t.prompt_ids for t in traj.traces] == [P1, p2]
        assert traj.traces[0].metadata["cut"] == "drift" and traj.traces[0].status == Status.TRUNCATED
        assert traj.traces[1].metadata["start"] == "drift"
        stats = traj.metadata["stats"]
        assert (stats["chains_cut"], stats["drift_boundaries"], stats["drift_tokens"]) == (1, 1, 1)
        assert all(t.metadata["drift"] == [] for t in traj.traces)  # no drift is trained


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


def test_rerendered_last_turn_links_at_the_generation_prompt_but_cuts_at_the_drift() -> None:
    """A harness that drops the reasoning echo changes the re-render from the generation prompt on
    (turn start 6, "assistant" 70, "<think>\\n" 71 vs "<think>\\n\\n" 72): call 0 is continued (one
    lineage chain, both trainable), but call 1 is not trained after call 0's raw ids."""
    start = 6
    p1 = SYS + [110, start, 70, 71]
    r1 = [501, 502, EOT]
    p2 = SYS + [110, start, 70, 72, 502, EOT, NL, 301, start, 70, 71]
    records = [rec(0, p1, r1), rec(1, p2, R2)]
    traj = build_prefix_merged(records, turn_start_ids={start})
    assert [(t.metadata["seqs"], t.metadata["cut"], t.metadata["start"], t.role) for t in traj.traces] == [
        ([0], "drift", None, "main"), ([1], None, "drift", "main")]
    assert [t.prompt_ids + t.response_ids for t in traj.traces] == [p1 + r1, p2 + R2]
    assert traj.metadata["stats"]["drift_tokens"] == 2 and traj.metadata["stats"]["chains"] == 1
    assert len(build_prefix_merged(records).traces) == 2  # without the anchor id: two chains


def test_a_user_turn_where_the_assistant_turn_was_is_no_rerender() -> None:
    """The re-rendered-turn rule needs the generation prompt's role token: a summary *user* turn
    (role 60) after the shared system and task is a new history, not call 0's turn re-rendered."""
    start = 6
    p1 = SYS + [110, start, 70, 71]
    summary = SYS + [110, start, 60, 120, 121, EOT, NL, start, 70, 71]
    traj = build_prefix_merged([rec(0, p1, [501, EOT]), rec(1, summary, R2)], turn_start_ids={start})
    assert [t.metadata["seqs"] for t in traj.traces] == [[0], [1]] and traj.metadata["stats"]["chains"] == 2
