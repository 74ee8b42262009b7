"""The gateway's core: one object owning what a running gateway shares — the engine client, the
journal sink, the session registry, the pause gate, the in-flight captures and engine calls — and
their lifetime hooks (``startup`` / ``shutdown``: drain in-flight captures, then close the engine
and the journal). It knows nothing of HTTP routes: the request pipeline (``pipeline.py``) and the
control plane (``control.py``) are built over it, the route tables (``app.py``) from those, and
``Gateway`` (``gateway.py``) serves them.

Events: ``gateway.events.subscribe(fn)`` calls ``fn(event)`` on the event loop for every
``GatewayEvent`` (one typed record per kind, declared in ``polar_env/observe/events.py``).
Subscribers must be cheap and must not block (count, enqueue); one that raises is logged and never
affects the request. Counters are typed
(``GatewayStats``): a renamed counter is a type error, not a silent zero on a dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from polar_env import stagecpu
from polar_env.chat import ChatFormat, chat_format
from polar_env.engines.base import EngineClient, WeightVersioned
from polar_env.journal.format import PromptRef
from polar_env.journal.protocols import CaptureError, JournalSink
from polar_env.journal.writer import JournalWriter
from polar_env.observe.events import GatewayEvents
from polar_env.proxy.admin import new_admin_token
from polar_env.proxy.config import GatewayConfig, Sampling
from polar_env.proxy.continuation import Continuation
from polar_env.proxy.gate import EngineGate
from polar_env.proxy.sessions import Session, SessionRegistry

if TYPE_CHECKING:
    from polar_env.records import CompletionRecord, Generation

log = logging.getLogger("polar_env.gateway")


INLINE_BODY_BYTES = 64 * 1024  # records up to these sizes are written on the loop when the writer is idle
INLINE_TOKENS = 16_384

@dataclass(slots=True)
class GatewayStats:
    """What went wrong, counted (``status()`` and ``/admin/status`` report them)."""

    engine_errors: int = 0  # engine calls that failed (answered 5xx/504)
    capture_errors: int = 0  # records that could not be journaled (answered 500)
    abandoned: int = 0  # calls whose client left while queued behind a pause (never sent)
    unexpected: int = 0  # exceptions no handler expected (answered 500, logged)
    client_gone: int = 0  # replies nobody read (recorded, marked client_gone)
    aborted: int = 0  # engine calls cancelled by an abort (cancel, early stop, close)


class GatewayCore:
    """See the module docstring. ``engine`` and ``store`` are closed by ``shutdown``."""

    def __init__(self, engine: EngineClient, store: JournalSink, config: GatewayConfig) -> None:
        if not config.admin_token:
            config = config.model_copy(update={"admin_token": new_admin_token()})
        self.engine = engine
        self.store = store
        self.config = config
        self.gate = EngineGate()
        self.sessions = SessionRegistry(store, self.new_continuation)
        self.events = GatewayEvents()
        self.stats = GatewayStats()
        self.in_flight: set[asyncio.Future[Any]] = set()  # strong references to shielded captures
        self._engine_calls: dict[str, set[asyncio.Task[Generation]]] = {}  # session -> running engine calls
        self.aborted: dict[asyncio.Task[Generation], str] = {}  # engine calls the gateway cancelled, and why
        self._expiry: asyncio.Task[None] | None = None
        self._closed = False
        self._writer: JournalWriter | None = None  # started on the first record

    # -- lifetime -----------------------------------------------------------------------------
    async def startup(self) -> None:
        """Start the idle-session expiry (the app's cleanup context calls this)."""
        idle_s = self.config.session_idle_s
        if idle_s and self._expiry is None:
            self._expiry = asyncio.create_task(self._expire_idle(idle_s))

    async def shutdown(self) -> None:
        """Drain in-flight captures, then close the engine client and the journal (once)."""
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
    def start_engine_call(self, session_id: str, call: Coroutine[object, object, Generation]) -> asyncio.Task[Generation]:
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
            self.stats.aborted += len(tasks)
            self.events.emit("calls_aborted", session_id, calls=len(tasks), reason=reason)
        return len(tasks)

    async def mark_aborted(self, session_id: str, mark: Mapping[str, object]) -> None:
        """Journal that a call was aborted (no tokens to record), in order with the records."""
        await self.journal_event(session_id, {"event": "aborted", **mark})

    async def journal_event(self, session_id: str, event: dict[str, object]) -> None:
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
    @property
    def chat(self) -> ChatFormat:
        """The engine's model family: the request rules, continuation and count_tokens use it."""
        return chat_format(self.config.template)

    def new_continuation(self) -> Continuation:
        return Continuation(self.chat)

    def open_session(self, session_id: str | None = None, metadata: dict[str, Any] | None = None,
                     continuation: bool | Continuation | None = None, sampling: Sampling | None = None) -> Session:
        """A new session (raises RequestError for a bad or reused id, OSError when its state cannot
        be persisted). ``continuation``: True/False, a ready tracker, or None for the default.
        ``sampling``: the session's whole trainer sampling, used instead of ``config.sampling``."""
        if continuation is None:
            continuation = self.config.continuation
        tracker = self.new_continuation() if continuation is True else continuation or None
        session = self.sessions.create(session_id, {} if metadata is None else metadata, tracker, sampling)
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
                         journal_bytes=written,
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
        if weight_version is not None and isinstance(self.engine, WeightVersioned):
            self.engine.set_weight_version(weight_version)  # engines that stamp their own version (embedded) carry the trainer's
        await self.gate.resume(weight_version)
        self.events.emit("resumed", None, weight_version=self.gate.weight_version)

    def status(self) -> dict[str, object]:
        return {**self.gate.status(), "sessions": len(self.sessions), "open_sessions": self.sessions.open_count(),
                "open_journals": self.store.open_fds(), "in_flight_captures": len(self.in_flight), **asdict(self.stats),
                "stage_cpu": stagecpu.snapshot()}

