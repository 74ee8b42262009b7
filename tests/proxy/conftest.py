from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.proxy.app import GatewayConfig, build_app
from polar_env.proxy.capture import CaptureStore
from polar_env.records import AssistantMessage, ChatRequest, Generation


@dataclass
class FakeEngine:
    """Test double implementing EngineClient: returns a fixed Generation or raises, and records
    every ChatRequest it receives. Real-engine behaviour is covered with EmbeddedEngine."""

    name: str = "fake"
    reply: Callable[[ChatRequest], Generation] | None = None
    error: Exception | None = None
    delay_s: float = 0.0
    seen: list[ChatRequest] = field(default_factory=list)

    async def generate(self, request: ChatRequest) -> Generation:
        self.seen.append(request)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        if self.reply is not None:
            return self.reply(request)
        return Generation(
            message=AssistantMessage(content="ok"), prompt_ids=[1, 2, 3], response_ids=[4, 5],
            response_logprobs=[-0.5, -0.25], finish_reason="stop", model="fake", engine="fake",
        )

    async def aclose(self) -> None:
        return None


class Gateway:
    """A live gateway (aiohttp TestServer on 127.0.0.1) plus helpers to open sessions and post."""

    def __init__(self, client: TestClient, store: CaptureStore) -> None:
        self.client = client
        self.store = store

    async def session(self, **body: object) -> dict:
        resp = await self.client.post("/sessions", json=body)
        assert resp.status == 201, await resp.text()
        return await resp.json()

    async def post(self, path: str, body: object, headers: dict[str, str] | None = None, raw: bytes | None = None):
        data = raw if raw is not None else orjson.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        return await self.client.post(path, data=data, headers=hdrs)


async def start_gateway(engine: object, tmp_path: Path, **config: object) -> tuple[TestClient, CaptureStore]:
    store = CaptureStore(tmp_path / "capture")
    app = build_app(engine, store, GatewayConfig(engine_model="polar-tiny-qwen3", **config))  # type: ignore[arg-type]
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, store


@pytest.fixture
async def scripted_gateway(scripted_engine: EmbeddedEngine, tmp_path: Path):
    client, store = await start_gateway(scripted_engine, tmp_path)
    try:
        yield Gateway(client, store)
    finally:
        await client.close()


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def fake_gateway(fake_engine: FakeEngine, tmp_path: Path):
    client, store = await start_gateway(fake_engine, tmp_path, max_body_bytes=64 * 1024)
    try:
        yield Gateway(client, store)
    finally:
        await client.close()
