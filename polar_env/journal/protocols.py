"""The two seams of journal storage, so a store other than local files (a multi-host store, an
object store) plugs in without touching the gateway or its readers.

``JournalSink`` is what the gateway writes through; ``JournalSource`` is what everything after a
call reads through (builders, POSTRUN workers, salvage, the dashboard, exports). ``JournalStore``
(``store.py``) implements both over one folder. Neither seam imports aiohttp, Ray or torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from polar_env.journal.format import PromptRef
from polar_env.journal.reader import PromptRefs
from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.records import CompletionRecord


class JournalSink(Protocol):
    """Where captured calls go.

    Contract:
    - ``append`` returns only once the record is durable (written whole, and fsynced when
      ``fsync``); otherwise it raises ``CaptureError`` and leaves nothing of the record behind.
      The gateway calls it before it answers, so a reply never exists for a lost call. Appends of
      one session arrive in capture order from one thread at a time.
    - ``append_event`` adds a non-record line (an aborted call) with the same durability.
    - ``write_session_meta`` replaces the session's state atomically; a session whose state
      cannot be written is not issued.
    - ``session_metas``, ``next_seq`` and ``has_session`` are what a restarted gateway reads back
      to restore its sessions.
    - ``forget`` drops a closed session's open resources (descriptor, encoder state);
      ``close_session`` only its descriptor; ``close`` all of them. None of these loses data.
    """

    @property
    def fsync(self) -> bool: ...

    def append(self, record: CompletionRecord, ref: PromptRef | None = None) -> int: ...

    def append_event(self, session_id: str, event: dict[str, Any]) -> None: ...

    def write_session_meta(self, meta: SessionMeta) -> None: ...

    def session_metas(self) -> list[SessionMeta]: ...

    def next_seq(self, session_id: str) -> int: ...

    def has_session(self, session_id: str) -> bool: ...

    def iter_records(self, session_id: str, start: int = 0) -> Iterator[CompletionRecord]: ...

    def open_fds(self) -> int: ...

    def close_session(self, session_id: str) -> None: ...

    def forget(self, session_id: str) -> None: ...

    def close(self) -> None: ...


class JournalSource(Protocol):
    """Where captured calls and outcomes are read back.

    Contract:
    - ``read`` returns a session's complete records in capture order; a torn last line (a crash
      mid-write) is skipped, any other bad line raises ``JournalError`` naming where it is.
      Client-gone events are folded into their records' notes. An unknown session reads as [].
    - ``read_with_refs`` also returns the v2 prompt references (``{seq: (parent, keep)}``).
    - ``session_ids`` lists sessions with a journal; ``outcome_ids`` those with an outcome (a
      session can have an outcome and no call).
    - ``read_session_meta`` / ``read_outcome`` return None when nothing was stored; ``next_seq``
      counts a session's calls from the journal's tail (cheap for an open session).
    - ``path`` names where a session's journal lives, for messages and for worker processes that
      reopen the store by folder.
    """

    def session_ids(self) -> list[str]: ...

    def read(self, session_id: str) -> list[CompletionRecord]: ...

    def read_with_refs(self, session_id: str) -> tuple[list[CompletionRecord], PromptRefs]: ...

    def iter_records(self, session_id: str, start: int = 0) -> Iterator[CompletionRecord]: ...

    def events(self, session_id: str) -> list[dict[str, Any]]: ...

    def read_session_meta(self, session_id: str) -> dict[str, Any] | None: ...

    def session_metas(self) -> list[SessionMeta]: ...

    def read_outcome(self, session_id: str) -> dict[str, Any] | None: ...

    def next_seq(self, session_id: str) -> int: ...

    def outcome_ids(self) -> list[str]: ...

    def path(self, session_id: str) -> Path: ...


def _conforms(store: JournalStore) -> tuple[JournalSink, JournalSource]:
    """Never called: mypy checks here that the file store implements both seams."""
    return store, store
