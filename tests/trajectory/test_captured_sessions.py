"""Builders on real captured sessions: gateway + embedded engine (scripted tool loops), a main
agent with a follow-up user turn, an interleaved sub-agent, and a compaction — in canonical and
continuation modes, on the Qwen3.5 template and the append-only one; then the fidelity check."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_env.chat import chat_format
from polar_env.chat.qwen35.template import APPEND_ONLY, QWEN35, TemplateQuirks
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.journal.reader import read_with_refs
from polar_env.records import CompletionRecord, Trajectory
from polar_env.trajectory.fidelity import verify
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import Gateway, start_gateway

POLICY = ScriptedPolicy(steps=(
    ScriptStep(command="ls", reasoning="List first."),
    ScriptStep(command="echo hi", reasoning="Now echo."),
    ScriptStep(text="Done: {tool_output}", reasoning="Wrap up."),
))


@pytest.fixture(scope="module")
def engines() -> dict[str, EmbeddedEngine]:
    return {name: EmbeddedEngine(policy=POLICY, chat=chat_format(name)) for name in ("qwen3.5", "append_only")}


class Agent:
    """A chat-completions harness loop that echoes tool calls (optionally without reasoning)."""

    def __init__(self, gw: Gateway, key: str, system: str, task: str, echo_reasoning: bool) -> None:
        self.gw, self.key, self.echo_reasoning = gw, key, echo_reasoning
        self.messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.done = False

    async def step(self) -> None:
        resp = await self.gw.post("/v1/chat/completions", {"model": "m", "messages": self.messages, "tools": [SHELL_TOOL]},
                                  {"Authorization": f"Bearer {self.key}"})
        assert resp.status == 200, await resp.text()
        msg = (await resp.json())["choices"][0]["message"]
        echo = {"role": "assistant", "content": msg["content"], "tool_calls": msg.get("tool_calls")}
        if self.echo_reasoning:
            echo["reasoning_content"] = msg.get("reasoning_content")
        if not msg.get("tool_calls"):
            echo.pop("tool_calls")
            self.messages.append(echo)
            self.done = True
            return
        self.messages.append(echo)
        for i, call in enumerate(msg["tool_calls"]):
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"out-{len(self.messages)}-{i}"})

    async def run(self) -> None:
        while not self.done:
            await self.step()


async def capture(engine: EmbeddedEngine, tmp_path: Path, *, continuation: bool, echo_reasoning: bool) -> list[CompletionRecord]:
    client, store = await start_gateway(engine, tmp_path, template=engine.chat.name)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="ep", continuation=continuation)
        main = Agent(gw, s["key"], "You are the main agent.", "Fix the bug.", echo_reasoning)
        sub = Agent(gw, s["key"], "You are a search sub-agent.", "Find the file.", echo_reasoning)
        while not (main.done and sub.done):  # interleaved, as parallel sub-agents are
            for agent in (main, sub):
                if not agent.done:
                    await agent.step()
        main.messages.append({"role": "user", "content": "Thanks. Check once more."})
        main.done = False
        await main.run()
        compacted = Agent(gw, s["key"], "You are the main agent.", "Summary of earlier work: fixed. Continue.", echo_reasoning)
        await compacted.run()
        records = store.read("ep")
        assert_ref_path_agrees(store.path("ep"), records)
        return records
    finally:
        await client.close()


def assert_ref_path_agrees(path: Path, records: list[CompletionRecord]) -> None:
    """The journal's prompt references give the same trajectories as re-comparing the token lists."""
    read, refs = read_with_refs(path)
    assert [r.model_dump() for r in read] == [r.model_dump() for r in records]
    assert refs, "a v2 journal of a tool loop stores prompt references"
    for strict in (False, True):
        compared = build_prefix_merged(records, strict=strict)
        assert build_prefix_merged(read, strict=strict, prompt_refs=refs).model_dump() == compared.model_dump()


def assert_faithful(traj: Trajectory, records: list[CompletionRecord]) -> None:
    """Masks are 1 exactly on sampled ids and every merged trace is prompt+response of its last call."""
    by_seq = {r.seq: r for r in records}
    for trace in traj.traces:
        seqs = trace.metadata["seqs"]
        sampled = [t for t, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m]
        assert sampled == [t for s in seqs for t in by_seq[s].response_ids]
        sampled_logprobs = [lp for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True) if m]
        assert sampled_logprobs == [x for s in seqs for x in by_seq[s].response_logprobs]
        assert all(lp == 0.0 for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True) if not m)
        if not trace.metadata["drift"]:
            last = by_seq[seqs[-1]]
            assert trace.prompt_ids + trace.response_ids == last.prompt_ids + last.response_ids


@pytest.mark.slow
async def test_continuation_mode_is_append_only_with_zero_drift(engines, tmp_path) -> None:
    engine = engines["qwen3.5"]
    records = await capture(engine, tmp_path, continuation=True, echo_reasoning=False)
    assert len(records) == 12  # main 3 + sub 3 + follow-up 3 + compaction 3
    assert sum("token-in" in " ".join(r.notes) for r in records) == 9  # all but the 3 first turns
    traj = build_prefix_merged(records)
    stats = traj.metadata["stats"]
    assert (stats["chains"], stats["drift_boundaries"]) == (3, 0), stats
    assert_faithful(traj, records)
    report = verify([traj], engine.model)
    assert report.tokens_checked == sum(len(r.response_ids) for r in records)
    assert report.max_abs_delta <= 1e-4, report.worst


@pytest.mark.slow
async def test_qwen_template_canonical_mode_forks_at_the_new_user_turn(engines, tmp_path) -> None:
    engine = engines["qwen3.5"]
    records = await capture(engine, tmp_path, continuation=False, echo_reasoning=True)
    traj = build_prefix_merged(records)
    stats = traj.metadata["stats"]
    # Reasoning before the follow-up query is stripped: the main agent's chain breaks there.
    assert (stats["chains"], stats["drift_boundaries"]) == (4, 0), stats
    assert [t.metadata["seqs"] for t in traj.traces] == [[0, 2, 4], [1, 3, 5], [6, 7, 8], [9, 10, 11]]
    assert_faithful(traj, records)
    assert verify([traj], engine.model).max_abs_delta <= 1e-4
    assert len(build_per_request(records).traces) == 12


@pytest.mark.slow
async def test_dropped_reasoning_echo_is_cut_as_drift(engines, tmp_path) -> None:
    """Every boundary where the harness dropped the reasoning is drift: both modes cut there (the
    loose mode used to merge across it and train later turns after a context the model never saw)."""
    engine = engines["qwen3.5"]
    records = await capture(engine, tmp_path, continuation=False, echo_reasoning=False)
    for strict in (False, True):
        traj = build_prefix_merged(records, strict=strict)
        stats = traj.metadata["stats"]
        assert stats["drift_boundaries"] >= 4 and stats["drift_tokens"] > 0, stats
        assert all(t.metadata["drift"] == [] for t in traj.traces)
        assert len(traj.traces) == 12
        assert_faithful(traj, records)
        assert verify([traj], engine.model).max_abs_delta <= 1e-4


@pytest.mark.slow
async def test_append_only_template_merges_across_user_turns(engines, tmp_path) -> None:
    engine = engines["append_only"]
    records = await capture(engine, tmp_path, continuation=False, echo_reasoning=True)
    traj = build_prefix_merged(records)
    stats = traj.metadata["stats"]
    assert (stats["chains"], stats["drift_boundaries"]) == (3, 0), stats
    assert [t.metadata["seqs"] for t in traj.traces] == [[0, 2, 4, 6, 7, 8], [1, 3, 5], [9, 10, 11]]
    assert_faithful(traj, records)
    assert verify([traj], engine.model).max_abs_delta <= 1e-4


def test_template_quirks_are_hashable_config() -> None:
    assert TemplateQuirks() == QWEN35 and hash(APPEND_ONLY)


@pytest.mark.slow
async def test_build_and_verify_cli(engines, tmp_path, capsys) -> None:
    from polar_env.cli import main

    await capture(engines["qwen3.5"], tmp_path, continuation=True, echo_reasoning=False)
    store = str(tmp_path / "capture")
    assert main(["build", "--store", store, "--out", str(tmp_path / "t.jsonl")]) == 0
    assert '"chains": 3' in capsys.readouterr().out
    assert Trajectory.from_json((tmp_path / "t.jsonl").read_bytes().splitlines()[0]).session_id == "ep"
    assert main(["verify", "--store", store]) == 0
    assert "max |Δlogprob|" in capsys.readouterr().out
