"""The gateway's events: one typed record per kind, and their fan-out to subscribers.

The gateway (``polar_env.proxy.core``) emits them; the metrics (``metrics.py``) and any other
watcher read them. They are declared here, below the gateway, so a reader names the same types
the gateway emits without importing it. ``emit`` checks each kind's fields against its TypedDict,
and a reader narrows on ``event.kind`` (``if event.kind == "call_recorded": event.data["seq"]``).
Events live in memory only: nothing persists them. Adding a kind: a TypedDict, an alias in
``GatewayEvent`` and an ``emit`` overload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypedDict, TypeVar, Unpack, cast, overload

log = logging.getLogger("polar_env.gateway")


class SessionOpened(TypedDict):
    continuation: bool


class SessionClosed(TypedDict):
    reason: str  # "closed", "idle", or the caller's reason


class CallRecorded(TypedDict):
    seq: int
    provider: str  # the wire format (``ProviderAPI`` value)
    journal_bytes: int
    prompt_tokens: int
    response_tokens: int
    engine_ms: float
    total_ms: float
    finish_reason: str
    notes: list[str]


class CallFailed(TypedDict):
    provider: str
    error: str  # the exception's class name
    status: int  # the HTTP status the harness got


class CallsAborted(TypedDict):
    calls: int
    reason: str


class Paused(TypedDict):
    drained: bool


class Resumed(TypedDict):
    weight_version: str


K = TypeVar("K", bound=str)
D = TypeVar("D")


@dataclass(frozen=True, slots=True)
class Event(Generic[K, D]):
    """One event: ``kind``, the session it concerns (None for gateway-wide ones), its fields, when."""

    kind: K
    session_id: str | None
    data: D
    at: float = field(default_factory=time.time)


GatewayEvent = (Event[Literal["session_opened"], SessionOpened] | Event[Literal["session_closed"], SessionClosed]
                | Event[Literal["call_recorded"], CallRecorded] | Event[Literal["call_failed"], CallFailed]
                | Event[Literal["calls_aborted"], CallsAborted] | Event[Literal["paused"], Paused]
                | Event[Literal["resumed"], Resumed])

EVENT_KINDS = ("session_opened", "session_closed", "call_recorded", "call_failed", "calls_aborted", "paused", "resumed")

Subscriber = Callable[[GatewayEvent], None]


class GatewayEvents:
    """Synchronous fan-out of ``GatewayEvent`` to subscribers (metrics, the dashboard). Subscribers
    must be cheap and must not block; one that raises is logged and never affects the request."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Register ``fn``; returns the function that unsubscribes it."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    @overload
    def emit(self, kind: Literal["session_opened"], session_id: str | None, **data: Unpack[SessionOpened]) -> None: ...
    @overload
    def emit(self, kind: Literal["session_closed"], session_id: str | None, **data: Unpack[SessionClosed]) -> None: ...
    @overload
    def emit(self, kind: Literal["call_recorded"], session_id: str | None, **data: Unpack[CallRecorded]) -> None: ...
    @overload
    def emit(self, kind: Literal["call_failed"], session_id: str | None, **data: Unpack[CallFailed]) -> None: ...
    @overload
    def emit(self, kind: Literal["calls_aborted"], session_id: str | None, **data: Unpack[CallsAborted]) -> None: ...
    @overload
    def emit(self, kind: Literal["paused"], session_id: str | None, **data: Unpack[Paused]) -> None: ...
    @overload
    def emit(self, kind: Literal["resumed"], session_id: str | None, **data: Unpack[Resumed]) -> None: ...

    def emit(self, kind: str, session_id: str | None, **data: object) -> None:
        if not self._subscribers:
            return
        event = cast(GatewayEvent, Event(kind, session_id, data))  # the overloads matched kind to its fields
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - a subscriber's bug never fails a request
                log.exception("gateway event subscriber %r failed on %s", fn, kind)
