"""The embedded default runtime: a bubblewrap (``bwrap``) sandbox, one per episode.

Layout. Each runtime owns a private host directory (``tempfile.mkdtemp``, under ``root_dir`` /
``$POLAR_RUNTIME_DIR`` / the system temp dir) holding three writable trees:

    <root>/workspace -> spec.workdir (default /testbed); prepare copies spec.source_dir in, .git included
    <root>/tmp       -> /tmp   (private; persists between execs, like a container's /tmp)
    <root>/home      -> /root  (HOME; harness config such as ~/.codex lives here, outside the diff)

Everything else is read-only: bwrap's empty tmpfs root, the host's ``/usr``, ``/etc`` and the merged
``/bin``/``/lib*`` symlinks (or, when ``spec.image`` names a root-filesystem directory, each top-level
entry of that directory), ``spec.binds`` (e.g. the npm harness installs and node), a fresh
``/dev``, ``/proc`` and a tmpfs ``/run``.

Isolation. ``--unshare-all`` gives the sandbox its own user, mount, pid, net, ipc, uts and cgroup
namespaces; ``--die-with-parent`` and ``--new-session`` are always on; the command runs as uid 0
*inside* the user namespace (the caller's uid outside, so it works rootless) with every capability
dropped (``--cap-drop ALL``; as real root, bwrap would otherwise keep them inside the namespace). The network namespace
has only ``lo``. With ``spec.network == "gateway"`` and a ``spec.gateway_socket``, the gateway's unix
socket is bound at ``/run/polar/gw.sock`` and the stdlib relay (``relay.py``, bound read-only at
``/run/polar/relay.py``) listens on ``127.0.0.1:<gateway_port>`` inside: the gateway is the only
address the sandbox can reach.

Exec and relay lifetime. Every ``exec`` is its own ``bwrap`` invocation (fresh namespaces over the
same persistent directories), so execs can run concurrently and a timeout simply kills one process
group. The relay is started per exec, in launch mode: ``python3 /run/polar/relay.py --listen ...
--socket ... -- CMD`` binds the port, forks the relay into the background and execs CMD, so the port
is ready before CMD starts and the relay dies with the exec's pid namespace. Cost: one python3
start per exec (tens of ms). The environment is cleared and set explicitly (PATH, HOME, LANG, then
``spec.env``, then the per-exec ``env``); it is handed to bwrap as its process environment, never as
argv (keys would show in ``ps``). stdout and stderr share one pipe, so output is merged in order.
On timeout the whole process group is killed (the pid namespace goes with it), ``timed_out`` is set
and ``exit_code`` is 124.

Files and diff. ``read_file``/``write_file`` work on the host side of the writable trees (paths
under ``spec.workdir``, ``/tmp`` and ``/root``; the read-only ``spec.binds`` can be read), refusing
anything that resolves outside them (a symlink planted by the harness cannot make the host write
elsewhere). ``diff`` runs git *inside* the sandbox, never on the host, because the workspace's
``.git/config`` is under the harness's control (hooks, diff drivers, fsmonitor). If the workspace has
no ``.git`` after the copy, prepare commits a baseline so ``diff`` shows everything changed since.

Limits. bwrap has no cgroup controls: ``spec.memory_mb`` and ``spec.pids_limit`` are not enforced
here (Docker enforces them). With the host as root filesystem the sandbox can read the host's
``/etc`` and ``/usr``; give a rootfs directory (``scripts/build_rootfs.sh``) to avoid that. Bind
targets (``spec.workdir``, ``spec.binds``) may be anywhere: a target missing from a read-only
system directory is made creatable (see ``system_mounts``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import posixpath
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Self

from polar_env.errors import ConfigError
from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings, check_host_paths

log = logging.getLogger(__name__)

RELAY_SOURCE = Path(__file__).with_name("relay.py")
POLAR_RUN_DIR = "/run/polar"
GATEWAY_SOCKET = "/run/polar/gw.sock"
RELAY_PATH = "/run/polar/relay.py"
HOME = "/root"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIMEOUT_EXIT_CODE = 124
BWRAP_INSTALL = "apt-get install -y bubblewrap"
HOST_SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ROOTFS_SKIP = frozenset({"proc", "dev", "sys", "tmp", "run", "root"})
READER_GRACE_S = 5.0

# git, run inside the runtime. `-c` (command scope) beats the workspace's own config, which the
# harness controls: the patch must be plain, prefixed a/ b/, without colour, textconv or ext-diff.
_GIT = "git -c safe.directory='*' -c core.quotePath=false -c diff.noprefix=false -c diff.mnemonicPrefix=false -c diff.relative=false"
BASELINE_SCRIPT = (
    f"if [ ! -e .git ]; then {_GIT} init -q && {_GIT} add -A && "
    f"{_GIT} -c user.name=polar -c user.email=polar@localhost commit -q --no-verify --allow-empty -m 'polar baseline'; fi"
)
DIFF_SCRIPT = f"{_GIT} add -A && {_GIT} diff --cached --binary --no-color --no-ext-diff --no-textconv"


def swap_timeout(code: int, timed_out: bool) -> int:
    return TIMEOUT_EXIT_CODE if timed_out else code


def relay_argv(port: int, command: Sequence[str]) -> list[str]:
    """The in-runtime launcher: bind 127.0.0.1:port, relay to the gateway socket, exec ``command``."""
    return ["python3", RELAY_PATH, "--listen", f"127.0.0.1:{port}", "--socket", GATEWAY_SOCKET, "--", *command]


def shell_argv(command: str | Sequence[str]) -> list[str]:
    """A string runs under ``/bin/sh -c``; a list is the argv itself."""
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise ConfigError("empty command")
    return argv


def _inside(path: str) -> str:
    if not path.startswith("/"):
        raise ConfigError(f"runtime paths must be absolute, got {path!r}")
    return posixpath.normpath(path)


def _under(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` into the existing ``dst`` (symlinks kept as links, .git included)."""
    if not src.is_dir():
        raise ConfigError(f"source_dir {src} is not a directory")
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)


def _force_rmtree(path: Path) -> None:
    """rmtree that also removes trees the harness made read-only."""

    def retry(func, p, _exc):  # type: ignore[no-untyped-def]
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
        func(p)

    if not path.exists():
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def _killpg(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader | None, into: bytearray) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        into += chunk


class HostWorkspaceRuntime(abc.ABC):
    """Shared machinery of the runtimes whose workspace is a host directory and whose every exec is
    a fresh process (bwrap, apptainer): temp dirs, copying, path mapping, process groups, timeouts.
    Subclasses supply ``_check``, ``_wrap`` (the full host argv for one in-runtime argv) and ``_env``."""

    name: ClassVar[str] = ""

    def __init__(self, spec: RuntimeSpec, *, root_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.timings = Timings()
        self._root_parent = root_dir or os.environ.get("POLAR_RUNTIME_DIR") or None
        self._root: Path | None = None
        self._procs: set[asyncio.subprocess.Process] = set()
        self._stopped = False

    # ----- to override -------------------------------------------------------------------------
    @abc.abstractmethod
    def _check(self) -> None: ...

    @abc.abstractmethod
    def _wrap(self, argv: list[str], cwd: str) -> list[str]: ...

    @abc.abstractmethod
    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]: ...

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

    def _mounts(self) -> list[tuple[str, Path, bool]]:
        """(path inside, host path, writable), longest inside path first."""
        mounts = [
            (_inside(self.spec.workdir), self.workspace, True),
            ("/tmp", self.tmp_dir, True),
            (HOME, self.home_dir, True),
            *((_inside(dst), Path(src), False) for src, dst in self.spec.binds),
        ]
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def host_path(self, path: str, *, write: bool = False) -> Path:
        """Map a path inside the runtime to the host, refusing escapes (symlinks included)."""
        inside = _inside(path)
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

    # ----- lifecycle ---------------------------------------------------------------------------
    async def prepare(self) -> None:
        if self._root is not None:
            raise ConfigError(f"{self.name} runtime already prepared")
        start = time.monotonic()
        _inside(self.spec.workdir)
        check_host_paths(self.spec)
        self._check()
        parent = Path(self._root_parent) if self._root_parent else None
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self._root = Path(tempfile.mkdtemp(prefix=f"polar-{self.name}-", dir=parent))
        try:
            for d in (self.workspace, self.tmp_dir, self.home_dir):
                d.mkdir()
            os.chmod(self.tmp_dir, 0o1777)
            if self.spec.source_dir is not None:
                await asyncio.to_thread(copy_tree, Path(self.spec.source_dir), self.workspace)
            if self.relay_enabled:
                res = await self.exec(["true"], timeout_s=60)
                if res.exit_code != 0:
                    raise ConfigError(f"{self.name}: the gateway relay does not start inside the runtime (needs python3): {res.output.strip()}")
            res = await self.exec(BASELINE_SCRIPT, timeout_s=120)
            if res.exit_code != 0:
                log.warning("%s: no git baseline in %s (diff() will fail): %s", self.name, self.spec.workdir, res.output.strip())
        except BaseException:
            await self._cleanup()
            raise
        self.timings.exec_s.clear()
        self.timings.prepare_s = time.monotonic() - start

    async def stop(self) -> None:
        if self._stopped or self._root is None:
            self._stopped = True
            return
        start = time.monotonic()
        await self._cleanup()
        self.timings.stop_s = time.monotonic() - start

    async def _cleanup(self) -> None:
        self._stopped = True
        procs = list(self._procs)
        for proc in procs:
            _killpg(proc)
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=10)
        if self._root is not None:
            try:
                await asyncio.to_thread(_force_rmtree, self._root)
            except OSError as e:  # never let teardown raise; say what is left behind
                log.warning("%s: could not remove %s: %s", self.name, self._root, e)

    # ----- exec --------------------------------------------------------------------------------
    async def exec(
        self, command: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 600.0
    ) -> ExecResult:
        _ = self.root  # ConfigError unless prepared and not stopped
        argv = shell_argv(command)
        if self.relay_enabled:
            argv = relay_argv(self.spec.gateway_port, argv)
        elif not isinstance(command, str):  # via sh, so a missing program exits 127 (bwrap says 1)
            argv = ["/bin/sh", "-c", 'exec "$@"', "sh", *argv]
        full = self._wrap(argv, _inside(cwd or self.spec.workdir))
        code, out, _err, timed_out, duration = await self._run(full, self._env(env), timeout_s, merge=True)
        self.timings.exec_s.append(duration)
        return ExecResult(swap_timeout(code, timed_out), out.decode("utf-8", "replace"), timed_out, duration)

    async def _run(
        self, argv: list[str], env: dict[str, str], timeout_s: float, *, merge: bool
    ) -> tuple[int, bytes, bytes, bool, float]:
        _ = self.root  # prepared and not stopped
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge else asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        self._procs.add(proc)
        out, err = bytearray(), bytearray()
        readers = [asyncio.ensure_future(_drain(proc.stdout, out))]
        if not merge:
            readers.append(asyncio.ensure_future(_drain(proc.stderr, err)))
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
                _killpg(proc)
                await proc.wait()
            _done, pending = await asyncio.wait(readers, timeout=READER_GRACE_S)
            for task in pending:  # something outside the namespace still holds the pipe
                task.cancel()
        finally:
            if proc.returncode is None:  # cancelled from outside
                _killpg(proc)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(proc.wait())
            for task in readers:
                task.cancel()
            self._procs.discard(proc)
        assert proc.returncode is not None
        return proc.returncode, bytes(out), bytes(err), timed_out, time.monotonic() - start

    # ----- files and diff ----------------------------------------------------------------------
    async def write_file(self, path: str, data: bytes) -> None:
        target = self.host_path(path, write=True)

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            self.host_path(str(path), write=True)  # re-check after creating parents
            with open(target, "wb") as f:
                f.write(data)

        await asyncio.to_thread(write)

    async def read_file(self, path: str) -> bytes:
        target = self.host_path(path)
        if not target.is_file():
            raise FileNotFoundError(path)
        return await asyncio.to_thread(target.read_bytes)

    async def diff(self) -> str:
        _ = self.root
        argv = self._wrap(["/bin/sh", "-c", DIFF_SCRIPT], _inside(self.spec.workdir))
        code, out, err, timed_out, _ = await self._run(argv, self._env(None), 300.0, merge=False)
        if code != 0 or timed_out:
            raise ConfigError(f"{self.name}: git diff failed in {self.spec.workdir} (exit {code}): {err.decode('utf-8', 'replace').strip()}")
        return out.decode("utf-8", "replace")

    async def __aenter__(self) -> Self:
        await self.prepare()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def system_mounts(image: str | Path | None, needed: Sequence[str] = ()) -> list[str]:
    """bwrap args for the read-only system: the host's /usr, /etc and merged-/usr symlinks, or every
    top-level entry of a rootfs directory, over bwrap's own tmpfs root. A ``needed`` mount point
    (workdir, bind targets) missing from a read-only directory is made creatable by re-creating that
    directory's path on the tmpfs and read-only binding its entries one level down instead."""
    if image is None:
        root = "/"
        top = [n for n in HOST_SYSTEM_DIRS if os.path.lexists(f"/{n}")]
    else:
        root = str(image)
        top = sorted(n for n in os.listdir(root) if n not in ROOTFS_SKIP and not n.startswith("."))
    missing = [_inside(p) for p in needed if not os.path.lexists(os.path.join(root, _inside(p).lstrip("/")))]
    args: list[str] = []

    def mount(inside: str, names: Sequence[str]) -> None:
        for n in names:
            child = posixpath.join(inside, n)
            host = os.path.join(root, child.lstrip("/"))
            if os.path.islink(host):
                args.extend(["--symlink", os.readlink(host), child])
            elif os.path.isdir(host) and any(m.startswith(child + "/") for m in missing):
                args.extend(["--dir", child])
                with contextlib.suppress(OSError):
                    mount(child, sorted(os.listdir(host)))
            else:
                args.extend(["--ro-bind", host, child])

    mount("/", top)
    return args


def bwrap_argv(
    spec: RuntimeSpec,
    *,
    bwrap: str,
    workspace: Path,
    tmp: Path,
    home: Path,
    command: Sequence[str],
    cwd: str,
) -> list[str]:
    """The full bwrap command line for one exec. Mount order matters (later mounts go on top)."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--uid", "0", "--gid", "0", "--cap-drop", "ALL"]
    argv += system_mounts(spec.image, [spec.workdir, *(dst for _src, dst in spec.binds)])
    argv += ["--dev", "/dev", "--proc", "/proc"]
    argv += ["--bind", str(tmp), "/tmp", "--bind", str(home), HOME]
    argv += ["--tmpfs", "/run", "--dir", POLAR_RUN_DIR]
    if spec.network == "gateway" and spec.gateway_socket is not None:
        argv += ["--ro-bind", str(RELAY_SOURCE), RELAY_PATH, "--bind", str(spec.gateway_socket), GATEWAY_SOCKET]
    argv += ["--bind", str(workspace), _inside(spec.workdir)]
    for src, dst in spec.binds:
        argv += ["--ro-bind", str(src), _inside(dst)]
    argv += ["--chdir", cwd, "--", *command]
    return argv


class SandboxRuntime(HostWorkspaceRuntime):
    """bubblewrap sandbox; see the module docstring."""

    name: ClassVar[str] = "sandbox"

    def __init__(self, spec: RuntimeSpec, *, root_dir: str | Path | None = None, bwrap: str | None = None) -> None:
        super().__init__(spec, root_dir=root_dir)
        self._bwrap_hint = bwrap
        self._bwrap: str | None = None

    def _check(self) -> None:
        found = shutil.which(self._bwrap_hint or os.environ.get("POLAR_BWRAP") or "bwrap")
        if found is None:
            raise ConfigError(f"bubblewrap (bwrap) is not installed; install it with: {BWRAP_INSTALL}")
        self._bwrap = found
        if self.spec.image is not None and not Path(self.spec.image).is_dir():
            raise ConfigError(f"sandbox image must be a root-filesystem directory (scripts/build_rootfs.sh), got {self.spec.image}")
        if self.spec.memory_mb is not None or self.spec.pids_limit is not None:
            log.info("sandbox runtime: memory_mb/pids_limit are not enforced by bwrap (no cgroups)")

    def _wrap(self, argv: list[str], cwd: str) -> list[str]:
        assert self._bwrap is not None
        return bwrap_argv(
            self.spec, bwrap=self._bwrap, workspace=self.workspace, tmp=self.tmp_dir, home=self.home_dir, command=argv, cwd=cwd
        )

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": HOME, "LANG": "C.UTF-8"}
        env.update(self.spec.env)
        env.update(extra or {})
        return env
