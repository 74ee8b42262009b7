"""The Provider seam: what one wire format (Anthropic, OpenAI Chat, OpenAI Responses, Gemini) owns.

A provider is a module exposing ``API`` (its name, a ``ProviderAPI``: the ``PROVIDERS`` key its
records carry), ``ROUTES`` (served with and without the ``/s/{session_id}`` prefix) and four pure
functions:

- ``to_chat(body, path_params, memo) -> Inbound``: the provider request as a normalized
  ChatRequest (OpenAI Chat messages/tools, generation params), whether the client wants a stream,
  the model name it asked for, and notes on anything dropped. Bad input raises ``RequestError``.
  ``memo`` is the session's ``proxy.reuse.Translations`` (None: translate everything): a format
  whose items translate independently (OpenAI Chat, Anthropic) translates only items it has not
  seen; one whose items depend on earlier ones (Gemini pairs responses with earlier calls,
  Responses folds items into messages) translates the whole body.
- ``from_chat(reply) -> dict``: the provider's non-streaming response body.
- ``stream_events(reply) -> Iterator[bytes]``: the provider's full SSE event sequence (framed).
- ``error_body(status, message) -> dict``: the provider's error JSON.

The gateway keeps everything else (auth, sessions, capture, engine calls, HTTP). Wire bodies stay
raw dicts: fields we do not model survive in the captured ``provider_request``. To add a provider:
one module here plus one ``PROVIDERS.register`` line in ``providers/__init__.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from polar_env.errors import RequestError
from polar_env.proxy.reuse import Translations
from polar_env.records import ChatRequest, Generation, ProviderAPI


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # aiohttp pattern, e.g. "/v1beta/models/{model}:{method}"


@dataclass(slots=True)
class Inbound:
    chat: ChatRequest
    stream: bool
    model: str  # the model name the harness asked for; echoed back in responses
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # provider reply flags (e.g. include_usage)


@dataclass(frozen=True, slots=True)
class Reply:
    generation: Generation
    model: str  # echoed to the harness (what it asked for), not the engine's name
    request_id: str  # 32 hex chars; providers add their own prefix (msg_, resp_, chatcmpl-)
    created: int  # epoch seconds
    options: Mapping[str, Any] = field(default_factory=dict)  # Inbound.options, handed back


class Provider(Protocol):
    API: ProviderAPI
    ROUTES: tuple[Route, ...]

    def to_chat(self, body: dict[str, Any], path_params: Mapping[str, str],
                memo: Translations | None = None) -> Inbound: ...

    def from_chat(self, reply: Reply) -> dict[str, Any]: ...

    def stream_events(self, reply: Reply) -> Iterator[bytes]: ...

    def error_body(self, status: int, message: str) -> dict[str, Any]: ...


def with_items(chat: ChatRequest, messages: list[dict[str, object]], tools: list[dict[str, object]]) -> ChatRequest:
    """``chat`` (its other fields validated) holding these very ``messages`` and ``tools``: dicts
    the provider built, so of their type already. Validating them would copy every dict, and the
    session's unchanged history must stay the objects ``Translations`` returned."""
    return chat.model_copy(update={"messages": messages, "tools": tools})


def id_suffix(engine_id: str, length: int = 24) -> str:
    """A stable provider-facing id suffix derived from the engine's random tool-call id."""
    return engine_id.rsplit("-", 1)[-1][:length]


def compact_arguments(arguments: str) -> str:
    """Tool arguments as compact JSON, as JSON.stringify-style harnesses re-serialise them.

    vLLM's parser emits ``{"city": "Paris"}``; harnesses echo ``{"city":"Paris"}``. Answering compact
    keeps the echoed history byte-identical. Unparseable text is passed through unchanged.
    """
    try:
        return orjson.dumps(orjson.loads(arguments)).decode()
    except orjson.JSONDecodeError:
        return arguments


def arguments_object(arguments: str) -> dict[str, Any]:
    """Tool arguments as an object (Anthropic ``input``, Gemini ``args``); non-objects are wrapped."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def require(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Fetch a required field or raise a clear RequestError naming it."""
    if key not in body:
        raise RequestError(f"missing required field '{key}' ({what})")
    value = body[key]
    if not isinstance(value, kind):
        raise RequestError(f"field '{key}' must be {what}")
    return value


def object_list(value: Any, name: str) -> list[Mapping[str, Any]]:
    """A list of JSON objects (empty when absent), or a RequestError naming the bad entry."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be a list")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise RequestError(f"{name}[{i}] must be an object")
    return value


def as_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"'{name}' must be a positive integer")
    return value


def as_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number")
    number = float(value)
    if not math.isfinite(number):
        raise RequestError(f"'{name}' must be a finite number")
    return number


def as_temperature(value: Any, name: str) -> float | None:
    """A sampling temperature: a finite number >= 0 (what vLLM and SGLang accept)."""
    number = as_float(value, name)
    if number is not None and number < 0:
        raise RequestError(f"'{name}' must be >= 0, got {number}")
    return number


def as_top_p(value: Any, name: str) -> float | None:
    """A nucleus mass in (0, 1]; zero, negative and subnormal values are client errors."""
    number = as_float(value, name)
    if number is not None and not (sys.float_info.min <= number <= 1.0):
        raise RequestError(f"'{name}' must be in (0, 1], got {number}")
    return number


def stop_list(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise RequestError(f"'{name}' must be a string or a list of strings")
