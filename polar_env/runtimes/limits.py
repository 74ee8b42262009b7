"""Per-session resource limits: processes, memory, workspace disk, output per exec, patch size.

The limits live in ``RuntimeSpec`` (``pids_limit``, ``memory_mb``, ``disk_mb``, ``output_mb``,
``patch_mb``; a task overrides them in its own spec). Each runtime enforces them with the strongest
mechanism the host allows and says which in ``Runtime.limits_report()`` (the session report):

- host-workspace runtimes (bubblewrap, Apptainer as a fallback): a cgroup per runtime — v1 (a
  ``polar_env/<id>`` group under the memory and pids hierarchies, writable as root) or v2 (a child of
  the caller's own cgroup when it is delegated: ``memory.max``, ``pids.max``, ``cgroup.kill``). Each
  exec joins it before it drops privileges. Without a writable cgroup: rlimits (``RLIMIT_NPROC`` per
  session uid, ``RLIMIT_DATA``), which are weaker (per process, not per session). A runtime that
  will not pass rlimits off as a bound (rootless Apptainer: ``rootless_bound``) refuses instead, or
  runs with ``unbounded`` set: no cgroup, no rlimits, and the report says "unbounded".
- disk, as root: one sized tmpfs on the runtime's root (``diskfs.py``: ``size=<disk_mb>m`` and
  ``nr_inodes``), so the kernel refuses writes past the bound with ENOSPC — files deleted while
  held open, many directories and deep trees included — and the agent's writes count against its
  memory cgroup. A full mount (one ``statvfs`` after every exec and every ``POLL_S``) also trips
  the sticky limit: the session asked for more than it was given. Without root: a watchdog sums
  the writable trees every few seconds (a walk: it misses files deleted while open and what lies
  beyond PATH_MAX) plus ``RLIMIT_FSIZE`` for any one file; the mechanism says which.
  Docker: see ``docker.py``.
- output: every exec's merged output is streamed through ``CappedBuffer``: head and tail are kept,
  the middle is replaced by a marker the model sees, so host memory stays bounded.
- patch: ``diff()`` streams through the same cap and raises ``LimitExceeded`` above ``patch_mb``.

A limit that is hit is sticky on the runtime (``limit_hit``): the watchdog kills what is left in the
cgroup, the exec that tripped it returns with ``limit`` set, and the session ends ERROR with the
limit named. Other sessions have their own cgroups and are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_env.errors import ConfigError, PolarError
from polar_env.runtimes import diskfs

if TYPE_CHECKING:
    from polar_env.runtimes.base import RuntimeSpec

log = logging.getLogger(__name__)

MIB = 1024 * 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP = "polar_env"


class LimitExceeded(PolarError):
    """A session went over one of its limits (``limit``: the RuntimeSpec field)."""

    def __init__(self, limit: str, detail: str) -> None:
        super().__init__(f"{limit} exceeded: {detail}")
        self.limit = limit
        self.detail = detail


def refuse_after_limit(hit: str | None) -> None:
    """A session over a limit has no diff to grade: its processes were killed mid-way."""
    if hit is not None:
        raise LimitExceeded(hit.split("=", 1)[0], hit)


def patch_text(runtime: str, workdir: str, patch_mb: float, code: int, out: CappedBuffer, err: CappedBuffer) -> str:
    """The agent's diff from a finished ``git diff`` (stdout capped at ``patch_mb``), or why there is
    none: ``LimitExceeded`` over the cap, ``ConfigError`` when git failed (exit 124: timed out)."""
    if out.truncated > 0:
        raise LimitExceeded("patch_mb", f"the diff is {out.total / MIB:.1f} MiB, over patch_mb={patch_mb:g}")
    if code != 0:
        raise ConfigError(f"{runtime}: git diff failed in {workdir} (exit {code}): {err.text().strip()}")
    return out.data().decode("utf-8", "replace")


class CappedBuffer:
    """At most ``cap`` bytes of a stream: the first half and the last half, with the size of the
    dropped middle recorded. ``text()`` puts a truncation marker where the middle was."""

    def __init__(self, cap: int, *, what: str = "output") -> None:
        self.cap = max(cap, 2)
        self.what = what
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.cap // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            keep = self.cap - self.cap // 2
            if len(self.tail) > 2 * keep:
                del self.tail[:-keep]

    @property
    def truncated(self) -> int:
        kept = len(self.head) + min(len(self.tail), self.cap - self.cap // 2)
        return self.total - kept

    def data(self) -> bytes:
        keep = self.cap - self.cap // 2
        tail = bytes(self.tail[-keep:]) if self.tail else b""
        if self.truncated <= 0:
            return bytes(self.head) + bytes(self.tail)
        marker = (f"\n[... polar_env: {self.truncated} bytes of {self.what} truncated "
                  f"({self.total} in all; limit {self.cap} bytes) ...]\n").encode()
        return bytes(self.head) + marker + tail

    def text(self) -> str:
        return self.data().decode("utf-8", "replace")


# -- cgroups -------------------------------------------------------------------------------------


def cgroup_version(root: Path = CGROUP_ROOT) -> str | None:
    """"v2" (unified), "v1" (memory and pids hierarchies writable), or None."""
    if (root / "cgroup.controllers").exists():
        return "v2"
    if all(os.access(root / c, os.W_OK) for c in ("memory", "pids")):
        return "v1"
    return None


def _own_v2_cgroup(root: Path) -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return root / line[3:].lstrip("/")
    except OSError:
        return None
    return None


@dataclass
class Cgroup:
    """One runtime's cgroup(s). ``procs``: the files an exec writes its pid to, to join."""

    version: str
    dirs: list[Path]
    procs: list[Path]
    memory_events: Path | None = None
    pids_events: Path | None = None
    baseline: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, *, memory_mb: int | None, pids_limit: int | None,
               root: Path = CGROUP_ROOT) -> Cgroup | None:
        """A cgroup with the limits set, or None when this host gives none (the caller falls back)."""
        version = cgroup_version(root)
        try:
            if version == "v1":
                return cls._v1(name, memory_mb, pids_limit, root)
            if version == "v2":
                return cls._v2(name, memory_mb, pids_limit, root)
        except OSError:
            return None
        return None

    @classmethod
    def _v1(cls, name: str, memory_mb: int | None, pids_limit: int | None, root: Path) -> Cgroup:
        mem, pids = root / "memory" / GROUP / name, root / "pids" / GROUP / name
        made: list[Path] = []
        try:
            for d in (mem, pids):
                d.mkdir(parents=True)
                made.append(d)
            if memory_mb is not None:
                (mem / "memory.limit_in_bytes").write_text(str(memory_mb * MIB))
                swap = mem / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    with contextlib.suppress(OSError):
                        swap.write_text(str(memory_mb * MIB))
            if pids_limit is not None:
                (pids / "pids.max").write_text(str(pids_limit))
        except OSError:
            for d in made:
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        group = cls("v1", [mem, pids], [mem / "cgroup.procs", pids / "cgroup.procs"],
                    memory_events=mem / "memory.oom_control", pids_events=pids / "pids.events")
        group.baseline = group.counters()
        return group

    @classmethod
    def _v2(cls, name: str, memory_mb: int | None, pids_limit: int | None, root: Path) -> Cgroup:
        own = _own_v2_cgroup(root)
        if own is None:
            raise OSError("no v2 cgroup of our own")
        parent = own / GROUP
        parent.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # enable the controllers for our children
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        d = parent / name
        d.mkdir()
        try:
            if memory_mb is not None:
                (d / "memory.max").write_text(str(memory_mb * MIB))
                with contextlib.suppress(OSError):
                    (d / "memory.swap.max").write_text("0")
            if pids_limit is not None:
                (d / "pids.max").write_text(str(pids_limit))
        except OSError:
            with contextlib.suppress(OSError):
                d.rmdir()
            raise
        group = cls("v2", [d], [d / "cgroup.procs"], memory_events=d / "memory.events", pids_events=d / "pids.events")
        group.baseline = group.counters()
        return group

    def counters(self) -> dict[str, int]:
        """OOM kills and refused forks so far."""
        out = {"oom_kill": 0, "pids_max": 0}
        for path, key, field_name in ((self.memory_events, "oom_kill", "oom_kill"), (self.pids_events, "pids_max", "max")):
            if path is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                for line in path.read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == field_name:
                        out[key] = int(v)
        return out

    def hit(self) -> str | None:
        """"memory_mb" / "pids_limit" once the kernel enforced one since the cgroup was made."""
        now = self.counters()
        if now["oom_kill"] > self.baseline.get("oom_kill", 0):
            return "memory_mb"
        if now["pids_max"] > self.baseline.get("pids_max", 0):
            return "pids_limit"
        return None

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in procs.read_text().split())
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL everything in the cgroup (v2: cgroup.kill; v1: until cgroup.procs is empty)."""
        if self.version == "v2":
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def tree_bytes(paths: list[Path]) -> int:
    """Bytes allocated under ``paths`` (not following symlinks; one walk). The fallback only: it
    cannot see files deleted while open, nor paths past PATH_MAX."""
    total = 0
    stack = [str(p) for p in paths]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def rootless_bound(*, root: Path | None = None) -> str | None:
    """Why a caller that is not root cannot bound memory and pids per session here, or None when it
    can: a probe cgroup is made (and removed) exactly as ``SessionLimits`` would, in a delegated v2
    subtree of the caller's own cgroup (systemd user scope with ``Delegate=yes``, or a site's own)."""
    root = root or CGROUP_ROOT
    version = cgroup_version(root)
    probe = Cgroup.create(f"probe-{os.getpid()}-{time.monotonic_ns()}", memory_mb=64, pids_limit=16, root=root)
    if probe is not None:
        probe.remove()
        return None
    if version == "v2":
        own = _own_v2_cgroup(root)
        return (f"cgroup v2 but {own or 'its own cgroup'} is not delegated to uid {os.geteuid()} with the memory and pids "
                "controllers (run under systemd-run --user --scope -p Delegate=yes, or a scheduler that delegates)")
    if (root / "memory").is_dir() or (root / "pids").is_dir():
        return "cgroups v1 (no delegation to unprivileged users)"
    return f"no cgroup filesystem at {root}"


# -- one runtime's enforcement -----------------------------------------------------------------------


class SessionLimits:
    """The limits of one host-workspace runtime: the cgroup (or rlimits), the disk watchdog, and
    the sticky ``hit``. ``prefix()`` is the argv every exec starts with (run as the caller, before
    any privilege drop): join the cgroup, set the rlimits, exec the rest."""

    DISK_CHECK_S = 5.0
    POLL_S = 0.5

    def __init__(self, spec: RuntimeSpec, name: str, *, trees: list[Path], uid: int | None,
                 mount: Path | None = None, no_mount: str | None = None, unbounded: str | None = None) -> None:
        self.spec = spec
        self.unbounded = unbounded  # why memory and pids go unbounded (the caller allowed it); None: bound them
        self.name = name
        self.trees = trees
        self.mount = mount  # the sized tmpfs holding the trees, when there is one
        self.no_mount = no_mount  # why there is none
        self.uid = uid
        self.cgroup: Cgroup | None = None
        self.hit: str | None = None
        self.mechanisms: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._kill_fallback: Callable[[], None] | None = None

    def start(self, kill_fallback: Callable[[], None]) -> None:
        spec = self.spec
        self._kill_fallback = kill_fallback
        if self.unbounded is None and (spec.memory_mb is not None or spec.pids_limit is not None):
            self.cgroup = Cgroup.create(self.name, memory_mb=spec.memory_mb, pids_limit=spec.pids_limit)
        cg = f"cgroup {self.cgroup.version}" if self.cgroup else None
        self.mechanisms = {
            "pids_limit": "none" if spec.pids_limit is None else
            (f"{cg} pids.max" if cg else f"rlimit NPROC (uid {self.uid})" if self.uid
             else "none (no writable cgroup; RLIMIT_NPROC would count the caller's own processes)"),
            "memory_mb": "none" if spec.memory_mb is None else
            (f"{cg} {'memory.max' if self.cgroup and self.cgroup.version == 'v2' else 'memory.limit_in_bytes'}"
             if cg else "rlimit DATA (per process)"),
            "disk_mb": self._disk_mechanism(),
            **{key: f"unbounded ({self.unbounded}; allowed by allow_unbounded)"
               for key in ("pids_limit", "memory_mb") if self.unbounded is not None and getattr(spec, key) is not None},
            "output_mb": "stream cap (head + tail kept, marker between)",
            "patch_mb": "stream cap on diff()",
        }
        self._task = asyncio.create_task(self._watch())

    def _disk_mechanism(self) -> str:
        spec = self.spec
        if spec.disk_mb is None:
            return "none"
        if self.mount is not None:
            return (f"tmpfs size={spec.disk_mb}m nr_inodes={diskfs.inodes_for(spec.disk_mb)} on the runtime root "
                    "(workspace, /tmp, HOME; kernel ENOSPC; full mount trips the limit)")
        return (f"watchdog tree walk (every {self.DISK_CHECK_S:g} s or more) + rlimit FSIZE; "
                f"no tmpfs: {self.no_mount or 'not mounted'}")

    def prefix(self) -> list[str]:
        spec = self.spec
        script = "".join(f"echo $$ > {shlex.quote(str(p))} && " for p in (self.cgroup.procs if self.cgroup else []))
        argv = ["/bin/sh", "-c", script + 'exec "$@"', "polar-limits"]
        rl: list[str] = []
        if spec.disk_mb is not None and self.mount is None:  # the tmpfs bounds one file too
            rl.append(f"--fsize={spec.disk_mb * MIB}")
        if self.cgroup is None and spec.pids_limit is not None and self.uid is not None and self.unbounded is None:
            rl.append(f"--nproc={spec.pids_limit}")
        if self.cgroup is None and spec.memory_mb is not None and self.unbounded is None:
            rl.append(f"--data={spec.memory_mb * MIB}")
        if rl and shutil.which("prlimit"):
            argv += ["prlimit", *rl, "--"]
        return argv

    def check(self) -> str | None:
        """Trip on what the kernel reports (two small file reads: fine on the event loop); the disk
        walk runs only in the watchdog, off the loop. Returns ``hit``."""
        if self.hit is None and self.cgroup is not None:
            which = self.cgroup.hit()
            if which is not None:
                self.trip(which, "OOM kill" if which == "memory_mb" else "fork refused")
        if self.hit is None and self.mount is not None and self.spec.disk_mb is not None:
            why = diskfs.full(self.mount)  # one statvfs
            if why is not None:
                self.trip("disk_mb", why)
        return self.hit

    def trip(self, limit: str, why: str) -> None:
        if self.hit is not None:
            return
        value = getattr(self.spec, limit)
        self.hit = f"{limit}={value} ({self.mechanisms.get(limit, '?')}): {why}"
        log.warning("runtime %s: %s; stopping the session's processes", self.name, self.hit)
        if self.cgroup is not None:
            self.cgroup.kill()
        if self._kill_fallback is not None:
            self._kill_fallback()

    async def _watch(self) -> None:
        """Poll the cgroup (and the tmpfs's statvfs) every ``POLL_S``; without the tmpfs, walk the writable
        trees every ``DISK_CHECK_S`` or, for big trees, every 20 walks' worth of time (a node of 256 SWE sessions must not spend its threads
        on ``stat``)."""
        next_disk = 0.0
        while self.hit is None:
            await asyncio.sleep(self.POLL_S)
            self.check()
            if self.spec.disk_mb is not None and self.mount is None and time.monotonic() >= next_disk:
                started = time.monotonic()
                used = await asyncio.to_thread(tree_bytes, self.trees)
                next_disk = time.monotonic() + max(self.DISK_CHECK_S, 20 * (time.monotonic() - started))
                if used > self.spec.disk_mb * MIB:
                    self.trip("disk_mb", f"{used // MIB} MiB written")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)

    def report(self) -> dict[str, Any]:
        return {"limits": {k: getattr(self.spec, k) for k in LIMIT_FIELDS}, "mechanisms": dict(self.mechanisms),
                "hit": self.hit, "uid": self.uid}


LIMIT_FIELDS = ("pids_limit", "memory_mb", "disk_mb", "output_mb", "patch_mb")
