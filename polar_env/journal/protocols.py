"""The seams of journal storage, so a store other than local files (a multi-host store, an object
store, memory) plugs in without touching the gateway or its readers.

``JournalSink`` is what the gateway writes through; ``JournalSource`` is what everything after a
call reads through (builders, POSTRUN workers, salvage, the dashboard, exports); ``Journal`` is
both over one place (a node's store: it journals calls and records outcomes). Only composition
roots (the CLI, node start, the rollout server, the dashboard server, the demo and train programs)
name a concrete store; code that opens a store by folder takes a ``JournalOpener`` from its root.
``store.py`` (files) and ``memory.py`` (memory) implement ``Journal``; both pass
``tests/journal/test_store_contract.py``. Nothing here imports a store, aiohttp, Ray or torch.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from polar_env.errors import PolarError
from polar_env.journal.format import PromptRef
from polar_env.journal.reader import PromptRefs
from polar_env.records import CompletionRecord

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_session_id(session_id: str) -> str:
    """Every store refuses the same ids (ValueError): ids become file names in the file store."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise ValueError(f"invalid session id {session_id!r}: use [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}")
    return session_id


def key_digest(key: str) -> bytes:
    """What is stored and indexed instead of a session key: its SHA-256."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class CaptureError(PolarError):
    """A record could not be written whole; nothing of it is left in the journal."""


class SessionMeta(BaseModel):
    """A session's persisted state (never the key in clear); the journal holds its sequence."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    key_sha256: str
    created_at: float
    metadata: dict[str, Any] = Field(default_factory=dict)
    continuation: bool = False
    closed: bool = False
    sampling: dict[str, Any] | None = None  # the session's own trainer sampling (proxy.config.Sampling)


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
    - ``write_outcome`` replaces the session's outcome atomically (readers never see half of one).
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

    def write_outcome(self, session_id: str, outcome: dict[str, object]) -> None: ...

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
    - ``path`` names where a session's journal lives, for messages; a journal that is a file
      there can be reopened by another process (POSTRUN workers) through a ``JournalOpener``.
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


class Journal(JournalSink, JournalSource, Protocol):
    """Both seams over one place: what a node's gateway journals to and its POSTRUN reads back and
    records outcomes in (also salvage, and a resumed run marking its outcome files)."""


JournalOpener = Callable[[Path], Journal]
"""Opens the journal kept at a folder (a run's ``capture/<node>/``). Roots pass the store class
itself (``JournalStore``): a class pickles by name, so workers in other processes get it too."""
