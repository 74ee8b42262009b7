"""A session opened with its own trainer sampling (a Gym row's temperature, slime's sampling params)
is sampled with it, whatever the harness sends and whatever the gateway-wide default; the record
says so (the chat request the engine got, and a note); a restarted gateway keeps it."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig, Sampling
from polar_env.proxy.gateway import Gateway
from tests.proxy.conftest import FakeEngine

CHAT = "/v1/chat/completions"
HARNESS_BODY = {"model": "whatever", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.3,
                "top_p": 0.5, "max_tokens": 4000, "top_k": 5}


async def _post(gateway: Gateway, *keys: str) -> None:
    client = TestClient(TestServer(gateway.app))
    await client.start_server()
    try:
        for key in keys:
            resp = await client.post(CHAT, json=HARNESS_BODY, headers={"Authorization": f"Bearer {key}"})
            assert resp.status == 200, await resp.text()
    finally:
        await client.close()  # closes the gateway too (the app's cleanup)


async def test_session_sampling_reaches_the_engine_and_the_record(tmp_path: Path) -> None:
    engine = FakeEngine()
    store = JournalStore(tmp_path / "capture")
    config = GatewayConfig(engine_model="m", sampling=Sampling(max_tokens=256))  # the node's default cap
    gateway = Gateway(engine, store, config)
    own = gateway.open_session("own", {}, False, Sampling(temperature=0.7, top_p=1.0, max_tokens=512))
    plain = gateway.open_session("plain", {}, False)
    assert own.key is not None and plain.key is not None
    await _post(gateway, own.key, plain.key)
    sent_own, sent_plain = engine.seen
    assert (sent_own.temperature, sent_own.top_p, sent_own.max_tokens) == (0.7, 1.0, 512)
    assert "top_k" not in sent_own.extra_body  # a harness extra that reshapes the distribution goes
    assert (sent_plain.temperature, sent_plain.top_p, sent_plain.max_tokens) == (1.3, 0.5, 256)  # the gateway's
    (record,) = store.read("own")
    assert (record.chat_request.temperature, record.chat_request.max_tokens) == (0.7, 512)
    assert "session sampling temperature=0.7 top_p=1.0 max_tokens=512" in record.notes
    assert not any(n.startswith("session sampling") for n in store.read("plain")[0].notes)

    restarted = Gateway(FakeEngine(), JournalStore(tmp_path / "capture"), config)
    assert restarted.sessions.get("own").sampling == Sampling(temperature=0.7, top_p=1.0, max_tokens=512)
    assert restarted.sessions.get("plain").sampling is None
    await restarted.aclose()


def test_conflicts_and_over() -> None:
    env = Sampling(temperature=1.0, max_tokens=256)
    assert env.conflicts(Sampling(temperature=0.7)) == ["temperature 0.7 != 1.0"]
    assert env.conflicts(Sampling(temperature=1.0, top_p=0.9)) == []  # agreeing or unset on one side
    assert Sampling(temperature=0.7).over(env) == Sampling(temperature=0.7, max_tokens=256)
