"""A journal store in memory: the same v2 lines as ``JournalStore`` (``format.py``), kept in lists
instead of files, with session states and outcomes in dicts.

For a gateway or reader that needs no disk (tests, a short-lived probe), and the second store that
shows the seams in ``protocols.py`` hold: it passes the contract suite ``JournalStore`` passes
(tests/journal/test_store_contract.py). Lines and outcomes are kept serialized, so a reader gets
fresh objects and an unserializable record fails at ``append`` as it does on disk. It lives and
dies with its process: ``path`` names no file, so POSTRUN reads it in the node, never in a worker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
from pydantic import ValidationError

from polar_env.journal.format import Encoder, PromptRef, apply_events
from polar_env.journal.protocols import CaptureError, Journal, SessionMeta, check_session_id
from polar_env.journal.reader import JournalError, PromptRefs, iter_journal, read_lines_with_refs
from polar_env.records import CompletionRecord
from polar_env.safetext import escape_surrogates, json_safe


class MemoryJournalStore:
    """Per-session journal lines, session states and outcomes in this process's memory. ``name``
    only labels its ``path``s (messages)."""

    fsync = False  # nothing to sync: a record is "durable" once it is in the list

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self._lines: dict[str, list[bytes]] = {}
        self._last_seq: dict[str, int] = {}
        self._metas: dict[str, bytes] = {}
        self._outcomes: dict[str, bytes] = {}
        self._encoder = Encoder()
        self._lock = threading.RLock()

    def path(self, session_id: str) -> Path:
        return Path(f"memory:{self.name}") / f"{check_session_id(session_id)}.jsonl"

    # -- appending --------------------------------------------------------------------------------
    def append(self, record: CompletionRecord, ref: PromptRef | None = None) -> int:
        """Keep one record's line and return its size; CaptureError (nothing kept) if it cannot be
        serialized."""
        check_session_id(record.session_id)
        with self._lock:
            try:
                data, token = self._encoder.encode(record, ref)
            except (TypeError, orjson.JSONEncodeError) as exc:
                raise CaptureError(f"record cannot be serialized: {exc}") from exc
            self._lines.setdefault(record.session_id, []).append(data)
            self._last_seq[record.session_id] = record.seq
            self._encoder.commit(token)
            return len(data)

    def append_event(self, session_id: str, event: dict[str, object]) -> None:
        check_session_id(session_id)
        with self._lock:
            data = orjson.dumps({"v": 2, "session_id": session_id, **event}, option=orjson.OPT_APPEND_NEWLINE)
            self._lines.setdefault(session_id, []).append(data)

    def _snapshot(self, session_id: str) -> list[bytes]:
        check_session_id(session_id)
        with self._lock:
            return list(self._lines.get(session_id, ()))

    # -- reading ----------------------------------------------------------------------------------
    def read(self, session_id: str) -> list[CompletionRecord]:
        events: list[dict[str, object]] = []
        records = list(iter_journal(self._snapshot(session_id), self.path(session_id), events=events))
        return apply_events(records, events)

    def read_with_refs(self, session_id: str) -> tuple[list[CompletionRecord], PromptRefs]:
        return read_lines_with_refs(self._snapshot(session_id), self.path(session_id))

    def iter_records(self, session_id: str, start: int = 0) -> Iterator[CompletionRecord]:
        yield from iter_journal(self._snapshot(session_id), self.path(session_id), start)

    def events(self, session_id: str) -> list[dict[str, object]]:
        parsed = (orjson.loads(line) for line in self._snapshot(session_id) if b'"event":' in line)
        return [e for e in parsed if "event" in e]

    def next_seq(self, session_id: str) -> int:
        check_session_id(session_id)
        with self._lock:
            last = self._last_seq.get(session_id)
        return 0 if last is None else last + 1

    def session_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._lines)

    def has_session(self, session_id: str) -> bool:
        check_session_id(session_id)
        with self._lock:
            return session_id in self._lines or session_id in self._metas

    # -- session state ----------------------------------------------------------------------------
    def write_session_meta(self, meta: SessionMeta) -> None:
        data = orjson.dumps(meta.model_dump(mode="json"))
        with self._lock:
            self._metas[check_session_id(meta.session_id)] = data

    def read_session_meta(self, session_id: str) -> dict[str, object] | None:
        check_session_id(session_id)
        with self._lock:
            data = self._metas.get(session_id)
        if data is None:
            return None
        try:
            return SessionMeta.model_validate(orjson.loads(data)).model_dump()
        except ValidationError as exc:  # only if SessionMeta changed under a live store
            raise JournalError(f"{self.path(session_id)}: not a valid session state: {str(exc).splitlines()[0]}") from exc

    def session_metas(self) -> list[SessionMeta]:
        with self._lock:  # in the file store's order (sorted file names)
            stored = [self._metas[sid] for sid in sorted(self._metas, key=lambda sid: sid + ".json")]
        return [SessionMeta.model_validate(orjson.loads(data)) for data in stored]

    # -- outcomes ---------------------------------------------------------------------------------
    def write_outcome(self, session_id: str, outcome: dict[str, object]) -> None:
        """As ``JournalStore.write_outcome``: serialized whole, a lone surrogate written escaped."""
        check_session_id(session_id)
        try:
            data = orjson.dumps(outcome, default=str)
        except orjson.JSONEncodeError:
            data = orjson.dumps(json_safe(outcome), default=lambda o: escape_surrogates(str(o)))
        with self._lock:
            self._outcomes[session_id] = data

    def read_outcome(self, session_id: str) -> dict[str, object] | None:
        check_session_id(session_id)
        with self._lock:
            data = self._outcomes.get(session_id)
        parsed = None if data is None else orjson.loads(data)
        return parsed if isinstance(parsed, dict) else None

    def outcome_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._outcomes)

    # -- resources: none held ---------------------------------------------------------------------
    def open_fds(self) -> int:
        return 0

    def close_session(self, session_id: str) -> None:
        return None

    def forget(self, session_id: str) -> None:
        """Drop the session's encoder state (a closed session); its lines stay."""
        with self._lock:
            self._encoder.forget(session_id)

    def close(self) -> None:
        return None


def _conforms(store: MemoryJournalStore) -> Journal:
    """Never called: mypy checks here that the memory store implements both seams."""
    return store
