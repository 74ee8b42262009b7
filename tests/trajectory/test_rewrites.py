"""Probes for rewritten histories: scripted call sequences, each with the chains it must give.

Why: a harness that compacts, truncates an old tool output or edits an earlier message sends a
request whose prompt no longer extends the context the model saw. The call it answers was still
continued (its answer went back), so it stays trainable; but the next call's tokens may not be
merged after a context the model never saw: a new chain starts there, with the reason recorded.
Compaction and truncation run through the real gateway (``SimulatedEngine``: the real Qwen3.5
template and tokenizer, scripted turns); the rest are journals of scripted records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.engines.simulated import SimulatedEngine
from polar_env.journal.reader import read_with_refs
from polar_env.journal.store import JournalStore
from polar_env.records import ChatRequest, CompletionRecord, ProviderAPI, Trajectory
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import Gateway, start_gateway
from tests.trajectory.test_lineage import ChatAgent, PerCallEngine, assert_counts

LOOP = ScriptedPolicy(steps=(ScriptStep(command="ls", reasoning="List first."),
                             ScriptStep(command="echo hi", reasoning="Now echo."),
                             ScriptStep(command="cat a.py", reasoning="Read it."),
                             ScriptStep(text="Done: {tool_output}", reasoning="Wrap up.")))
SUMMARY = "Summary of the conversation so far: listed the files, echoed hi; next read a.py."
LONG_OUTPUT = "\n".join(f"a{i}.py" for i in range(60))


def engine(policy: ScriptedPolicy = LOOP) -> SimulatedEngine:
    return SimulatedEngine(latency_s=0.0, policy=policy)


def text_engine(answer: str) -> SimulatedEngine:
    return engine(ScriptedPolicy(steps=(ScriptStep(text=answer, reasoning="Write it."),)))


Chains = list[tuple[list[int], bool, str, str | None]]


def chains(traj: Trajectory) -> Chains:
    """(seqs, trainable, role, why the chain starts) per trace."""
    return [(t.metadata["seqs"], t.trainable, t.role, t.metadata.get("start")) for t in traj.traces]


def assert_faithful(traj: Trajectory, records: list[CompletionRecord]) -> None:
    """Every trace is exactly the last call's prompt and sampled ids (no drift, no rewritten
    context), with mask 1 on exactly its calls' sampled ids."""
    by_seq = {r.seq: r for r in records}
    for trace in traj.traces:
        seqs = trace.metadata["seqs"]
        last = by_seq[seqs[-1]]
        assert trace.prompt_ids + trace.response_ids == last.prompt_ids + last.response_ids, seqs
        sampled = [t for t, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m]
        assert sampled == [t for s in seqs for t in by_seq[s].response_ids], seqs
    assert traj.metadata["stats"]["drift_boundaries"] == 0


def check(records: list[CompletionRecord], expected: Chains, refs: dict[int, tuple[int, int]] | None = None) -> Trajectory:
    """Both merging builders give ``expected``; per_request gives every call its chain's role."""
    traj = build_prefix_merged(records, prompt_refs=refs)
    assert chains(traj) == expected
    assert chains(build_prefix_merged(records, strict=True, prompt_refs=refs)) == expected
    assert_faithful(traj, records)
    assert_counts(traj, records)
    role = {s: r for seqs, _, r, _ in expected for s in seqs}
    per = build_per_request(records, prompt_refs=refs)
    assert [(t.metadata["seqs"][0], t.role) for t in per.traces] == sorted(role.items())
    return traj


class Script:
    """A scripted harness writing records directly (no gateway): each call renders its messages
    with the engine's real template, and the harness echoes the answer with its tool-call ids."""

    def __init__(self) -> None:
        self.records: list[CompletionRecord] = []

    async def call(self, eng: SimulatedEngine, messages: list[dict[str, Any]]) -> dict[str, Any]:
        chat = ChatRequest(messages=[dict(m) for m in messages], tools=[SHELL_TOOL])
        gen = await eng.generate(chat)
        self.records.append(CompletionRecord(**gen.model_dump(), session_id="s", seq=len(self.records),
                                             provider_api=ProviderAPI.OPENAI_CHAT, provider_request={},
                                             chat_request=chat, timings={"received_at": 0.0}))
        msg = gen.message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in msg.tool_calls]
        turn: dict[str, Any] = {"role": "assistant", "content": msg.content or "", "reasoning_content": msg.reasoning}
        return {**turn, "tool_calls": calls} if calls else turn

    async def step(self, eng: SimulatedEngine, messages: list[dict[str, Any]], output: str = "out") -> dict[str, Any]:
        """One call whose answer (and one tool result per call) is appended to ``messages``."""
        turn = await self.call(eng, messages)
        messages.append(turn)
        messages.extend({"role": "tool", "tool_call_id": c["id"], "content": output} for c in turn.get("tool_calls", []))
        return turn


def start(system: str = "You are the main agent.", task: str = "Fix the bug.") -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


async def test_compaction_through_the_gateway_starts_a_new_chain(tmp_path: Path) -> None:
    """seqs 0-1 tool calls; 2 the compaction call (the history + "summarize"); 3-6 continue on
    [system, task, summary]. Before the fix seq 3 joined seq 0's chain by the re-rendered-turn
    rule (its summary *user* turn taken for seq 0's re-rendered assistant turn) and was trained
    after seq 0's sampled ids, which it never saw."""
    loop = engine()
    client, store = await start_gateway(PerCallEngine(loop, loop, text_engine(SUMMARY), loop), tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="compact")
        main = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        await main.step()  # seq 0
        await main.step()  # seq 1
        compact = ChatAgent(gw, s["key"], "", "")
        compact.messages = [*main.messages, {"role": "user", "content": "Summarize the conversation so far."}]
        said = await compact.post(compact.body())  # seq 2
        after = ChatAgent(gw, s["key"], "", "")
        after.messages = [*main.messages[:2], {"role": "user", "content": said["content"]}]
        while not after.done:
            await after.step()  # seqs 3-6
    finally:
        await client.close()
    records, refs = read_with_refs(store.path("compact"))
    assert len(records) == 7
    # seq 2 sends seq 1's answer back, but Qwen3.5 drops earlier reasoning before a new user query:
    # a chain of its own (template_rerendered); seq 3 restarts on [system, task, summary].
    expected: Chains = [([0, 1], True, "branch", None), ([2], True, "branch", "template_rerendered"),
                        ([3, 4, 5, 6], True, "main", "history_rewritten")]
    traj = check(records, expected, refs)
    check(records, expected)
    assert traj.metadata["stats"]["chain_starts"] == [{"seq": 2, "parent": 1, "reason": "template_rerendered"},
                                                      {"seq": 3, "parent": None, "reason": "history_rewritten"}]


async def test_truncated_old_tool_output_through_the_gateway_keeps_the_continued_call(tmp_path: Path) -> None:
    """seq 0 lists 60 files; seq 1 echoes; the harness then replaces seq 0's tool output by
    "[output truncated]" and sends seq 1's answer back: seqs 2-3. Before the fix seq 2 linked as a
    sibling of seq 1 (its prompt extends seq 0's), so seq 1 was dropped as uncontinued."""
    client, store = await start_gateway(engine(), tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="trunc")
        main = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        await main.step(tool_output=LONG_OUTPUT)  # seq 0
        await main.step()  # seq 1
        assert main.messages[3]["role"] == "tool"
        main.messages[3] = {**main.messages[3], "content": "[output truncated]"}
        while not main.done:
            await main.step()  # seqs 2, 3
    finally:
        await client.close()
    records, refs = read_with_refs(store.path("trunc"))
    expected: Chains = [([0, 1], True, "main", None), ([2, 3], True, "branch", "history_rewritten")]
    traj = check(records, expected, refs)
    check(records, expected)
    assert traj.metadata["stats"]["chain_starts"] == [{"seq": 2, "parent": 1, "reason": "history_rewritten"}]
    assert traj.metadata["stats"]["untrained"] == {}


async def test_an_edited_earlier_message_starts_a_new_chain() -> None:
    """seqs 0-1, then the harness edits the task message and sends seq 1's answer back: 2-3."""
    script, loop = Script(), engine()
    messages = start()
    await script.step(loop, messages)
    await script.step(loop, messages)
    messages[1] = {"role": "user", "content": "Fix the bug in calc.py."}
    await script.step(loop, messages)
    await script.step(loop, messages)
    check(script.records, [([0, 1], True, "main", None), ([2, 3], True, "branch", "history_rewritten")])


async def test_a_first_call_sent_back_on_a_rewritten_history_is_continued() -> None:
    """The harness edits the task right after seq 0 and sends seq 0's answer back (seqs 1-3):
    seq 0 is a chain of one, but its answer went back, so it is trained (a standalone call
    nothing sent back is not). (Truncating seq 0's own tool output would not do: the model never
    saw it, so seq 1 still extends seq 0's context and merges.)"""
    script, loop = Script(), engine()
    messages = start()
    await script.step(loop, messages)
    messages[1] = {"role": "user", "content": "Fix the bug in calc.py."}
    while (await script.step(loop, messages)).get("tool_calls"):
        pass
    check(script.records, [([0], True, "branch", None), ([1, 2, 3], True, "main", "history_rewritten")])


class ParallelPolicy(ScriptedPolicy):
    """Test double: the first turn calls the shell twice in one answer."""

    def next_turn(self, messages: Any, tools: Any) -> dict[str, Any]:
        turn = ScriptedPolicy.next_turn(self, messages, tools)
        if not any(m.get("role") == "assistant" for m in messages):
            call = turn["tool_calls"][0]
            turn["tool_calls"] = [call, {"type": "function", "function": {"name": call["function"]["name"],
                                                                        "arguments": {"command": "pwd"}}}]
        return turn


async def test_parallel_tool_calls_stay_one_chain() -> None:
    script, eng = Script(), engine(ParallelPolicy(steps=LOOP.steps[:1] + LOOP.steps[3:]))
    messages = start()
    first = await script.step(eng, messages)
    assert len(first["tool_calls"]) == 2 and [m["role"] for m in messages[-2:]] == ["tool", "tool"]
    await script.step(eng, messages)
    check(script.records, [([0, 1], True, "main", None)])


async def test_a_sub_agent_with_its_own_history_is_its_own_chain() -> None:
    """Main seq 0 delegates; the sub-agent runs seqs 1-4 on its own history (its answer quoted in
    main's tool result); main continues with seqs 5-7. Not merged into main's chain."""
    script, loop = Script(), engine()
    main = start()
    await script.step(loop, main)  # seq 0
    sub = start("You are a search sub-agent.", "Find the file with the bug.")
    while (await script.step(loop, sub)).get("tool_calls"):
        pass  # seqs 1-4
    answer = sub[-1]["content"]
    main[-1] = {**main[-1], "content": f"sub-agent says: {answer}"}
    while (await script.step(loop, main)).get("tool_calls"):
        pass  # seqs 5-7
    check(script.records, [([0, 5, 6, 7], True, "main", None), ([1, 2, 3, 4], True, "branch", None)])


async def test_identical_siblings_the_builder_follows_the_gateways_parent(tmp_path: Path) -> None:
    """Continuation mode: the harness sends the same request twice, both identical answers are
    recorded (seqs 1, 2) and it keeps the *first*. The gateway plans seq 3 on the latest twin
    (``pick_sibling``: their tokens are the same) and records that parent; the builder follows the
    record (before the fix it took the earliest twin, so the two disagreed). Without the journal's
    references the tool-call ids the harness sent back decide. Either way the same tokens train."""
    client, store = await start_gateway(engine(), tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="twins", continuation=True)
        main = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        await main.step()  # seq 0
        kept = await main.post(main.body())  # seq 1
        await main.post(main.body())  # seq 2: its identical twin
        main.take(kept)
        while not main.done:
            await main.step()  # seqs 3, 4
    finally:
        await client.close()
    records, refs = read_with_refs(store.path("twins"))
    assert records[1].prompt_ids == records[2].prompt_ids and records[1].response_ids == records[2].response_ids
    assert refs[3][0] == 2  # the gateway's recorded parent
    by_ref = check(records, [([0, 2, 3, 4], True, "main", None), ([1], False, "uncontinued", None)], refs)
    by_ids = check(records, [([0, 1, 3, 4], True, "main", None), ([2], False, "uncontinued", None)])
    trained = [[(t.prompt_ids, t.response_ids, t.loss_mask) for t in traj.traces if t.trainable] for traj in (by_ref, by_ids)]
    assert trained[0] == trained[1]


async def test_probes_replay_from_a_journal(tmp_path: Path) -> None:
    """The direct-record probes read back from a v2 journal (writer's prefix references) build the same."""
    script, loop = Script(), engine()
    messages = start()
    await script.step(loop, messages, LONG_OUTPUT)
    await script.step(loop, messages)
    messages[3] = {**messages[3], "content": "[output truncated]"}
    await script.step(loop, messages)
    store = JournalStore(tmp_path)
    for record in script.records:
        store.append(record)
    records, refs = read_with_refs(store.path("s"))
    expected: Chains = [([0, 1], True, "main", None), ([2], True, "branch", "history_rewritten")]
    assert chains(build_prefix_merged(records, prompt_refs=refs)) == chains(build_prefix_merged(script.records)) == expected
