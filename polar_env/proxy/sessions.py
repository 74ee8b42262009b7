"""Sessions and the rule that ties a request to one: the secret key we issued is authoritative.

The key may arrive as ``x-api-key`` (Anthropic), ``Authorization: Bearer`` (OpenAI, Codex),
``x-goog-api-key`` or ``?key=`` (Gemini). A ``/s/{session_id}/`` path prefix names the session
explicitly, but the key must still belong to it. Harness headers that merely look like ours
(opencode's own ``x-session-id``) are never consulted.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from polar_env.errors import RequestError
from polar_env.proxy.capture import CaptureStore, check_session_id
from polar_env.proxy.continuation import Continuation


@dataclass(slots=True)
class Session:
    id: str
    key: str
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    next_seq: int = 0
    closed: bool = False
    errors: int = 0
    continuation: Continuation | None = None  # token-in mode (see continuation.py)

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


def request_keys(headers: Mapping[str, str], query: Mapping[str, str]) -> list[str]:
    """Every credential the request carries, in the places the four provider SDKs put them."""
    keys = [headers.get("x-api-key", ""), headers.get("x-goog-api-key", ""), query.get("key", "")]
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        keys.append(auth[7:].strip())
    return [k for k in keys if k]


class SessionRegistry:
    def __init__(self, store: CaptureStore) -> None:
        self.store = store
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}

    def create(
        self,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        continuation: Continuation | None = None,
    ) -> Session:
        sid = session_id or secrets.token_hex(8)
        try:
            check_session_id(sid)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        if sid in self._by_id:
            raise RequestError(f"session {sid!r} already exists", status=409)
        session = Session(
            id=sid,
            key=f"sk-polar-{secrets.token_urlsafe(24)}",
            created_at=time.time(),
            metadata=dict(metadata or {}),
            next_seq=self.store.count(sid),  # a re-registered id continues its journal
            continuation=continuation,
        )
        self._by_id[sid] = session
        self._by_key[session.key] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise RequestError(f"unknown session {session_id!r}", status=404, kind="not_found_error")
        return session

    def resolve(self, keys: list[str], path_session: str | None = None) -> Session:
        """The open session the request's key belongs to, or a 401 RequestError."""
        session = next((self._by_key[k] for k in keys if k in self._by_key), None)
        if session is None:
            raise RequestError("invalid API key: not issued by this gateway", status=401, kind="authentication_error")
        if path_session is not None and path_session != session.id:
            raise RequestError("API key does not belong to this session", status=401, kind="authentication_error")
        if session.closed:
            raise RequestError(f"session {session.id!r} is closed", status=401, kind="authentication_error")
        return session

    def close(self, session_id: str) -> Session:
        session = self.get(session_id)
        session.closed = True
        self._by_key.pop(session.key, None)
        self.store.close_session(session_id)
        return session

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))
