"""The gateway application: routes from the provider table, one request pipeline for all of them.

Per request: read and check the body → resolve the session from its key → provider ``to_chat`` →
quirks and sampling overrides → engine call (through the pause gate) → record journaled → provider
reply (JSON or the provider's full SSE sequence). Engines are always called non-streaming so token
data is complete; streams are synthesized from the finished generation. Any failure is answered in
the provider's own error shape; nothing is recorded for a request that was refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from polar_env.engines.base import EngineClient
from polar_env.errors import (
    EngineError,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
    RequestError,
)
from polar_env.proxy.capture import CaptureStore
from polar_env.proxy.continuation import Continuation
from polar_env.proxy.gate import EngineGate
from polar_env.proxy.providers import PROVIDERS
from polar_env.proxy.providers.base import Provider, Reply
from polar_env.proxy.quirks import apply_quirks
from polar_env.proxy.sessions import Session, SessionRegistry, request_keys
from polar_env.qwen.template import QWEN35, TemplateQuirks
from polar_env.qwen.tokenizer import load_tokenizer
from polar_env.records import ChatRequest, CompletionRecord, Generation, ProviderAPI, Timings


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    engine_model: str
    public_url: str | None = None  # what harnesses should use; defaults to the request's Host
    max_body_bytes: int = 32 * 1024 * 1024  # a 100k-token Claude Code history is ~1-2 MB
    temperature: float | None = None  # when set, overrides the harness's value (trainer's choice)
    top_p: float | None = None
    max_tokens_cap: int | None = None
    admin_token: str | None = None
    template: TemplateQuirks = QWEN35  # the engine's chat template; continuation mode renders with it
    continuation: bool = False  # default for new sessions (POST /sessions may override)


ENGINE = web.AppKey("engine", EngineClient)
STORE = web.AppKey("store", CaptureStore)
SESSIONS = web.AppKey("sessions", SessionRegistry)
GATE = web.AppKey("gate", EngineGate)
CONFIG = web.AppKey("config", GatewayConfig)

_SAMPLING_EXTRAS = frozenset({"top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})
_JSON_TYPES = ("application/json", "text/json", "application/x-ndjson", "")


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def engine_status(exc: EngineError) -> int:
    """The status a harness sees for an engine failure: its own fault (4xx) or ours (5xx)."""
    if isinstance(exc, EngineTimeout):
        return 504
    if isinstance(exc, EngineUnavailable):
        return 503
    if isinstance(exc, EngineHTTPError) and exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
        return 400  # e.g. prompt longer than the context: the request's fault, not a gateway failure
    return 502


async def read_json(request: web.Request) -> dict[str, Any]:
    ctype = request.content_type.lower() if request.headers.get("Content-Type") else ""
    if ctype not in _JSON_TYPES:
        raise RequestError(f"Content-Type must be application/json, got {ctype!r}", status=415)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise RequestError(f"request body exceeds {request.app[CONFIG].max_body_bytes} bytes", status=413) from exc
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def provider_handler(provider: Provider) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await complete(request, provider)
        except RequestError as exc:
            return json_response(provider.error_body(exc.status, exc.message), exc.status)
        except EngineError as exc:
            status = engine_status(exc)
            return json_response(provider.error_body(status, f"engine error: {exc.message}"), status)

    return handle


_IN_FLIGHT: set[asyncio.Future[Generation]] = set()  # strong references to shielded captures


async def generate_and_record(
    app: web.Application,
    session: Session,
    provider: Provider,
    body: dict[str, Any],
    chat: ChatRequest,
    engine_chat: ChatRequest,
    notes: list[str],
    received: float,
    started: float,
) -> Generation:
    """Call the engine through the pause gate and journal the completion before returning it."""
    engine_started = time.perf_counter()
    try:
        async with app[GATE].call() as weight_version:
            generation = await app[ENGINE].generate(engine_chat)
    except EngineError:
        session.errors += 1
        raise
    if session.continuation is not None:
        session.continuation.remember(chat, generation)
    engine_ms = (time.perf_counter() - engine_started) * 1000
    # Generation and ChatRequest are validated already; construct without re-validating the
    # (possibly 100k-long) token lists on the hot path.
    record = CompletionRecord.model_construct(
        **{name: getattr(generation, name) for name in type(generation).model_fields},
        session_id=session.id,
        seq=session.take_seq(),
        provider_api=provider.API,
        provider_request=body,
        chat_request=chat,
        timings=Timings(received_at=received, engine_ms=engine_ms, total_ms=(time.perf_counter() - started) * 1000),
        notes=notes,
    )
    if record.weight_version is None:
        record.weight_version = weight_version  # engines that do not report one: the gate's version
    app[STORE].append(record)  # before the reply: an answered call is never lost
    return generation


def trainer_overrides(chat: ChatRequest, config: GatewayConfig, notes: list[str]) -> dict[str, Any]:
    """What the gateway's configuration overrides in every request: the served model, and the
    sampling parameters when the trainer owns them (harness extras that reshape the distribution
    are dropped then too)."""
    updates: dict[str, Any] = {"model": config.engine_model}
    if config.temperature is not None:
        updates["temperature"] = config.temperature
    if config.top_p is not None:
        updates["top_p"] = config.top_p
    if config.temperature is not None or config.top_p is not None:
        dropped = sorted(k for k in chat.extra_body if k in _SAMPLING_EXTRAS)
        if dropped:
            updates["extra_body"] = {k: v for k, v in chat.extra_body.items() if k not in _SAMPLING_EXTRAS}
            notes.append(f"dropped harness sampling params {dropped}")
    if config.max_tokens_cap is not None:
        updates["max_tokens"] = min(chat.max_tokens or config.max_tokens_cap, config.max_tokens_cap)
    return updates


async def complete(request: web.Request, provider: Provider) -> web.StreamResponse:
    received = time.time()
    started = time.perf_counter()
    app = request.app
    config = app[CONFIG]
    body = await read_json(request)
    session = app[SESSIONS].resolve(request_keys(request.headers, request.query), request.match_info.get("session_id"))
    inbound = provider.to_chat(body, request.match_info)
    notes = inbound.notes
    updates = trainer_overrides(inbound.chat, config, notes)
    chat = apply_quirks(inbound.chat, notes).model_copy(update=updates)
    # The session id lets the engine client keep a session on one worker (prefix-cache affinity).
    engine_update: dict[str, Any] = {"extra_body": {**chat.extra_body, "session_id": session.id}}
    if session.continuation is not None:
        prompt_ids, note = session.continuation.plan(chat)
        notes.append(note)
        if prompt_ids is not None:
            engine_update["prompt_ids"] = prompt_ids
    engine_chat = chat.model_copy(update=engine_update)

    # The engine call and the capture run as their own task, shielded: a harness that disconnects
    # (which cancels this handler) must not cancel a generation that is already paid for, nor
    # lose its record.
    capture = asyncio.ensure_future(
        generate_and_record(app, session, provider, body, chat, engine_chat, notes, received, started)
    )
    _IN_FLIGHT.add(capture)
    capture.add_done_callback(_IN_FLIGHT.discard)
    generation = await asyncio.shield(capture)

    reply = Reply(generation, inbound.model or config.engine_model, uuid.uuid4().hex, int(received), inbound.options)
    if not inbound.stream:
        return json_response(provider.from_chat(reply))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        await resp.write(b"".join(provider.stream_events(reply)))
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client went away; the record is already on disk
    return resp


# -- side endpoints harnesses call -------------------------------------------------------------


async def root(request: web.Request) -> web.Response:
    """Claude Code preconnects with ``HEAD /``."""
    return json_response({"status": "ok", "service": "polar-env gateway"})


async def models(request: web.Request) -> web.Response:
    """One listing that satisfies both the OpenAI and the Anthropic model-list clients."""
    name = request.app[CONFIG].engine_model
    card = {"id": name, "object": "model", "type": "model", "display_name": name, "created": 0,
            "created_at": "1970-01-01T00:00:00Z", "owned_by": "polar_env"}
    return json_response({"object": "list", "data": [card], "has_more": False, "first_id": name, "last_id": name})


async def gemini_models(request: web.Request) -> web.Response:
    name = request.app[CONFIG].engine_model
    return json_response({"models": [{"name": f"models/{name}", "displayName": name,
                                      "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]}]})


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic ``/v1/messages/count_tokens``: the engine-side prompt length via our Qwen3.5 render."""
    from polar_env.proxy.providers import anthropic
    from polar_env.qwen.template import render
    from polar_env.qwen.tokenizer import load_tokenizer

    provider = PROVIDERS[ProviderAPI.ANTHROPIC]
    try:
        body = await read_json(request)
        request.app[SESSIONS].resolve(request_keys(request.headers, request.query), request.match_info.get("session_id"))
        chat = anthropic.count_tokens_chat(body)
        notes: list[str] = []
        chat = apply_quirks(chat, notes)
        thinking = chat.chat_template_kwargs.get("enable_thinking", True) is not False
        text = render(chat.messages, chat.tools, enable_thinking=thinking, quirks=request.app[CONFIG].template)
        ids = load_tokenizer().encode(text)
    except RequestError as exc:
        return json_response(provider.error_body(exc.status, exc.message), exc.status)
    return json_response({"input_tokens": len(ids)})


async def refuse_websocket(request: web.Request) -> web.Response:
    """Codex's built-in provider tries a Responses websocket first; 426 makes it fall back to POST."""
    return json_response({"error": {"message": "websocket transport is not supported; use HTTP POST",
                                     "type": "invalid_request_error", "param": None, "code": None}}, 426)


def guess_provider(request: web.Request) -> Provider:
    """For requests no route matched: answer in the shape the caller most likely speaks."""
    path, headers = request.path, request.headers
    if "anthropic-version" in headers or path.endswith("/messages"):
        api = ProviderAPI.ANTHROPIC
    elif "x-goog-api-key" in headers or ("/models/" in path and ":" in path):
        api = ProviderAPI.GEMINI
    elif path.endswith("/responses"):
        api = ProviderAPI.OPENAI_RESPONSES
    else:
        api = ProviderAPI.OPENAI_CHAT
    return PROVIDERS.get(api, PROVIDERS[ProviderAPI.OPENAI_CHAT])


async def not_found(request: web.Request) -> web.Response:
    provider = guess_provider(request)
    message = f"no route for {request.method} {request.path}"
    return json_response(provider.error_body(404, message), 404)


# -- sessions and admin ------------------------------------------------------------------------


def _plain_error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status)


def base_url(request: web.Request) -> str:
    configured = request.app[CONFIG].public_url
    return (configured or f"{request.scheme}://{request.host}").rstrip("/")


def session_env(base: str, session_id: str, key: str, model: str) -> dict[str, str]:
    """What each harness needs to reach this session (harnesses.md §2–§7)."""
    return {
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_KEY": key,
        "OPENAI_MODEL": model,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": model,
        "GOOGLE_GEMINI_BASE_URL": base,
        "GEMINI_API_KEY": key,
        "POLAR_SESSION_ID": session_id,
        "POLAR_API_KEY": key,
        "POLAR_MODEL": model,
    }


async def create_session(request: web.Request) -> web.Response:
    try:
        body = await read_json(request) if request.can_read_body else {}
        session_id = body.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise RequestError("'session_id' must be a string")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise RequestError("'metadata' must be an object")
        config = request.app[CONFIG]
        wants = body.get("continuation", config.continuation)
        if not isinstance(wants, bool):
            raise RequestError("'continuation' must be a boolean")
        continuation = Continuation(load_tokenizer(), config.template) if wants else None
        session = request.app[SESSIONS].create(session_id, metadata, continuation)
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    base = base_url(request)
    model = request.app[CONFIG].engine_model
    return json_response({
        "session_id": session.id,
        "key": session.key,
        "continuation": session.continuation is not None,
        "model": model,
        "base_url": base,
        "base_urls": {"anthropic": base, "openai": f"{base}/v1", "gemini": base},
        "env": session_env(base, session.id, session.key, model),
    }, 201)


def session_summary(session: Session) -> dict[str, Any]:
    """What the session routes show about a session (never its key)."""
    return {"session_id": session.id, "created_at": session.created_at, "closed": session.closed,
            "continuation": session.continuation is not None,
            "completions": session.next_seq, "errors": session.errors, "metadata": session.metadata}


def _session_info(request: web.Request) -> dict[str, Any]:
    return session_summary(request.app[SESSIONS].get(request.match_info["session_id"]))


async def list_sessions(request: web.Request) -> web.Response:
    """Admin: every session this gateway process knows, oldest first."""
    if not _admin_allowed(request):
        return _plain_error(401, "admin token required")
    sessions = sorted(request.app[SESSIONS], key=lambda s: s.created_at)
    return json_response({"sessions": [session_summary(s) for s in sessions]})


async def get_session(request: web.Request) -> web.Response:
    try:
        return json_response(_session_info(request))
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)


async def session_completions(request: web.Request) -> web.Response:
    """The session's journal, read back from disk (what a trainer or builder consumes)."""
    session_id = request.match_info["session_id"]
    try:
        request.app[SESSIONS].get(session_id)
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    records = request.app[STORE].read(session_id)
    body = b'{"session_id":' + orjson.dumps(session_id) + b',"completions":[' + b",".join(r.to_json() for r in records) + b"]}"
    return web.Response(body=body, content_type="application/json")


async def delete_session(request: web.Request) -> web.Response:
    try:
        info = _session_info(request)
        request.app[SESSIONS].close(request.match_info["session_id"])
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    return json_response({**info, "closed": True})


def _admin_allowed(request: web.Request) -> bool:
    token = request.app[CONFIG].admin_token
    return token is None or request.headers.get("Authorization", "") == f"Bearer {token}"


async def admin_pause(request: web.Request) -> web.Response:
    if not _admin_allowed(request):
        return _plain_error(401, "admin token required")
    timeout_s = float(request.query.get("timeout_s", "600"))
    drained = await request.app[GATE].pause(timeout_s)
    return json_response({**request.app[GATE].status(), "drained": drained}, 200 if drained else 504)


async def admin_resume(request: web.Request) -> web.Response:
    if not _admin_allowed(request):
        return _plain_error(401, "admin token required")
    version = None
    if request.can_read_body:
        try:
            body = await read_json(request)
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)
        if body.get("weight_version") is not None:
            version = str(body["weight_version"])
    await request.app[GATE].resume(version)
    return json_response(request.app[GATE].status())


async def admin_status(request: web.Request) -> web.Response:
    return json_response({**request.app[GATE].status(), "sessions": len(request.app[SESSIONS])})


# -- assembly ----------------------------------------------------------------------------------


def build_app(engine: EngineClient, store: CaptureStore, config: GatewayConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    app[ENGINE] = engine
    app[STORE] = store
    app[SESSIONS] = SessionRegistry(store)
    app[GATE] = EngineGate()
    app[CONFIG] = config

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        yield
        await engine.aclose()
        store.close()

    app.cleanup_ctx.append(lifetime)
    router = app.router
    for prefix in ("", "/s/{session_id}"):
        for provider in PROVIDERS.values():
            for route in provider.ROUTES:
                router.add_route(route.method, prefix + route.path, provider_handler(provider))
        router.add_post(prefix + "/v1/messages/count_tokens", count_tokens)
        router.add_get(prefix + "/v1/models", models)
        router.add_get(prefix + "/models", models)
        router.add_get(prefix + "/v1beta/models", gemini_models)
        router.add_get(prefix + "/v1/responses", refuse_websocket)
        router.add_get(prefix + "/responses", refuse_websocket)
    router.add_get("/", root)  # also answers HEAD
    router.add_get("/health", root)
    router.add_post("/sessions", create_session)
    router.add_get("/sessions", list_sessions)
    router.add_get("/sessions/{session_id}", get_session)
    router.add_get("/sessions/{session_id}/completions", session_completions)
    router.add_delete("/sessions/{session_id}", delete_session)
    router.add_post("/admin/pause", admin_pause)
    router.add_post("/admin/resume", admin_resume)
    router.add_get("/admin/status", admin_status)
    router.add_route("*", "/{tail:.*}", not_found)
    return app
