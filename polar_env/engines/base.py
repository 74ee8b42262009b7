"""The engine-client seam and the one place HTTP transport errors become EngineErrors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

import aiohttp
import orjson

from polar_env.errors import (
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
)
from polar_env.records import ChatRequest, Generation


class EngineClient(Protocol):
    """Generate one assistant turn for a chat request, with exact token data."""

    name: str

    async def generate(self, request: ChatRequest) -> Generation: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class WeightVersioned(Protocol):
    """An engine that stamps its records with its own weight version (the embedded engine): told
    the trainer's label when the gateway resumes after an update. A served engine's version comes
    from the gateway's pause gate instead."""

    def set_weight_version(self, label: str) -> None: ...


def new_session() -> aiohttp.ClientSession:
    """The HTTP session engine clients own. No connection cap: aiohttp's default of 100 would
    queue the 101st concurrent generation behind the others (a rollout runs hundreds at once)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


_ERROR_TEXT_LIMIT = 2000  # enough for any engine traceback summary, bounded for logs


def error_message(body: bytes) -> str:
    """Pull the human message out of an engine error body (vLLM, SGLang, FastAPI, or plain text)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:_ERROR_TEXT_LIMIT] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_ERROR_TEXT_LIMIT]
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])[:_ERROR_TEXT_LIMIT]
    return orjson.dumps(data).decode()[:_ERROR_TEXT_LIMIT]


async def request_json(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any] | None = None,
    *,
    engine: str,
    timeout_s: float,
    method: str = "POST",
    decode: Callable[[bytes], object] = orjson.loads,
    payload: bytes | None = None,
) -> object:
    """Send ``body`` as JSON (or nothing, for GET) and return the decoded JSON, or raise an
    EngineError. ``decode`` (raising orjson.JSONDecodeError on malformed JSON) may be a typed
    decoder for a hot response shape. ``payload``: the body already encoded (instead of ``body``;
    pass it inline, so no caller's name keeps it alive).

    The body is handed to aiohttp as a one-shot stream with its length (``_sent_once``): aiohttp
    keeps a ``bytes`` body on the request until the reply's headers arrive, i.e. for the whole
    generation — 1.65 MB per call at 100k tokens, times the calls in flight."""
    if payload is None and body is not None:
        payload = orjson.dumps(body)
    data: AsyncIterator[bytes] | None = None
    headers: dict[str, str] | None = None
    if payload is not None:
        headers = {"Content-Type": "application/json", "Content-Length": str(len(payload))}
        data = _sent_once([payload])
        payload = None
    try:
        async with session.request(
            method,
            url,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise EngineHTTPError(error_message(raw), engine=engine, url=url, status=resp.status)
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise EngineUnavailable(f"cannot reach engine: {exc}", engine=engine, url=url) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise EngineTimeout(f"no answer within {timeout_s:g}s", engine=engine, url=url) from exc
    except aiohttp.ClientPayloadError as exc:
        raise EngineProtocolError(f"truncated response body: {exc}", engine=engine, url=url) from exc
    except aiohttp.ClientError as exc:
        raise EngineUnavailable(f"engine transport error: {exc}", engine=engine, url=url) from exc
    try:
        return decode(raw)
    except orjson.JSONDecodeError as exc:
        snippet = raw[:200].decode("utf-8", "replace")
        raise EngineProtocolError(f"malformed JSON from engine: {snippet!r}", engine=engine, url=url) from exc


async def _sent_once(holder: list[bytes]) -> AsyncIterator[bytes]:
    """The one chunk of a request body, dropped by this generator as it is handed over: once the
    transport has sent it, nothing on the request holds it."""
    yield holder.pop()


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    engine: str,
    timeout_s: float,
) -> dict[str, Any]:
    """POST ``body`` and return the decoded JSON object, or raise an EngineError subclass."""
    data = await request_json(session, url, body, engine=engine, timeout_s=timeout_s)
    if not isinstance(data, dict):
        raise EngineProtocolError(f"expected a JSON object, got {type(data).__name__}", engine=engine, url=url)
    return data
