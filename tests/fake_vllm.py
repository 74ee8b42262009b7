"""FakeVLLM: a test double of a vLLM OpenAI server (``/v1/models`` + a canned chat completion).

It replays the recorded vLLM 0.33 tool-call response in ``tests/fixtures/engines``, so the gateway's
real VLLMClient can be driven without an inference engine. The real engine paths are covered by
the embedded-engine tests. Importable from a subprocess, with ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

SEEN = web.AppKey("seen", list)  # the bodies the gateway sent
REPLY = Path(__file__).resolve().parent / "fixtures" / "engines" / "vllm_chat_tool_call.json"
MODEL = "qwen3.5-4b"


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
