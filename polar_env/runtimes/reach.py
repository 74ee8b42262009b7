"""Which host paths a runtime's unprivileged uid can reach, and where its stage goes when it cannot.

As root, every exec drops to the runtime's own uid before bwrap (or apptainer) starts, and bwrap
resolves the source path of each bind as that uid: with no mapping of the host's root into its user
namespace it has no DAC override, so every directory on the way must be traversable by the uid
(``o+x``, or owned by it). A ``TMPDIR`` inside a 0700 folder (what SLURM and systemd give a job:
``/tmp/job123/tmp`` under a 0700 ``/tmp/job123``) puts the whole runtime base out of its reach.
Such a runtime is reached through a stage instead (``hostworkspace.py``): an empty directory, 0700
and owned by the uid, that each exec bind-mounts the runtime onto in its own private mount namespace
(as root, before the drop). The stage's parent must be traversable by every uid, so it is the first
of ``$TMPDIR`` and ``STAGE_DIRS`` that is; that parent holds only empty mount points.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

STAGE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # usually 1777, whatever TMPDIR a job was given
TRAVERSE_FIX = "set TMPDIR to a directory every user can traverse (e.g. TMPDIR=/tmp)"
_SOURCE_PATH = re.compile(r"bwrap: Can't find source path (.+?): (.+)")


def _can_traverse(st: os.stat_result, uid: int) -> bool:
    mode = st.st_mode
    return bool(mode & stat.S_IXOTH or (st.st_uid == uid and mode & stat.S_IXUSR) or (st.st_gid == uid and mode & stat.S_IXGRP))


def reachable(path: str | Path, uid: int) -> bool:
    """Whether ``uid`` (no supplementary groups) can traverse to ``path``."""
    for d in reversed(Path(os.path.realpath(path)).parents):
        try:
            st = os.stat(d)
        except OSError:
            return False
        if not _can_traverse(st, uid):
            return False
    return True


def blocking_dir(path: str | Path, uid: int) -> Path | None:
    """The first existing directory on the way to ``path`` that ``uid`` cannot traverse (None: none)."""
    real = Path(os.path.realpath(path))
    for d in [*reversed(real.parents), real]:
        try:
            st = os.stat(d)
        except OSError:
            return None  # not there yet: whoever creates it picks its mode
        if stat.S_ISDIR(st.st_mode) and not _can_traverse(st, uid):
            return d
    return None


def stage_parents() -> list[Path]:
    """Every place a stage may be (``leftovers.sweep`` looks in all of them)."""
    seen: dict[str, Path] = {}
    for d in (tempfile.gettempdir(), *STAGE_DIRS):
        seen.setdefault(os.path.realpath(d), Path(d))
    return list(seen.values())


def stage_parent() -> Path | None:
    """The first stage parent every uid can traverse and this process can write (None: none is)."""
    for d in stage_parents():
        if d.is_dir() and blocking_dir(d, -1) is None and os.access(d, os.W_OK | os.X_OK):
            return d
    return None


def describe(path: Path) -> str:
    """``path`` with its mode and owner, for a message that says why a uid is stopped there."""
    try:
        st = os.stat(path)
    except OSError:
        return str(path)
    return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid})"


def start_error(name: str, output: str, uid: int | None, relay: bool) -> str | None:
    """Why a runtime's first exec failed, when its output says: a bind source its uid cannot reach
    (bwrap's "Can't find source path"), else, with the relay on, a missing python3. None: neither."""
    found = _SOURCE_PATH.search(output)
    if found is not None:
        path, why = found.group(1), found.group(2).strip()
        who = f"its unprivileged uid {uid}" if uid is not None else "the runtime"
        blocked = blocking_dir(path, uid) if uid is not None else None
        where = f": {describe(blocked)} is not traversable by it" if blocked is not None else ""
        fix = f"{TRAVERSE_FIX}, or chmod o+x {blocked}" if blocked is not None else f"check {path} exists"
        return f"{name}: bwrap cannot reach {path} as {who} ({why}){where}; {fix}"
    if relay and "python3" in output:
        return f"{name}: the gateway relay does not start inside the runtime (needs python3): {output.strip()}"
    return None


def default_base() -> Path:
    """Where runtime folders live when a node names no ``runtime_root``: ``$TMPDIR/polar-runtimes``."""
    return Path(tempfile.gettempdir()) / "polar-runtimes"
