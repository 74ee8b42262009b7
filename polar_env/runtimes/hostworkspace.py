"""Shared machinery of the runtimes whose workspace is a host directory and whose every exec is a
fresh process (bubblewrap, Apptainer): temp dirs, copying, path mapping, process groups, timeouts,
the session's limits (``limits.py``) and, when the caller is root, the unprivileged uid the agent
runs as.

Privileges. As root, each runtime gets its own host uid (``SANDBOX_UID_BASE`` + a random slot); its
writable trees are chowned to it, and every exec drops to it (``setpriv``) after joining the cgroup,
so uid 0 inside the sandbox's user namespace is that uid outside — never the host's root. Host
sources that uid cannot reach (``/root`` is 0700: the interpreter, the harness installs, the gateway
socket's private directory) are bind-mounted into the runtime's ``stage/`` directory in a private
mount namespace of that one exec (``unshare --mount``), which vanishes with it. When the runtime's
root is itself out of reach (a ``TMPDIR`` under a 0700 job folder), the whole root is reached that
way, through a stage under a temp dir every uid can traverse (``reach.py``).

Disk and teardown. As root, ``prepare`` mounts one sized tmpfs on the runtime's root before it
is populated (``diskfs.py``): workspace/, tmp/ and home/ share it, the chown to the runtime's uid
works on it like on any directory, and the kernel bounds the whole (ENOSPC). ``stop`` kills the
processes (the exec groups, then the cgroup), unmounts the tmpfs (lazily when busy) and removes the
empty mount point: O(1) whatever is inside. Without the tmpfs the root is removed by
``diskfs.remove_tree`` (iterative, modes fixed, deadline). Teardown never raises; what it cannot
remove is logged and left in the node's incarnation folder for ``leftovers.sweep``.

Subclasses supply ``_check``, ``_wrap`` (the full host argv for one in-runtime argv, ``{ARGS_FD}``
standing for a file descriptor that carries ``_args_payload``) and ``_env``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import posixpath
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

from polar_env.errors import ConfigError
from polar_env.runtimes import diskfs
from polar_env.runtimes.argv import relay_argv, shell_argv
from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings, check_host_paths
from polar_env.runtimes.history import SCRUB_HISTORY
from polar_env.runtimes.limits import MIB, CappedBuffer, SessionLimits, patch_text, refuse_after_limit
from polar_env.runtimes.reach import TRAVERSE_FIX, blocking_dir, describe, reachable, stage_parent, start_error

log = logging.getLogger(__name__)

HOME = "/root"
TIMEOUT_EXIT_CODE = 124
LIMIT_EXIT_CODE = 137
READER_GRACE_S = 5.0
SANDBOX_UID_BASE = 100_000
SANDBOX_UID_SLOTS = 60_000
ARGS_FD = "{ARGS_FD}"
STAGE_PREFIX = "polar-stage-"
_GIT = "git -c safe.directory='*' -c core.quotePath=false -c diff.noprefix=false -c diff.mnemonicPrefix=false -c diff.relative=false"
BASELINE_SCRIPT = (
    f"{SCRUB_HISTORY} && if [ ! -e .git ]; then {_GIT} init -q && {_GIT} add -A && "
    f"{_GIT} -c user.name=polar -c user.email=polar@localhost commit -q --no-verify --allow-empty -m 'polar baseline'; fi"
)
DIFF_SCRIPT = f"{_GIT} add -A && {_GIT} diff --cached --binary --no-color --no-ext-diff --no-textconv"


def inside_path(path: str) -> str:
    """A path inside the runtime, normalised; a relative one is refused in one line."""
    if not path.startswith("/"):
        raise ConfigError(f"runtime paths must be absolute, got {path!r}")
    return posixpath.normpath(path)


def _under(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` (a task repo, an image's workdir) into the existing ``dst``: symlinks kept as
    links, .git included, modes and times kept; ownership is the runtime's to set. ``cp`` takes
    0.24 s for a 75 MB, 3,300-file tree here, ``shutil.copytree`` 0.9 s."""
    if not src.is_dir():
        raise ConfigError(f"source_dir {src} is not a directory")
    proc = subprocess.run(["cp", "-dR", "--preserve=mode,timestamps,links", "--", f"{src}/.", str(dst)],
                          capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise ConfigError(f"cannot copy {src} into the workspace: {proc.stderr.strip()[-500:]}")


def chown_tree(root: Path, uid: int) -> None:
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                os.lchown(os.path.join(dirpath, name), uid, uid)


def drops_privileges() -> bool:
    """Whether a ``drops_root`` runtime's execs run as an unprivileged uid here (root, setpriv, unshare)."""
    return os.geteuid() == 0 and shutil.which("setpriv") is not None and shutil.which("unshare") is not None


def killpg(proc: asyncio.subprocess.Process) -> None:
    """Kill ``proc``'s whole process group (each exec leads its own), if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader | None, into: CappedBuffer | None) -> None:
    """Read ``stream`` to its end into ``into`` (None: read and drop)."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        if into is not None:
            into.add(chunk)


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Also tells when the process exits: ``Process.wait()`` waits for its pipes to close too, which a
    background process it left holding stdout (``server &``, alive in the session's PID namespace)
    would delay until the call's timeout."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


def swap_timeout(code: int, timed_out: bool) -> int:
    return TIMEOUT_EXIT_CODE if timed_out else code


class HostWorkspaceRuntime(abc.ABC):
    """See the module docstring."""

    name: ClassVar[str] = ""
    drops_root: ClassVar[bool] = False  # True: as root, execs drop to the runtime's own uid
    relay_per_exec: ClassVar[bool] = True  # False: the subclass starts one relay per session itself

    def __init__(self, spec: RuntimeSpec, *, root_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.timings = Timings()
        self._root_parent = root_dir or os.environ.get("POLAR_RUNTIME_DIR") or None
        self._root: Path | None = None
        self._procs: set[asyncio.subprocess.Process] = set()
        self._leftover_readers: set[asyncio.Future[None]] = set()  # pipes held by what an exec left running
        self._stopped = False
        self.uid: int | None = None
        self.limits: SessionLimits | None = None
        self._stage: list[tuple[str, str]] = []  # (host source, staged path) for this runtime's execs
        self._stage_base: Path | None = None  # outside the runtime's root, when the root is unreachable
        self._mounted = False  # the sized tmpfs is on the root (diskfs.py)
        self.unbounded: str | None = None  # set by _check: memory/pids go unbounded, and why (limits.py)

    # ----- to override -------------------------------------------------------------------------
    @abc.abstractmethod
    def _check(self) -> None: ...

    @abc.abstractmethod
    def _wrap(self, argv: list[str], cwd: str) -> list[str]: ...

    @abc.abstractmethod
    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]: ...

    def _args_payload(self, argv: list[str], cwd: str) -> bytes | None:
        return None

    def _pass_fds(self) -> tuple[int, ...]:
        """More file descriptors an exec's argv names (kept open by the runtime)."""
        return ()

    # ----- layout ------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        if self._root is None or self._stopped:
            raise ConfigError(f"{self.name} runtime is not prepared (or already stopped)")
        return self._root

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def home_dir(self) -> Path:
        return self.root / "home"

    @property
    def relay_enabled(self) -> bool:
        return self.spec.network == "gateway" and self.spec.gateway_socket is not None

    @property
    def limit_hit(self) -> str | None:
        return self.limits.hit if self.limits is not None else None

    def limits_report(self) -> dict[str, Any]:
        return self.limits.report() if self.limits is not None else {}

    def _mounts(self) -> list[tuple[str, Path, bool]]:
        """(path inside, host path, writable), longest inside path first."""
        mounts = [
            (inside_path(self.spec.workdir), self.workspace, True),
            ("/tmp", self.tmp_dir, True),
            (HOME, self.home_dir, True),
            *((inside_path(dst), Path(src), False) for src, dst in self.spec.binds),
        ]
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def host_path(self, path: str, *, write: bool = False) -> Path:
        """Map a path inside the runtime to the host, refusing escapes (symlinks included)."""
        inside = inside_path(path)
        for prefix, host, writable in self._mounts():
            if not _under(inside, prefix):
                continue
            if write and not writable:
                raise ConfigError(f"{path} is on a read-only bind")
            rel = posixpath.relpath(inside, prefix)
            target = host if rel == "." else host / rel
            base = os.path.realpath(host)
            real = os.path.realpath(target)
            if real != base and not real.startswith(base + os.sep):
                raise ConfigError(f"{path} resolves outside the runtime's {prefix} (symlink escape refused)")
            return Path(real)
        allowed = ", ".join(m[0] for m in self._mounts())
        raise ConfigError(f"{path} is not under a runtime directory the host can reach ({allowed})")

    def staged(self, source: str | Path) -> str:
        """The path an exec reaches ``source`` by (itself, or its stage when the uid cannot)."""
        src = str(source)
        for host, stage in self._stage:
            if src == host or src.startswith(host + "/"):
                return stage + src[len(host):]
        return src

    # ----- lifecycle ---------------------------------------------------------------------------
    async def prepare(self) -> None:
        if self._root is not None:
            raise ConfigError(f"{self.name} runtime already prepared")
        start = time.monotonic()
        inside_path(self.spec.workdir)
        check_host_paths(self.spec)
        self._check()
        parent = Path(self._root_parent) if self._root_parent else None
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self._root = Path(tempfile.mkdtemp(prefix=f"polar-{self.name}-", dir=parent))
        try:
            no_mount = "no disk_mb" if self.spec.disk_mb is None else diskfs.mount_tmpfs(self._root, self.spec.disk_mb)
            self._mounted = no_mount is None
            for d in (self.workspace, self.tmp_dir, self.home_dir):
                d.mkdir()
            os.chmod(self.tmp_dir, 0o1777)
            seeded = self.spec.source_dir is not None
            if self.spec.source_dir is not None:
                await asyncio.to_thread(copy_tree, Path(self.spec.source_dir), self.workspace)
            elif (image_workdir := self._image_workdir()) is not None:  # the image's /testbed, else hidden by the bind
                await asyncio.to_thread(copy_tree, image_workdir, self.workspace)
                seeded = True
            if self.drops_root and drops_privileges():
                self.uid = SANDBOX_UID_BASE + random.randrange(SANDBOX_UID_SLOTS)
                await asyncio.to_thread(self._own, self.uid)
            self.limits = SessionLimits(self.spec, self._root.name, trees=[self.workspace, self.tmp_dir, self.home_dir],
                                        uid=self.uid, mount=self._root if self._mounted else None, no_mount=no_mount,
                                        unbounded=self.unbounded)
            self.limits.start(self._kill_all)
            if not seeded and await self._export_workdir() and self.uid is not None:
                await asyncio.to_thread(chown_tree, self.workspace, self.uid)
            if self.relay_enabled:
                res = await self.exec(["true"], timeout_s=60)
                if res.exit_code != 0:
                    raise ConfigError(start_error(self.name, res.output, self.uid, relay=True)
                                      or f"{self.name}: the runtime does not start (exit {res.exit_code}): {res.output.strip()}")
            res = await self.exec(BASELINE_SCRIPT, timeout_s=120)
            if res.exit_code != 0:
                if (why := start_error(self.name, res.output, self.uid, relay=False)) is not None:
                    raise ConfigError(why)
                log.warning("%s: no git baseline in %s (diff() will fail): %s", self.name, self.spec.workdir, res.output.strip())
        except BaseException:
            await self._cleanup()
            raise
        self.timings.exec_s.clear()
        self.timings.prepare_s = time.monotonic() - start

    def _own(self, uid: int) -> None:
        """Hand the writable trees to ``uid`` and stage what it cannot reach (see the module doc)."""
        root = self.root
        chown_tree(root, uid)
        os.chmod(root, 0o700)
        sources: list[Path] = [Path(src) for src, _dst in self.spec.binds]
        if self.relay_enabled and self.spec.gateway_socket is not None:
            sock = Path(self.spec.gateway_socket)
            with contextlib.suppress(OSError):  # the relay connects as the sandbox uid; the key still gates it
                os.chmod(sock, 0o666)
            sources.append(sock)
        sources += self._extra_sources()
        if reachable(root, uid):
            stage = root / "stage"
        else:  # e.g. a root_dir under a 0700 directory: reach the whole runtime through a stage
            # (reach.py) named after the runtime, so leftovers.sweep finds it when this process dies
            parent = stage_parent()
            if parent is None:
                blocked = blocking_dir(root, uid) or root
                raise ConfigError(f"{self.name}: {describe(blocked)} keeps the runtime's uid {uid} from {root}, and no "
                                  f"temp dir every user can traverse is writable for its stage; {TRAVERSE_FIX}, or "
                                  f"chmod o+x {blocked}")
            self._stage_base = stage = parent / f"{STAGE_PREFIX}{root.name}"
            stage.mkdir(mode=0o700)
            (stage / "r").mkdir()
            self._stage.append((str(root), str(stage / "r")))
        for i, src in enumerate(sources):
            if reachable(src, uid):
                continue
            stage.mkdir(exist_ok=True)
            target = stage / str(i)
            if src.is_dir():
                target.mkdir()
            else:
                target.touch()
            self._stage.append((str(src), str(target)))
        if stage.exists():
            chown_tree(stage, uid)

    def _extra_sources(self) -> list[Path]:
        return []

    def _image_workdir(self) -> Path | None:
        """The image folder's own copy of the workdir on the host, copied into the workspace when
        no ``source_dir`` is given (the bind would hide it otherwise)."""
        return None

    async def _export_workdir(self) -> bool:
        """For an image with no host folder (a SIF): fill the empty workspace from the image's
        workdir through the runtime; True when something was copied."""
        return False

    async def stop(self) -> None:
        if self._stopped or self._root is None:
            self._stopped = True
            return
        start = time.monotonic()
        await self._cleanup()
        self.timings.stop_s = time.monotonic() - start

    def _kill_all(self) -> None:
        for proc in list(self._procs):
            killpg(proc)

    async def _cleanup(self) -> None:
        self._stopped = True
        procs = list(self._procs)
        for proc in procs:
            killpg(proc)
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=10)
        for task in list(self._leftover_readers):
            task.cancel()
        if self.limits is not None:
            try:
                await self.limits.aclose()
            except OSError as e:
                log.warning("%s: could not remove its cgroup: %s", self.name, e)
        if self._stage_base is not None:  # only empty mount points: the mounts lived in the execs' namespaces
            await asyncio.to_thread(diskfs.remove_tree, self._stage_base)
        if self._root is not None:  # never raises: what stays is logged, and swept by leftovers.sweep later
            left = await asyncio.to_thread(self._remove_root, self._root)
            if left is not None:
                log.warning("%s: could not remove %s (left for leftovers.sweep): %s", self.name, self._root, left)

    def _remove_root(self, root: Path) -> str | None:
        """With the tmpfs: unmount it (lazily if busy) and remove the empty mount point, O(1) whatever
        the agent left inside; without it: the bounded iterative remover."""
        if self._mounted:
            why = diskfs.unmount(root)
            if why is not None:
                return why
            self._mounted = False
        return diskfs.remove_tree(root)

    # ----- exec --------------------------------------------------------------------------------
    def _privileged_prefix(self) -> list[str]:
        """As root: a private mount namespace holding the stages, then the drop to the uid."""
        if self.uid is None:
            return []
        mounts = "".join(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)} && " for src, dst in self._stage)
        uid = str(self.uid)
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
        if not mounts:
            return drop
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", mounts + 'exec "$@"', "polar-stage", *drop]

    async def exec(
        self, command: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 600.0
    ) -> ExecResult:
        _ = self.root  # ConfigError unless prepared and not stopped
        if self.limit_hit is not None:  # the session is over; its processes were killed
            return ExecResult(LIMIT_EXIT_CODE, f"[polar_env: {self.limit_hit}]", False, 0.0, limit=self.limit_hit)
        argv = shell_argv(command)
        if self.relay_enabled and self.relay_per_exec:
            argv = relay_argv(self.spec.gateway_port, argv)
        elif not isinstance(command, str):  # via sh, so a missing program exits 127 (bwrap says 1)
            argv = ["/bin/sh", "-c", 'exec "$@"', "sh", *argv]
        out = CappedBuffer(int(self.spec.output_mb * MIB))
        code, _err, timed_out, duration = await self._run(argv, inside_path(cwd or self.spec.workdir), self._env(env),
                                                          timeout_s, out, None)
        self.timings.exec_s.append(duration)
        hit = self.limits.check() if self.limits is not None else None
        return ExecResult(LIMIT_EXIT_CODE if hit else swap_timeout(code, timed_out), out.text(), timed_out, duration,
                          limit=hit, truncated_bytes=max(out.truncated, 0))

    async def _run(
        self, argv: list[str], cwd: str, env: dict[str, str], timeout_s: float, out: CappedBuffer, err: CappedBuffer | None
    ) -> tuple[int, CappedBuffer | None, bool, float]:
        """Run one in-runtime argv; stdout into ``out`` (stderr too unless ``err`` is given)."""
        _ = self.root  # prepared and not stopped
        start = time.monotonic()
        full = [*(self.limits.prefix() if self.limits else []), *self._privileged_prefix(), *self._wrap(argv, cwd)]
        payload = self._args_payload(argv, cwd)
        fds: tuple[int, ...] = ()
        if payload is not None:
            fd = os.memfd_create("polar-args", 0)
            os.write(fd, payload)
            os.lseek(fd, 0, os.SEEK_SET)
            fds = (fd,)
            full = [a.replace(ARGS_FD, str(fd)) for a in full]
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _ExitProtocol(loop),
                *full,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT if err is None else asyncio.subprocess.PIPE,
                env=env,
                pass_fds=(*fds, *self._pass_fds()),
                start_new_session=True,  # its own process group: a timeout kills all of it
            )
        finally:
            for fd in fds:
                os.close(fd)
        proc = asyncio.subprocess.Process(transport, protocol, loop)
        self._procs.add(proc)
        streams = [(proc.stdout, out), *([(proc.stderr, err)] if err is not None else [])]
        readers = [asyncio.ensure_future(_drain(stream, into)) for stream, into in streams]
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(protocol.exited), timeout_s)
            except TimeoutError:
                timed_out = True
                killpg(proc)
                await protocol.exited
            _done, pending = await asyncio.wait(readers, timeout=READER_GRACE_S)
            for (stream, _into), task in zip(streams, readers, strict=True):
                if task in pending:  # what it left running holds the pipe: read on, dropping it, until it ends
                    task.cancel()
                    self._leftover_readers.add(dropper := asyncio.ensure_future(_drain(stream, None)))
                    dropper.add_done_callback(self._leftover_readers.discard)
        finally:
            if proc.returncode is None:  # cancelled from outside
                killpg(proc)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(protocol.exited)
            for task in readers:
                task.cancel()
            self._procs.discard(proc)
        assert proc.returncode is not None
        return proc.returncode, err, timed_out, time.monotonic() - start

    # ----- files and diff ----------------------------------------------------------------------
    async def write_file(self, path: str, data: bytes) -> None:
        target = self.host_path(path, write=True)
        uid = self.uid

        def write() -> None:
            missing = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.host_path(str(path), write=True)  # re-check after creating parents
            with open(target, "wb") as f:
                f.write(data)
            if uid is not None:  # the agent's own files stay its own
                for p in [*missing, target]:
                    with contextlib.suppress(OSError):
                        os.lchown(p, uid, uid)

        await asyncio.to_thread(write)

    async def read_file(self, path: str) -> bytes:
        target = self.host_path(path)
        if not target.is_file():
            raise FileNotFoundError(path)
        return await asyncio.to_thread(target.read_bytes)

    async def diff(self) -> str:
        _ = self.root
        refuse_after_limit(self.limit_hit)
        out, err = CappedBuffer(int(self.spec.patch_mb * MIB), what="patch"), CappedBuffer(1 * MIB, what="stderr")
        code, _, timed_out, _ = await self._run(["/bin/sh", "-c", DIFF_SCRIPT], inside_path(self.spec.workdir),
                                                self._env(None), 300.0, out, err)
        return patch_text(self.name, self.spec.workdir, self.spec.patch_mb, swap_timeout(code, timed_out), out, err)

    async def __aenter__(self) -> Self:
        await self.prepare()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
