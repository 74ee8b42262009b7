"""Sessions and the rule that ties a request to one: the secret key we issued is authoritative.

The key may arrive as ``x-api-key`` (Anthropic), ``Authorization: Bearer`` (OpenAI, Codex),
``x-goog-api-key`` or ``?key=`` (Gemini). A ``/s/{session_id}/`` path prefix names the session
explicitly, but the key must still belong to it. Harness headers that merely look like ours
(opencode's own ``x-session-id``) are never consulted.

Keys are never kept in clear past creation: the registry indexes SHA-256 digests and confirms a hit
with ``hmac.compare_digest``. Every session's state (id, key digest, metadata, continuation flag,
closed) is persisted in the store when it changes; a restarted gateway restores it, and the
journal's last record gives the sequence to continue from. An id that exists (in memory or in the
store) is never created again, so nobody can append to another session's journal.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_env.errors import RequestError
from polar_env.journal.protocols import JournalSink, SessionMeta, check_session_id, key_digest
from polar_env.proxy.config import Sampling
from polar_env.proxy.continuation import Continuation
from polar_env.proxy.echoes import EchoTip
from polar_env.proxy.reuse import Translations

log = logging.getLogger("polar_env.gateway")

MAX_METADATA_BYTES = 64 * 1024  # task ids, seeds, labels; not a place for datasets


@dataclass(slots=True)
class Session:
    id: str
    key: str | None  # only known to the process that created it; restored sessions have None
    key_hash: bytes
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    next_seq: int = 0
    closed: bool = False
    errors: int = 0
    continuation: Continuation | None = None  # token-in mode (see continuation.py)
    continuation_mode: bool = False
    echo: EchoTip | None = None  # canonical mode: the last recorded prompt, as echoed (echoes.py)
    last_used: float = field(default_factory=time.monotonic)
    sampling: Sampling | None = None  # the task's trainer sampling, in place of the gateway's (complete)
    # The last request's list fields (provider body, chat request) that the next one shares its
    # unchanged history with (proxy/reuse.py); references, not copies.
    shared_body: dict[str, list[object]] = field(default_factory=dict)
    shared_chat: dict[str, list[object]] = field(default_factory=dict)
    translations: Translations = field(default_factory=Translations)  # what to_chat made of shared items

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def meta(self) -> SessionMeta:
        return SessionMeta(session_id=self.id, key_sha256=self.key_hash.hex(), created_at=self.created_at,
                           metadata=self.metadata, continuation=self.continuation_mode, closed=self.closed,
                           sampling=None if self.sampling is None else self.sampling.model_dump())


def request_keys(headers: Mapping[str, str], query: Mapping[str, str]) -> list[str]:
    """Every credential the request carries, in the places the four provider SDKs put them."""
    keys = [headers.get("x-api-key", ""), headers.get("x-goog-api-key", ""), query.get("key", "")]
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        keys.append(auth[7:].strip())
    return [k for k in keys if k]


def check_metadata(metadata: Any) -> dict[str, Any]:
    if not isinstance(metadata, dict):
        raise RequestError("'metadata' must be an object")
    try:
        size = len(orjson.dumps(metadata))
    except orjson.JSONEncodeError as exc:
        raise RequestError(f"'metadata' cannot be stored: {exc}") from exc
    if size > MAX_METADATA_BYTES:
        raise RequestError(f"'metadata' is {size} bytes; the limit is {MAX_METADATA_BYTES}", status=413)
    return dict(metadata)


class SessionRegistry:
    def __init__(self, store: JournalSink, continuation_factory: Callable[[], Continuation] | None = None) -> None:
        self.store = store
        self._continuation_factory = continuation_factory
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[bytes, Session] = {}
        self.restore()

    def restore(self) -> None:
        """Load every session persisted in the store (a restart keeps keys, ids and sequences)."""
        for meta in self.store.session_metas():
            if meta.session_id in self._by_id:
                continue
            session = Session(
                id=meta.session_id,
                key=None,
                key_hash=bytes.fromhex(meta.key_sha256),
                created_at=meta.created_at,
                metadata=meta.metadata,
                next_seq=self.store.next_seq(meta.session_id),
                closed=meta.closed,
                continuation_mode=meta.continuation,
                sampling=None if meta.sampling is None else Sampling.model_validate(meta.sampling),
            )
            if meta.continuation and self._continuation_factory is not None:
                session.continuation = self._continuation_factory()  # earlier turns fall back to templating
            self._by_id[session.id] = session
            if not session.closed:
                self._by_key[session.key_hash] = session

    def create(
        self,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        continuation: Continuation | None = None,
        sampling: Sampling | None = None,
    ) -> Session:
        sid = session_id if session_id is not None else secrets.token_hex(8)
        try:
            check_session_id(sid)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        if sid in self._by_id or self.store.has_session(sid):
            raise RequestError(f"session {sid!r} already exists (ids are never reused)", status=409)
        key = f"sk-polar-{secrets.token_urlsafe(24)}"
        session = Session(
            id=sid,
            key=key,
            key_hash=key_digest(key),
            created_at=time.time(),
            metadata=check_metadata(metadata or {}),
            continuation=continuation,
            continuation_mode=continuation is not None,
            sampling=sampling,
        )
        self.store.write_session_meta(session.meta())  # first: a session that cannot be restored is not issued
        self._by_id[sid] = session
        self._by_key[session.key_hash] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise RequestError(f"unknown session {session_id!r}", status=404, kind="not_found_error")
        return session

    def by_key(self, keys: list[str]) -> Session | None:
        """The open session one of ``keys`` belongs to (constant-time confirmation), or None."""
        for k in keys:
            digest = key_digest(k)
            session = self._by_key.get(digest)
            if session is not None and hmac.compare_digest(digest, session.key_hash):
                return session
        return None

    def resolve(self, keys: list[str], path_session: str | None = None) -> Session:
        """The open session the request's key belongs to, or a 401 RequestError."""
        session = self.by_key(keys)
        if session is None:
            raise RequestError("invalid API key: not issued by this gateway", status=401, kind="authentication_error")
        if path_session is not None and path_session != session.id:
            raise RequestError("API key does not belong to this session", status=401, kind="authentication_error")
        if session.closed:
            raise RequestError(f"session {session.id!r} is closed", status=401, kind="authentication_error")
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str) -> Session:
        session = self.get(session_id)
        session.closed = True
        session.continuation = None
        session.echo = None
        session.shared_body, session.shared_chat, session.translations = {}, {}, Translations()
        self._by_key.pop(session.key_hash, None)
        self.store.close_session(session_id)
        try:
            self.store.write_session_meta(session.meta())
        except OSError as exc:  # closed in memory now; a restart would reopen it, so say so
            log.error("session %s closed but its state could not be persisted: %s", session_id, exc)
        return session

    def expire_idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """Close open sessions unused for ``idle_s`` seconds; returns their ids."""
        now = time.monotonic() if now is None else now
        stale = [s.id for s in self._by_key.values() if now - s.last_used > idle_s]
        for sid in stale:
            self.close(sid)
        return stale

    def open_count(self) -> int:
        return len(self._by_key)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))
