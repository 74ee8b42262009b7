"""Durable capture: one JSON-lines journal per session, appended before the reply is sent.

Each record is a single ``os.write`` on an ``O_APPEND`` descriptor, so a crash of the gateway never
leaves a half-written record behind another one, and everything already answered is on disk (in
the OS page cache; ``fsync=True`` also survives a machine crash, at ~1 ms per record). A store
re-opened on the same directory reads every session back and continues its sequence numbers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import orjson

from polar_env.errors import ConfigError
from polar_env.records import CompletionRecord

_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_session_id(session_id: str) -> str:
    if not _SESSION_ID.match(session_id):
        raise ValueError(f"invalid session id {session_id!r}: use [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}")
    return session_id


class CaptureStore:
    """Per-session journals under ``root`` (``<session_id>.jsonl``)."""

    def __init__(self, root: Path, *, fsync: bool = False) -> None:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create capture store {root}: {exc}") from exc
        self.root = root
        self.fsync = fsync
        self._fds: dict[str, int] = {}

    def path(self, session_id: str) -> Path:
        return self.root / f"{check_session_id(session_id)}.jsonl"

    def append(self, record: CompletionRecord) -> None:
        fd = self._fds.get(record.session_id)
        if fd is None:
            fd = os.open(self.path(record.session_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fds[record.session_id] = fd
        os.write(fd, record.to_json() + b"\n")
        if self.fsync:
            os.fsync(fd)

    def read(self, session_id: str) -> list[CompletionRecord]:
        """All complete records of a session; a torn final line (crash mid-write) is skipped."""
        path = self.path(session_id)
        if not path.exists():
            return []
        records = []
        lines = path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line:
                continue
            try:
                records.append(CompletionRecord.model_validate(orjson.loads(line)))
            except (orjson.JSONDecodeError, ValueError):
                if i == len(lines) - 1:  # no trailing newline: the write was cut short
                    break
                raise
        return records

    def count(self, session_id: str) -> int:
        path = self.path(session_id)
        return path.read_bytes().count(b"\n") if path.exists() else 0

    def session_ids(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.jsonl"))

    def close_session(self, session_id: str) -> None:
        fd = self._fds.pop(session_id, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for session_id in list(self._fds):
            self.close_session(session_id)
