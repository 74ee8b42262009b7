"""Test doubles of SGLang workers and of the SGLang router (SGLang Model Gateway / SMG), named
as such. Shapes are read from their sources: the router's worker registry
(lightseekorg/smg ``crates/protocols/src/worker.rs`` ``WorkerListResponse`` / ``WorkerInfo``:
``GET /workers`` → ``{"workers": [{"id", "url", "model_id", "worker_type", "connection_mode",
"runtime_type", "priority", "cost", "is_healthy", "status", "load"}], "total", "stats"}``,
``POST /workers {"url", "worker_type"}``, ``DELETE /workers/{id}``; slime registers and removes its
engines exactly so) and a worker's ``/v1/chat/completions`` (token-id chat shape),
``/abort_request`` (``{"rid"}`` or ``{"abort_all": true}``) and ``/v1/loads`` (``{"loads":
[{"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs"}]}``), which slime's
``abort()`` polls until idle. Each worker answers from a real engine client (embedded or
simulated). The router double is control plane only: it proxies no traffic (Polar posts to
workers directly) and judges health by connecting to each worker, as the router's health
checker does."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from polar_env.records import ChatRequest


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{bound}", bound


class FakeSGLangWorker:
    """One SGLang worker: chat completions from ``engine``, abortable by rid."""

    def __init__(self, engine: Any, weight_version: str = "7") -> None:
        self.engine = engine
        self.weight_version = weight_version
        self.bodies: list[dict[str, Any]] = []
        self.aborts: list[dict[str, Any]] = []
        self.running: dict[str, asyncio.Task[Any]] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeSGLangWorker:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/health", self._health)
        self.runner, self.url, _ = await _serve(app)
        return self

    async def stop(self) -> None:
        """The engine process dies: every connection drops, nothing answers."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _loads(self, request: web.Request) -> web.Response:
        n = len(self.running)
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [
            {"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0, "num_total_reqs": n}]})

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborts.append(body)
        targets = list(self.running) if body.get("abort_all") else [str(body.get("rid"))]
        for rid in targets:
            task = self.running.get(rid)
            if task is not None:
                task.cancel()
        return web.json_response({})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        task = asyncio.ensure_future(self.engine.generate(ChatRequest(
            messages=body["messages"], tools=body.get("tools") or [], temperature=body.get("temperature"),
            top_p=body.get("top_p"), max_tokens=body.get("max_tokens"), prompt_ids=body.get("input_ids"))))
        self.running[rid] = task
        try:
            gen = await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the client went away, not an abort
            return web.json_response({"choices": [{"index": 0, "finish_reason": "abort", "message": {
                "role": "assistant", "content": ""}, "prompt_token_ids": [], "response_token_ids": [],
                "logprobs": {"content": []}}]})
        finally:
            self.running.pop(rid, None)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in gen.message.tool_calls]
        return web.json_response({
            "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": gen.finish_reason,
                         "message": {"role": "assistant", "content": gen.message.content,
                                     "reasoning_content": gen.message.reasoning, "tool_calls": calls},
                         "prompt_token_ids": gen.prompt_ids, "response_token_ids": gen.response_ids,
                         "logprobs": {"content": [{"token": "", "logprob": lp} for lp in gen.response_logprobs]}}],
            "metadata": {"weight_version": self.weight_version},
        })


class FakeSGLangRouter:
    """The router's worker registry. ``FakeSGLangRouter(engine)`` also starts and registers one
    worker backed by ``engine`` (what slime's RolloutManager sets up for one engine)."""

    def __init__(self, engine: Any = None, weight_version: str = "7") -> None:
        self.engine = engine
        self.weight_version = weight_version
        self.workers: list[FakeSGLangWorker] = []
        self.registry: dict[str, dict[str, Any]] = {}  # id → worker spec
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.port = 0

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [b for w in self.workers for b in w.bodies]

    async def start(self) -> FakeSGLangRouter:
        app = web.Application()
        app.router.add_get("/workers", self._list)
        app.router.add_post("/workers", self._create)
        app.router.add_delete("/workers/{worker_id}", self._delete)
        self.runner, self.url, self.port = await _serve(app)
        if self.engine is not None:
            await self.add_worker(self.engine)
        return self

    async def add_worker(self, engine: Any) -> FakeSGLangWorker:
        worker = await FakeSGLangWorker(engine, self.weight_version).start()
        self.workers.append(worker)
        self.register(worker.url)
        return worker

    def register(self, url: str, worker_type: str = "regular") -> str:
        worker_id = uuid.uuid4().hex[:12]
        self.registry[worker_id] = {"id": worker_id, "url": url, "worker_type": worker_type}
        return worker_id

    def remove(self, url: str) -> None:
        for worker_id, spec in list(self.registry.items()):
            if spec["url"] == url:
                del self.registry[worker_id]

    async def stop(self) -> None:
        for w in self.workers:
            await w.stop()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @staticmethod
    async def _healthy(url: str) -> bool:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 0.5)
        except (TimeoutError, OSError):
            return False
        writer.close()
        return True

    async def _list(self, request: web.Request) -> web.Response:
        infos = []
        for spec in self.registry.values():
            healthy = await self._healthy(spec["url"])
            infos.append({**spec, "model_id": "default", "connection_mode": "http", "runtime_type": "sglang",
                          "priority": 50, "cost": 1.0, "is_healthy": healthy,
                          "status": "ready" if healthy else "not_ready", "load": 0})
        kinds = [i["worker_type"] for i in infos]
        return web.json_response({"workers": infos, "total": len(infos), "stats": {
            "total_workers": len(infos), "healthy_workers": sum(i["is_healthy"] for i in infos), "total_models": 1,
            "total_load": 0, "by_type": {k: kinds.count(k) for k in ("regular", "prefill", "decode")}}})

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        worker_id = self.register(str(body["url"]), str(body.get("worker_type") or "regular"))
        return web.json_response({"status": "accepted", "worker_id": worker_id}, status=202)

    async def _delete(self, request: web.Request) -> web.Response:
        if self.registry.pop(request.match_info["worker_id"], None) is None:
            return web.json_response({"error": "worker not found"}, status=404)
        return web.json_response({"status": "accepted"}, status=202)
