"""An engine request's body is not held while the engine generates (polar_env/engines/base.py).

aiohttp keeps a ``bytes`` body on its request object until the reply's headers arrive: at 100k
tokens that is 1.65 MB per call for the whole generation, times the calls in flight. The body is
sent with its length, not chunked, and once the engine has read it nothing but the caller's own
name refers to it.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from polar_env.engines.base import new_session, request_json


async def test_the_body_is_sent_whole_and_released_before_the_reply() -> None:
    got = asyncio.Event()
    release = asyncio.Event()
    seen: dict[str, object] = {}

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        seen.update(length=len(body), content_length=request.headers.get("Content-Length"),
                    chunked=request.headers.get("Transfer-Encoding"), head=body[:9])
        got.set()
        await release.wait()  # the engine generating
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    payload = b'{"ids":[' + b"1," * 2_000_000 + b"1]}"  # 4 MB: more than one socket send
    async with TestServer(app, host="127.0.0.1") as server:
        http = new_session()
        try:
            call = asyncio.create_task(request_json(http, str(server.make_url("/v1/chat/completions")), payload=payload,
                                                    engine="test", timeout_s=30))
            arrived = asyncio.ensure_future(got.wait())
            await asyncio.wait({call, arrived}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            if call.done():
                call.result()  # a send that failed says why (aiohttp warns of large bytes bodies), not a timeout
            assert got.is_set(), "the engine never got the request"
            await asyncio.sleep(0.05)  # the client's side of the send has returned
            # this test's name and getrefcount's argument: aiohttp holds no reference while it waits
            assert sys.getrefcount(payload) == 2
            release.set()
            assert await asyncio.wait_for(call, 30) == {"ok": True}
        finally:
            release.set()
            await http.close()
    assert seen == {"length": len(payload), "content_length": str(len(payload)), "chunked": None, "head": b'{"ids":[1'}


async def test_a_get_sends_no_body() -> None:
    seen: dict[str, int] = {}

    async def models(request: web.Request) -> web.Response:
        seen["length"] = len(await request.read())
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
        data = await request_json(http, str(server.make_url("/v1/models")), engine="test", timeout_s=30, method="GET")
    assert data == {"data": []} and seen["length"] == 0
