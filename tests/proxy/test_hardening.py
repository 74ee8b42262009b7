"""Issue 9's findings, one test (or a few) each: each failed on the gateway before the fix.

1 control plane auth · 2 non-finite logprobs · 3 torn/short journal writes (gateway side; the store
side is in tests/journal/test_store.py) · 4 restart · 5 bounded fds and idle expiry · 6 validation before the
engine · 7 engine timeout and pause · 8 the smaller ones.
"""

from __future__ import annotations

import asyncio
import math
import os
import stat
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.journal import store as journal_store
from polar_env.journal.store import JournalStore
from polar_env.proxy.admin import load_or_create_admin_token
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway as LiveGateway
from polar_env.records import AssistantMessage, ChatRequest, Generation
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import FakeEngine, Gateway, start_gateway
from tests.proxy.conftest import live as live_gateway

CHAT = "/v1/chat/completions"


def chat_body(**kw: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Run it."}], "tools": [SHELL_TOOL], **kw}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def live(engine: object, root: Path, **config: object) -> Gateway:
    client, store = await start_gateway(engine, root, **config)
    return Gateway(client, store)


# -- 1. control plane ----------------------------------------------------------------------------


async def test_control_plane_needs_the_admin_token_or_the_sessions_own_key(fake_gateway: Gateway) -> None:
    c = fake_gateway.client
    assert (await c.post("/sessions", json={})).status == 401
    assert (await c.post("/sessions", json={}, headers=bearer("polar-admin-guess"))).status == 401
    a = await fake_gateway.session(session_id="a")
    b = await fake_gateway.session(session_id="b")
    assert (await fake_gateway.post(CHAT, chat_body(), bearer(b["key"]))).status == 200
    for path in ("/sessions/b", "/sessions/b/completions"):
        assert (await c.get(path)).status == 401
        assert (await c.get(path, headers=bearer(a["key"]))).status == 401  # another session's key
        assert (await c.get(path, headers=bearer(b["key"]))).status == 200  # its own
        assert (await c.get(path, headers=fake_gateway.admin)).status == 200
    assert (await c.delete("/sessions/b", headers=bearer(a["key"]))).status == 401
    assert (await c.delete("/sessions/b")).status == 401
    for method, path in (("POST", "/admin/pause"), ("POST", "/admin/resume"), ("GET", "/admin/status")):
        resp = await c.request(method, path, headers=bearer(a["key"]))
        assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    status = await (await c.get("/admin/status", headers=fake_gateway.admin)).json()
    assert status["paused"] is False and status["sessions"] == 2


async def test_gateway_always_has_an_admin_token(tmp_path: Path) -> None:
    gw = LiveGateway(FakeEngine(), JournalStore(tmp_path), GatewayConfig(engine_model="m"))
    token = gw.config.admin_token
    assert token and len(token) >= 32
    other = LiveGateway(FakeEngine(), JournalStore(tmp_path / "2"), GatewayConfig(engine_model="m"))
    assert other.config.admin_token != token
    given = LiveGateway(FakeEngine(), JournalStore(tmp_path / "3"), GatewayConfig(engine_model="m", admin_token="t0p"))
    assert given.config.admin_token == "t0p"


def test_admin_token_file_is_created_0600_and_reused(tmp_path: Path) -> None:
    assert load_or_create_admin_token(tmp_path, "given") == ("given", None)
    assert not (tmp_path / "admin_token").exists()
    token, path = load_or_create_admin_token(tmp_path / "store", None)
    assert path == tmp_path / "store" / "admin_token" and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_admin_token(tmp_path / "store", None) == (token, path)


async def test_keys_never_stored_in_clear(fake_gateway: Gateway, tmp_path: Path) -> None:
    s = await fake_gateway.session(session_id="k", metadata={"task": "t"})
    assert (await fake_gateway.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
    for path in fake_gateway.store.root.rglob("*"):
        if path.is_file():
            assert s["key"].encode() not in path.read_bytes(), path


async def test_provider_app_serves_no_control_plane(fake_engine: FakeEngine, tmp_path: Path) -> None:
    """What a sandbox reaches: provider routes for its own key, nothing else, whatever it sends."""
    gw = LiveGateway(fake_engine, JournalStore(tmp_path), GatewayConfig(engine_model="m"))
    session = gw.open_session("mine")
    other = gw.open_session("theirs")
    admin = bearer(gw.config.admin_token or "")
    full = TestClient(TestServer(gw.app))
    sandbox = TestClient(TestServer(gw.provider_app))
    await full.start_server()
    await sandbox.start_server()
    try:
        resp = await sandbox.post(CHAT, json=chat_body(), headers=bearer(session.key or ""))
        assert resp.status == 200
        assert (await sandbox.post(f"/s/theirs{CHAT}", json=chat_body(), headers=bearer(session.key or ""))).status == 401
        for method, path in (("POST", "/sessions"), ("GET", "/sessions/theirs"), ("GET", "/sessions/theirs/completions"),
                             ("DELETE", "/sessions/theirs"), ("POST", "/admin/pause"), ("GET", "/admin/status")):
            resp = await sandbox.request(method, path, headers=admin)  # even with the admin token
            assert resp.status == 404 and "error" in await resp.json(), (method, path)
        assert (await sandbox.get("/v1/models")).status == 200
        assert len(gw.store.read("mine")) == 1 and gw.store.read("theirs") == []
        del other
    finally:
        await sandbox.close()
        await full.close()


# -- 2. non-finite logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-310, 1e-45, 1e-6])
async def test_tiny_temperature_is_greedy_and_finite(scripted_gateway: Gateway, temperature: float) -> None:
    s = await scripted_gateway.session()
    resp = await scripted_gateway.post(CHAT, chat_body(temperature=temperature), bearer(s["key"]))
    assert resp.status == 200, await resp.text()
    (record,) = scripted_gateway.store.read(s["session_id"])
    assert all(math.isfinite(lp) for lp in record.response_logprobs)
    resp = await scripted_gateway.client.get(f"/sessions/{s['session_id']}/completions", headers=scripted_gateway.admin)
    assert resp.status == 200


def nan_reply(request: ChatRequest) -> Generation:
    return Generation(message=AssistantMessage(content="x"), prompt_ids=[1], response_ids=[2, 3],
                      response_logprobs=[-0.1, float("nan")], finish_reason="stop")


async def test_non_finite_logprob_is_refused_not_recorded(fake_gateway: Gateway, fake_engine: FakeEngine) -> None:
    fake_engine.reply = nan_reply
    s = await fake_gateway.session()
    resp = await fake_gateway.post(CHAT, chat_body(), bearer(s["key"]))
    body = await resp.json()
    assert resp.status == 502 and body["error"]["type"] == "server_error"
    assert fake_gateway.store.read(s["session_id"]) == []
    info = await (await fake_gateway.client.get(f"/sessions/{s['session_id']}", headers=fake_gateway.admin)).json()
    assert info["errors"] == 1 and info["completions"] == 0


# -- 3. a write that cannot complete fails the request -------------------------------------------


async def test_short_journal_write_is_a_500_and_leaves_nothing(fake_gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that takes only part of the record (the fake write below is the test double for a
    full disk; the real RLIMIT_FSIZE case is in tests/journal/test_store.py)."""
    s = await fake_gateway.session(session_id="full")
    assert (await fake_gateway.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
    real_write = os.write
    journal_fds = fake_gateway.store._fds

    def short_write(fd: int, data: bytes) -> int:
        return real_write(fd, data[: len(data) // 2]) if fd in journal_fds.values() else real_write(fd, data)

    monkeypatch.setattr(journal_store.os, "write", short_write)
    resp = await fake_gateway.post(CHAT, chat_body(), bearer(s["key"]))
    body = await resp.json()
    assert resp.status == 500 and "could not record" in body["error"]["message"]
    monkeypatch.setattr(journal_store.os, "write", real_write)
    assert (await fake_gateway.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
    records = fake_gateway.store.read("full")
    assert [r.seq for r in records] == [0, 1]  # the failed call left no bytes and no gap
    assert fake_gateway.store.path("full").read_bytes().count(b"\n") == 2


# -- 4. restart ----------------------------------------------------------------------------------


async def test_restart_keeps_sessions_keys_and_sequence(tmp_path: Path) -> None:
    first = await live(FakeEngine(), tmp_path, admin_token="adm")
    try:
        s = await first.session(session_id="ep", metadata={"task": "t-1"}, continuation=False)
        assert (await first.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
        closed = await first.session(session_id="gone")
        assert (await first.client.delete("/sessions/gone", headers=first.admin)).status == 200
    finally:
        await first.client.close()
    second = await live(FakeEngine(), tmp_path, admin_token="adm")
    try:
        assert (await second.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
        assert [r.seq for r in second.store.read("ep")] == [0, 1]
        info = await (await second.client.get("/sessions/ep", headers=second.admin)).json()
        assert info["metadata"] == {"task": "t-1"} and info["completions"] == 2 and info["closed"] is False
        assert (await second.post(CHAT, chat_body(), bearer(closed["key"]))).status == 401  # stays closed
        resp = await second.client.post("/sessions", json={"session_id": "ep"}, headers=second.admin)
        assert resp.status == 409
        assert second.store.read_session_meta("ep")["metadata"] == {"task": "t-1"}
    finally:
        await second.client.close()


async def test_existing_journal_id_cannot_be_recreated(tmp_path: Path) -> None:
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / "old.jsonl").write_bytes(b"")
    gw = await live(FakeEngine(), tmp_path)
    try:
        resp = await gw.client.post("/sessions", json={"session_id": "old"}, headers=gw.admin)
        assert resp.status == 409
    finally:
        await gw.client.close()


async def test_restored_continuation_session_keeps_its_mode(scripted_engine: EmbeddedEngine, tmp_path: Path) -> None:
    first = await live(scripted_engine, tmp_path, admin_token="adm")
    s = await first.session(session_id="cont", continuation=True)
    await first.client.close()
    second = await live(scripted_engine, tmp_path, admin_token="adm")
    try:
        info = await (await second.client.get("/sessions/cont", headers=second.admin)).json()
        assert info["continuation"] is True
        assert (await second.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
        (record,) = second.store.read("cont")
        assert any(n.startswith("continuation") for n in record.notes)
    finally:
        await second.client.close()


# -- 5. bounded fds, idle expiry ------------------------------------------------------------------


async def test_open_journals_are_bounded(tmp_path: Path) -> None:
    gw = await live(FakeEngine(), tmp_path)
    gw.store.max_open = 8
    try:
        keys = [(await gw.session())["key"] for _ in range(40)]
        for key in keys:
            assert (await gw.post(CHAT, chat_body(), bearer(key))).status == 200
        assert gw.store.open_fds() <= 8
        for key in keys[:5]:  # evicted journals reopen and keep appending
            assert (await gw.post(CHAT, chat_body(), bearer(key))).status == 200
        sizes = sorted(len(gw.store.read(sid)) for sid in gw.store.session_ids())
        assert sizes == [1] * 35 + [2] * 5
    finally:
        await gw.client.close()


async def test_idle_sessions_expire(tmp_path: Path) -> None:
    gw = await live(FakeEngine(), tmp_path, session_idle_s=0.2)
    try:
        s = await gw.session()
        assert (await gw.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
        await asyncio.sleep(0.6)
        assert (await gw.post(CHAT, chat_body(), bearer(s["key"]))).status == 401
        info = await (await gw.client.get(f"/sessions/{s['session_id']}", headers=gw.admin)).json()
        assert info["closed"] is True and gw.store.open_fds() == 0
    finally:
        await gw.client.close()


# -- 6. validation before the engine --------------------------------------------------------------


def deep(levels: int) -> object:
    value: object = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


BAD_BODIES = {
    "deep-content": (CHAT, chat_body(messages=[{"role": "user", "content": "q", "extra": deep(300)}])),
    "deep-anywhere": (CHAT, chat_body(metadata=deep(260))),
    "role-list": (CHAT, chat_body(messages=[{"role": ["user"], "content": "q"}])),
    "role-dict": (CHAT, chat_body(messages=[{"role": {"r": 1}, "content": "q"}])),
    "tool-choice-int": (CHAT, chat_body(tool_choice=5)),
    "stream-options-str": (CHAT, chat_body(stream=True, stream_options="yes")),
    "anthropic-tool-choice-type-list": ("/v1/messages", {"model": "c", "max_tokens": 8, "tool_choice": {"type": ["auto"]},
                                                         "messages": [{"role": "user", "content": "q"}]}),
    "deep-tool-arguments": (CHAT, chat_body(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                "function": {"name": "bash", "arguments": deep(300)}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ])),
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
async def test_bad_bodies_are_4xx_before_the_engine(tmp_path: Path, name: str) -> None:
    engine = FakeEngine()
    gw = await live(engine, tmp_path)
    try:
        s = await gw.session()
        path, body = BAD_BODIES[name]
        raw = orjson.dumps(body) if name not in ("deep-content", "deep-tool-arguments", "deep-anywhere") else _dump_deep(body)
        resp = await gw.post(path, None, {**bearer(s["key"]), "anthropic-version": "2023-06-01"}, raw=raw)
        assert 400 <= resp.status < 500, await resp.text()
        assert "error" in orjson.loads(await resp.read())
        assert engine.seen == [] and gw.store.read(s["session_id"]) == []
        info = await (await gw.client.get(f"/sessions/{s['session_id']}", headers=gw.admin)).json()
        assert info["completions"] == 0  # no seq was spent
    finally:
        await gw.client.close()


def _dump_deep(value: object) -> bytes:
    """orjson cannot write what it refuses to record; json (no depth limit) writes the attack body."""
    import json
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        return json.dumps(value).encode()
    finally:
        sys.setrecursionlimit(limit)


async def test_scripted_engine_with_odd_tool_schema(scripted_gateway: Gateway) -> None:
    tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": ["string"]}}}}
    s = await scripted_gateway.session()
    resp = await scripted_gateway.post(CHAT, chat_body(tools=[tool]), bearer(s["key"]))
    assert resp.status == 200, await resp.text()


async def test_engine_client_bug_is_a_json_502_not_plain_text(fake_gateway: Gateway, fake_engine: FakeEngine) -> None:
    fake_engine.error = RuntimeError("a bug in an engine client")
    s = await fake_gateway.session()
    resp = await fake_gateway.post(CHAT, chat_body(), bearer(s["key"]))
    assert resp.status == 502 and resp.content_type == "application/json"
    assert "bug" not in (await resp.json())["error"]["message"]


# -- 7. engine timeout, pause that never wedges ---------------------------------------------------


async def test_engine_timeout_is_a_provider_shaped_504(tmp_path: Path) -> None:
    gw = await live(FakeEngine(delay_s=5.0), tmp_path, engine_timeout_s=0.2)
    try:
        s = await gw.session()
        resp = await gw.post("/v1/messages", {"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]},
                             {"x-api-key": s["key"]})
        assert resp.status == 504  # the 0.2 s engine timeout cut the call: the engine's 5 s answer would be a 200
        body = await resp.json()
        assert body["type"] == "error" and body["error"]["type"] in ("timeout_error", "api_error", "overloaded_error")
    finally:
        await gw.client.close()


async def test_pause_that_cannot_drain_rolls_back_and_reports(tmp_path: Path) -> None:
    engine = FakeEngine(delay_s=0.8)
    gw = await live(engine, tmp_path)
    try:
        s = await gw.session(session_id="slow")
        hung = asyncio.create_task(gw.post(CHAT, chat_body(), bearer(s["key"])))
        await asyncio.sleep(0.1)
        resp = await gw.client.post("/admin/pause?timeout_s=0.2", headers=gw.admin)
        status = await resp.json()
        assert resp.status == 504 and status["drained"] is False and status["paused"] is False
        assert [c["session_id"] for c in status["running"]] == ["slow"]
        engine.delay_s = 0.0
        assert (await gw.post(CHAT, chat_body(), bearer(s["key"]))).status == 200  # not wedged
        assert (await hung).status == 200
    finally:
        await gw.client.close()


# -- 8. the smaller ones -------------------------------------------------------------------------


async def test_session_id_with_newline_and_oversized_metadata_are_refused(tmp_path: Path) -> None:
    gw = await live(FakeEngine(), tmp_path)
    try:
        resp = await gw.client.post("/sessions", json={"session_id": "abc\n"}, headers=gw.admin)
        assert resp.status == 400 and "invalid session id" in (await resp.json())["error"]["message"]
        resp = await gw.client.post("/sessions", json={"metadata": {"blob": "x" * 100_000}}, headers=gw.admin)
        assert resp.status == 413
        assert len(live_gateway(gw.client).sessions) == 0
    finally:
        await gw.client.close()


@pytest.mark.parametrize("value", ["abc", "nan", "-1", "inf"])
async def test_pause_timeout_must_be_a_number(fake_gateway: Gateway, value: str) -> None:
    resp = await fake_gateway.client.post(f"/admin/pause?timeout_s={value}", headers=fake_gateway.admin)
    assert resp.status == 400 and "timeout_s" in (await resp.json())["error"]["message"]
    assert (await (await fake_gateway.client.get("/admin/status", headers=fake_gateway.admin)).json())["paused"] is False


async def test_engine_ms_excludes_the_pause_wait(fake_gateway: Gateway) -> None:
    s = await fake_gateway.session()
    await fake_gateway.client.post("/admin/pause", headers=fake_gateway.admin)
    call = asyncio.create_task(fake_gateway.post(CHAT, chat_body(), bearer(s["key"])))
    await asyncio.sleep(0.4)
    await fake_gateway.client.post("/admin/resume", headers=fake_gateway.admin)
    assert (await call).status == 200
    (record,) = fake_gateway.store.read(s["session_id"])
    assert record.timings.total_ms >= 350 and record.timings.engine_ms < 100


async def test_embedded_engine_records_the_resumed_weight_version(scripted_engine: EmbeddedEngine, tmp_path: Path) -> None:
    gw = await live(scripted_engine, tmp_path)
    try:
        s = await gw.session()
        await gw.client.post("/admin/pause", headers=gw.admin)
        await gw.client.post("/admin/resume", json={"weight_version": "step-7"}, headers=gw.admin)
        assert (await gw.post(CHAT, chat_body(), bearer(s["key"]))).status == 200
        (record,) = gw.store.read(s["session_id"])
        assert record.weight_version == "step-7"
    finally:
        scripted_engine.version_label = None  # the engine is shared by the whole test session
        await gw.client.close()


async def test_call_abandoned_behind_a_pause_is_not_generated(fake_gateway: Gateway, fake_engine: FakeEngine) -> None:
    s = await fake_gateway.session()
    await fake_gateway.client.post("/admin/pause", headers=fake_gateway.admin)
    url = fake_gateway.client.make_url(CHAT)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(url, json=chat_body(), headers=bearer(s["key"]), timeout=aiohttp.ClientTimeout(total=0.2))
    await asyncio.sleep(0.1)
    await fake_gateway.client.post("/admin/resume", headers=fake_gateway.admin)
    await asyncio.sleep(0.2)
    assert fake_engine.seen == [] and fake_gateway.store.read(s["session_id"]) == []
    assert live_gateway(fake_gateway.client).stats.abandoned == 1


async def test_session_that_cannot_be_persisted_is_not_issued(fake_gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def disk_full(meta: object) -> None:  # test double for a full disk under DIR/sessions
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fake_gateway.store, "write_session_meta", disk_full)
    resp = await fake_gateway.client.post("/sessions", json={"session_id": "nope"}, headers=fake_gateway.admin)
    assert resp.status == 507 and "No space left" in (await resp.json())["error"]["message"]
    assert len(live_gateway(fake_gateway.client).sessions) == 0
