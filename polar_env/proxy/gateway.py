"""The ``Gateway``: one object owning what a running gateway shares — the engine client, the
journal, the session registry, the pause gate and the in-flight captures — and their lifetime.

The aiohttp applications (``app``: the full API; ``provider_app``: the provider routes only, for
sandboxes) are route tables over it (``proxy/app.py``); handlers reach it through one app key
that nothing outside ``proxy/`` uses. Nodes, the CLI, the demo, the harness check and the trainer
hold a ``Gateway`` and call its methods.

Lifetime: ``await gateway.start(...)`` binds the sockets; ``await gateway.aclose()`` stops
accepting, waits for every in-flight capture (a record being written when the harness already
left) and only then closes the engine client and the journal. Serving ``gateway.app`` through any
aiohttp runner (a test server) runs the same shutdown from the app's cleanup context.

Events: ``gateway.events.subscribe(fn)`` calls ``fn(event)`` on the event loop for every
``GatewayEvent`` (see ``EVENT_KINDS``). Subscribers must be cheap and must not block (count,
enqueue); one that raises is logged and never affects the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from polar_env.engines.base import EngineClient
from polar_env.journal.format import PromptRef
from polar_env.journal.protocols import JournalSink
from polar_env.journal.store import CaptureError
from polar_env.journal.writer import JournalWriter
from polar_env.proxy.admin import new_admin_token
from polar_env.proxy.continuation import Continuation
from polar_env.proxy.gate import EngineGate
from polar_env.proxy.sessions import Session, SessionRegistry
from polar_env.qwen.template import QWEN35, TemplateQuirks
from polar_env.qwen.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from polar_env.records import CompletionRecord, Generation

log = logging.getLogger("polar_env.gateway")


class Sampling(BaseModel):
    """Trainer-owned sampling: each value that is set overrides what every harness request says,
    whatever the engine (``PolarEnvConfig.sampling``, the node's and the gateway's are this one
    model; the CLI's ``--temperature``/``--top-p``/``--max-tokens`` are views of it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)  # cap on the tokens sampled per call


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_model: str
    public_url: str | None = None  # what harnesses should use; defaults to the request's Host
    max_body_bytes: int = 32 * 1024 * 1024  # a 100k-token Claude Code history is ~1-2 MB
    sampling: Sampling = Sampling()
    admin_token: str | None = None  # None: the Gateway generates one (gateway.config.admin_token)
    template: TemplateQuirks = QWEN35  # the engine's chat template; continuation mode renders with it
    continuation: bool = False  # default for new sessions (POST /sessions may override)
    engine_timeout_s: float = 1800.0  # per engine call; past it the harness gets a 504
    session_idle_s: float | None = 24 * 3600.0  # open sessions unused this long are closed; None: never
    drain_s: float = 30.0  # aclose waits this long for in-flight captures before closing the journal


INLINE_BODY_BYTES = 64 * 1024  # records up to these sizes are written on the loop when the writer is idle
INLINE_TOKENS = 16_384

EVENT_KINDS = ("session_opened", "session_closed", "call_recorded", "call_failed", "calls_aborted", "paused", "resumed")


@dataclass(frozen=True, slots=True)
class GatewayEvent:
    """``kind`` is one of ``EVENT_KINDS``. ``data`` by kind — call_recorded: seq, provider, journal_bytes,
    prompt_tokens, response_tokens, engine_ms, total_ms, finish_reason, notes; call_failed:
    provider, error (class name), status; session_closed: reason; calls_aborted: calls, reason;
    paused: drained;
    resumed: weight_version."""

    kind: str
    session_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)


class GatewayEvents:
    """Synchronous fan-out of ``GatewayEvent`` to subscribers (metrics, the dashboard)."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[GatewayEvent], None]] = []

    def subscribe(self, fn: Callable[[GatewayEvent], None]) -> Callable[[], None]:
        """Register ``fn``; returns the function that unsubscribes it."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    def emit(self, kind: str, session_id: str | None = None, **data: Any) -> None:
        if not self._subscribers:
            return
        event = GatewayEvent(kind, session_id, data)
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - a subscriber's bug never fails a request
                log.exception("gateway event subscriber %r failed on %s", fn, kind)


class Gateway:
    """See the module docstring. ``engine`` is closed by ``aclose``; ``store`` too."""

    def __init__(self, engine: EngineClient, store: JournalSink, config: GatewayConfig) -> None:
        if not config.admin_token:
            config = config.model_copy(update={"admin_token": new_admin_token()})
        self.engine = engine
        self.store = store
        self.config = config
        self.gate = EngineGate()
        self.sessions = SessionRegistry(store, self.new_continuation)
        self.events = GatewayEvents()
        self.stats: dict[str, int] = {"engine_errors": 0, "capture_errors": 0, "abandoned": 0, "unexpected": 0,
                                  "client_gone": 0}
        self.in_flight: set[asyncio.Future[Any]] = set()  # strong references to shielded captures
        self._engine_calls: dict[str, set[asyncio.Task[Generation]]] = {}  # session -> running engine calls
        self.aborted: dict[asyncio.Task[Generation], str] = {}  # engine calls the gateway cancelled, and why
        self._app: web.Application | None = None
        self._provider_app: web.Application | None = None
        self._runners: list[web.AppRunner] = []
        self._expiry: asyncio.Task[None] | None = None
        self._closed = False
        self._writer: JournalWriter | None = None  # started on the first record
        self._port: int | None = None
        self._host = "127.0.0.1"
        self.socket: Path | None = None  # the unix socket sandboxes reach (provider routes only)

    @staticmethod
    def of(app: web.Application) -> Gateway:
        """The gateway behind one of its aiohttp apps (for middleware and tests holding an app)."""
        return app[GATEWAY]

    # -- the route tables ---------------------------------------------------------------------
    @property
    def app(self) -> web.Application:
        """The full API (providers, sessions, admin); its cleanup context owns the lifetime."""
        if self._app is None:
            from polar_env.proxy.app import build_app

            self._app = build_app(self)
        return self._app

    @property
    def provider_app(self) -> web.Application:
        """What a sandbox is served: provider routes only, over this gateway's state."""
        if self._provider_app is None:
            from polar_env.proxy.app import build_provider_app

            self._provider_app = build_provider_app(self)
        return self._provider_app

    # -- lifetime -----------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int | None = 0, unix_socket: str | Path | None = None,
                    *, access_log: logging.Logger | None = None, access_log_class: Any = None) -> Gateway:
        """Serve the full API on ``host:port`` (``port=None``: no TCP listener) and the provider
        routes on ``unix_socket`` when given. Raises OSError when a socket cannot be bound."""
        kwargs: dict[str, Any] = {"access_log": access_log}
        if access_log_class is not None:
            kwargs["access_log_class"] = access_log_class
        runner = web.AppRunner(self.app, **kwargs)
        await runner.setup()
        self._runners.append(runner)
        try:
            if port is not None:
                site = web.TCPSite(runner, host, port)
                await site.start()
                self._host = host
                self._port = int(runner.addresses[-1][1])
            if unix_socket is not None:
                sandbox = web.AppRunner(self.provider_app, access_log=None)
                await sandbox.setup()
                self._runners.insert(0, sandbox)
                await web.UnixSite(sandbox, str(unix_socket)).start()
                self.socket = Path(unix_socket)
        except BaseException:
            await self.aclose()
            raise
        return self

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def url(self) -> str | None:
        """``http://host:port`` of the full API, or None when no TCP listener was started."""
        return None if self._port is None else f"http://{self._host}:{self._port}"

    async def aclose(self) -> None:
        """Stop listening, drain in-flight captures, then close the engine client and journal."""
        runners, self._runners = self._runners, []
        for runner in runners:  # the sandbox runner first: it does not own the state
            await runner.cleanup()
        await self._shutdown()  # already done by the app's cleanup context when it was served

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _startup(self) -> None:
        idle_s = self.config.session_idle_s
        if idle_s and self._expiry is None:
            self._expiry = asyncio.create_task(self._expire_idle(idle_s))

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
            self._expiry = None
        await self.drain(self.config.drain_s)
        try:
            await self.engine.aclose()
        finally:
            if self._writer is not None:
                await asyncio.to_thread(self._writer.close)  # everything queued is written first
            self.store.close()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every in-flight capture settled; False if some were still running."""
        pending = [f for f in self.in_flight if not f.done()]
        if not pending:
            return True
        done, still = await asyncio.wait(pending, timeout=timeout_s)
        if still:
            log.error("%d capture(s) still running after %gs at shutdown; closing anyway", len(still), timeout_s)
        return not still

    # -- engine calls -------------------------------------------------------------------------
    def start_engine_call(self, session_id: str, call: Any) -> asyncio.Task[Generation]:
        """Run one engine call as its own task, so ``abort_session`` can stop it."""
        task: asyncio.Task[Generation] = asyncio.ensure_future(call)
        calls = self._engine_calls.setdefault(session_id, set())
        calls.add(task)

        def done(t: asyncio.Task[Generation]) -> None:
            calls.discard(t)
            if not calls and self._engine_calls.get(session_id) is calls:
                del self._engine_calls[session_id]

        task.add_done_callback(done)
        return task

    def abort_session(self, session_id: str, reason: str) -> int:
        """Stop the session's in-flight engine calls (cancel, early stop, close) by cancelling their
        tasks: the engine clients honour cancellation (vLLM: the closed connection aborts the
        request; SGLang: the client posts ``/abort_request`` for the call's rid). Returns how many
        calls were aborted."""
        tasks = [t for t in self._engine_calls.get(session_id, ()) if not t.done()]
        for task in tasks:
            self.aborted[task] = reason
            task.cancel()
        if tasks:
            self.stats["aborted"] = self.stats.get("aborted", 0) + len(tasks)
            self.events.emit("calls_aborted", session_id, calls=len(tasks), reason=reason)
        return len(tasks)

    async def mark_aborted(self, session_id: str, mark: dict[str, Any]) -> None:
        """Journal that a call was aborted (no tokens to record), in order with the records."""
        await self.journal_event(session_id, {"event": "aborted", **mark})

    async def journal_event(self, session_id: str, event: dict[str, Any]) -> None:
        """Journal an event line (``{"event": ...}``), in order with the records."""
        if self._writer is None:
            self._writer = JournalWriter(self.store.append)
        await self._writer.submit(self.store.append_event, session_id, event)

    def _forget(self, session_id: str) -> None:
        """Drop a closed session's journal state after whatever is still queued for it."""
        if self._writer is not None:
            self._writer.call(lambda: self.store.forget(session_id))
        else:
            self.store.forget(session_id)

    def track(self, capture: asyncio.Future[Any]) -> None:
        """Keep a strong reference to a shielded capture until it settles."""
        self.in_flight.add(capture)
        capture.add_done_callback(self._settled)

    def _settled(self, capture: asyncio.Future[Any]) -> None:
        """Drop the reference; retrieve the outcome so a capture whose handler was cancelled
        (client gone) does not log 'exception was never retrieved' (it was counted already)."""
        self.in_flight.discard(capture)
        if not capture.cancelled():
            capture.exception()

    async def _expire_idle(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(60.0, max(idle_s / 4, 0.05)))
            for sid in self.sessions.expire_idle(idle_s):
                log.info("session %s closed after %gs idle", sid, idle_s)
                self._forget(sid)
                self.events.emit("session_closed", sid, reason="idle")

    # -- sessions -----------------------------------------------------------------------------
    def new_continuation(self) -> Continuation:
        return Continuation(load_tokenizer(), self.config.template)

    def open_session(self, session_id: str | None = None, metadata: dict[str, Any] | None = None,
                     continuation: bool | Continuation | None = None) -> Session:
        """A new session (raises RequestError for a bad or reused id, OSError when its state cannot
        be persisted). ``continuation``: True/False, a ready tracker, or None for the default."""
        if continuation is None:
            continuation = self.config.continuation
        tracker = self.new_continuation() if continuation is True else continuation or None
        session = self.sessions.create(session_id, {} if metadata is None else metadata, tracker)
        self.events.emit("session_opened", session.id, continuation=session.continuation_mode)
        return session

    def close_session(self, session_id: str, reason: str = "closed") -> Session:
        """Close a session: no new calls; its in-flight engine calls are aborted (nobody will
        use them), and each is marked in its journal."""
        session = self.sessions.close(session_id)
        self.abort_session(session_id, reason)
        self._forget(session_id)
        self.events.emit("session_closed", session_id, reason=reason)
        return session

    async def record(self, record: CompletionRecord, ref: PromptRef | None = None, body_bytes: int | None = None) -> None:
        """Journal one record whole (CaptureError otherwise); returns once it is durable, so
        the reply that follows is never for a lost call. Encoding, write and fsync run on the
        journal writer thread, in submission order; a small record (``inline_record``) is written
        on the loop when the writer is idle, which costs less than the hand-off."""
        if self._closed and (self._writer is None or self._writer.closed):
            raise CaptureError("the gateway is closed; the call was not recorded")
        if self._writer is None:
            self._writer = JournalWriter(self.store.append)
        written = await self._writer.append(record, ref, inline=self.inline_record(record, body_bytes))
        self.events.emit("call_recorded", record.session_id, seq=record.seq, provider=record.provider_api.value,
                         journal_bytes=written if isinstance(written, int) else 0,
                         prompt_tokens=len(record.prompt_ids), response_tokens=len(record.response_ids),
                         engine_ms=record.timings.engine_ms, total_ms=record.timings.total_ms,
                         finish_reason=record.finish_reason, notes=list(record.notes))

    def inline_record(self, record: CompletionRecord, body_bytes: int | None) -> bool:
        """Whether a record is cheap enough to encode and write on the event loop: its provider
        body (hashed per message) and its token lists (serialized) both small, and no fsync.
        Bounded by these sizes, the write costs at most ~0.3 ms of loop time on this machine
        (scripts/bench_gateway.py), never time proportional to a session's history."""
        return (not self.store.fsync and body_bytes is not None and body_bytes <= INLINE_BODY_BYTES
                and len(record.prompt_ids) + len(record.response_ids) <= INLINE_TOKENS)

    # -- weights ------------------------------------------------------------------------------
    async def pause(self, timeout_s: float | None = 600.0) -> bool:
        """Stop new engine calls and drain running ones; False (and not paused) on timeout."""
        drained = await self.gate.pause(timeout_s)
        self.events.emit("paused", None, drained=drained)
        return drained

    async def resume(self, weight_version: str | None = None) -> None:
        """Let calls through again; records sampled from now on carry ``weight_version``."""
        set_version = getattr(self.engine, "set_weight_version", None)
        if weight_version is not None and callable(set_version):
            set_version(weight_version)  # engines that stamp their own version (embedded) carry the trainer's
        await self.gate.resume(weight_version)
        self.events.emit("resumed", None, weight_version=self.gate.weight_version)

    def status(self) -> dict[str, Any]:
        return {**self.gate.status(), "sessions": len(self.sessions), "open_sessions": self.sessions.open_count(),
                "open_journals": self.store.open_fds(), "in_flight_captures": len(self.in_flight), **self.stats}


GATEWAY = web.AppKey("gateway", Gateway)  # proxy-internal: handlers reach the gateway through it
