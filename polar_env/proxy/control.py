"""The control plane: ``POST /sessions``, the session routes and ``/admin/*``.

They need the admin token (``Authorization: Bearer``), which is always set: the ``Gateway``
generates one in memory when the config has none (``gateway.config.admin_token``). A session's
own key also opens its ``GET /sessions/{id}`` and ``…/completions``. Sandboxes never see these
routes at all: they are served ``gateway.provider_app``, which has only the provider routes (see
``polar_env/runtimes/relay.py`` for why the filter lives here).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import orjson
from aiohttp import web

from polar_env.errors import RequestError
from polar_env.journal.reader import JournalError
from polar_env.proxy.admin import bearer_token, token_matches
from polar_env.proxy.core import GatewayCore
from polar_env.proxy.pipeline import json_response, read_json
from polar_env.proxy.sessions import Session, request_keys

log = logging.getLogger("polar_env.gateway")


def _plain_error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


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


def session_summary(session: Session) -> dict[str, Any]:
    """What the session routes show about a session (never its key)."""
    return {"session_id": session.id, "created_at": session.created_at, "closed": session.closed,
            "continuation": session.continuation_mode,
            "completions": session.next_seq, "errors": session.errors, "metadata": session.metadata}


_PAGE = 8  # records decoded per trip to the reader thread; the loop serves others in between


def _int_param(request: web.Request, name: str, default: int | None) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise RequestError(f"{name} must be a non-negative integer, got {raw!r}")
    return int(raw)


def _timeout_param(request: web.Request) -> float:
    raw = request.query.get("timeout_s", "600")
    try:
        value = float(raw)
    except ValueError:
        raise RequestError(f"timeout_s must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"timeout_s must be a finite number >= 0, got {raw!r}")
    return value


class ControlPlane:
    """The session and admin routes' handlers over one gateway core (``gw``)."""

    def __init__(self, gw: GatewayCore) -> None:
        self.gw = gw

    def is_admin(self, request: web.Request) -> bool:
        return token_matches(bearer_token(request.headers.get("Authorization", "")), self.gw.config.admin_token or "")

    def reads_metrics(self, request: web.Request) -> bool:
        """The admin token, or the read-only metrics token (a scraper that can do nothing else)."""
        given = bearer_token(request.headers.get("Authorization", ""))
        metrics = self.gw.config.metrics_token
        return self.is_admin(request) or (metrics is not None and token_matches(given, metrics))

    def require_admin(self, request: web.Request) -> None:
        if not self.is_admin(request):
            raise RequestError("admin token required (Authorization: Bearer <admin token>)", status=401)

    def authorize_session(self, request: web.Request) -> Session:
        """The session named in the path, for the admin or that session's own key; else 401/404."""
        registry = self.gw.sessions
        session_id = request.match_info["session_id"]
        if self.is_admin(request):
            return registry.get(session_id)
        own = registry.by_key(request_keys(request.headers, request.query))
        if own is None or own.id != session_id:
            raise RequestError("this route needs the admin token or the session's own key", status=401)
        return own

    def base_url(self, request: web.Request) -> str:
        configured = self.gw.config.public_url
        return (configured or f"{request.scheme}://{request.host}").rstrip("/")

    async def create_session(self, request: web.Request) -> web.Response:
        try:
            self.require_admin(request)
            body = await read_json(request, self.gw.config.max_body_bytes) if request.can_read_body else {}
            session_id = body.get("session_id")
            if session_id is not None and not isinstance(session_id, str):
                raise RequestError("'session_id' must be a string")
            metadata = body.get("metadata")
            wants = body.get("continuation", self.gw.config.continuation)
            if not isinstance(wants, bool):
                raise RequestError("'continuation' must be a boolean")
            session = self.gw.open_session(session_id, metadata, wants)
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)
        except OSError as exc:  # the session state could not be persisted (disk full): no session
            log.error("cannot persist a new session: %s", exc)
            return json_response({"error": {"message": f"cannot persist the session: {exc.strerror or exc}",
                                            "type": "server_error", "code": 507}}, 507)
        assert session.key is not None
        base = self.base_url(request)
        model = self.gw.config.engine_model
        return json_response({
            "session_id": session.id,
            "key": session.key,
            "continuation": session.continuation_mode,
            "model": model,
            "base_url": base,
            "base_urls": {"anthropic": base, "openai": f"{base}/v1", "gemini": base},
            "env": session_env(base, session.id, session.key, model),
        }, 201)

    async def list_sessions(self, request: web.Request) -> web.Response:
        """Admin: every session this gateway process knows, oldest first."""
        if not self.is_admin(request):
            return _plain_error(401, "admin token required (Authorization: Bearer <admin token>)")
        sessions = sorted(self.gw.sessions, key=lambda s: s.created_at)
        return json_response({"sessions": [session_summary(s) for s in sessions]})

    async def get_session(self, request: web.Request) -> web.Response:
        try:
            return json_response(session_summary(self.authorize_session(request)))
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)

    async def session_completions(self, request: web.Request) -> web.StreamResponse:
        """The session's journal, read back from disk (what a trainer or builder consumes), as whole
        records. ``?start=N&limit=M`` pages through it. The journal is decoded on a reader thread a
        few records at a time and streamed, so a 100-call session never stalls the event loop."""
        try:
            session_id = self.authorize_session(request).id
            start = _int_param(request, "start", 0) or 0
            limit = _int_param(request, "limit", None)
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)
        records = self.gw.store.iter_records(session_id, start)

        def page() -> list[bytes]:
            out = []
            for record in records:
                out.append(record.to_json())
                if len(out) == _PAGE:
                    break
            return out

        remaining = limit
        try:
            chunk = await asyncio.to_thread(page)  # the first page before the 200: errors still get a 500
        except JournalError as exc:
            log.error("%s", exc)
            return json_response({"error": {"message": f"journal unreadable: {exc}", "type": "server_error", "code": 500}}, 500)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"session_id":' + orjson.dumps(session_id) + b',"completions":[')
        first = True
        try:
            while chunk and (remaining is None or remaining > 0):
                if remaining is not None:
                    chunk, remaining = chunk[:remaining], remaining - len(chunk[:remaining])
                await resp.write((b"" if first else b",") + b",".join(chunk))
                first = False
                chunk = await asyncio.to_thread(page)
        except JournalError as exc:  # past the status line: end the body unparseable rather than short
            log.error("%s", exc)
            await resp.write(b"]")
            return resp
        await resp.write(b"]}")
        await resp.write_eof()
        return resp

    async def delete_session(self, request: web.Request) -> web.Response:
        try:
            session = self.gw.close_session(self.authorize_session(request).id)
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)
        return json_response(session_summary(session))

    async def admin_pause(self, request: web.Request) -> web.Response:
        """Drain in-flight calls. If they do not finish within ``timeout_s`` the pause is undone
        (504, ``drained: false``, ``paused: false``) and ``running`` lists the calls still going."""
        try:
            self.require_admin(request)
            timeout_s = _timeout_param(request)
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)
        gate = self.gw.gate
        drained = await self.gw.pause(timeout_s)
        if drained:
            return json_response({**gate.status(), "drained": True, "running": []})
        running = gate.running()
        message = f"{len(running)} engine call(s) did not finish within {timeout_s:g}s; the pause was undone"
        return json_response({**gate.status(), "drained": False, "running": running,
                              "error": {"message": message, "type": "timeout_error", "code": 504}}, 504)

    async def admin_resume(self, request: web.Request) -> web.Response:
        version = None
        try:
            self.require_admin(request)
            body = await read_json(request, self.gw.config.max_body_bytes) if request.can_read_body else {}
            raw = body.get("weight_version")
            if raw is not None:
                if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
                    raise RequestError("'weight_version' must be a string or a number")
                version = str(raw)
        except RequestError as exc:
            return _plain_error(exc.status, exc.message)
        await self.gw.resume(version)
        return json_response(self.gw.gate.status())

    async def admin_status(self, request: web.Request) -> web.Response:
        if not self.is_admin(request):
            return _plain_error(401, "admin token required (Authorization: Bearer <admin token>)")
        return json_response(self.gw.status())
