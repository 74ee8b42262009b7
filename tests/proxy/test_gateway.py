"""The Gateway object: listening and closing (in-flight captures drained before the journal
closes), the events hook, and engine abort on cancel/close — including SGLang's /abort_request
against a local HTTP server that holds the generation until it is aborted."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from polar_env.engines.sglang import SGLangClient
from polar_env.journal.store import JournalStore
from polar_env.observe.events import GatewayEvent
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway
from tests.conftest import SHELL_TOOL
from tests.proxy.conftest import FakeEngine
from tests.waits import until

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "Run it."}], "tools": [SHELL_TOOL]}


async def test_start_serves_tcp_and_the_sandbox_socket_and_emits_events(tmp_path: Path) -> None:
    events: list[GatewayEvent] = []
    gw = Gateway(FakeEngine(), JournalStore(tmp_path), GatewayConfig(engine_model="m"))
    unsubscribe = gw.events.subscribe(events.append)
    gw.events.subscribe(lambda e: 1 / 0)  # a broken subscriber never fails a request
    sock_dir = Path(tempfile.mkdtemp(prefix="pgw-"))
    await gw.start("127.0.0.1", 0, sock_dir / "gw.sock")
    try:
        assert gw.url and gw.url.startswith("http://127.0.0.1:") and gw.socket == sock_dir / "gw.sock"
        session = gw.open_session("a")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gw.url}{CHAT}", json=BODY, headers={"Authorization": f"Bearer {session.key}"}) as resp:
                assert resp.status == 200
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(gw.socket))) as http:
            async with http.get("http://gw/admin/status") as resp:
                assert resp.status == 404  # provider routes only on the sandbox socket
        assert await gw.pause(1.0)
        await gw.resume("7")
        gw.close_session("a")
        unsubscribe()
        gw.open_session("b")
    finally:
        await gw.aclose()
    kinds = [e.kind for e in events]
    assert kinds == ["session_opened", "call_recorded", "paused", "resumed", "session_closed"]
    recorded = events[1]
    assert recorded.session_id == "a" and recorded.data["seq"] == 0 and recorded.data["response_tokens"] == 2
    assert events[3].data["weight_version"] == "7"


async def test_aclose_drains_a_capture_whose_client_left(tmp_path: Path) -> None:
    engine = FakeEngine(delay_s=2.0)  # the client gives up well before the engine answers, even on a loaded machine
    store = JournalStore(tmp_path)
    gw = await Gateway(engine, store, GatewayConfig(engine_model="m")).start()
    session = gw.open_session("s")
    async with aiohttp.ClientSession() as http:
        try:
            await http.post(f"{gw.url}{CHAT}", json=BODY, headers={"Authorization": f"Bearer {session.key}"},
                            timeout=aiohttp.ClientTimeout(total=0.5))
        except TimeoutError:
            pass
    assert len(gw.in_flight) == 1  # the generation goes on without its client
    await gw.aclose()
    assert not gw.in_flight
    assert [r.seq for r in JournalStore(tmp_path).read("s")] == [0]  # written before the store closed


async def test_closing_a_session_aborts_its_engine_call_and_marks_the_journal(tmp_path: Path) -> None:
    cancelled = asyncio.Event()

    class SlowEngine(FakeEngine):
        async def generate(self, request):  # type: ignore[no-untyped-def]
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("not reached")

    store = JournalStore(tmp_path)
    gw = await Gateway(SlowEngine(), store, GatewayConfig(engine_model="m")).start()
    try:
        session = gw.open_session("s")
        async with aiohttp.ClientSession() as http:
            call = asyncio.ensure_future(http.post(f"{gw.url}{CHAT}", json=BODY,
                                                   headers={"Authorization": f"Bearer {session.key}"}))
            await asyncio.sleep(0.2)
            gw.close_session("s", reason="cancelled")
            resp = await asyncio.wait_for(call, 5)
            assert resp.status == 503 and "aborted" in (await resp.json())["error"]["message"]
        await asyncio.wait_for(cancelled.wait(), 1)
    finally:
        await gw.aclose()
    assert store.read("s") == []
    (mark,) = store.events("s")
    assert mark["event"] == "aborted" and mark["reason"] == "cancelled" and mark["provider_api"] == "openai_chat"
    assert gw.stats.aborted == 1


async def test_sglang_call_is_aborted_with_its_rid(tmp_path: Path) -> None:
    seen: dict[str, str] = {}
    held = asyncio.Event()

    async def generate(request: web.Request) -> web.Response:
        seen["generate_rid"] = (await request.json())["rid"]
        held.set()
        await asyncio.sleep(30)  # until the client goes away
        return web.json_response({})

    async def abort(request: web.Request) -> web.Response:
        seen["abort_rid"] = (await request.json())["rid"]
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    server = TestServer(app)
    await server.start_server()
    engine = SGLangClient([str(server.make_url("")).rstrip("/")], "m", mode="generate")
    engine._render = lambda request: asyncio.sleep(0, [1, 2, 3])  # type: ignore[method-assign]
    gw = await Gateway(engine, JournalStore(tmp_path), GatewayConfig(engine_model="m")).start()
    try:
        session = gw.open_session("s")
        async with aiohttp.ClientSession() as http:
            call = asyncio.ensure_future(http.post(f"{gw.url}{CHAT}", json=BODY,
                                                   headers={"Authorization": f"Bearer {session.key}"}))
            await asyncio.wait_for(held.wait(), 5)
            assert gw.abort_session("s", "stopped early") == 1
            assert (await asyncio.wait_for(call, 5)).status == 503
        await until(lambda: "abort_rid" in seen, "the engine abort for the aborted session's call")
    finally:
        await gw.aclose()
        await server.close()
    assert seen["abort_rid"] == seen["generate_rid"]
