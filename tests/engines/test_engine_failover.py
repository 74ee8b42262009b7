"""Engines that change under a running rollout, and cancelled calls.

- SGLangClient behind a router double that speaks sgl-router's shapes (tests/fake_engines.py):
  a worker is killed mid-run, the router drops it and registers a replacement (what slime's fault
  tolerance does), and no session loses a turn.
- Cancelling a call in flight: the SGLang client posts ``/abort_request`` for its rid; the vLLM
  client closes the connection (vLLM aborts a request whose client disconnected).
"""

from __future__ import annotations

import asyncio

from fake_engines import MODEL, FakeSGLangRouter

from polar_env.engines.sglang import SGLangClient
from polar_env.engines.simulated import SimulatedEngine
from polar_env.engines.vllm import VLLMClient
from polar_env.records import ChatRequest
from tests.waits import until

USER = [{"role": "user", "content": "hi"}]
SESSIONS, TURNS = 8, 30


async def test_worker_killed_and_replaced_mid_run_loses_no_session() -> None:
    router = await FakeSGLangRouter().start()
    first = await router.add_worker(SimulatedEngine(latency_s=0.05))
    doomed = await router.add_worker(SimulatedEngine(latency_s=0.05))
    client = SGLangClient(model=MODEL, router_url=router.url, refresh_s=0.2)
    done: dict[str, int] = {}

    async def session(i: int) -> None:
        for _ in range(TURNS):
            gen = await client.generate(ChatRequest(messages=USER, extra_body={"session_id": f"s{i}"}))
            assert gen.response_ids
            done[f"s{i}"] = done.get(f"s{i}", 0) + 1

    async def chaos() -> None:
        await until(lambda: doomed.bodies, "a call on the doomed engine", poll_s=0.01)
        await doomed.stop()  # the engine dies; its in-flight calls drop
        await asyncio.sleep(0.3)
        router.remove(doomed.url)  # slime's engine shutdown deletes it from the router
        await asyncio.sleep(0.3)
        await router.add_worker(SimulatedEngine(latency_s=0.05))  # and registers the restarted engine

    try:
        await asyncio.wait_for(asyncio.gather(chaos(), *(session(i) for i in range(SESSIONS))), 60)
        replacement = router.workers[2]
        await session(SESSIONS)  # a new session: the replacement holds no prefix, so it gets it
    finally:
        await client.aclose()
        await router.stop()
    assert done == {f"s{i}": TURNS for i in range(SESSIONS + 1)}  # every session got every turn
    assert doomed.bodies and first.bodies and replacement.bodies  # traffic followed the router's list
    assert client.rediscoveries >= 1
    assert sum(len(w.bodies) for w in router.workers) >= SESSIONS * TURNS


async def test_cancelled_sglang_call_posts_abort_request_for_its_rid() -> None:
    router = await FakeSGLangRouter(SimulatedEngine(latency_s=30.0)).start()
    (worker,) = router.workers
    client = SGLangClient([worker.url], MODEL)
    try:
        call = asyncio.ensure_future(client.generate(ChatRequest(messages=USER)))
        await until(lambda: worker.running, "the engine to start generating", poll_s=0.01)
        call.cancel()
        await until(lambda: worker.aborts, "the abort request", poll_s=0.01)
        (rid,) = [b["rid"] for b in worker.bodies]
        assert worker.aborts == [{"rid": rid}]
        await until(lambda: not worker.running, "the engine to stop generating", poll_s=0.01)
    finally:
        await client.aclose()
        await router.stop()


async def test_cancelled_vllm_call_closes_its_connection() -> None:
    """A raw server that reads the request and never answers: the client's cancellation must
    reach it as a closed connection (vLLM's with_cancellation aborts the request then)."""
    closed = asyncio.Event()
    got_request = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        got_request.set()
        if await reader.read(1 << 16) == b"" or await reader.read() == b"":
            closed.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = VLLMClient(f"http://127.0.0.1:{port}", MODEL)
    try:
        call = asyncio.ensure_future(client.generate(ChatRequest(messages=USER)))
        await asyncio.wait_for(got_request.wait(), 10)
        assert not closed.is_set()
        call.cancel()
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_fixed_worker_list_fails_over_to_the_next_worker() -> None:
    router = await FakeSGLangRouter().start()
    live = await router.add_worker(SimulatedEngine(latency_s=0.0))
    dead = await router.add_worker(SimulatedEngine(latency_s=0.0))
    await dead.stop()
    client = SGLangClient([live.url, dead.url], MODEL)
    try:
        keys = [f"k{i}" for i in range(12)]
        for key in keys:  # some keys hash to the dead worker; every call still lands
            gen = await client.generate(ChatRequest(messages=USER, extra_body={"session_id": key}))
            assert gen.response_ids
        assert len(live.bodies) == len(keys) and client.rediscoveries >= 1
    finally:
        await client.aclose()
        await router.stop()
