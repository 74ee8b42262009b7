"""Trainable means continued by the harness (trajectory/lineage.py), on captures through the real
gateway: a declared side request (Claude Code's title call, replayed from its recorded body), a
call whose client went away mid-generation and was retried, a single call off to the side of the
main chain, and the captured-vs-trainable token counts. Engines are test doubles named as such:
``SimulatedEngine`` (real Qwen3.5 template and tokenizer, scripted turns) wrapped to be slow or to
answer differently per call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.engines.simulated import SimulatedEngine
from polar_env.harnesses import HARNESSES
from polar_env.journal.format import CLIENT_GONE
from polar_env.journal.reader import read_with_refs
from polar_env.proxy.providers import PROVIDERS
from polar_env.records import ChatRequest, CompletionRecord, Generation, ProviderAPI, Trajectory
from polar_env.trajectory.lineage import builtin_side_requests, side_request_of
from polar_env.trajectory.outcome import with_outcome
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import Gateway, live, start_gateway
from tests.waits import until

FIXTURES = Path(__file__).parents[1] / "fixtures" / "providers"
TOOL_LOOP = ScriptedPolicy(steps=(ScriptStep(command="ls", reasoning="List first."),
                                  ScriptStep(command="echo hi", reasoning="Now echo."),
                                  ScriptStep(text="Done: {tool_output}", reasoning="Wrap up.")))


class PerCallEngine:
    """Test double: call ``i`` goes to ``engines[min(i, last)]``; ``hold`` (if set) keeps call 0
    waiting until it is released, so its client can give up first."""

    name = "per-call"

    def __init__(self, *engines: SimulatedEngine) -> None:
        self.engines = engines
        self.calls = 0
        self.hold: asyncio.Event | None = None
        self.first_done = asyncio.Event()

    async def generate(self, request: ChatRequest) -> Generation:
        index = self.calls
        self.calls += 1
        if index == 0 and self.hold is not None:
            await self.hold.wait()
        try:
            return await self.engines[min(index, len(self.engines) - 1)].generate(request)
        finally:
            if index == 0:
                self.first_done.set()

    async def aclose(self) -> None:
        return None


def simulated(reasoning: str) -> SimulatedEngine:
    steps = tuple(ScriptStep(command=s.command, text=s.text, reasoning=f"{reasoning} {s.reasoning}") for s in TOOL_LOOP.steps)
    return SimulatedEngine(latency_s=0.0, policy=ScriptedPolicy(steps=steps))


class ChatAgent:
    """An OpenAI-chat harness loop that echoes the gateway's answers (reasoning included)."""

    def __init__(self, gw: Gateway, key: str, system: str, task: str) -> None:
        self.gw, self.key = gw, key
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.done = False

    def body(self) -> dict[str, Any]:
        return {"model": "m", "messages": self.messages, "tools": [SHELL_TOOL]}

    async def post(self, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        resp = await self.gw.client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {self.key}"}, **kw)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["message"]

    def take(self, msg: dict[str, Any], tool_output: str = "out") -> None:
        echo = {"role": "assistant", "content": msg["content"], "reasoning_content": msg.get("reasoning_content")}
        if msg.get("tool_calls"):
            echo["tool_calls"] = msg["tool_calls"]
        self.messages.append(echo)
        if not msg.get("tool_calls"):
            self.done = True
        for call in msg.get("tool_calls") or []:
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_output})

    async def step(self, tool_output: str = "out") -> dict[str, Any]:
        msg = await self.post(self.body())
        self.take(msg, tool_output)
        return msg


def roles(traj: Trajectory) -> list[tuple[list[int], bool, str]]:
    return [(t.metadata["seqs"], t.trainable, t.role) for t in traj.traces]


def assert_counts(traj: Trajectory, records: list[CompletionRecord]) -> None:
    """Captured = every sampled token; trainable = the mask-1 tokens of trainable traces; untrained
    per role adds up to the rest. Masks and logprobs of every trace are still the captured ones."""
    stats = traj.metadata["stats"]
    assert stats["captured_tokens"] == sum(len(r.response_ids) for r in records)
    assert stats["trainable_tokens"] == sum(sum(t.loss_mask) for t in traj.traces if t.trainable)
    assert stats["captured_tokens"] - stats["trainable_tokens"] == sum(u["tokens"] for u in stats["untrained"].values())
    by_seq = {r.seq: r for r in records}
    for trace in traj.traces:
        sampled = [t for t, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m]
        assert sampled == [t for s in trace.metadata["seqs"] for t in by_seq[s].response_ids]


@pytest.mark.parametrize("stream", [False, True])
async def test_client_gone_then_retried_yields_a_journal_note_and_one_trainable_chain(tmp_path: Path, stream: bool) -> None:
    engine = PerCallEngine(simulated("first try."), simulated("second try."))
    engine.hold = asyncio.Event()
    client, store = await start_gateway(engine, tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="gone")
        agent = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        with pytest.raises(asyncio.TimeoutError):  # the harness's SDK gives up on a slow first call ...
            await agent.post({**agent.body(), "stream": stream}, timeout=aiohttp.ClientTimeout(total=0.5))
        engine.hold.set()  # ... the engine finishes it anyway, and the gateway records it
        await asyncio.wait_for(engine.first_done.wait(), 10)
        await until(lambda: store.read("gone"), "the gateway to record the call its client gave up on")
        await agent.step()  # the retry, whose answer the harness keeps
        while not agent.done:
            await agent.step()
        assert live(client).stats.client_gone == 1  # once: the note spares an event line for the same call
    finally:
        await client.close()
    records = store.read("gone")
    assert [CLIENT_GONE in r.notes for r in records] == [True, False, False, False]
    assert records[0].prompt_ids == records[1].prompt_ids and records[0].response_ids != records[1].response_ids
    lines = store.path("gone").read_bytes().splitlines()
    assert json.loads(lines[0])["notes"][-1] == CLIENT_GONE  # the note is in the durable line itself
    assert len(lines) == 4 and not store.events("gone")
    read, refs = read_with_refs(store.path("gone"))
    for traj in (build_prefix_merged(records), build_prefix_merged(read, prompt_refs=refs), build_prefix_merged(records, strict=True)):
        assert roles(traj) == [([0], False, "client_gone"), ([1, 2, 3], True, "main")]
        assert_counts(traj, records)
        assert traj.metadata["stats"]["untrained"] == {"client_gone": {"calls": 1, "tokens": len(records[0].response_ids)}}
    per = build_per_request(records)
    assert [(t.trainable, t.role) for t in per.traces] == [(False, "client_gone")] + [(True, "main")] * 3
    rewarded = with_outcome(build_prefix_merged(records), {"session_id": "gone", "status": "completed", "reward": 1.0})
    assert [t.reward for t in rewarded.traces] == [None, 1.0]


async def test_a_reply_that_could_not_be_delivered_is_marked_by_an_event_line(tmp_path: Path) -> None:
    from polar_env.journal.store import JournalStore

    store = JournalStore(tmp_path)
    engine = simulated("x")
    records = []
    for seq in range(2):
        chat = ChatRequest(messages=[{"role": "user", "content": "hi"}])
        gen = await engine.generate(chat)
        records.append(CompletionRecord(**gen.model_dump(), session_id="s", seq=seq, provider_api=ProviderAPI.OPENAI_CHAT,
                                        provider_request={}, chat_request=chat, timings={"received_at": 0.0}))
    store.append(records[0])
    store.append_event("s", {"event": "client_gone", "seq": 0})
    store.append(records[1])
    assert [CLIENT_GONE in r.notes for r in store.read("s")] == [True, False]
    assert [CLIENT_GONE in r.notes for r in read_with_refs(store.path("s"))[0]] == [True, False]
    # a retried first call nobody continued (both roots, same prompt): the gone one is dropped
    assert roles(build_prefix_merged(store.read("s"))) == [([0], False, "client_gone"), ([1], True, "main")]
    # the same journal without the note (as written before it existed): nothing tells them apart
    old = build_prefix_merged(records)
    assert roles(old) == [([0], False, "ambiguous_sibling"), ([1], False, "ambiguous_sibling")]
    assert old.metadata["stats"]["ambiguous_siblings"] == 2


async def test_side_calls_never_continued_are_not_trainable_but_a_quoted_sub_agent_is(tmp_path: Path) -> None:
    sub_engine = SimulatedEngine(latency_s=0.0, policy=ScriptedPolicy(steps=(
        ScriptStep(text="The bug is in calc.py, in add(): it subtracts.", reasoning="Found it."),)))
    main_engine = simulated("main.")
    engine = PerCallEngine(main_engine, main_engine, main_engine, sub_engine, main_engine)
    client, store = await start_gateway(engine, tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="side")
        main = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        first = await main.post(main.body())  # seq 0: a tool call
        fork = ChatAgent(gw, s["key"], "", "")  # seq 1: the same history, asked something else; nobody uses it
        fork.messages = list(main.messages)
        fork.take(first)
        fork.messages.append({"role": "user", "content": "Rate your progress."})
        await main.post(fork.body())
        lone = ChatAgent(gw, s["key"], "You check spelling.", "Spell: recieve")  # seq 2: unrelated, once
        await main.post(lone.body())
        sub = ChatAgent(gw, s["key"], "You are a search sub-agent.", "Say where the bug is.")
        answer = await sub.post(sub.body())  # seq 3: a one-call sub-agent whose answer the main agent quotes
        main.take(first, tool_output=f"sub-agent says: {answer['content']}")
        while not main.done:
            await main.step()  # seqs 4, 5
    finally:
        await client.close()
    records = store.read("side")
    traj = build_prefix_merged(records)
    assert roles(traj) == [([0, 4, 5], True, "main"), ([1], False, "uncontinued"), ([2], False, "uncontinued"),
                           ([3], True, "branch")]
    assert_counts(traj, records)
    untrained = traj.metadata["stats"]["untrained"]
    assert untrained == {"uncontinued": {"calls": 2, "tokens": len(records[1].response_ids) + len(records[2].response_ids)}}
    assert [t.role for t in build_per_request(records).traces] == ["main", "uncontinued", "uncontinued", "branch", "main", "main"]


def _body(path: Path) -> dict[str, Any]:
    body = json.loads(path.read_text())
    body["stream"] = False
    return body


async def test_claude_code_title_request_is_a_side_chain_without_reward(tmp_path: Path) -> None:
    engine = PerCallEngine(simulated("title."), simulated("main."))
    client, store = await start_gateway(engine, tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="cc")
        headers = {"x-api-key": s["key"], "anthropic-version": "2023-06-01"}
        title, main = FIXTURES / "anthropic" / "claude_code_title.json", FIXTURES / "captured" / "claude-anthropic" / "01.json"
        for body in (_body(title), _body(main)):
            resp = await gw.post("/v1/messages", body, headers)
            assert resp.status == 200, await resp.text()
    finally:
        await client.close()
    records = store.read("cc")
    traj = with_outcome(build_prefix_merged(records), {"session_id": "cc", "status": "completed", "reward": 1.0})
    assert roles(traj) == [([0], False, "side_request:title"), ([1], True, "main")]
    assert [t.reward for t in traj.traces] == [None, 1.0]
    assert_counts(traj, records)
    # without the preset's matcher the title call is just one more standalone call: main has one call,
    # so nothing shows it is off to the side, and both stay trainable
    assert [t.trainable for t in build_prefix_merged(records, side_requests=()).traces] == [True, True]


def test_every_declared_model_side_request_has_a_matcher_that_fits_its_recorded_shape() -> None:
    named = {(spec.name, s.name) for spec in HARNESSES.values() for s in spec.side_requests if s.match is not None}
    assert named == {("claude_code", "title"), ("opencode", "title"), ("gemini_cli", "classifier"), ("qwen_code", "memory")}

    def record(api: ProviderAPI, body: dict[str, Any], params: dict[str, str] | None = None) -> CompletionRecord:
        chat = PROVIDERS[api].to_chat(body, params or {}).chat
        return CompletionRecord(message={"content": ""}, prompt_ids=[1], response_ids=[], response_logprobs=[], finish_reason="stop",
                                session_id="s", seq=0, provider_api=api, provider_request=body, chat_request=chat,
                                timings={"received_at": 0.0})

    requests = builtin_side_requests()
    captured = FIXTURES / "captured"
    assert side_request_of(record(ProviderAPI.ANTHROPIC, _body(FIXTURES / "anthropic" / "claude_code_title.json")), requests) == "title"
    assert side_request_of(record(ProviderAPI.OPENAI_CHAT, _body(captured / "opencode-openai_chat" / "01.json")), requests) == "title"
    mains = [(ProviderAPI.ANTHROPIC, "claude-anthropic"), (ProviderAPI.OPENAI_CHAT, "opencode-openai_chat"),
             (ProviderAPI.OPENAI_CHAT, "qwen-openai_chat"), (ProviderAPI.OPENAI_CHAT, "pi-openai_chat"),
             (ProviderAPI.ANTHROPIC, "pi-anthropic")]
    for api, folder in mains:
        for name in ("02.json",):
            assert side_request_of(record(api, _body(captured / folder / name)), requests) is None, folder
    gemini = _body(captured / "gemini-gemini" / "01.json")
    params = {"model": "m", "method": "generateContent"}
    assert side_request_of(record(ProviderAPI.GEMINI, gemini, params), requests) is None
    classifier = {"contents": [{"role": "user", "parts": [{"text": "fix it"}]}],
                  "systemInstruction": {"parts": [{"text": "You are a specialized Task Routing AI. Classify."}]},
                  "generationConfig": {"responseMimeType": "application/json",
                                       "responseSchema": {"type": "OBJECT", "properties": {"model_choice": {"type": "STRING"}}}}}
    assert side_request_of(record(ProviderAPI.GEMINI, classifier, params), requests) == "classifier"
    memory = _body(captured / "qwen-openai_chat" / "02.json")
    memory["messages"][0] = {"role": "system",
                             "content": "You are now acting as the managed memory extraction subagent for an AI coding assistant."}
    assert side_request_of(record(ProviderAPI.OPENAI_CHAT, memory), requests) == "memory"


async def test_a_summary_carried_into_a_fresh_history_keeps_the_post_compaction_call_trainable(tmp_path: Path) -> None:
    def text(answer: str) -> SimulatedEngine:
        return SimulatedEngine(latency_s=0.0, policy=ScriptedPolicy(steps=(ScriptStep(text=answer, reasoning="Write it."),)))

    main_engine = simulated("main.")
    summary = "Summary so far: listed the files, echoed hi, the bug is fixed."
    engine = PerCallEngine(main_engine, main_engine, main_engine, text(summary), text("All done, nothing left."),
                           text("Spelling checked: receive."))
    client, store = await start_gateway(engine, tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="compact")
        main = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        while not main.done:
            await main.step()  # seqs 0-2
        compact = ChatAgent(gw, s["key"], "", "")
        compact.messages = [*main.messages, {"role": "user", "content": "Summarize the work so far."}]
        said = await compact.post(compact.body())  # seq 3: the compaction call
        assert said["content"] == summary
        after = ChatAgent(gw, s["key"], "You are the main agent.", f"Earlier work: {said['content']} Finish up.")
        await after.step()  # seq 4: the one call after the compaction, on a fresh history quoting the summary
        other = ChatAgent(gw, s["key"], "You are the main agent.", "Check the spelling of recieve.")
        await other.step()  # seq 5: one call on a fresh history that quotes nothing
    finally:
        await client.close()
    records = store.read("compact")
    traj = build_prefix_merged(records)
    by_first = {t.metadata["seqs"][0]: (t.trainable, t.role) for t in traj.traces}
    assert by_first[0] == (True, "main") and by_first[4] == (True, "branch") and by_first[5] == (False, "uncontinued")
    assert all(t.trainable for t in traj.traces if 3 in t.metadata["seqs"])  # the compaction call itself
    assert_counts(traj, records)


async def test_a_retry_recorded_after_its_sibling_was_continued_is_not_trainable() -> None:
    """No client-gone note (an old journal): the late sibling is a standalone call whose answer no
    request quotes, off to the side of a multi-call main chain."""
    first, second = simulated("first."), simulated("second.")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are the main agent."}, {"role": "user", "content": "Fix it."}]
    records: list[CompletionRecord] = []

    async def call(engine: SimulatedEngine, history: list[dict[str, Any]]) -> dict[str, Any]:
        chat = ChatRequest(messages=list(history), tools=[SHELL_TOOL])
        gen = await engine.generate(chat)
        records.append(CompletionRecord(**gen.model_dump(), session_id="s", seq=len(records), provider_api=ProviderAPI.OPENAI_CHAT,
                                        provider_request={}, chat_request=chat, timings={"received_at": 0.0}))
        msg = gen.message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in msg.tool_calls]
        turn: dict[str, Any] = {"role": "assistant", "content": msg.content or "", "reasoning_content": msg.reasoning}
        return {**turn, "tool_calls": calls} if calls else turn

    turn = await call(second, messages)  # seq 0
    messages += [turn, {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": "a.py"}]
    retried = list(messages)
    turn = await call(second, messages)  # seq 1: the reply the harness got
    messages += [turn, {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": "hi"}]
    await call(second, messages)  # seq 2
    await call(first, retried)  # seq 3: the abandoned twin of seq 1, recorded last
    traj = build_prefix_merged(records)
    assert roles(traj) == [([0, 1, 2], True, "main"), ([3], False, "uncontinued")]
    assert_counts(traj, records)
