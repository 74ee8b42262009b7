"""``GET /sessions``: the admin's list of this gateway's sessions (never their keys)."""

from __future__ import annotations

from pathlib import Path

from tests.proxy.conftest import FakeEngine, start_gateway


async def test_admin_lists_sessions_without_keys(tmp_path: Path) -> None:
    client, _store = await start_gateway(FakeEngine(), tmp_path, admin_token="t0p")
    admin = {"Authorization": "Bearer t0p"}
    try:
        assert (await (await client.get("/sessions", headers=admin)).json()) == {"sessions": []}
        keys = []
        for sid in ("b", "a"):
            keys.append((await (await client.post("/sessions", json={"session_id": sid, "metadata": {"n": sid}})).json())["key"])
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                 headers={"Authorization": f"Bearer {keys[0]}"})
        assert resp.status == 200
        await client.delete("/sessions/a")
        resp = await client.get("/sessions", headers=admin)
        assert resp.status == 200
        listed = (await resp.json())["sessions"]
        assert [(s["session_id"], s["completions"], s["closed"], s["metadata"]) for s in listed] == [
            ("b", 1, False, {"n": "b"}), ("a", 0, True, {"n": "a"})]
        text = await resp.text()
        assert not any(k in text for k in keys)
        for headers in ({}, {"Authorization": f"Bearer {keys[0]}"}, {"Authorization": "Bearer wrong"}):
            assert (await client.get("/sessions", headers=headers)).status == 401
    finally:
        await client.close()
