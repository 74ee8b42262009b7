"""Test doubles of inference servers, named as such: the one module the engine-client tests share.

- ``ScriptedEngine``: any engine, answering each path with a canned reply and recording what it
  was sent (``GET /version`` as vLLM's when ``version`` is set; ``/metrics`` from ``metrics``).
- ``fake_vllm_app``: FakeVLLM, a vLLM OpenAI server replaying the recorded vLLM 0.33 tool-call
  response in ``tests/fixtures/engines`` (``/v1/models`` + chat). Importable from a subprocess,
  with ``tests/`` on ``sys.path``.
- ``PrefixCacheVLLM``: FakeVLLM with a prefix cache: token-in echoes the ids, each reply reports
  ``usage.prompt_tokens_details.cached_tokens`` (the longest block-aligned prefix of an earlier
  prompt or prompt + reply, as vLLM's block cache finds it) and ``/metrics`` carries vLLM's
  ``vllm:prefix_cache_{queries,hits}_total``.
- ``FakeSGLangWorker`` / ``FakeSGLangRouter``: SGLang workers and the router's worker registry
  (SGLang Model Gateway / SMG). Shapes from their sources: ``GET /workers`` →
  ``{"workers": [{"id", "url", "model_id", "worker_type", "connection_mode", "runtime_type",
  "priority", "cost", "is_healthy", "status", "load"}], "total", "stats"}`` (lightseekorg/smg
  ``crates/protocols/src/worker.rs``), ``POST /workers {"url", "worker_type"}``,
  ``DELETE /workers/{id}`` (slime registers and removes its engines so); a worker's
  ``/v1/chat/completions`` (token-id chat shape), ``/abort_request`` (``{"rid"}`` or
  ``{"abort_all": true}``) and ``/v1/loads``, which slime's ``abort()`` polls until idle. Each
  worker answers from a real engine client (embedded or simulated). The router double is control
  plane only: it proxies no traffic (Polar posts to workers directly) and judges health by
  connecting to each worker, as the router's health checker does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any, Self

from aiohttp import web
from aiohttp.test_utils import TestServer

from polar_env.records import ChatRequest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "engines"
SEEN = web.AppKey("seen", list)  # the bodies the gateway sent
REPLY = FIXTURES / "vllm_chat_tool_call.json"
MODEL = "qwen3.5-4b"


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{bound}", bound


class _Served:
    """A double served on 127.0.0.1 by aiohttp: ``routes`` says what it answers."""

    runner: web.AppRunner | None = None
    url = ""

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> Self:
        app = web.Application()
        self.routes(app)
        self.runner, self.url, _ = await _serve(app)
        return self

    async def stop(self) -> None:
        """The engine process dies: every connection drops, nothing answers."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


# ---- any engine, scripted ----------------------------------------------------------------------
class ScriptedEngine:
    """Answers each path with a canned reply and records (method, path, json body) of the calls."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[tuple[str, str, Any]] = []
        self.raw: list[bytes] = []  # the request bodies as sent
        self.replies: dict[str, tuple[int, bytes]] = {}
        self.hang_paths: set[str] = set()
        self.release = asyncio.Event()
        self.version: str | None = None  # what GET /version answers ({"version": ...}); None: 404, as a non-vLLM server
        self.version_gets = 0  # kept out of ``requests``: those are the engine calls
        self.metrics = ""  # the Prometheus text GET /metrics answers ("": 404); not recorded either
        self._server: TestServer | None = None

    def reply(self, path: str, body: Any, status: int = 200) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.replies[path] = (status, raw)

    @property
    def bodies(self) -> list[Any]:
        return [body for _, _, body in self.requests]

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/version":
            self.version_gets += 1
            if self.version is None:
                return web.json_response({"detail": "Not Found"}, status=404)
            return web.json_response({"version": self.version})
        if request.path == "/metrics":
            return web.Response(text=self.metrics, status=200 if self.metrics else 404)
        raw = await request.read()
        self.raw.append(raw)
        self.requests.append((request.method, request.path, json.loads(raw) if raw else None))
        if request.path in self.hang_paths:
            await self.release.wait()
        status, body = self.replies.get(request.path, (404, b'{"error": {"message": "no such route"}}'))
        return web.Response(status=status, body=body, content_type="application/json")

    async def start(self) -> ScriptedEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self.url = f"http://127.0.0.1:{self._server.port}"
        return self

    async def close(self) -> None:
        self.release.set()
        if self._server is not None:
            await self._server.close()


def load_fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return loaded


# ---- vLLM ----------------------------------------------------------------------------------------
def fake_vllm_app(models: tuple[str, ...] = (MODEL,)) -> web.Application:
    body = REPLY.read_bytes()
    seen: list[dict[str, object]] = []

    async def list_models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

    async def chat(request: web.Request) -> web.Response:
        sent = await request.json()
        seen.append(sent)
        if sent.get("model") not in models:  # what vLLM answers for an unknown model name
            return web.json_response({"error": {"message": f"The model `{sent.get('model')}` does not exist.",
                                                "type": "NotFoundError", "code": 404}}, status=404)
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", chat)
    app[SEEN] = seen
    return app


class PrefixCacheVLLM(_Served):
    """FakeVLLM with a block prefix cache of ``capacity`` sequences (LRU), for routing tests."""

    def __init__(self, block: int = 16, capacity: int = 64, response_ids: tuple[int, ...] = (7, 8, 9)) -> None:
        self.block, self.capacity, self.response_ids = block, capacity, list(response_ids)
        self.cached: list[list[int]] = []  # most recently used last
        self.queries = self.hits = 0
        self.sessions: list[str] = []  # the session id of each call, in order

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)

    def hit(self, ids: list[int]) -> int:
        best, found = 0, -1
        for i, seq in enumerate(self.cached):
            n = 0
            for a, b in zip(seq, ids, strict=False):
                if a != b:
                    break
                n += 1
            n = min(n, len(ids) - 1) // self.block * self.block  # the last token is always computed
            if n > best:
                best, found = n, i
        if found >= 0:
            self.cached.append(self.cached.pop(found))
        return best

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.sessions.append(str(body.get("session_id")))
        ids = list(body["kv_transfer_params"]["prompt_token_ids"])
        cached = self.hit(ids)
        self.queries += len(ids)
        self.hits += cached
        self.cached.append(ids + self.response_ids)
        del self.cached[:-self.capacity]
        reply = load_fixture("vllm_chat_tool_call.json")
        reply["prompt_token_ids"] = ids
        choice = reply["choices"][0]
        choice["token_ids"] = self.response_ids
        choice["logprobs"] = {"content": [{"token": "", "logprob": -0.5} for _ in self.response_ids]}
        reply["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(self.response_ids),
                          "total_tokens": len(ids) + len(self.response_ids),
                          "prompt_tokens_details": {"cached_tokens": cached}}
        return web.json_response(reply)

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = '{engine="0",model_name="m"}'
        return web.Response(text=(
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{labels} {float(self.queries)}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{labels} {float(self.hits)}\n"))

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


# ---- SGLang --------------------------------------------------------------------------------------
class FakeSGLangWorker(_Served):
    """One SGLang worker: chat completions from ``engine``, abortable by rid."""

    def __init__(self, engine: Any, weight_version: str = "7") -> None:
        self.engine = engine
        self.weight_version = weight_version
        self.bodies: list[dict[str, Any]] = []
        self.aborts: list[dict[str, Any]] = []
        self.running: dict[str, asyncio.Task[Any]] = {}

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/health", self._health)

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
