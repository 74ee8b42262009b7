"""The kernel-side disk bound of a host-workspace runtime and the removal of runtime folders.

Bound. As root, ``mount_tmpfs`` mounts one sized tmpfs (``size=<disk_mb>m,nr_inodes=<n>``,
nosuid, nodev) on the runtime's root before it is populated, so workspace/, tmp/ and home/ (the
agent's ``/tmp`` and ``HOME`` too) share one filesystem the kernel refuses to overfill: a write
past it fails with ENOSPC, whatever the shape of the tree (files deleted while held open keep their
pages on the mount; every directory costs an inode; depth does not matter). ``nr_inodes`` is one
per ``INODE_BYTES`` of ``disk_mb`` (ext4's default ratio). tmpfs lives in RAM (and swap): the
agent's own writes are charged to its memory cgroup, so they count against ``memory_mb`` too.
Without root (or with ``POLAR_DISK_TMPFS=0``) nothing is mounted and the watchdog walk of
``limits.py`` is all there is.

Removal. ``remove_tree`` never recurses and never follows long paths: it unmounts whatever is
mounted below (lazily when busy), then empties directories depth-first from an explicit stack,
moving a subdirectory up to the top before it is emptied once its path passes ``SHORT_PATH``, so
a 3,000-level tree costs a rename per deep level and no path ever nears PATH_MAX. It gives back
the modes the agent removed where they are in the way, stops at a deadline, and returns what
stopped it instead of raising (teardown must not fail).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MIB = 1024 * 1024
INODE_BYTES = 16 * 1024
MIN_INODES = 1024
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
SOURCE = "polar-disk"  # the tmpfs's source name in /proc/self/mountinfo
REMOVE_TIMEOUT_S = 120.0
SHORT_PATH = 1024  # longer directory paths are moved up to the top before they are emptied
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def inodes_for(disk_mb: int) -> int:
    return max(MIN_INODES, disk_mb * MIB // INODE_BYTES)


def tmpfs_wanted() -> str | None:
    """None when this process may mount the bound, else why not."""
    if os.environ.get("POLAR_DISK_TMPFS", "1") == "0":
        return "POLAR_DISK_TMPFS=0"
    if os.geteuid() != 0:
        return "not root"
    return None


def mount_tmpfs(path: Path, disk_mb: int) -> str | None:
    """Mount the sized tmpfs on ``path``; None on success, else why it could not be."""
    why = tmpfs_wanted()
    if why is not None:
        return why
    opts = f"size={disk_mb}m,nr_inodes={inodes_for(disk_mb)},mode=0700"
    if _libc.mount(SOURCE.encode(), os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        return f"mount tmpfs: {os.strerror(ctypes.get_errno())}"
    return None


def unmount(path: str | Path) -> str | None:
    """Unmount ``path`` (lazily when busy: the mount goes once its last user does); None when done."""
    target = os.fsencode(path)
    if _libc.umount2(target, 0) == 0:
        return None
    if _libc.umount2(target, MNT_DETACH) == 0:
        return None
    return f"umount {path}: {os.strerror(ctypes.get_errno())}"


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(path: str | Path) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    top = os.path.abspath(path)
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4:
                    point = _unescape(parts[4])
                    if point == top or point.startswith(top.rstrip("/") + "/"):
                        found.append(point)
    except OSError:
        return []
    return sorted(set(found), key=len, reverse=True)


def usage(path: Path) -> tuple[int, int, int, int]:
    """(bytes used, bytes total, inodes used, inodes total) of the filesystem at ``path``."""
    st = os.statvfs(path)
    return ((st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize,
            st.f_files - st.f_ffree, st.f_files)


def full(path: Path) -> str | None:
    """What is exhausted on the mount at ``path`` (within a MiB of its size, or every inode taken)."""
    try:
        used, total, iused, itotal = usage(path)
    except OSError:
        return None
    if total and total - used < min(MIB, total // 64):
        return f"filesystem full: {used // MIB} of {total // MIB} MiB"
    if itotal and itotal - iused < 4:
        return f"inodes exhausted: {iused} of {itotal}"
    return None


def _writable(path: str) -> None:
    try:
        os.chmod(path, stat.S_IRWXU)
    except OSError:
        pass


def _with_fixup(fn: Callable[[str], Any], path: str, fix: str) -> Any:
    """``fn(path)``; on EACCES/EPERM, give ``fix`` (the directory in the way) back its modes, once."""
    try:
        return fn(path)
    except PermissionError:
        _writable(fix)
        return fn(path)


def _list(d: str) -> list[os.DirEntry[str]]:
    with os.scandir(d) as it:
        return list(it)


def remove_tree(path: str | Path, timeout_s: float = REMOVE_TIMEOUT_S) -> str | None:
    """Remove ``path`` whatever its shape; None when gone, else what is left and why (see the module doc)."""
    top = os.path.abspath(path)
    problem: str | None = None
    for point in mounts_under(top):
        problem = unmount(point) or problem
    if problem is not None and mounts_under(top):  # never delete through a mount that stayed
        return problem
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            os.unlink(top)
            return None
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{top}: {e}"
    deadline = time.monotonic() + timeout_s
    tag = secrets.token_hex(4)
    moved = 0
    for _attempt in range(3):
        stack: list[tuple[str, bool]] = [(top, False)]  # (directory, its entries are gone: rmdir it)
        while stack:
            if time.monotonic() > deadline:
                return f"{top}: not removed within {timeout_s:g} s ({len(stack)} directories left)"
            d, emptied = stack.pop()
            if emptied:
                try:
                    _with_fixup(os.rmdir, d, os.path.dirname(d))
                except OSError as e:
                    problem = f"{d}: {e}"
                continue
            try:
                entries = _with_fixup(_list, d, d)
            except OSError as e:
                problem = f"{d}: {e}"
                continue
            if d != top:
                stack.append((d, True))
            for entry in entries:
                try:
                    if not entry.is_dir(follow_symlinks=False):
                        _with_fixup(os.unlink, entry.path, d)
                    elif len(entry.path) < SHORT_PATH:
                        stack.append((entry.path, False))
                    else:  # move it up: no path is ever longer than SHORT_PATH plus one name
                        moved += 1
                        new = os.path.join(top, f".polar-rm-{tag}-{moved}")
                        _writable(entry.path)  # moving a directory rewrites its ".."
                        _with_fixup(functools.partial(os.rename, dst=new), entry.path, d)
                        stack.append((new, False))
                except FileNotFoundError:
                    continue
                except OSError as e:
                    problem = f"{entry.path}: {e}"
        try:
            os.rmdir(top)
            return None
        except FileNotFoundError:
            return None
        except OSError as e:
            problem = f"{top}: {e}"
    return problem
