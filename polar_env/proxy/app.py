"""The gateway application: routes from the provider table, one request pipeline for all of them.

Per request: read and check the body → resolve the session from its key → provider ``to_chat`` →
quirks and sampling overrides → engine call (through the pause gate) → record journaled → provider
reply (JSON or the provider's full SSE sequence). Engines are always called non-streaming so token
data is complete; streams are synthesized from the finished generation. Any failure is answered in
the provider's own error shape; nothing is recorded for a request that was refused.

Control plane. ``POST /sessions``, ``/admin/*`` and the session routes need the admin token
(``Authorization: Bearer``), which is always set: ``build_app`` generates one in memory when the
config has none, readable as ``app[CONFIG].admin_token``. A session's own key also opens its
``GET /sessions/{id}`` and ``…/completions``. Sandboxes never see the control plane at all: they
are served ``build_provider_app(app)``, a second application on the same state that has only the
provider routes (see ``polar_env/runtimes/relay.py`` for why the filter lives here).

Validation happens before the engine call: a body that cannot be recorded (nested too deep), an
ill-typed field or a bad parameter is a provider-shaped 4xx and never reaches the engine. What
the engine returns is checked too (finite logprobs); the record is written whole before the reply
or the request fails with a provider-shaped 5xx. Anything unexpected still answers in the
provider's JSON shape (500), never aiohttp's plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from polar_env.engines.base import EngineClient
from polar_env.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
    PolarError,
    RequestError,
)
from polar_env.observe.metrics import install_gateway_metrics, observe_call, share_gateway_metrics
from polar_env.proxy.admin import bearer_token, new_admin_token, token_matches
from polar_env.proxy.capture import CaptureError, CaptureStore, JournalError
from polar_env.proxy.continuation import Continuation
from polar_env.proxy.gate import EngineGate
from polar_env.proxy.providers import PROVIDERS
from polar_env.proxy.providers.base import Provider, Reply
from polar_env.proxy.quirks import apply_quirks
from polar_env.proxy.sessions import Session, SessionRegistry, request_keys
from polar_env.proxy.validate import check_messages
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
    admin_token: str | None = None  # None: build_app generates one (app[CONFIG].admin_token)
    template: TemplateQuirks = QWEN35  # the engine's chat template; continuation mode renders with it
    continuation: bool = False  # default for new sessions (POST /sessions may override)
    engine_timeout_s: float = 1800.0  # per engine call; past it the harness gets a 504
    session_idle_s: float | None = 24 * 3600.0  # open sessions unused this long are closed; None: never


ENGINE = web.AppKey("engine", EngineClient)
STORE = web.AppKey("store", CaptureStore)
SESSIONS = web.AppKey("sessions", SessionRegistry)
GATE = web.AppKey("gate", EngineGate)
CONFIG = web.AppKey("config", GatewayConfig)
STATS = web.AppKey("stats", dict)

log = logging.getLogger("polar_env.gateway")

_SAMPLING_EXTRAS = frozenset({"top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})
_JSON_TYPES = ("application/json", "text/json", "application/x-ndjson", "")


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class ClientGone(PolarError):
    """The harness disconnected while its call waited at the pause gate: nothing is generated."""


def engine_status(exc: EngineError) -> int:
    """The status a harness sees for an engine failure: its own fault (4xx) or ours (5xx)."""
    if isinstance(exc, EngineTimeout):
        return 504
    if isinstance(exc, EngineUnavailable):
        return 503
    if isinstance(exc, EngineHTTPError) and exc.status == 429:
        return 429  # the engine's backpressure: harness SDKs retry 429 with backoff
    if isinstance(exc, EngineHTTPError) and exc.status is not None and 400 <= exc.status < 500:
        return 400  # e.g. prompt longer than the context: the request's fault, not a gateway failure
    return 502


def engine_message(exc: EngineError, status: int) -> str:
    """What the harness is told. The engine's own words only when they are about the request
    (4xx); never its internal URL, host or traceback (those go to the gateway's log)."""
    if status == 400:
        return f"engine rejected the request: {exc.message[:500]}"
    return {
        429: "engine is overloaded (rate limited); retry later",
        503: "engine unavailable",
        504: "engine did not answer in time",
    }.get(status, "engine failed or returned an unusable response")


_NEST_MARGIN = 8  # levels a body gains inside a record; orjson writes at most 254


def check_recordable(body: dict[str, Any]) -> None:
    """Refuse (400) a body that parses but could not be journaled (nested deeper than orjson
    writes), before any engine time is spent on it."""
    wrapped: Any = body
    for _ in range(_NEST_MARGIN):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError as exc:
        raise RequestError(f"request body cannot be recorded ({exc}); JSON may nest at most {254 - _NEST_MARGIN} levels") from exc


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
    check_recordable(body)
    return body


def provider_handler(provider: Provider) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await complete(request, provider)
        except RequestError as exc:
            return json_response(provider.error_body(exc.status, exc.message), exc.status)
        except EngineError as exc:
            status = engine_status(exc)
            request.app[STATS]["engine_errors"] += 1
            log.warning("engine error (%d to the harness): %s", status, exc)
            return json_response(provider.error_body(status, engine_message(exc, status)), status)
        except CaptureError as exc:
            request.app[STATS]["capture_errors"] += 1
            log.error("capture failed, answered 500: %s", exc)
            return json_response(provider.error_body(500, f"the gateway could not record this call ({exc}); retry"), 500)
        except ClientGone:
            return web.Response(status=499)  # nobody reads it

    return handle


_IN_FLIGHT: set[asyncio.Future[Generation]] = set()  # strong references to shielded captures


def _settled(capture: asyncio.Future[Generation]) -> None:
    """Drop the strong reference; retrieve the outcome so a capture whose handler was cancelled
    (client gone) does not log 'exception was never retrieved' (it was counted already)."""
    _IN_FLIGHT.discard(capture)
    if not capture.cancelled():
        capture.exception()


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def check_finite(generation: Generation) -> None:
    """A NaN or infinite logprob would be journaled as null and poison every reader: refuse it."""
    if not all(map(math.isfinite, generation.response_logprobs)):
        bad = next(i for i, lp in enumerate(generation.response_logprobs) if not math.isfinite(lp))
        raise EngineProtocolError(
            f"engine returned a non-finite logprob ({generation.response_logprobs[bad]}) at response token {bad}",
            engine=generation.engine,
        )


async def call_engine(app: web.Application, chat: ChatRequest) -> Generation:
    """One engine call under the gateway's deadline; foreign exceptions become EngineErrors."""
    timeout_s = app[CONFIG].engine_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            generation = await app[ENGINE].generate(chat)
    except TimeoutError as exc:
        raise EngineTimeout(f"no answer within {timeout_s:g}s (engine timeout)", engine=app[ENGINE].name) from exc
    except (PolarError, asyncio.CancelledError):
        raise
    except Exception as exc:  # an engine client bug must not become a plain-text 500
        log.exception("engine client %s raised %s", app[ENGINE].name, type(exc).__name__)
        raise EngineProtocolError(f"engine client raised {type(exc).__name__}: {exc}", engine=app[ENGINE].name) from exc
    if not isinstance(generation, Generation):
        raise EngineProtocolError(f"engine client returned {type(generation).__name__}", engine=app[ENGINE].name)
    check_finite(generation)
    return generation


async def generate_and_record(
    request: web.Request,
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
    app = request.app
    try:
        async with app[GATE].call(session.id) as weight_version:
            if client_gone(request):  # gave up while queued behind a pause: spend nothing on it
                app[STATS]["abandoned"] += 1
                raise ClientGone(session.id)
            engine_started = time.perf_counter()  # after the gate: pause time is not engine time
            generation = await call_engine(app, engine_chat)
            engine_ms = (time.perf_counter() - engine_started) * 1000
    except EngineError:
        session.errors += 1
        raise
    # Generation and ChatRequest are validated already; construct without re-validating the
    # (possibly 100k-long) token lists on the hot path.
    seq = session.take_seq()
    record = CompletionRecord.model_construct(
        **{name: getattr(generation, name) for name in type(generation).model_fields},
        session_id=session.id,
        seq=seq,
        provider_api=provider.API,
        provider_request=body,
        chat_request=chat,
        timings=Timings(received_at=received, engine_ms=engine_ms, total_ms=(time.perf_counter() - started) * 1000),
        notes=notes,
    )
    if record.weight_version is None:
        record.weight_version = weight_version  # engines that do not report one: the gate's version
    try:
        journal_bytes = app[STORE].append(record)  # before the reply: an answered call is never lost
    except CaptureError:
        session.errors += 1
        if session.next_seq == seq + 1:
            session.next_seq = seq  # nothing was written: the number is free again
        raise
    observe_call(app, record, journal_bytes)
    if session.continuation is not None:
        session.continuation.remember(chat, generation)
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


def translate(provider: Provider, body: dict[str, Any], match_info: Any) -> Any:
    """``provider.to_chat`` with ill-typed input reported as a 400 naming the problem. The
    providers check what they read; this catches what a fuzzer finds that they do not."""
    try:
        return provider.to_chat(body, match_info)
    except RequestError:
        raise
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise RequestError(f"invalid request: '{where}' {first.get('msg', 'is invalid')}") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        log.warning("%s body rejected by a generic check (%s: %s)", provider.API, type(exc).__name__, exc)
        raise RequestError(f"invalid request: ill-typed field ({type(exc).__name__}: {str(exc)[:200]})") from exc


async def complete(request: web.Request, provider: Provider) -> web.StreamResponse:
    received = time.time()
    started = time.perf_counter()
    app = request.app
    config = app[CONFIG]
    body = await read_json(request)
    session = app[SESSIONS].resolve(request_keys(request.headers, request.query), request.match_info.get("session_id"))
    inbound = translate(provider, body, request.match_info)
    notes = inbound.notes
    updates = trainer_overrides(inbound.chat, config, notes)
    chat = apply_quirks(inbound.chat, notes).model_copy(update=updates)
    check_messages(chat.messages)  # what the template would refuse, refused before the engine
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
        generate_and_record(request, session, provider, body, chat, engine_chat, notes, received, started)
    )
    _IN_FLIGHT.add(capture)
    capture.add_done_callback(_settled)
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
        try:
            chat = anthropic.count_tokens_chat(body)
        except (ValidationError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise RequestError(f"invalid request: ill-typed field ({type(exc).__name__})") from exc
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


@web.middleware
async def last_resort(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """An exception no handler expected is logged and answered as provider-shaped JSON (500),
    never as aiohttp's plain-text page."""
    try:
        return await handler(request)
    except (web.HTTPException, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        request.app[STATS]["unexpected"] += 1
        return json_response(guess_provider(request).error_body(500, "internal gateway error (logged)"), 500)


# -- sessions and admin ------------------------------------------------------------------------


def _plain_error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


def is_admin(request: web.Request) -> bool:
    return token_matches(bearer_token(request.headers.get("Authorization", "")), request.app[CONFIG].admin_token or "")


def require_admin(request: web.Request) -> None:
    if not is_admin(request):
        raise RequestError("admin token required (Authorization: Bearer <admin token>)", status=401)


def authorize_session(request: web.Request) -> Session:
    """The session named in the path, for the admin or that session's own key; else 401/404."""
    registry = request.app[SESSIONS]
    session_id = request.match_info["session_id"]
    if is_admin(request):
        return registry.get(session_id)
    own = registry.by_key(request_keys(request.headers, request.query))
    if own is None or own.id != session_id:
        raise RequestError("this route needs the admin token or the session's own key", status=401)
    return own


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
        require_admin(request)
        body = await read_json(request) if request.can_read_body else {}
        session_id = body.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise RequestError("'session_id' must be a string")
        metadata = body.get("metadata")
        config = request.app[CONFIG]
        wants = body.get("continuation", config.continuation)
        if not isinstance(wants, bool):
            raise RequestError("'continuation' must be a boolean")
        continuation = Continuation(load_tokenizer(), config.template) if wants else None
        session = request.app[SESSIONS].create(session_id, {} if metadata is None else metadata, continuation)
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    except OSError as exc:  # the session state could not be persisted (disk full): no session
        log.error("cannot persist a new session: %s", exc)
        return json_response({"error": {"message": f"cannot persist the session: {exc.strerror or exc}",
                                        "type": "server_error", "code": 507}}, 507)
    assert session.key is not None
    base = base_url(request)
    model = request.app[CONFIG].engine_model
    return json_response({
        "session_id": session.id,
        "key": session.key,
        "continuation": session.continuation_mode,
        "model": model,
        "base_url": base,
        "base_urls": {"anthropic": base, "openai": f"{base}/v1", "gemini": base},
        "env": session_env(base, session.id, session.key, model),
    }, 201)


def session_summary(session: Session) -> dict[str, Any]:
    """What the session routes show about a session (never its key)."""
    return {"session_id": session.id, "created_at": session.created_at, "closed": session.closed,
            "continuation": session.continuation_mode,
            "completions": session.next_seq, "errors": session.errors, "metadata": session.metadata}


async def list_sessions(request: web.Request) -> web.Response:
    """Admin: every session this gateway process knows, oldest first."""
    if not is_admin(request):
        return _plain_error(401, "admin token required (Authorization: Bearer <admin token>)")
    sessions = sorted(request.app[SESSIONS], key=lambda s: s.created_at)
    return json_response({"sessions": [session_summary(s) for s in sessions]})


async def get_session(request: web.Request) -> web.Response:
    try:
        return json_response(session_summary(authorize_session(request)))
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)


async def session_completions(request: web.Request) -> web.Response:
    """The session's journal, read back from disk (what a trainer or builder consumes)."""
    try:
        session_id = authorize_session(request).id
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    try:
        records = request.app[STORE].read(session_id)
    except JournalError as exc:
        log.error("%s", exc)
        return json_response({"error": {"message": f"journal unreadable: {exc}", "type": "server_error", "code": 500}}, 500)
    body = b'{"session_id":' + orjson.dumps(session_id) + b',"completions":[' + b",".join(r.to_json() for r in records) + b"]}"
    return web.Response(body=body, content_type="application/json")


async def delete_session(request: web.Request) -> web.Response:
    try:
        session = request.app[SESSIONS].close(authorize_session(request).id)
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    return json_response(session_summary(session))


def _timeout_param(request: web.Request) -> float:
    raw = request.query.get("timeout_s", "600")
    try:
        value = float(raw)
    except ValueError:
        raise RequestError(f"timeout_s must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"timeout_s must be a finite number >= 0, got {raw!r}")
    return value


async def admin_pause(request: web.Request) -> web.Response:
    """Drain in-flight calls. If they do not finish within ``timeout_s`` the pause is undone
    (504, ``drained: false``, ``paused: false``) and ``running`` lists the calls still going."""
    try:
        require_admin(request)
        timeout_s = _timeout_param(request)
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    gate = request.app[GATE]
    drained = await gate.pause(timeout_s)
    if drained:
        return json_response({**gate.status(), "drained": True, "running": []})
    running = gate.running()
    message = f"{len(running)} engine call(s) did not finish within {timeout_s:g}s; the pause was undone"
    return json_response({**gate.status(), "drained": False, "running": running,
                          "error": {"message": message, "type": "timeout_error", "code": 504}}, 504)


async def admin_resume(request: web.Request) -> web.Response:
    version = None
    try:
        require_admin(request)
        body = await read_json(request) if request.can_read_body else {}
        raw = body.get("weight_version")
        if raw is not None:
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
                raise RequestError("'weight_version' must be a string or a number")
            version = str(raw)
    except RequestError as exc:
        return _plain_error(exc.status, exc.message)
    engine = request.app[ENGINE]
    set_version = getattr(engine, "set_weight_version", None)
    if version is not None and callable(set_version):
        set_version(version)  # engines that stamp their own version (embedded) carry the trainer's
    await request.app[GATE].resume(version)
    return json_response(request.app[GATE].status())


async def admin_status(request: web.Request) -> web.Response:
    if not is_admin(request):
        return _plain_error(401, "admin token required (Authorization: Bearer <admin token>)")
    registry = request.app[SESSIONS]
    return json_response({**request.app[GATE].status(), "sessions": len(registry), "open_sessions": registry.open_count(),
                          "open_journals": request.app[STORE].open_fds(), **request.app[STATS]})


# -- assembly ----------------------------------------------------------------------------------


def _add_provider_routes(router: web.UrlDispatcher) -> None:
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


async def _expire_idle(app: web.Application, idle_s: float) -> None:
    while True:
        await asyncio.sleep(min(60.0, max(idle_s / 4, 0.05)))
        for sid in app[SESSIONS].expire_idle(idle_s):
            log.info("session %s closed after %gs idle", sid, idle_s)


def build_app(engine: EngineClient, store: CaptureStore, config: GatewayConfig) -> web.Application:
    if not config.admin_token:
        config = dataclasses.replace(config, admin_token=new_admin_token())
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[last_resort])
    app[ENGINE] = engine
    app[STORE] = store
    app[SESSIONS] = SessionRegistry(store, lambda: Continuation(load_tokenizer(), config.template))
    app[GATE] = EngineGate()
    app[CONFIG] = config
    app[STATS] = {"engine_errors": 0, "capture_errors": 0, "abandoned": 0, "unexpected": 0}

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        expiry = asyncio.create_task(_expire_idle(app, config.session_idle_s)) if config.session_idle_s else None
        yield
        if expiry is not None:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
        await engine.aclose()
        store.close()

    app.cleanup_ctx.append(lifetime)
    router = app.router
    _add_provider_routes(router)
    router.add_post("/sessions", create_session)
    router.add_get("/sessions", list_sessions)
    router.add_get("/sessions/{session_id}", get_session)
    router.add_get("/sessions/{session_id}/completions", session_completions)
    router.add_delete("/sessions/{session_id}", delete_session)
    router.add_post("/admin/pause", admin_pause)
    router.add_post("/admin/resume", admin_resume)
    router.add_get("/admin/status", admin_status)
    install_gateway_metrics(app, app[GATE], is_admin)
    router.add_route("*", "/{tail:.*}", not_found)
    return app


def build_provider_app(app: web.Application) -> web.Application:
    """What a sandbox is given (the gateway's unix socket): the provider routes only, over the
    same sessions, store, engine and gate as ``app``. Session and admin routes do not exist
    here (404), whatever credential is sent. ``app`` owns the shared state's lifetime."""
    sandbox = web.Application(client_max_size=app[CONFIG].max_body_bytes, middlewares=[last_resort])
    for key in (ENGINE, STORE, SESSIONS, GATE, CONFIG, STATS):
        sandbox[key] = app[key]  # type: ignore[index]
    share_gateway_metrics(sandbox, app)
    _add_provider_routes(sandbox.router)
    sandbox.router.add_route("*", "/{tail:.*}", not_found)
    return sandbox
