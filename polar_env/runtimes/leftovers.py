"""What a dead process leaves behind, and how the next one clears it: runtime folders (full repo
copies) and their cgroups.

Each node incarnation keeps its runtimes under ``<base>/<node_id>/<incarnation>/`` and holds an
exclusive ``flock`` on ``<incarnation>/.lock`` for as long as it lives. The kernel drops the lock
when the process dies (``kill -9`` included), so any incarnation folder whose lock can be taken
belongs to a dead process: ``sweep`` removes it with the cgroups named after its runtimes. Live
nodes (on this host, any job) keep their locks and are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from polar_env.runtimes.hostworkspace import STAGE_PREFIX, _force_rmtree
from polar_env.runtimes.limits import CGROUP_ROOT, GROUP, Cgroup

log = logging.getLogger(__name__)
LOCK = ".lock"


@dataclass
class Incarnation:
    """This process's runtime folder, locked while it lives."""

    path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        _force_rmtree(self.path)


def claim(base: Path, node_id: str) -> Incarnation:
    """A fresh, locked runtime folder for this node process."""
    path = Path(base) / node_id / f"{os.getpid()}-{secrets.token_hex(3)}"
    path.mkdir(parents=True)
    fd = os.open(path / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return Incarnation(path, fd)


def _remove_cgroups(names: list[str], root: Path = CGROUP_ROOT) -> None:
    for name in names:
        for parent in (root / "memory" / GROUP, root / "pids" / GROUP, root / GROUP):
            d = parent / name
            if d.is_dir():
                Cgroup("v1", [d], [d / "cgroup.procs"]).remove()


def sweep(base: Path) -> list[str]:
    """Remove every incarnation folder under ``base`` whose owner is dead; returns their paths."""
    removed: list[str] = []
    base = Path(base)
    if not base.is_dir():
        return removed
    for node_dir in base.iterdir():
        if not node_dir.is_dir():
            continue
        for inc in node_dir.iterdir():
            lock = inc / LOCK
            if not inc.is_dir() or not lock.exists():
                continue
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                runtimes = [p.name for p in inc.iterdir() if p.is_dir()]
                _remove_cgroups(runtimes)
                for name in runtimes:  # stage folders outside the runtime (hostworkspace.py)
                    _force_rmtree(Path(tempfile.gettempdir()) / f"{STAGE_PREFIX}{name}")
                _force_rmtree(inc)
                removed.append(str(inc))
                log.warning("removed %s (%d runtime folders) left by a dead node process", inc, len(runtimes))
            finally:
                os.close(fd)
    return removed
