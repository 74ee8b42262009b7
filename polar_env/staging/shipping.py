"""Journals from nodes that share no disk with the head: the head pulls each node's shard over Ray.

Salvage, ``polar-env build``, ``--resume``, the dashboard and the run folder read every node's
journals from the head's own filesystem (``<store>/<node_id>/``). On one host, or on a filesystem
every host mounts, a node writes there itself. Otherwise the node journals to a private spool in
its own runtime folder and the head copies it into ``<store>/<node_id>/``:

- ``read_shard`` (node side) returns what changed since the head's cursors: the new complete lines
  of each append-only journal, and whole files (session state, outcomes) that were replaced;
- ``ShardMirror`` (head side) applies them, in order, and keeps the cursors.

Why the head pulls rather than the node pushing as it writes: nothing is added to the reply path
(a captured call is durable on the node's disk before its reply, as on one host, and no extra hop
is awaited at 256 sessions); the head's folder has one writer, the head; the cursors live where
the copy does, so a lost or repeated pull is harmless. The head pulls every ``interval_s`` and once
more before it accepts a session's result, so a finished session's journal and outcome are on the
head by construction. A host that dies takes with it at most the calls of the last interval, of
sessions that come back ``node_lost`` (masked) and that ``--resume`` runs again.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

Chunk = tuple[str, int, bytes, bool]  # (path in the shard, offset, bytes, whole file)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}")
_APPEND = (".jsonl",)  # journals: append-only, shipped by their new complete lines
_WHOLE = (".json", ".jsonl.torn")  # session state and outcomes (replaced by rename), torn tails
_BUDGET = 16 * 1024 * 1024  # bytes per pull; the head pulls again at once while there is more


def _shipped(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and not name.endswith(".tmp") and name.endswith(_APPEND + _WHOLE)


def _files(root: Path) -> list[tuple[str, os.stat_result]]:
    out = []
    for folder, prefix in ((root, ""), (root / "sessions", "sessions/")):
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            if _shipped(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    out.append((prefix + entry.name, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:  # replaced between the listing and the stat
                    continue
    return out


def read_shard(root: Path, cursors: dict[str, int], budget: int = _BUDGET) -> tuple[list[Chunk], bool]:
    """What changed under ``root`` since ``cursors`` (path → bytes shipped for a journal, the
    mtime in ns for a whole file), and whether more is left. Only complete lines of a journal are
    shipped (a record is one write ending in a newline; a write in progress is never half-sent).
    A journal shorter than its cursor was cut back (a torn tail repaired) and is sent again whole."""
    chunks: list[Chunk] = []
    sent = 0
    for rel, st in sorted(_files(root)):
        if sent >= budget:
            return chunks, True
        seen = cursors.get(rel)
        path = root / rel
        if rel.endswith(_APPEND):
            cut = seen is not None and st.st_size < seen  # cut back: the head's copy is rewritten whole
            start = 0 if seen is None or cut else seen
            if st.st_size == start and seen is not None and not cut:
                continue
            data = _read(path, start, st.st_size - start)
            end = data.rfind(b"\n") + 1
            if end or seen is None or cut:
                chunks.append((rel, start, data[:end], start == 0))
                sent += end
        elif seen != st.st_mtime_ns:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            chunks.append((rel, st.st_mtime_ns, data, True))
            sent += len(data)
    return chunks, False


def _read(path: Path, offset: int, size: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(size)
    except FileNotFoundError:
        return b""


class ShardMirror:
    """The head's copy of one node's shard under ``dest`` and the cursors it was pulled to."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.cursors: dict[str, int] = {}
        self.bytes = 0  # shipped so far (node stats and the closing summary show it)

    def apply(self, chunks: list[Chunk]) -> None:
        for rel, offset, data, whole in chunks:
            if not _safe(rel):
                raise ValueError(f"a node shipped a journal path outside its shard: {rel!r}")
            path = self.dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(_APPEND):
                with path.open("r+b" if path.exists() and not whole else "wb") as f:
                    f.seek(offset)
                    f.write(data)
                    f.truncate()
                self.cursors[rel] = offset + len(data)
            else:
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
                self.cursors[rel] = offset  # a whole file's cursor is its mtime on the node
            self.bytes += len(data)


def _safe(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) in (1, 2) and (len(parts) == 1 or parts[0] == "sessions") and _shipped(parts[-1])


class Puller:
    """Keeps a ``ShardMirror`` up to date from ``pull(cursors)`` (the node actor's
    ``shard_since``): in the background every ``interval_s``, and on demand (``sync``) with the
    guarantee that a pull that began after the call has finished."""

    def __init__(self, mirror: ShardMirror, pull: Callable[[dict[str, int]], Awaitable[tuple[list[Chunk], bool]]],
                 interval_s: float = 0.5) -> None:
        self.mirror = mirror
        self._pull = pull
        self.interval_s = interval_s
        self._lock = asyncio.Lock()
        self._started = 0
        self._finished = 0
        self._loop: asyncio.Task[None] | None = None
        self.error: str | None = None  # the last pull's failure (the node died: salvage reads what is here)

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())

    async def sync(self) -> None:
        want = self._started + 1
        async with self._lock:
            if self._finished >= want:
                return
            self._started += 1
            number = self._started
            try:
                more = True
                while more:
                    chunks, more = await self._pull(dict(self.mirror.cursors))
                    await asyncio.to_thread(self.mirror.apply, chunks)
                self.error = None
            finally:
                self._finished = number

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the node died or is stopping; run() reports it
                self.error = f"{type(exc).__name__}: {exc}"

    async def aclose(self) -> None:
        """Stop pulling; returns once no pull is being applied (a caller's ``sync`` included)."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        async with self._lock:
            pass


def write_probe(store: Path) -> tuple[Path, str]:
    """A file in the head's store that a node on a shared filesystem sees at the same path."""
    store.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    path = store / f".polar-shared-probe-{token[:8]}"
    path.write_text(token)
    return path, token


def sees_probe(path: str, token: str) -> bool:
    try:
        return Path(path).read_text() == token
    except OSError:
        return False
