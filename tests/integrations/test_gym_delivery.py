"""Which trace NeMo Gym gets from a session with a side chain, on a real capture: opencode's
recorded bodies (tests/fixtures/providers/captured/opencode-openai_chat: a title-generator
request, then the main agent's tool round trip) replayed through the real gateway and the
embedded engine (scripted tokens), built by the prefix-merge builder. The main chain is
delivered; the title chain is opencode's declared side request, so it is not trainable for the
task's reward: never delivered, its tokens reported apart (untrained), per rollout and per run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from polar_env.chat import chat_format
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.integrations.delivery import DeliveryTally, choose_delivered
from polar_env.integrations.nemo_gym.agent import build_result
from polar_env.integrations.nemo_gym.convert import check_contiguous
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.proxy.conftest import Gateway, start_gateway

CAPTURED = Path(__file__).parents[1] / "fixtures" / "providers" / "captured" / "opencode-openai_chat"
POLICY = ScriptedPolicy(steps=(ScriptStep(command="echo hi", reasoning="Run it."),
                               ScriptStep(text="done", reasoning="It printed hi.")))


def _body(name: str) -> dict[str, Any]:
    body = json.loads((CAPTURED / name).read_text())
    body.pop("stream_options", None)
    body["stream"] = False  # replayed without SSE; the gateway captures both the same way
    return body


async def opencode_capture(tmp_path: Path) -> list[Any]:
    """opencode's recorded session (title request, tool call, tool result) replayed through the
    gateway; returns the captured records."""
    engine = EmbeddedEngine(policy=POLICY, chat=chat_format("qwen3.5"))
    client, store = await start_gateway(engine, tmp_path, template="qwen3.5")
    try:
        gw = Gateway(client, store)
        s = await gw.session(session_id="oc")
        auth = {"Authorization": f"Bearer {s['key']}"}
        title = await gw.post("/v1/chat/completions", _body("01.json"), auth)
        assert title.status == 200, await title.text()
        first = await gw.post("/v1/chat/completions", _body("02.json"), auth)
        assert first.status == 200, await first.text()
        msg = (await first.json())["choices"][0]["message"]
        (call,) = msg["tool_calls"]
        third = _body("03.json")  # opencode's next request, with our answer where the recorded one was
        third["messages"][2] = {"role": "assistant", "content": msg.get("content") or "", "tool_calls": msg["tool_calls"]}
        third["messages"][3] = {**third["messages"][3], "tool_call_id": call["id"]}
        last = await gw.post("/v1/chat/completions", third, auth)
        assert last.status == 200, await last.text()
        return store.read("oc")
    finally:
        await client.close()


async def test_real_side_chain_capture_delivers_main_chain_and_reports_the_drop(tmp_path: Path) -> None:
    """opencode's title side request plus its main chain; the main chain's next request re-renders
    the first answer differently from what was sampled, so the chain is cut there (never trained
    after a context the model did not see): one title trace and two main traces. Gym takes one
    trace per rollout: the larger main piece is delivered, the other piece and the title are counted."""
    records = await opencode_capture(tmp_path)
    traj = build_prefix_merged(records)
    assert len(traj.traces) == 3  # the title chain and the main chain, cut at its drift
    mains = [i for i, t in enumerate(traj.traces) if t.trainable]
    (title_i,) = [i for i, t in enumerate(traj.traces) if not t.trainable]
    assert len(mains) == 2 and traj.traces[mains[0]].metadata["cut"] == "drift"
    assert traj.traces[mains[1]].metadata["start"] == "drift"
    delivery = choose_delivered(traj)
    main = max(mains, key=lambda i: sum(traj.traces[i].loss_mask))
    other = sum(traj.traces[next(i for i in mains if i != main)].loss_mask)
    assert delivery.index == main and delivery.dropped_traces == 2
    title = traj.traces[title_i]
    title_tokens = sum(title.loss_mask)
    assert (title.trainable, title.role, traj.traces[main].trainable) == (False, "side_request:title", True)
    assert delivery.untrained_tokens == title_tokens > 0 and delivery.dropped_tokens == other > 0
    assert delivery.delivered_tokens == sum(traj.traces[main].loss_mask)
    assert delivery.trainable_tokens == delivery.delivered_tokens + other
    assert choose_delivered(build_prefix_merged(records)) == delivery  # deterministic on a rebuild
    row = {"responses_create_params": {"input": [{"role": "user", "content": "echo hi"}]}}
    result = SimpleNamespace(session_id="oc", status="completed", reward=1.0, evaluation={}, failure_kind=None,
                             failure_detail=None, mask=False, trajectory=traj)
    out = build_result(row, result, model="m", records=records)
    assert out["polar_dropped_traces"] == 2 and out["polar_dropped_tokens"] == other
    assert out["polar_untrained_tokens"] == title_tokens
    assert out["polar"]["trainable_tokens"][title_i] == 0
    items = out["response"]["output"]
    assert main == mains[0]  # the first call (reasoning and the tool call) is the larger piece
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert check_contiguous(items)[-1] == traj.traces[main].response_ids[-1]
    tally = DeliveryTally()
    tally.add(delivery)
    tally.add(choose_delivered(traj.model_copy(update={"traces": [traj.traces[main]]})))
    assert tally.report()["rollouts"] == 2 and tally.report()["rollouts_with_drops"] == 1
