"""The embedded default runtime: a bubblewrap (``bwrap``) sandbox, one per episode.

Layout. Each runtime owns a private host directory (``tempfile.mkdtemp``, under ``root_dir`` /
``$POLAR_RUNTIME_DIR`` / the system temp dir) holding three writable trees:

    <root>/workspace -> spec.workdir (default /testbed); prepare copies spec.source_dir in, else the
                        image's own workdir (``<rootfs>/testbed``), .git included
    <root>/tmp       -> /tmp   (private; persists between execs, like a container's /tmp)
    <root>/home      -> /root  (HOME; harness config such as ~/.codex lives here, outside the diff)

Everything else is read-only: bwrap's empty tmpfs root, the host's ``/usr``, ``/etc`` and the merged
``/bin``/``/lib*`` symlinks (or, when ``spec.image`` names an image folder — a rootfs, an OCI bundle's
``rootfs/``, or an image name found in the local store, see ``bundle.py`` — each top-level entry of
that root filesystem), ``spec.binds`` (e.g. the npm harness installs and node), a fresh
``/dev``, ``/proc`` and a tmpfs ``/run``.

Isolation. ``--unshare-all`` gives the sandbox its own user, mount, pid, net, ipc, uts and cgroup
namespaces; ``--die-with-parent`` and ``--new-session`` are always on; the command runs as uid 0
*inside* the user namespace (the caller's uid outside, so it works rootless) with every capability
dropped (``--cap-drop ALL``; as real root, bwrap would otherwise keep them inside the namespace). The network namespace
has only ``lo``. With ``spec.network == "gateway"`` and a ``spec.gateway_socket``, the gateway's unix
socket is bound at ``/run/polar/gw.sock`` and the stdlib relay (``relay.py``, bound read-only at
``/run/polar/relay.py``) listens on ``127.0.0.1:<gateway_port>`` inside: the gateway is the only
address the sandbox can reach.

Exec and relay lifetime. The session's first exec starts one bwrap *instance* (its own
namespaces, a holder process); every exec joins it (``bwrap_instance.py``: ``nsenter`` into its
user, net, ipc, uts and cgroup namespaces, then ``bwrap --pidns`` with the same mounts and
``--cap-drop ALL``), so background processes live until the session stops, as under Docker and
Apptainer, and execs can still run concurrently. The relay runs once per instance
(``relay.py --background``). The environment is cleared and set explicitly (PATH, HOME, LANG, then
a bundle's ``process.env`` but HOME, then ``spec.env``, then the per-exec ``env``); it is handed to
bwrap as its process environment, never as argv (keys would show in ``ps``). stdout and stderr
share one pipe, so output is merged in order. On timeout the exec's process group is killed,
``timed_out`` is set and ``exit_code`` is 124.

Files and diff. ``read_file``/``write_file`` work on the host side of the writable trees (paths
under ``spec.workdir``, ``/tmp`` and ``/root``; the read-only ``spec.binds`` can be read), refusing
anything that resolves outside them (a symlink planted by the harness cannot make the host write
elsewhere). ``diff`` runs git *inside* the sandbox, never on the host, because the workspace's
``.git/config`` is under the harness's control (hooks, diff drivers, fsmonitor). If the workspace has
no ``.git`` after the copy, prepare commits a baseline so ``diff`` shows everything changed since.

Limits (``limits.py``). Processes and memory: the runtime's own cgroup, which every exec joins
before bwrap starts (rlimits without one). Disk: as root, the runtime's root directory is one sized
tmpfs (``diskfs.py``; ``size=<disk_mb>m``, ``nr_inodes`` one per 16 KiB), so workspace, ``/tmp`` and
HOME are bounded by the kernel (ENOSPC) together — files deleted while open, inodes and depth
included — and teardown unmounts it in O(1) whatever the agent left; rootless, a watchdog walk.
``limits_report()["mechanisms"]["disk_mb"]`` names which. With the host as root filesystem the
sandbox can read the host's ``/etc`` and ``/usr``; give a rootfs directory
(``scripts/build_rootfs.sh``) to avoid that. Bind targets (``spec.workdir``, ``spec.binds``) may be
anywhere: a target missing from a read-only
system directory is made creatable (see ``system_mounts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from polar_env.errors import ConfigError
from polar_env.runtimes.argv import GATEWAY_SOCKET, POLAR_RUN_DIR, RELAY_PATH, RELAY_SOURCE, relay_argv
from polar_env.runtimes.base import RuntimeSpec
from polar_env.runtimes.bundle import ImageDir
from polar_env.runtimes.bwrap_instance import (
    HOLDER,
    INFO_TIMEOUT_S,
    READY,
    Instance,
    nsenter_argv,
    open_namespaces,
    read_info,
)
from polar_env.runtimes.hostworkspace import (  # noqa: F401 - re-exported: the runtimes' shared names
    ARGS_FD,
    BASELINE_SCRIPT,
    DIFF_SCRIPT,
    HOME,
    TIMEOUT_EXIT_CODE,
    HostWorkspaceRuntime,
    copy_tree,
    inside_path,
    killpg,
    swap_timeout,
)
from polar_env.runtimes.imagestore import image_workdir, local_image
from polar_env.runtimes.limits import MIB, CappedBuffer
from polar_env.runtimes.reach import start_error

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BWRAP_INSTALL = "apt-get install -y bubblewrap"
HOST_SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ROOTFS_SKIP = frozenset({"proc", "dev", "sys", "tmp", "run", "root"})



# The host /etc entries a sandbox on the host's root filesystem sees (``minimal_etc``): what the
# dynamic loader, shells, git, python, node and TLS need; never shadow, sudoers, ssh keys or the rest.
ETC_ALLOW = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "hosts",
             "host.conf", "nsswitch.conf", "gai.conf", "protocols", "services", "ssl", "ca-certificates",
             "ca-certificates.conf", "gitconfig", "bash.bashrc", "profile", "profile.d", "inputrc", "environment",
             "mime.types", "python3", "python3.11", "debian_version", "os-release", "lsb-release", "magic",
             "magic.mime", "terminfo", "shells", "locale.alias", "locale.gen", "mailcap", "nodejs", "npmrc", "xdg")
PASSWD = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"
HOSTNAME = "sandbox"
HOSTS = f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{HOSTNAME}\n"


def write_hosts(root: Path) -> Path:
    """The /etc/hosts of a sandbox running an image: ``localhost`` and its own name resolve, as in a
    Docker container (images from debootstrap or ``docker export`` have none; tests that start a
    local server by name fail without it)."""
    path = root / "etc-hosts"
    path.write_text(HOSTS)
    return path


def write_etc(root: Path) -> Path:
    """The synthesized /etc/passwd and /etc/group of a sandbox (root and nobody only)."""
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(PASSWD)
    (etc / "group").write_text(GROUP)
    return etc


def system_mounts(image: str | Path | None, needed: Sequence[str] = (), etc: Path | None = None,
                  stage: Callable[[str | Path], str] = str) -> list[str]:
    """bwrap args for the read-only system: the host's /usr, /etc and merged-/usr symlinks, or every
    top-level entry of a rootfs directory, over bwrap's own tmpfs root. A ``needed`` mount point
    (workdir, bind targets) missing from a read-only directory is made creatable by re-creating that
    directory's path on the tmpfs and read-only binding its entries one level down instead. With
    ``etc`` (a directory holding passwd and group) and the host as root, /etc is minimal: the
    ``ETC_ALLOW`` entries of the host's plus those two files."""
    if image is None:
        root = "/"
        top = [n for n in HOST_SYSTEM_DIRS if os.path.lexists(f"/{n}") and not (etc is not None and n == "etc")]
    else:
        root = os.path.realpath(image)
        top = sorted(n for n in os.listdir(root) if n not in ROOTFS_SKIP and not n.startswith("."))
    missing = [inside_path(p) for p in needed if not os.path.lexists(os.path.join(root, inside_path(p).lstrip("/")))]
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
                args.extend(["--ro-bind", stage(host), child])

    mount("/", top)
    if image is None and etc is not None:
        args += ["--dir", "/etc"]
        mount("/etc", [n for n in ETC_ALLOW if os.path.lexists(f"/etc/{n}")])
        args += ["--ro-bind", str(etc / "passwd"), "/etc/passwd", "--ro-bind", str(etc / "group"), "/etc/group"]
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
    etc: Path | None = None,
    stage: Callable[[str | Path], str] = str,
    rootfs: str | Path | None = None,
    hosts: Path | None = None,
    pidns: int | None = None,
    info_fd: int | None = None,
) -> list[str]:
    """The full bwrap command line for the session's instance, or with ``pidns`` (an fd on the
    instance's PID namespace) for one exec joining it (``bwrap_instance.py``: nsenter has entered
    its other namespaces). Mount order matters (later mounts go on top). ``stage`` maps a host
    source to the path this exec reaches it by (see hostworkspace.py); ``rootfs``: the image's root
    filesystem when ``spec.image`` is a bundle or a store name; ``hosts``: the /etc/hosts an image
    gets (``write_hosts``), as container runtimes give one; ``info_fd``: where bwrap reports the
    instance's pid and namespaces."""
    if pidns is None:
        argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--hostname", HOSTNAME, "--uid", "0", "--gid",
                "0", "--cap-drop", "ALL"]
    else:
        argv = [bwrap, "--pidns", str(pidns), "--die-with-parent", "--cap-drop", "ALL"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    needed = [spec.workdir, *(dst for _src, dst in spec.binds), *(["/etc/hosts"] if hosts is not None else [])]
    argv += system_mounts(rootfs if rootfs is not None else spec.image, needed, etc, stage)
    if hosts is not None:
        argv += ["--ro-bind", stage(hosts), "/etc/hosts"]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    argv += ["--bind", stage(tmp), "/tmp", "--bind", stage(home), HOME]
    argv += ["--tmpfs", "/run", "--dir", POLAR_RUN_DIR]
    if spec.network == "gateway" and spec.gateway_socket is not None:
        argv += ["--ro-bind", stage(RELAY_SOURCE), RELAY_PATH, "--bind", stage(spec.gateway_socket), GATEWAY_SOCKET]
    argv += ["--bind", stage(workspace), inside_path(spec.workdir)]
    for src, dst in spec.binds:
        argv += ["--ro-bind", stage(src), inside_path(dst)]
    argv += ["--chdir", cwd, "--", *command]
    return argv


class SandboxRuntime(HostWorkspaceRuntime):
    """bubblewrap sandbox, one instance per session joined by every exec; see the module docstring."""

    name: ClassVar[str] = "sandbox"
    drops_root: ClassVar[bool] = True
    relay_per_exec: ClassVar[bool] = False  # one relay per instance (_start_instance)

    def __init__(self, spec: RuntimeSpec, *, root_dir: str | Path | None = None, bwrap: str | None = None) -> None:
        super().__init__(spec, root_dir=root_dir)
        self._bwrap_hint = bwrap
        self._bwrap: str | None = None
        self._nsenter: str | None = None
        self._etc: Path | None = None
        self._hosts: Path | None = None
        self._image: ImageDir | None = None
        self._instance: Instance | None = None
        self._drain: asyncio.Future[bytes] | None = None  # the instance's output, read so its pipe never fills
        self._starting = asyncio.Lock()
        self.restarts = 0  # instances started again after the agent ended one (its holder killed)

    def _check(self) -> None:
        found = shutil.which(self._bwrap_hint or os.environ.get("POLAR_BWRAP") or "bwrap")
        if found is None:
            raise ConfigError(f"bubblewrap (bwrap) is not installed; install it with: {BWRAP_INSTALL}")
        self._nsenter = shutil.which("nsenter")
        if self._nsenter is None:
            raise ConfigError("sandbox: nsenter (util-linux) is not installed; every exec joins the session's sandbox "
                              "with it: apt-get install -y util-linux")
        self._bwrap = found
        self._image = self.image_dir

    @property
    def image_dir(self) -> ImageDir | None:
        """The image folder (a rootfs, a bundle, or a store name's), read once; None: the host's system."""
        if self._image is None and self.spec.image is not None:
            self._image = local_image(self.spec.image, "sandbox")
        return self._image

    @property
    def path(self) -> str:
        """The PATH a command gets when the caller passes none: spec.env's, else the image's, else the default."""
        image = self.image_dir
        return self.spec.env.get("PATH") or (image.env.get("PATH") if image else None) or DEFAULT_PATH

    def _image_workdir(self) -> Path | None:
        return image_workdir(self.image_dir, self.spec.workdir)

    def _extra_sources(self) -> list[Path]:
        image = self.image_dir
        return [image.rootfs.resolve()] if image is not None else []

    def _full_argv(self, argv: Sequence[str], cwd: str, *, pidns: int | None = None, info_fd: int | None = None) -> list[str]:
        assert self._bwrap is not None
        if self._etc is None and self.spec.image is None:
            self._etc = write_etc(self.root)
        if self._hosts is None and self.spec.image is not None:
            self._hosts = write_hosts(self.root)
        image = self.image_dir
        return bwrap_argv(self.spec, bwrap=self._bwrap, workspace=self.workspace, tmp=self.tmp_dir, home=self.home_dir,
                          command=argv, cwd=cwd, etc=Path(self.staged(self._etc)) if self._etc else None,
                          stage=self.staged, rootfs=image.rootfs if image is not None else None, hosts=self._hosts,
                          pidns=pidns, info_fd=info_fd)

    def _wrap(self, argv: list[str], cwd: str) -> list[str]:
        # join the instance (started by _run first); bwrap reads its options from a file descriptor,
        # so host paths stay out of /proc/*/cmdline; the command itself (paths inside) stays on the argv
        assert self._instance is not None and self._nsenter is not None and self._bwrap is not None
        return [*nsenter_argv(self._nsenter, self._instance), self._bwrap, "--args", ARGS_FD, "--", *argv]

    def _args_payload(self, argv: list[str], cwd: str) -> bytes | None:
        assert self._instance is not None
        return _options(self._full_argv(argv, cwd, pidns=self._instance.fds["pid"]), argv)

    def _pass_fds(self) -> tuple[int, ...]:
        return self._instance.pass_fds if self._instance is not None else ()

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": HOME, "LANG": "C.UTF-8"}
        image = self.image_dir
        env.update({k: v for k, v in (image.env if image else {}).items() if k != "HOME"})  # HOME: the writable /root
        env.update(self.spec.env)
        env.update(extra or {})
        return env

    async def _run(self, argv: list[str], cwd: str, env: dict[str, str], timeout_s: float, out: CappedBuffer,
                   err: CappedBuffer | None) -> tuple[int, CappedBuffer | None, bool, float]:
        if self._instance is None or not self._instance.alive:
            await self._start_instance()
        return await super()._run(argv, cwd, env, timeout_s, out, err)

    async def _start_instance(self) -> None:
        """The session's instance (once; concurrent first execs wait for it; again after the agent
        ended it), and, for the gateway, one relay in its network namespace for the session."""
        async with self._starting:
            if self._instance is not None and self._instance.alive:
                return
            if self._instance is not None:
                self.restarts += 1
                log.warning("sandbox: the session's sandbox ended (exit %s, its holder killed from inside); starting "
                            "a new one: background processes are gone", self._instance.proc.returncode)
                self._instance.close()
                self._procs.discard(self._instance.proc)
                self._instance = None
            self._instance = await self._launch()
            if self.relay_enabled:
                relay = [*relay_argv(self.spec.gateway_port, [])[:-1], "--background"]
                buf = CappedBuffer(1 * MIB)
                code, _, _, _ = await super()._run(relay, "/", self._env(None), INFO_TIMEOUT_S, buf, None)
                if code != 0:
                    raise ConfigError(start_error(self.name, buf.text(), self.uid, relay=True)
                                      or f"sandbox: the gateway relay does not start (exit {code}): {buf.text().strip()}")

    async def _launch(self) -> Instance:
        """Start bwrap with the holder, read its pid and namespaces from ``--info-fd``, open them."""
        assert self._bwrap is not None
        hold_r, hold_w = os.pipe()
        info_r, info_w = os.pipe()
        args = os.memfd_create("polar-args", 0)
        try:
            os.write(args, _options(self._full_argv(HOLDER, "/", info_fd=info_w), HOLDER))
            os.lseek(args, 0, os.SEEK_SET)
            full = [*(self.limits.prefix() if self.limits else []), *self._privileged_prefix(),
                    self._bwrap, "--args", str(args), "--", *HOLDER]
            proc = await asyncio.create_subprocess_exec(*full, stdin=hold_r, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT, env=self._env(None),
                                                        pass_fds=(args, info_w), start_new_session=True)
        except BaseException:
            for fd in (hold_w, info_r):
                os.close(fd)
            raise
        finally:
            for fd in (hold_r, info_w, args):
                os.close(fd)
        self._procs.add(proc)
        instance = Instance(proc, hold_w)
        info = await read_info(info_r)
        assert proc.stdout is not None
        first = b""
        try:
            if info is None or "child-pid" not in info:
                raise ProcessLookupError("no --info-fd report")
            instance.fds = open_namespaces(info)
            with contextlib.suppress(TimeoutError):
                first = await asyncio.wait_for(proc.stdout.readline(), INFO_TIMEOUT_S)
            if first != READY:
                raise ProcessLookupError(first.decode("utf-8", "replace").strip() or "the holder never started")
        except (OSError, ValueError) as exc:
            instance.close()
            killpg(proc)
            raw = b""
            with contextlib.suppress(TimeoutError):
                raw, _ = await asyncio.wait_for(proc.communicate(), 10)
            self._procs.discard(proc)
            text = (first + raw).decode("utf-8", "replace")
            raise ConfigError(start_error(self.name, text, self.uid, relay=False)
                              or f"sandbox: the session's sandbox does not start (exit {proc.returncode}): "
                                 f"{text.strip()[-500:] or exc}") from None
        self._drain = asyncio.ensure_future(proc.stdout.read())  # it prints nothing once up; keep the pipe open
        return instance

    async def _cleanup(self) -> None:
        """The holder's pipe first (the instance then ends, and everything left in its PID namespace
        with it), then the rest."""
        if self._instance is not None:
            self._instance.close()
        await super()._cleanup()
        if self._drain is not None:
            self._drain.cancel()
        self._instance = self._drain = None


def _options(full: list[str], argv: Sequence[str]) -> bytes:
    """bwrap's options (between the binary and ``-- argv``) as its ``--args`` file: NUL-separated."""
    return b"".join(a.encode() + b"\0" for a in full[1 : -(len(argv) + 1)])
