"""What a dead process leaves behind, and how the next one clears it: runtime folders (full repo
copies, possibly still-mounted tmpfs disks) and their cgroups.

Each node incarnation keeps its runtimes under ``<base>/<node_id>/<incarnation>/`` and holds an
exclusive ``flock`` on ``<incarnation>/.lock`` for as long as it lives. The kernel drops the lock
when the process dies (``kill -9`` included), so any incarnation folder whose lock can be taken
belongs to a dead process: ``sweep`` stops the Apptainer instances recorded in its runtime folders
(``apptainer_instance.sweep_runtime``: an instance outlives the process that started it, and holds
no cgroup when rootless), kills what is left in the cgroups named after its runtimes,
renames the folder to ``<node_id>/.trash-<incarnation>`` (so a removal that fails or times out is
retried by the next sweep, lock or no lock), unmounts what is mounted below it and removes it
(``diskfs.remove_tree``: any depth, any count, bounded). Live nodes (on this host, any job) keep
their locks and are never touched. ``sweep`` never raises: a leftover it cannot clear is logged
and must not stop a node from starting.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from polar_env.runtimes import diskfs
from polar_env.runtimes.apptainer_instance import sweep_runtime
from polar_env.runtimes.hostworkspace import STAGE_PREFIX
from polar_env.runtimes.limits import CGROUP_ROOT, GROUP, Cgroup
from polar_env.runtimes.reach import stage_parents

log = logging.getLogger(__name__)
LOCK = ".lock"
TRASH = ".trash-"


@dataclass
class Incarnation:
    """This process's runtime folder, locked while it lives."""

    path: Path
    fd: int

    def release(self) -> None:
        path = self.path
        with contextlib.suppress(OSError):  # trash first: a removal left unfinished is swept later
            os.rename(path, path.with_name(TRASH + path.name))
            path = path.with_name(TRASH + path.name)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        left = diskfs.remove_tree(path)
        if left is not None:
            log.warning("could not remove %s (the next sweep will): %s", self.path, left)


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
    """Remove every incarnation folder under ``base`` whose owner is dead; returns their paths. Never raises."""
    removed: list[str] = []
    try:
        nodes = [d for d in Path(base).iterdir() if d.is_dir()] if Path(base).is_dir() else []
    except OSError as e:
        log.warning("leftovers: cannot list %s: %s", base, e)
        return removed
    for node_dir in nodes:
        try:
            incs = sorted(node_dir.iterdir())
        except OSError as e:
            log.warning("leftovers: cannot list %s: %s", node_dir, e)
            continue
        for inc in incs:
            try:
                if _sweep_one(inc):
                    removed.append(str(inc))
            except Exception as e:  # noqa: BLE001 - a leftover must never stop the next node
                log.warning("leftovers: could not clear %s: %s", inc, e)
    return removed


def _sweep_one(inc: Path) -> bool:
    """Clear ``inc`` if its owner is dead (or it is already trash); True when it was one to clear."""
    if inc.name.startswith(TRASH):
        _clear(inc, [p.name for p in _subdirs(inc)])
        return True
    lock = inc / LOCK
    if not inc.is_dir() or not lock.exists():
        return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # alive
        runtimes = [p.name for p in _subdirs(inc)]
        trash = inc.with_name(TRASH + inc.name)
        os.rename(inc, trash)  # from here on, the next sweep retries whatever this one cannot finish
    finally:
        os.close(fd)
    _clear(trash, runtimes)
    log.warning("removed %s (%d runtime folders) left by a dead node process", inc, len(runtimes))
    return True


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _clear(path: Path, runtimes: list[str]) -> None:
    """Stop the runtimes' instances, kill their cgroups, then unmount and remove ``path`` and their stage folders."""
    for name in runtimes:
        if (stopped := sweep_runtime(path / name)) > 0:
            log.warning("leftovers: stopped %d apptainer instance(s) of %s", stopped, path / name)
    _remove_cgroups(runtimes)
    for name in runtimes:  # stage folders outside the runtime (hostworkspace.py), wherever reach.py put them
        for parent in stage_parents():
            diskfs.remove_tree(parent / f"{STAGE_PREFIX}{name}")
    left = diskfs.remove_tree(path)
    if left is not None:
        log.warning("leftovers: %s is not fully removed (the next sweep retries): %s", path, left)
