"""Token-in continuation over retried calls, through the real gateway: a client gives up on an
answered call and retries the same prompt; both replies say the same thing with different reasoning.
The next prompt must continue the turn the harness sent back (its reasoning, else the delivered
one), never the abandoned call's tokens; siblings it cannot tell apart fall back to templating with
the reason noted. Engines are the test doubles of tests/trajectory/test_lineage.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from polar_env.journal.format import CLIENT_GONE
from tests.proxy.conftest import Gateway, start_gateway
from tests.trajectory.test_lineage import ChatAgent, PerCallEngine, simulated
from tests.waits import until


async def retried(tmp_path: Path, *, give_up: bool, keep_reasoning: bool) -> list[Any]:
    """Call 0 (reasoning "first try."), then the same prompt again (call 1, "second try."), the
    harness keeping call 1's reply; then one more turn. ``give_up``: the client abandons call 0
    (else it reads both, as two sub-agents sharing a prompt would); ``keep_reasoning``: the
    harness echoes the reasoning it got (else it drops it)."""
    engine = PerCallEngine(simulated("first try."), simulated("second try."))
    engine.hold = asyncio.Event() if give_up else None
    client, store = await start_gateway(engine, tmp_path)
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="retry", continuation=True)
        agent = ChatAgent(gw, s["key"], "You are the main agent.", "Fix the bug.")
        if give_up:
            assert engine.hold is not None
            with pytest.raises(asyncio.TimeoutError):
                await agent.post(agent.body(), timeout=aiohttp.ClientTimeout(total=0.5))
            engine.hold.set()
            await until(lambda: store.read("retry"), "the gateway to record the call its client gave up on")
        else:
            await agent.post(agent.body())
        answer = await agent.post(agent.body())  # the retry, whose reply the harness keeps
        if not keep_reasoning:
            answer = {**answer, "reasoning_content": None}
        agent.take(answer)
        await agent.step()
    finally:
        await client.close()
    return store.read("retry")


@pytest.mark.parametrize("keep_reasoning", [True, False], ids=["echoes-reasoning", "drops-reasoning"])
async def test_the_next_prompt_continues_the_retry_the_harness_kept(tmp_path: Path, keep_reasoning: bool) -> None:
    records = await retried(tmp_path, give_up=True, keep_reasoning=keep_reasoning)
    assert [CLIENT_GONE in r.notes for r in records] == [True, False, False]
    abandoned, kept, nxt = records
    assert abandoned.prompt_ids == kept.prompt_ids and abandoned.response_ids != kept.response_ids
    assert abandoned.message.content == kept.message.content  # the same visible reply ...
    assert abandoned.message.reasoning != kept.message.reasoning  # ... with other reasoning
    context = kept.prompt_ids + kept.response_ids
    assert nxt.prompt_ids[: len(context)] == context, "the model was fed the abandoned call's tokens"
    assert any(n.startswith("continuation: token-in") for n in nxt.notes), nxt.notes


async def test_the_echoed_reasoning_picks_among_delivered_siblings(tmp_path: Path) -> None:
    records = await retried(tmp_path, give_up=False, keep_reasoning=True)
    first, kept, nxt = records
    context = kept.prompt_ids + kept.response_ids
    assert nxt.prompt_ids[: len(context)] == context
    assert nxt.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] != first.prompt_ids + first.response_ids


async def test_siblings_that_cannot_be_told_apart_fall_back_with_the_reason(tmp_path: Path) -> None:
    records = await retried(tmp_path, give_up=False, keep_reasoning=False)
    nxt = records[-1]
    notes = [n for n in nxt.notes if n.startswith("continuation")]
    assert notes == ["continuation fallback: 2 sampled turns (retries) match the echoed assistant turn and differ "
                     "in their tokens; cannot tell which the harness sent"], nxt.notes
