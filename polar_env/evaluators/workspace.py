"""The grader's own view of a workspace: a manifest taken from outside the agent's reach, and the
change set between two manifests.

Why not ``git diff``: the agent owns its repository's ``.git`` — config (filters, external diff
drivers, hooks), attributes (``* binary`` hides a text change), the index, HEAD and the objects —
and a git that reads them says whatever the agent made it say, or fails (a deleted ``.git`` used to
turn a wrong fix into a masked grader error). So the grader never asks the agent's git anything:
it walks the workspace itself (``lstat``, never following a link; the top-level ``.git`` is skipped
unread), hashes the regular files, and compares that with the pristine base it took before the agent
ran (``base_manifest``, cached per task source). A change is a path whose kind, content or mode
differs; what of it may reach the grader is ``integrity.admit``'s decision, not this module's.

A workspace the walk cannot take (an unreadable directory, more than ``MAX_ENTRIES`` entries, a
changed file that cannot be read) raises ``WorkspaceBroken``: the agent's doing, graded 0, unmasked.

Host-workspace runtimes (bubblewrap, Apptainer) are walked on the host side, off the event loop;
other runtimes (Docker) run the same walk inside with an isolated interpreter (``python3 -I -S``,
cwd ``/``) as a plain script argument, so nothing in the workspace is imported.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import json
import os
import posixpath
import stat
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_env.errors import PolarError
from polar_env.runtimes import walk as _walk
from polar_env.runtimes.base import Runtime
from polar_env.runtimes.walk import HASH_LIMIT, walk
from polar_env.safetext import bad_name

MAX_ENTRIES = _walk.MAX_ENTRIES  # module-level, so a test can lower it

DISPLAY_LIMIT = 400_000  # characters of the graded patch kept for people


class WorkspaceBroken(PolarError):
    """The agent left a workspace the grader cannot take: reward 0, unmasked (its own doing)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One path of a manifest: ``kind`` file / link / dir / other, permission bits, size and, for
    a regular file at most ``HASH_LIMIT`` bytes, the sha256 of its bytes."""

    kind: str
    mode: int
    size: int
    digest: str | None = None

    def same(self, other: Entry) -> bool:
        if self.kind != other.kind:
            return False
        if self.kind == "dir":
            return True
        if self.kind == "file":
            return self.digest is not None and self.digest == other.digest and self.mode & 0o111 == other.mode & 0o111
        return self.size == other.size and self.digest == other.digest


Manifest = dict[str, Entry]  # repo-relative posix path → entry


_SCRIPT = (
    "from __future__ import annotations\nimport sys, json\n"
    + f"HASH_LIMIT = {HASH_LIMIT}\nMAX_ENTRIES = {MAX_ENTRIES}\n" + inspect.getsource(walk)
    + "try:\n    rows = walk(sys.argv[1], sys.argv[2] == '1', int(sys.argv[3]))\n"
    "except OSError as exc:\n    print(json.dumps({'error': str(exc)})); sys.exit(0)\n"
    "print(json.dumps({'rows': rows}))\n"
)


def _host_root(runtime: Runtime, inside: str) -> Path | None:
    host_path = getattr(runtime, "host_path", None)
    if host_path is None or not hasattr(runtime, "workspace"):
        return None
    return Path(host_path(inside))


Rows = list[tuple[str, str, int, int, str | None]]


def _to_manifest(rows: Iterable[Any]) -> Manifest:
    return {str(p): Entry(str(k), int(m), int(s), d) for p, k, m, s, d in rows}


async def snapshot(runtime: Runtime, inside: str | None = None, *, digests: bool = True) -> Manifest:
    """The manifest of ``inside`` (default: the workspace) in ``runtime``. Raises WorkspaceBroken."""
    inside = inside or runtime.spec.workdir
    own: Callable[[str, bool], Awaitable[Rows]] | None = getattr(runtime, "walk_tree", None)
    if own is not None:  # a runtime that walks its own trees (a test double with no real one)
        return _to_manifest(await own(inside, digests))
    host = _host_root(runtime, inside)
    if host is not None:
        try:
            return _to_manifest(await asyncio.to_thread(walk, str(host), digests, MAX_ENTRIES))
        except OSError as exc:
            raise WorkspaceBroken(f"the grader cannot take the workspace: {exc}") from None
    res = await runtime.exec(["python3", "-I", "-S", "-c", _SCRIPT, inside, "1" if digests else "0", str(MAX_ENTRIES)],
                             cwd="/", timeout_s=600.0)
    try:
        doc = json.loads(res.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"the workspace walk failed in the runtime (exit {res.exit_code}): {res.output[-500:]}") from None
    if "error" in doc:
        raise WorkspaceBroken(f"the grader cannot take the workspace: {doc['error']}")
    return _to_manifest(doc["rows"])


async def read(runtime: Runtime, inside: str) -> bytes:
    """A regular file's bytes, never through a link (host side where the runtime has one)."""
    host = _host_root(runtime, inside)
    if host is None:
        return await runtime.read_file(inside)

    def get() -> bytes:
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{inside} is not a regular file")
            return f.read()

    return await asyncio.to_thread(get)


# -- the pristine base ------------------------------------------------------------------------------

_BASES: OrderedDict[tuple[str, ...], Manifest] = OrderedDict()
BASE_CACHE = 32


def source_key(runtime: Runtime) -> tuple[str, ...] | None:
    """What a workspace's pristine content is a function of, or None when it is not known."""
    spec = runtime.spec
    if spec.source_dir is None and spec.image is None:
        return None
    return (spec.kind, str(spec.image), str(spec.source_dir), spec.workdir)


async def base_manifest(runtime: Runtime) -> Manifest:
    """The manifest of a freshly prepared (pristine) workspace: taken before any agent code runs,
    cached per task source, so a group of samples walks its base once per process."""
    key = source_key(runtime)
    if key is not None and key in _BASES:
        _BASES.move_to_end(key)
        return _BASES[key]
    found = await snapshot(runtime)
    if key is not None:
        _BASES[key] = found
        while len(_BASES) > BASE_CACHE:
            _BASES.popitem(last=False)
    return found


# -- the change set ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    """One changed path: its new entry (None: deleted) and, for a changed regular file the grader
    could read, its bytes. Picklable: it crosses to the evaluation worker."""

    path: str
    new: Entry | None
    old: Entry | None
    data: bytes | None = None


@dataclass(slots=True)
class Changes:
    """What the agent changed in its workspace, computed by the grader. ``broken``: why there is no
    change set (the agent's doing); ``source``: how it was taken."""

    items: list[Change] = field(default_factory=list)
    source: str = "snapshot"
    broken: str | None = None

    @property
    def empty(self) -> bool:
        return not self.items and self.broken is None

    def paths(self) -> list[str]:
        return [c.path for c in self.items]


def compare(base: Manifest, after: Manifest) -> list[tuple[str, Entry | None, Entry | None]]:
    """(path, new, old) for every path whose entry differs; directories only as kind changes."""
    out: list[tuple[str, Entry | None, Entry | None]] = []
    for path, new in after.items():
        old = base.get(path)
        if old is None:
            if new.kind != "dir":
                out.append((path, new, None))
        elif not new.same(old):
            out.append((path, new, old))
    for path, old in base.items():
        if path not in after and old.kind != "dir":
            out.append((path, None, old))
    return sorted(out, key=lambda c: c[0])


async def changes_between(runtime: Runtime, base: Manifest, after: Manifest, *, root: str | None = None,
                          cap_bytes: int | None = None) -> Changes:
    """The change set of ``after`` against ``base``, with the bytes of each changed regular file
    read from ``runtime`` under ``root`` (default: its workspace). ``cap_bytes`` bounds the bytes read
    (the session's ``patch_mb``); above it LimitExceeded, like a diff over the cap."""
    from polar_env.runtimes.limits import LimitExceeded

    root = root or runtime.spec.workdir
    items: list[Change] = []
    total = 0
    for path, new, old in compare(base, after):
        data = None
        # a name that is not UTF-8 text is dropped by the allow-list whatever it holds: not read
        if new is not None and new.kind == "file" and new.digest is not None and not bad_name(path):
            total += new.size
            if cap_bytes is not None and total > cap_bytes:
                raise LimitExceeded("patch_mb", f"the agent changed over {cap_bytes / 2**20:g} MiB of files")
            try:
                data = await read(runtime, posixpath.join(root, path))
            except LimitExceeded:  # a file over the runtime's read cap (patch_mb): named as the limit
                raise
            except (OSError, PolarError) as exc:
                raise WorkspaceBroken(f"the grader cannot read {path}: {exc}") from None
        items.append(Change(path, new, old, data))
    return Changes(items)


async def agent_changes(runtime: Runtime, base: Manifest) -> Changes:
    """The agent's change set, taken from its live runtime; WorkspaceBroken becomes ``broken``."""
    cap = int(runtime.spec.patch_mb * 1024 * 1024)
    try:
        return await changes_between(runtime, base, await snapshot(runtime), cap_bytes=cap)
    except WorkspaceBroken as exc:
        return Changes(broken=str(exc))


def unified(changes: Iterable[Change], old_text: Callable[[str], str | None]) -> str:
    """A unified diff of the text changes, for people (never applied: the grader writes files)."""
    parts: list[str] = []
    size = 0
    for c in changes:
        before = old_text(c.path) if c.old is not None else None
        after = _text(c.data) if c.new is not None else None
        if (c.new is not None and after is None) or (c.old is not None and c.old.kind == "file" and before is None
                                                     and c.new is not None):
            parts.append(f"Binary or unreadable change: {c.path}\n")
            continue
        a = (before or "").splitlines(keepends=True)
        b = (after or "").splitlines(keepends=True)
        lines = difflib.unified_diff(a, b, f"a/{c.path}" if c.old else "/dev/null", f"b/{c.path}" if c.new else "/dev/null")
        text = f"diff --git a/{c.path} b/{c.path}\n" + "".join(x if x.endswith("\n") else x + "\n\\ No newline at end of file\n"
                                                                for x in lines)
        parts.append(text)
        size += len(text)
        if size > DISPLAY_LIMIT:
            parts.append("[... polar_env: graded patch truncated for display ...]\n")
            break
    return "".join(parts)


def _text(data: bytes | None) -> str | None:
    if data is None or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def is_text(data: bytes | None) -> bool:
    return _text(data) is not None
