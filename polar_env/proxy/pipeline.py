"""The request pipeline every provider route shares.

Per request: read and check the body → resolve the session from its key → provider ``to_chat`` →
quirks and sampling overrides → engine call (through the pause gate) → record journaled → provider
reply (JSON or the provider's full SSE sequence). Engines are always called non-streaming so token
data is complete; streams are synthesized from the finished generation. Any failure is answered in
the provider's own error shape; nothing is recorded for a request that was refused.

Validation happens before the engine call: a body that cannot be recorded (nested too deep), an
ill-typed field or a bad parameter is a provider-shaped 4xx and never reaches the engine. What
the engine returns is checked too (finite logprobs); the record is written whole before the reply
or the request fails with a provider-shaped 5xx. A call whose harness disconnected while it was
generated is still recorded (its tokens were paid for) with the journal's ``client_gone`` note,
and a reply that could not be written is marked by a ``client_gone`` event: builders then train
only the retry the conversation continued (``polar_env/trajectory/lineage.py``). Anything
unexpected still answers in the provider's JSON shape (500), never aiohttp's plain text.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import ValidationError

from polar_env.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
    PolarError,
    RequestError,
)
from polar_env.journal.format import CLIENT_GONE, CLIENT_GONE_EVENT, PromptRef, identical_prefix
from polar_env.journal.protocols import CaptureError
from polar_env.proxy.config import GatewayConfig, Sampling
from polar_env.proxy.continuation import Plan
from polar_env.proxy.core import GatewayCore
from polar_env.proxy.echoes import EchoTip, journal_ref
from polar_env.proxy.providers import PROVIDERS
from polar_env.proxy.providers.base import Inbound, Provider, Reply
from polar_env.proxy.quirks import apply_quirks
from polar_env.proxy.reuse import Translations, share_lists
from polar_env.proxy.sessions import Session, request_keys
from polar_env.proxy.validate import check_messages
from polar_env.records import ChatRequest, CompletionRecord, Generation, ProviderAPI, Timings
from polar_env.stagecpu import stage
from polar_env.tokenids import ECHO_ANCHOR

log = logging.getLogger("polar_env.gateway")

_SAMPLING_EXTRAS = frozenset({"top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})
_JSON_TYPES = ("application/json", "text/json", "application/x-ndjson", "")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]



def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class CallAborted(PolarError):
    """The gateway aborted this call's generation (session cancelled, stopped early or closed)."""


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


def _nested(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


def check_recordable(body: dict[str, Any], checked: Mapping[str, Sequence[object]] | None = None) -> None:
    """Refuse (400) a body that parses but could not be journaled (nested deeper than orjson
    writes), before any engine time is spent on it. ``checked``: the lists of a body that passed
    this check; leading items of ``body``'s lists that are those very objects (shared history,
    ``proxy/reuse.py``) sit at the same depth and are not serialized again. Each part is wrapped
    in the levels the body adds above it (orjson counts list and object levels alike)."""
    try:
        if not checked:
            orjson.dumps(_nested(body, _NEST_MARGIN))
            return
        for key, value in body.items():
            old = checked.get(key) if type(value) is list else None
            if old is None:
                orjson.dumps(_nested(value, _NEST_MARGIN + 1))
            else:
                for item in value[identical_prefix(value, old):]:
                    orjson.dumps(_nested(item, _NEST_MARGIN + 2))
    except orjson.JSONEncodeError as exc:
        raise RequestError(f"request body cannot be recorded ({exc}); JSON may nest at most {254 - _NEST_MARGIN} levels") from exc


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    """The request body in one buffer the caller owns, refused (413) past ``max_body_bytes``.
    aiohttp's ``read()`` copies it twice and keeps it on the request until the handler returns:
    ~1 MB per call for the whole generation, times the calls in flight."""
    too_big = RequestError(f"request body exceeds {max_body_bytes} bytes", status=413)
    if (request.content_length or 0) > max_body_bytes:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)  # one chunk: that chunk itself


async def read_json(request: web.Request, max_body_bytes: int, *, recordable_check: bool = True) -> dict[str, Any]:
    """The request's JSON object; ``recordable_check=False``: the caller checks it
    (``check_recordable`` against the history it shares)."""
    ctype = request.content_type.lower() if request.headers.get("Content-Type") else ""
    if ctype not in _JSON_TYPES:
        raise RequestError(f"Content-Type must be application/json, got {ctype!r}", status=415)
    raw = await read_body(request, max_body_bytes)
    with stage("parse"):
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc
    del raw  # the parsed body is what the call keeps
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if recordable_check:
        with stage("validate"):
            check_recordable(body)
    return body


def share_chat(chat: ChatRequest, previous: Mapping[str, list[object]]) -> tuple[ChatRequest, dict[str, list[object]]]:
    """``chat`` with its messages and tools sharing ``previous``'s objects (the session's last
    chat request) where they serialize the same (``proxy/reuse.py``), and the lists to remember."""
    lists: dict[str, object] = {"messages": chat.messages, "tools": chat.tools}
    remembered = share_lists(lists, previous)
    if lists["messages"] is chat.messages and lists["tools"] is chat.tools:
        return chat, remembered
    return chat.model_copy(update=lists), remembered


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


def trainer_overrides(chat: ChatRequest, config: GatewayConfig, notes: list[str],
                      session_sampling: Sampling | None = None) -> dict[str, Any]:
    """What the gateway's configuration overrides in every request: the served model, and the
    sampling parameters when the trainer owns them (harness extras that reshape the distribution
    are dropped then too). ``session_sampling`` (the task's own, set when the session was opened)
    replaces ``config.sampling`` and is named in the record's notes."""
    updates: dict[str, Any] = {"model": config.engine_model}
    sampling = config.sampling if session_sampling is None else session_sampling
    if session_sampling is not None:
        notes.append(f"session sampling {session_sampling.line() or '(none set)'}")
    if sampling.temperature is not None:
        updates["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        updates["top_p"] = sampling.top_p
    if sampling.temperature is not None or sampling.top_p is not None:
        dropped = sorted(k for k in chat.extra_body if k in _SAMPLING_EXTRAS)
        if dropped:
            updates["extra_body"] = {k: v for k, v in chat.extra_body.items() if k not in _SAMPLING_EXTRAS}
            notes.append(f"dropped harness sampling params {dropped}")
    if sampling.max_tokens is not None:
        updates["max_tokens"] = min(chat.max_tokens or sampling.max_tokens, sampling.max_tokens)
    return updates


def translate(provider: Provider, body: dict[str, Any], match_info: Mapping[str, str],
              memo: Translations | None = None) -> Inbound:
    """``provider.to_chat`` with ill-typed input reported as a 400 naming the problem. The
    providers check what they read; this catches what a fuzzer finds that they do not."""
    try:
        return provider.to_chat(body, match_info, memo)
    except RequestError:
        raise
    except ValidationError as exc:
        errors = exc.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        msg = errors[0]["msg"] if errors else "is invalid"
        raise RequestError(f"invalid request: '{where or 'body'}' {msg}") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        log.warning("%s body rejected by a generic check (%s: %s)", provider.API, type(exc).__name__, exc)
        raise RequestError(f"invalid request: ill-typed field ({type(exc).__name__}: {str(exc)[:200]})") from exc


# -- side endpoints harnesses call -------------------------------------------------------------


async def root(request: web.Request) -> web.Response:
    """Claude Code preconnects with ``HEAD /``."""
    return json_response({"status": "ok", "service": "polar-env gateway"})


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
    return PROVIDERS.get(api if api in PROVIDERS else ProviderAPI.OPENAI_CHAT)


async def not_found(request: web.Request) -> web.Response:
    provider = guess_provider(request)
    message = f"no route for {request.method} {request.path}"
    return json_response(provider.error_body(404, message), 404)



def last_resort(gw: GatewayCore) -> Middleware:
    """The middleware that answers an exception no handler expected as provider-shaped JSON
    (500, logged and counted), never as aiohttp's plain-text page."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (web.HTTPException, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            gw.stats.unexpected += 1
            return json_response(guess_provider(request).error_body(500, "internal gateway error (logged)"), 500)

    return middleware


class CallPipeline:
    """The provider routes' handlers over one gateway core (``gw``): bound methods, so a handler
    never looks its gateway up in the app."""

    def __init__(self, gw: GatewayCore) -> None:
        self.gw = gw

    def provider_handler(self, provider: Provider) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return await self.complete(request, provider)
            except RequestError as exc:
                return json_response(provider.error_body(exc.status, exc.message), exc.status)
            except EngineError as exc:
                status = engine_status(exc)
                self.gw.stats.engine_errors += 1
                self.gw.events.emit("call_failed", None, provider=provider.API.value, error=type(exc).__name__, status=status)
                log.warning("engine error (%d to the harness): %s", status, exc)
                return json_response(provider.error_body(status, engine_message(exc, status)), status)
            except CaptureError as exc:
                self.gw.stats.capture_errors += 1
                self.gw.events.emit("call_failed", None, provider=provider.API.value, error=type(exc).__name__, status=500)
                log.error("capture failed, answered 500: %s", exc)
                return json_response(provider.error_body(500, f"the gateway could not record this call ({exc}); retry"), 500)
            except CallAborted as exc:
                return json_response(provider.error_body(503, str(exc)), 503)
            except ClientGone:
                return web.Response(status=499)  # nobody reads it

        return handle

    async def call_engine(self, chat: ChatRequest) -> Generation:
        """One engine call under the gateway's deadline; foreign exceptions become EngineErrors."""
        timeout_s = self.gw.config.engine_timeout_s
        engine = self.gw.engine
        try:
            async with asyncio.timeout(timeout_s):
                generation = await engine.generate(chat)
        except TimeoutError as exc:
            raise EngineTimeout(f"no answer within {timeout_s:g}s (engine timeout)", engine=engine.name) from exc
        except (PolarError, asyncio.CancelledError):
            raise
        except Exception as exc:  # an engine client bug must not become a plain-text 500
            log.exception("engine client %s raised %s", engine.name, type(exc).__name__)
            raise EngineProtocolError(f"engine client raised {type(exc).__name__}: {exc}", engine=engine.name) from exc
        if not isinstance(generation, Generation):
            raise EngineProtocolError(f"engine client returned {type(generation).__name__}", engine=engine.name)
        check_finite(generation)
        return generation

    async def generate_and_record(
        self,
        request: web.Request,
        session: Session,
        provider: Provider,
        body: dict[str, Any],
        chat: ChatRequest,
        engine_chat: ChatRequest,
        notes: list[str],
        received: float,
        started: float,
        plan: Plan | None = None,
    ) -> tuple[Generation, int]:
        """Call the engine through the pause gate and journal the completion before returning it with
        its seq. The gate is held until the record is durable, so a drained pause has nothing half-recorded."""
        gw = self.gw
        async with gw.gate.call(session.id) as weight_version:
            if client_gone(request):  # gave up while queued behind a pause: spend nothing on it
                gw.stats.abandoned += 1
                raise ClientGone(session.id)
            engine_started = time.perf_counter()  # after the gate: pause time is not engine time
            tip = session.echo if plan is None else None  # canonical: the echo extends the last prompt
            anchor = ECHO_ANCHOR.set(tip.anchor() if tip is not None else None)  # the engine call's context
            engine_call = gw.start_engine_call(session.id, self.call_engine(engine_chat))
            ECHO_ANCHOR.reset(anchor)
            try:
                generation = await engine_call
            except EngineError:
                session.errors += 1
                raise
            except asyncio.CancelledError:
                reason = gw.aborted.pop(engine_call, None)
                current = asyncio.current_task()
                if reason is None or (current is not None and current.cancelling()):
                    raise  # our own cancellation (shutdown), not an abort
                session.errors += 1
                await gw.mark_aborted(session.id, {
                    "provider_api": provider.API.value, "received_at": received, "reason": reason,
                    "engine_ms": round((time.perf_counter() - engine_started) * 1000, 3),
                    "prompt_tokens": len(engine_chat.prompt_ids) if engine_chat.prompt_ids is not None else None,
                })
                raise CallAborted(f"call aborted: session {reason}") from None
            gw.aborted.pop(engine_call, None)
            engine_ms = (time.perf_counter() - engine_started) * 1000
            if client_gone(request):  # the harness gave up during the generation: nobody reads this reply
                gw.stats.client_gone += 1
                notes.append(CLIENT_GONE)
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
                ref = (PromptRef(plan.parent.seq, plan.keep, plan.ids) if plan is not None
                       else await journal_ref(tip, generation.prompt_ids))
                await gw.record(record, ref, request.content_length)  # before the reply: an answered call is never lost
            except CaptureError:
                session.errors += 1
                if session.next_seq == seq + 1:
                    session.next_seq = seq  # nothing was written: the number is free again
                raise
            if session.continuation is None:
                session.echo = EchoTip(seq, generation.prompt_ids, generation.response_ids)
        if session.continuation is not None:
            with stage("continuation"):
                session.continuation.remember(chat, generation, seq, plan, abandoned=CLIENT_GONE in notes)
        return generation, seq

    async def complete(self, request: web.Request, provider: Provider) -> web.StreamResponse:
        received = time.time()
        started = time.perf_counter()
        gw = self.gw
        config = gw.config
        body = await read_json(request, config.max_body_bytes, recordable_check=False)
        session = gw.sessions.resolve(request_keys(request.headers, request.query), request.match_info.get("session_id"))
        with stage("share"):  # unchanged history takes the last request's objects (proxy/reuse.py)
            shared = share_lists(body, session.shared_body)
        with stage("validate"):
            check_recordable(body, session.shared_body)  # what it shares was checked with that body
        session.shared_body = shared  # only a recordable body is shared from
        with stage("parse"):
            inbound = translate(provider, body, request.match_info, session.translations)
        with stage("validate"):
            notes = inbound.notes
            updates = trainer_overrides(inbound.chat, config, notes, session.sampling)
            chat = apply_quirks(inbound.chat, notes, gw.chat).model_copy(update=updates)
        with stage("share"):
            chat, shared_chat = share_chat(chat, session.shared_chat)
        with stage("validate"):  # what the template would refuse, refused before the engine
            checked = session.shared_chat.get("messages")
            check_messages(chat.messages, gw.chat.rules, identical_prefix(chat.messages, checked) if checked else 0)
        session.shared_chat = shared_chat  # only checked messages are shared from
        # The session id lets the engine client keep a session on one worker (prefix-cache affinity).
        engine_update: dict[str, Any] = {"extra_body": {**chat.extra_body, "session_id": session.id}}
        plan = None
        if session.continuation is not None:
            if gw.chat.cheap_continuation:
                with stage("continuation"):
                    plan, note = session.continuation.plan(chat)
            else:  # the family's continuation renders the history: not on the event loop
                plan, note = await asyncio.to_thread(session.continuation.plan, chat)
            notes.append(note)
            if plan is not None:
                engine_update["prompt_ids"] = plan.ids
        engine_chat = chat.model_copy(update=engine_update)

        # The engine call and the capture run as their own task, shielded: a harness that disconnects
        # (which cancels this handler) must not cancel a generation that is already paid for, nor
        # lose its record.
        capture = asyncio.ensure_future(
            self.generate_and_record(request, session, provider, body, chat, engine_chat, notes, received, started, plan)
        )
        gw.track(capture)
        generation, seq = await asyncio.shield(capture)

        with stage("reply_build"):
            reply = Reply(generation, inbound.model or config.engine_model, uuid.uuid4().hex, int(received), inbound.options)
            if not inbound.stream:
                return json_response(provider.from_chat(reply))
            events = b"".join(provider.stream_events(reply))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            await resp.write(events)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):  # the client went away; the record is already on disk
            if CLIENT_GONE in notes:  # gone before the record was written: the record says so already
                return resp
            gw.stats.client_gone += 1
            if session.continuation is not None:
                session.continuation.abandon(seq)
            try:
                await gw.journal_event(session.id, {"event": CLIENT_GONE_EVENT, "seq": seq})
            except CaptureError as exc:  # the record stands; builders then see it as delivered
                log.error("cannot journal that seq %d of %s was not delivered: %s", seq, session.id, exc)
        return resp

    async def models(self, request: web.Request) -> web.Response:
        """One listing that satisfies both the OpenAI and the Anthropic model-list clients."""
        name = self.gw.config.engine_model
        card = {"id": name, "object": "model", "type": "model", "display_name": name, "created": 0,
                "created_at": "1970-01-01T00:00:00Z", "owned_by": "polar_env"}
        return json_response({"object": "list", "data": [card], "has_more": False, "first_id": name, "last_id": name})

    async def gemini_models(self, request: web.Request) -> web.Response:
        name = self.gw.config.engine_model
        return json_response({"models": [{"name": f"models/{name}", "displayName": name,
                                          "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]}]})

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic ``/v1/messages/count_tokens``: the engine-side prompt length, rendered in the
        engine's chat format."""
        from polar_env.proxy.providers import anthropic

        provider = PROVIDERS[ProviderAPI.ANTHROPIC]
        try:
            body = await read_json(request, self.gw.config.max_body_bytes)
            self.gw.sessions.resolve(request_keys(request.headers, request.query), request.match_info.get("session_id"))
            try:
                chat = anthropic.count_tokens_chat(body)
            except (ValidationError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
                raise RequestError(f"invalid request: ill-typed field ({type(exc).__name__})") from exc
            notes: list[str] = []
            family = self.gw.chat
            chat = apply_quirks(chat, notes, family)
            thinking = chat.chat_template_kwargs.get("enable_thinking", True) is not False
            # a whole history's render + tokenization: not on the event loop
            n = await asyncio.to_thread(family.count_tokens, chat.messages, chat.tools, enable_thinking=thinking)
        except RequestError as exc:
            return json_response(provider.error_body(exc.status, exc.message), exc.status)
        return json_response({"input_tokens": n})
