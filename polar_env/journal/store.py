"""The journal store: one JSON-lines journal per session, appended before the reply is sent, plus
each session's persisted state (``sessions/<id>.json``) so a restarted gateway knows its sessions.
Lines are journal v2 (``polar_env/journal/format.py``: linear in tokens); ``version=1`` writes
the earlier whole-record lines (kept for comparisons); readers take both, streamed
(``reader.py``). A session's outcome (reward, status, evaluation) is stored next to its journal
(``<id>.result.json``). ``JournalStore`` is the file implementation of both seams in
``protocols.py``: the gateway writes through ``JournalSink``, everything after reads through
``JournalSource``.

Threads. The gateway appends from its journal writer thread (``polar_env/journal/writer.py``)
while the event loop opens and closes sessions: descriptors and the encoder state are guarded by
one lock, so a close can never land between another thread's open and write.

Whole records or nothing. Each record is a single ``os.write`` on an ``O_APPEND`` descriptor whose
returned length is checked: a short or failed write (disk full, ``ulimit -f``) is truncated back
and raised as ``CaptureError``, so the gateway answers 5xx instead of 200 for a torn record. A
journal whose tail was torn by a crash (kill -9 in the middle of an 8 MB write) is repaired when it
is next opened for appending: the fragment is moved to ``<id>.jsonl.torn`` and cut off, so the next
record never glues onto it. ``fsync=True`` also survives a machine crash, at ~1 ms per record.

Bounded descriptors. Journals stay open in a small LRU (``max_open``, default 64): a gateway with
thousands of undeleted sessions keeps at most that many fds. Measured against open-append-close:
an evicted session pays one reopen (~25 µs with the torn-tail check) when it comes back, a session
that keeps appending pays nothing, where open-append-close pays the reopen on every record.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from polar_env.errors import ConfigError
from polar_env.journal.format import Encoder, PromptRef, apply_events
from polar_env.journal.protocols import CaptureError as CaptureError  # these four re-exported for callers
from polar_env.journal.protocols import Journal
from polar_env.journal.protocols import SessionMeta as SessionMeta
from polar_env.journal.protocols import check_session_id as check_session_id
from polar_env.journal.protocols import key_digest as key_digest
from polar_env.journal.reader import JournalError, PromptRefs, iter_journal, read_with_refs
from polar_env.records import CompletionRecord
from polar_env.safetext import escape_surrogates, json_safe
from polar_env.stagecpu import stage

log = logging.getLogger("polar_env.gateway")

_TAIL_CHUNK = 64 * 1024
RESULT_SUFFIX = ".result.json"  # a session's outcome, next to its journal


class JournalStore:
    """Per-session journals under ``root`` (``<session_id>.jsonl``), session state under
    ``root/sessions`` and outcomes as ``root/<session_id>.result.json``."""

    def __init__(self, root: Path, *, fsync: bool = False, max_open: int = 64, version: int = 2) -> None:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create capture store {root}: {exc}") from exc
        self.root = root
        self.fsync = fsync
        self.max_open = max(1, max_open)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.RLock()
        self._encoder = Encoder() if version == 2 else None

    def path(self, session_id: str) -> Path:
        return self.root / f"{check_session_id(session_id)}.jsonl"

    # -- appending --------------------------------------------------------------------------------
    def _fd(self, session_id: str) -> int:
        fd = self._fds.get(session_id)
        if fd is not None:
            self._fds.move_to_end(session_id)
            return fd
        path = self.path(session_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            repair_tail(fd, path)
        except OSError:
            os.close(fd)
            raise
        self._fds[session_id] = fd
        while len(self._fds) > self.max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def append(self, record: CompletionRecord, ref: PromptRef | None = None) -> int:
        """Journal one record whole and return its size in bytes, or raise CaptureError with the
        journal unchanged. ``ref``: the gateway's token-in prompt reference (continuation mode),
        stored as such."""
        with self._lock:
            try:
                with stage("journal_encode"):
                    if self._encoder is None:
                        data, token = record.to_json() + b"\n", None
                    else:
                        data, token = self._encoder.encode(record, ref)
            except (TypeError, orjson.JSONEncodeError) as exc:
                raise CaptureError(f"record cannot be serialized: {exc}") from exc
            with stage("journal_write"):
                self._append_line(record.session_id, data)
            if token is not None and self._encoder is not None:
                self._encoder.commit(token)
            return len(data)

    def append_event(self, session_id: str, event: dict[str, Any]) -> None:
        """A non-record line (``{"event": ...}``: an aborted call); readers of records skip it."""
        with self._lock:
            data = orjson.dumps({"v": 2, "session_id": session_id, **event}, option=orjson.OPT_APPEND_NEWLINE)
            self._append_line(session_id, data)

    def events(self, session_id: str) -> list[dict[str, Any]]:
        """The session's event lines (aborted calls), in journal order."""
        path = self.path(session_id)
        if not path.exists():
            return []
        with open(path, "rb") as f:
            parsed = (orjson.loads(line) for line in f if b'"event":' in line and line.endswith(b"\n"))
            return [e for e in parsed if "event" in e]

    def _append_line(self, session_id: str, data: bytes) -> None:
        try:
            fd = self._fd(session_id)
        except OSError as exc:
            raise CaptureError(f"cannot open journal of {session_id!r}: {exc.strerror or exc}") from exc
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
        except OSError as exc:
            self._undo(session_id, fd, size)
            raise CaptureError(f"journal write failed: {exc.strerror or exc}") from exc
        if written != len(data):
            self._undo(session_id, fd, size)
            raise CaptureError(f"journal write cut short ({written} of {len(data)} bytes; disk full or file size limit)")
        if self.fsync:
            try:
                os.fsync(fd)
            except OSError as exc:
                self._undo(session_id, fd, size)
                raise CaptureError(f"journal fsync failed: {exc.strerror or exc}") from exc

    def _undo(self, session_id: str, fd: int, size: int) -> None:
        try:
            os.ftruncate(fd, size)
        except OSError as exc:  # the next open cuts the fragment off instead
            log.error("cannot truncate journal of %s back to %d bytes: %s", session_id, size, exc)
        self.close_session(session_id)

    # -- reading ----------------------------------------------------------------------------------
    def read(self, session_id: str) -> list[CompletionRecord]:
        """All complete records of a session; a torn final line (crash mid-write) is skipped.
        A bad line anywhere else raises JournalError naming the file and line. Client-gone event
        lines are folded into their records' notes (``journal.format.apply_events``)."""
        path = self.path(session_id)
        if not path.exists():
            return []
        events: list[dict[str, Any]] = []
        with open(path, "rb") as f:
            records = list(iter_journal(f, path, events=events))
        return apply_events(records, events)

    def iter_records(self, session_id: str, start: int = 0) -> Iterator[CompletionRecord]:
        """The session's records in journal order, streamed line by line (v1 and v2); records
        before the ``start``-th are decoded (v2 references need them) but not yielded."""
        path = self.path(session_id)
        if not path.exists():
            return
        with open(path, "rb") as f:
            yield from iter_journal(f, path, start)

    def read_with_refs(self, session_id: str) -> tuple[list[CompletionRecord], PromptRefs]:
        """``read`` plus the v2 prompt references (``reader.read_with_refs``)."""
        return read_with_refs(self.path(session_id))

    def count(self, session_id: str) -> int:
        path = self.path(session_id)
        return path.read_bytes().count(b"\n") if path.exists() else 0

    def next_seq(self, session_id: str) -> int:
        """One past the last whole record's seq (0 for an empty journal); reads only the tail."""
        path = self.path(session_id)
        if not path.exists():
            return 0
        with open(path, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            tail = b""
            while pos > 0:
                step = min(_TAIL_CHUNK, pos)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
                whole = tail[: tail.rfind(b"\n") + 1]  # a torn fragment after the last newline is not a record
                start = whole.rfind(b"\n", 0, len(whole) - 1) if whole else -1
                if whole and (start >= 0 or pos == 0):
                    try:
                        return int(orjson.loads(whole[start + 1 : -1])["seq"]) + 1
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                        return self.count(session_id)
        return 0

    def session_ids(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.jsonl"))

    def has_session(self, session_id: str) -> bool:
        return self.path(session_id).exists() or self._meta_path(session_id).exists()

    # -- session state ----------------------------------------------------------------------------
    def _meta_path(self, session_id: str) -> Path:
        return self.root / "sessions" / f"{check_session_id(session_id)}.json"

    def write_session_meta(self, meta: SessionMeta) -> None:
        """Atomically replace the session's state file (write a temp file, then rename)."""
        path = self._meta_path(meta.session_id)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_bytes(orjson.dumps(meta.model_dump(mode="json")))
        os.replace(tmp, path)

    def read_session_meta(self, session_id: str) -> dict[str, Any] | None:
        """The session's persisted state (``SessionMeta`` as a dict), or None if none was stored."""
        path = self._meta_path(session_id)
        try:
            return SessionMeta.model_validate(orjson.loads(path.read_bytes())).model_dump()
        except FileNotFoundError:
            return None
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise JournalError(f"{path} is not a valid session state file: {str(exc).splitlines()[0]}") from exc

    def session_metas(self) -> list[SessionMeta]:
        folder = self.root / "sessions"
        metas = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            try:
                metas.append(SessionMeta.model_validate(orjson.loads(path.read_bytes())))
            except (orjson.JSONDecodeError, ValidationError) as exc:
                log.error("skipping unreadable session state %s: %s", path, str(exc).splitlines()[0])
        return metas

    # -- outcomes ---------------------------------------------------------------------------------
    def _outcome_path(self, session_id: str) -> Path:
        return self.root / f"{check_session_id(session_id)}{RESULT_SUFFIX}"

    def write_outcome(self, session_id: str, outcome: dict[str, Any]) -> None:
        """Atomically replace the session's outcome: readers never see half a file. Never fails on
        text: a lone surrogate (a file name of the agent's that is not UTF-8) is written escaped."""
        path = self._outcome_path(session_id)
        tmp = path.with_suffix(".tmp")
        try:
            data = orjson.dumps(outcome, default=str)
        except orjson.JSONEncodeError:
            data = orjson.dumps(json_safe(outcome), default=lambda o: escape_surrogates(str(o)))
        tmp.write_bytes(data)
        tmp.replace(path)

    def read_outcome(self, session_id: str) -> dict[str, Any] | None:
        try:
            data = orjson.loads(self._outcome_path(session_id).read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def outcome_ids(self) -> list[str]:
        return sorted(p.name.removesuffix(RESULT_SUFFIX) for p in self.root.glob(f"*{RESULT_SUFFIX}"))

    # -- descriptors ------------------------------------------------------------------------------
    def open_fds(self) -> int:
        return len(self._fds)

    def close_session(self, session_id: str) -> None:
        with self._lock:
            fd = self._fds.pop(session_id, None)
            if fd is not None:
                os.close(fd)

    def forget(self, session_id: str) -> None:
        """Close the session's descriptor and drop its encoder state (a closed session)."""
        with self._lock:
            self.close_session(session_id)
            if self._encoder is not None:
                self._encoder.forget(session_id)

    def close(self) -> None:
        with self._lock:
            for session_id in list(self._fds):
                self.close_session(session_id)


def _conforms(store: JournalStore) -> Journal:
    """Never called: mypy checks here that the file store implements both seams."""
    return store


def repair_tail(fd: int, path: Path) -> None:
    """Cut a torn last line off the journal (moving it to ``<path>.torn``) before anything is appended."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    pos = size
    cut = 0
    while pos > 0:
        step = min(_TAIL_CHUNK, pos)
        pos -= step
        chunk = os.pread(fd, step, pos)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            cut = pos + nl + 1
            break
    fragment_len = size - cut
    torn = path.with_name(path.name + ".torn")
    with open(torn, "ab") as out:
        offset = cut
        while offset < size:
            piece = os.pread(fd, min(1 << 20, size - offset), offset)
            if not piece:
                break
            out.write(piece)
            offset += len(piece)
        out.write(b"\n")
    os.ftruncate(fd, cut)
    log.warning("journal %s had a torn last record (%d bytes); moved to %s", path, fragment_len, torn)
