"""Apptainer runtime (rootless; HPC clusters). One ``apptainer instance`` per session, joined by
every exec (``apptainer_instance.py``: the instance's namespaces via ``nsenter``).

Why an instance: a fresh ``apptainer exec`` per tool call cost ~410 ms wall and ~88 ms host CPU
(the Go CLI and its starter every time), and background processes died with each call; Docker keeps
them, which is what agents expect. The instance is started by the first exec of ``prepare`` with
the argv below (``instance start`` instead of ``exec``, the image's start action replaced by a
``sleep``), its record in the runtime folder so ``leftovers.sweep`` stops it after a crash, and
``stop`` SIGKILLs its PID 1. The per-exec form remains for copying a SIF's workdir out at prepare.
The state that must survive between execs lives in host directories bound in (the same layout as
the sandbox, see ``sandbox.py``):

    <root>/workspace -> spec.workdir   <root>/tmp -> /tmp   <root>/home -> /root (via --home, so HOME=/root)

The argv (``apptainer_argv``, unit-tested exactly):

    apptainer exec --userns --containall --cleanenv --home <root>/home:/root --pwd <cwd>
        -B <root>/workspace:<workdir> -B <root>/tmp:/tmp
        [-B <relay.py>:/run/polar/relay.py:ro -B <gateway.sock>:/run/polar/gw.sock]
        [-B <src>:<dst>:ro ...]                                  # spec.binds
        --net --network none                                     # only lo, always
        <image> CMD...
    # the session's instance: ``instance start`` for ``exec``, no --pwd,
    #   -B <root>/instance-start:/.singularity.d/actions/start:ro ... <image> <name>

``--userns`` (``userns=True``, the default): Apptainer's unprivileged user-namespace path, never its
setuid starter — what HPC sites allow. What a site needs: unprivileged user namespaces
(``user.max_user_namespaces`` > 0; on Debian/Ubuntu kernels ``kernel.unprivileged_userns_clone=1``,
and no AppArmor userns restriction for the apptainer binary), nothing else for a sandbox directory;
a ``.sif`` additionally needs ``squashfuse`` and ``/dev/fuse`` (rootless Apptainer mounts SIFs via
FUSE). As root, plain ``apptainer exec`` also takes the privileged path, which fails where root's
bounding set lacks CAP_SYS_RESOURCE (seen on our CI machines); ``--userns`` works there.

Privileges (``drops_root``): as root, every exec drops to the runtime's own unprivileged uid first
(``hostworkspace.py``: ``SANDBOX_UID_BASE`` + a random slot, ``setpriv``), exactly as the sandbox
does — with ``--userns`` and no ``--fakeroot`` Apptainer maps the caller's uid to itself, so without
the drop the agent would be the host's real root on the bound workspace, /tmp and HOME. Inside, the
agent runs as that uid (Apptainer's model: no root in the container), owning the writable trees.
What the uid cannot reach (an image under ``/root/.cache``, harness binds, the gateway socket) is
staged into a private mount namespace of that one exec, along with copies of /etc/passwd and
/etc/group that name the uid (Apptainer refuses a caller it cannot look up). The Apptainer install
itself cannot be staged (its starter finds its session directory by the compiled-in prefix, and a
bind-mounted prefix is not found from inside): it must be world-readable where it was built for
(``scripts/install_apptainer.sh``: ``/opt/polar_env/apptainer/<version>`` as root; any site
install in ``/usr`` or ``/opt``). Rootless callers run as themselves.

``--home <dir>:/root`` replaces ``--no-home``: the user's real home is still not mounted, and HOME
points at a private per-episode directory like in the other runtimes (Apptainer refuses to set HOME
through ``APPTAINERENV_HOME``). ``IMAGE`` is a ``.sif``, a sandbox directory (a plain rootfs, an OCI
bundle's ``rootfs/`` or an image name found in the local store, ``bundle.py``) or a URI such as
``docker://`` + ``polar_env.tasks.images.swegym_image(...)`` or ``docker-archive://SAVE.tar``, which
prepare converts once into the store as a sandbox folder and then runs as a store image
(``apptainer_images.py``: the dropped uid has no writable Apptainer cache to pull into per exec).
The environment is nsenter's own (so values never appear in argv, and
nothing of the host's leaks): what the image's ``/.singularity.d/env`` scripts set (sourced once at
instance start, as Apptainer does per exec), then a bundle's ``process.env``, ``spec.env`` and the
call's; PATH is the image's unless given (also ``path``). The per-exec form passes the same as
``APPTAINERENV_<K>`` variables. A SIF that the runtime's uid cannot mount (``/dev/fuse`` closed) is
unpacked once into the store at prepare (``apptainer_images.py``). Without ``source_dir`` the workspace
starts as the image's workdir: copied from a folder image, or tarred out through a SIF (the
workspace not bound) and extracted with tarfile's checks. The relay runs once per instance (``--background``,
like Docker's): the instance's network namespace (``--network none``: only ``lo``) is shared by its
execs.

Limits (``limits.py``): the instance and each exec join the runtime's own cgroup first (as root,
v1 or v2; rootless, a delegated v2 subtree). Rootless without one, memory and pids cannot be bounded
per session (rlimits are per process: a hit was the agent's own MemoryError, never a limit), so
``_check`` refuses in one line unless ``spec.allow_unbounded``, and then the report says "unbounded". Apptainer's
own ``--memory``/``--pids-limit`` (``cgroup_flags=True``) need cgroups v2 with systemd delegation for
a non-root caller (on our CI machines, cgroups v1 without systemd: ``FATAL: ... cannot use systemd
cgroups manager``); as root with the uid drop Apptainer runs unprivileged too, so keep
``cgroup_flags`` off there and rely on the runtime's own cgroup (verified: pids and memory trip).
Output, patch and disk caps are the shared ones: as root, the disk is the sized tmpfs on the runtime
root that holds the bound workspace, /tmp and HOME (``diskfs.py``).

Binary: ``binary=``, else ``$POLAR_APPTAINER``, else ``apptainer`` on PATH, else what
``scripts/install_apptainer.sh`` built (``$POLAR_APPTAINER_CACHE`` or ``~/.cache/polar_env/apptainer``,
``bin/apptainer``). ``probe`` runs ``true`` through all of the above for preflight. Tests: the argv by
unit test; the lifecycle with a fake ``apptainer`` that maps ``exec`` onto bwrap
(``tests/fixtures/runtimes/fake_apptainer``) and against the real binary built by that script
(``tests/runtimes/test_apptainer_real.py``, required under ``CI``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from polar_env.errors import ConfigError
from polar_env.runtimes import limits
from polar_env.runtimes.apptainer_images import Converted, ensure_sandbox, last_line, sif_key
from polar_env.runtimes.apptainer_instance import (
    ENV_SCRIPT,
    START_INSIDE,
    START_SCRIPT,
    START_TEXT,
    config_dir,
    instance_name,
    nsenter_argv,
    parse_env,
    records,
    stop_instances,
)
from polar_env.runtimes.argv import GATEWAY_SOCKET, RELAY_PATH, RELAY_SOURCE, relay_argv
from polar_env.runtimes.base import RuntimeSpec
from polar_env.runtimes.bundle import ImageDir
from polar_env.runtimes.hostworkspace import (
    HOME,
    SANDBOX_UID_BASE,
    HostWorkspaceRuntime,
    chown_tree,
    drops_privileges,
    inside_path,
    killpg,
)
from polar_env.runtimes.imagestore import URI_SCHEMES, extract_stream, image_workdir, local_image
from polar_env.runtimes.limits import MIB, CappedBuffer
from polar_env.runtimes.reach import reachable, start_error

APPTAINER_INSTALL = ("run scripts/install_apptainer.sh (builds it once, linked from ~/.cache/polar_env/apptainer; "
                     "Debian 12 has no package) or install Apptainer (https://apptainer.org/docs/admin/main/installation.html)")
PROBE_TIMEOUT_S = 60.0
EXPORT_TIMEOUT_S = 600.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HOST_ENV_DROP = ("APPTAINERENV_", "SINGULARITYENV_", "APPTAINER_ENV", "SINGULARITY_ENV")


def cached_binary() -> Path:
    """Where ``scripts/install_apptainer.sh`` puts its link to the binary it built."""
    cache = os.environ.get("POLAR_APPTAINER_CACHE") or Path.home() / ".cache" / "polar_env" / "apptainer"
    return Path(cache) / "bin" / "apptainer"


def find_apptainer(hint: str | None = None) -> str | None:
    """The binary to run: ``hint`` or ``$POLAR_APPTAINER`` (a name on PATH or a path) when given,
    else ``apptainer`` on PATH, else the install script's; None when there is none."""
    named = hint or os.environ.get("POLAR_APPTAINER")
    if named:
        return shutil.which(named)
    found = shutil.which("apptainer")
    if found is not None:
        return found
    cached = cached_binary()
    return str(cached) if os.access(cached, os.X_OK) else None


def fuse_usable(dropped: bool) -> bool:
    """Whether the uid that runs apptainer can open /dev/fuse (a SIF's squashfuse mount): with
    ``dropped`` (root dropping to the runtime's uid) only a world-rw device counts."""
    try:
        mode = os.stat("/dev/fuse").st_mode
    except OSError:
        return False
    if dropped:
        return mode & 0o006 == 0o006
    return os.access("/dev/fuse", os.R_OK | os.W_OK)


def unbounded_refusal(why: str) -> str:
    return (f"this host cannot bound memory/pids for rootless Apptainer: {why}; run as root (the runtime's own "
            "cgroup), or pass --allow-unbounded (runtime.allow_unbounded: true) to run without")


def describe_host(binary: str) -> str:
    """One line on a site's Apptainer for preflight: version, user namespaces, cgroup mode and what
    bounds a session's memory and pids here, and whether a SIF is mounted or unpacked."""
    proc = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False, timeout=PROBE_TIMEOUT_S)
    version = (proc.stdout.strip() or proc.stderr.strip() or "unknown version").splitlines()[0]
    try:
        userns = f"user namespaces max {Path('/proc/sys/user/max_user_namespaces').read_text().strip()}"
    except OSError:
        userns = "user namespaces: unknown"
    mode = "cgroup v2" if (limits.CGROUP_ROOT / "cgroup.controllers").exists() else "cgroups v1"
    dropped = drops_privileges()
    if dropped:
        bound = "limits: the runtime's own cgroup (as root)" if limits.cgroup_version() else "limits: rlimits only (no cgroup)"
    else:
        why = limits.rootless_bound()
        bound = f"limits (uid {os.geteuid()}): " + ("delegated cgroup v2" if why is None else f"none: {why}")
    sif = "SIF mounted (squashfuse)" if fuse_usable(dropped) else "SIF unpacked once (/dev/fuse closed)"
    return f"{version}; {userns}; {mode}; {bound}; {sif}"


def _bind_part(path: str | Path) -> str:
    s = str(path)
    if ":" in s or "," in s:
        raise ConfigError(f"apptainer bind paths cannot contain ':' or ',': {s}")
    return s


def apptainer_argv(
    *,
    binary: str,
    image: str,
    workdir: str,
    workspace: Path | None,
    tmp: Path,
    home: Path,
    cwd: str,
    command: Sequence[str],
    gateway_socket: Path | None = None,
    binds: Sequence[tuple[Path, str]] = (),
    memory_mb: int | None = None,
    pids_limit: int | None = None,
    userns: bool = True,
    instance: str | None = None,
    start_script: Path | None = None,
) -> list[str]:
    """The exact ``apptainer exec`` command line for one exec (see the module docstring); no
    ``workspace``: the image's own workdir shows (to copy it out). ``instance``: ``apptainer instance
    start`` with the same options instead, naming that instance (``command`` unused), with
    ``start_script`` bound over the image's start action (a plain rootfs has none)."""
    b = _bind_part
    action = ["instance", "start"] if instance is not None else ["exec"]
    pwd = ["--pwd", cwd] if instance is None else []
    argv = [binary, *action, *(["--userns"] if userns else []), "--containall", "--cleanenv", "--home", f"{b(home)}:{HOME}", *pwd]
    argv += [*(["-B", f"{b(workspace)}:{b(workdir)}"] if workspace is not None else []), "-B", f"{b(tmp)}:/tmp"]
    if gateway_socket is not None:
        argv += ["-B", f"{b(RELAY_SOURCE)}:{RELAY_PATH}:ro", "-B", f"{b(gateway_socket)}:{GATEWAY_SOCKET}"]
    for src, dst in binds:
        argv += ["-B", f"{b(src)}:{b(dst)}:ro"]
    if memory_mb is not None:
        argv += ["--memory", f"{memory_mb}M", "--memory-swap", f"{memory_mb}M"]
    if pids_limit is not None:
        argv += ["--pids-limit", str(pids_limit)]
    if start_script is not None:
        argv += ["-B", f"{b(start_script)}:{START_INSIDE}:ro"]
    argv += ["--net", "--network", "none", image, *([instance] if instance is not None else command)]
    return argv


def apptainer_env(host_env: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """The apptainer process environment: the host's (minus any APPTAINERENV_ leftovers) plus one
    ``APPTAINERENV_<K>`` per variable the container should see."""
    out = {k: v for k, v in host_env.items() if not k.startswith(_HOST_ENV_DROP)}
    for k, v in env.items():
        if k == "HOME":
            continue  # set by --home
        out[f"APPTAINERENV_{k}"] = v
    return out


class ApptainerRuntime(HostWorkspaceRuntime):
    """Apptainer, one instance per session joined by every exec; see the module docstring."""

    name: ClassVar[str] = "apptainer"
    drops_root: ClassVar[bool] = True
    relay_per_exec: ClassVar[bool] = False  # one relay per instance (_start_instance)

    def __init__(self, spec: RuntimeSpec, *, root_dir: str | Path | None = None, binary: str | None = None,
                 cgroup_flags: bool = False, userns: bool = True) -> None:
        super().__init__(spec, root_dir=root_dir)
        self._cgroup_flags = cgroup_flags
        self._userns = userns
        self._binary_hint = binary
        self._binary: str | None = None
        self._image: ImageDir | None = None  # a folder image (rootfs or bundle), read at prepare
        self._run_image = spec.image or ""  # what apptainer runs: a URI, a SIF, or the folder's rootfs
        self._probed_path: str | None = None
        self._converted: Converted | None = None  # a URI image's (or closed-fuse SIF's) sandbox folder in the store
        self._instance_pid: int | None = None  # the session instance's PID 1 (apptainer_instance.py)
        self._image_env: dict[str, str] = {}  # what the image's env scripts set, read at instance start
        self._starting = asyncio.Lock()
        self._nsenter: str | None = None

    def _check(self) -> None:
        found = find_apptainer(self._binary_hint)
        if found is None:
            hint = self._binary_hint or os.environ.get("POLAR_APPTAINER") or "apptainer"
            raise ConfigError(f"apptainer binary {hint!r} not found; {APPTAINER_INSTALL}")
        self._binary = found
        prefix = Path(found).resolve().parent.parent
        if self.drops_root and os.geteuid() == 0 and not reachable(prefix / "libexec", SANDBOX_UID_BASE):
            raise ConfigError(f"the apptainer install {prefix} is not reachable by unprivileged uids, which every exec "
                              "drops to as root (Apptainer finds its starter and session directory by its compiled-in "
                              "prefix, so it cannot be staged); install it under a world-readable prefix: "
                              "scripts/install_apptainer.sh uses /opt/polar_env/apptainer")
        image = self.spec.image
        if not image:
            raise ConfigError("the apptainer runtime needs spec.image (.sif, sandbox directory or docker:// URI)")
        image = str(self._converted.path) if self._converted is not None else image
        if not image.startswith(URI_SCHEMES) and not Path(image).is_file():
            self._image = local_image(image, "apptainer")  # a folder: its rootfs is the sandbox directory
            self._run_image = str(self._image.rootfs)
        if Path(image).is_file() and not self._fuse_usable():  # prepare unsquashes it first; a direct caller
            raise ConfigError(f"apptainer image {image} is a SIF, which rootless Apptainer mounts with squashfuse, but "
                              "/dev/fuse is not open to the uid that runs it; prepare() unpacks it into the store")
        for tool in ("nsenter", "setpriv"):
            if shutil.which(tool) is None:
                raise ConfigError(f"apptainer: {tool} (util-linux) is not on PATH; every exec joins the session's "
                                  "instance with nsenter")
        self._nsenter = shutil.which("nsenter")
        if not drops_privileges() and (self.spec.memory_mb is not None or self.spec.pids_limit is not None):
            why = limits.rootless_bound()
            if why is not None and not self.spec.allow_unbounded:
                raise ConfigError(unbounded_refusal(why))
            self.unbounded = why

    def _fuse_usable(self) -> bool:
        return fuse_usable(self.drops_root and os.geteuid() == 0)

    def _own(self, uid: int) -> None:
        """Also give the uid a name: Apptainer looks its caller up (``FATAL: Couldn't determine user
        account information: user: unknown userid``), so each exec's private mount namespace gets
        copies of the host's /etc/passwd and /etc/group with one entry for it."""
        super()._own(uid)
        for name, entry in (("passwd", f"polar:x:{uid}:{uid}:polar agent:{HOME}:/bin/sh"), ("group", f"polar:x:{uid}:")):
            host = Path("/etc") / name
            text = host.read_text() if host.exists() else ""
            copy = self.root / f"etc-{name}"
            copy.write_text(text + ("" if text.endswith("\n") or not text else "\n") + entry + "\n")
            self._stage.append((str(copy), str(host)))

    def _extra_sources(self) -> list[Path]:
        if self._run_image and not self._run_image.startswith(URI_SCHEMES):
            return [Path(self._run_image).resolve()]
        return []

    def _image_workdir(self) -> Path | None:
        return image_workdir(self._image, self.spec.workdir)

    @property
    def path(self) -> str:
        """The PATH a command gets when the caller passes none: spec.env's, else the image's (a
        bundle's config, else what the image's own environment scripts set, read at prepare), else
        the default."""
        return (self.spec.env.get("PATH") or (self._image.env.get("PATH") if self._image else None)
                or self._probed_path or DEFAULT_PATH)

    def _wrap(self, argv: list[str], cwd: str) -> list[str]:
        """Join the session's instance (started by ``_run`` before the first exec)."""
        assert self._instance_pid is not None and self._nsenter is not None
        return nsenter_argv(self._nsenter, self._instance_pid, cwd, argv)

    def _privileged_prefix(self) -> list[str]:
        """The instance's namespaces hold the stages already: only the drop to the uid (as root), and
        no_new_privs either way (Apptainer sets it for its own execs)."""
        if self._instance_pid is None:
            return super()._privileged_prefix()
        uid = [] if self.uid is None else [f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                                           "--inh-caps=-all", "--bounding-set=-all"]
        return ["setpriv", *uid, "--no-new-privs", "--"]

    def _apptainer_argv(self, argv: list[str], cwd: str, *, workspace: bool = True, instance: str | None = None,
                        start_script: Path | None = None) -> list[str]:
        """One ``apptainer exec`` (or, with ``instance``, the ``instance start``) command line."""
        assert self._binary is not None and self._run_image
        st = self.staged
        binary = self._binary if self.uid is None else str(Path(self._binary).resolve())  # a link may be in /root
        image = self._run_image
        if not image.startswith(URI_SCHEMES):
            image = st(Path(image).resolve())
        sock = Path(st(self.spec.gateway_socket)) if self.relay_enabled and self.spec.gateway_socket else None
        return apptainer_argv(
            binary=binary,
            image=image,
            workdir=inside_path(self.spec.workdir),
            workspace=Path(st(self.workspace)) if workspace else None,
            tmp=Path(st(self.tmp_dir)),
            home=Path(st(self.home_dir)),
            cwd=cwd,
            command=argv,
            gateway_socket=sock,
            binds=[(Path(st(src)), dst) for src, dst in self.spec.binds],
            memory_mb=self.spec.memory_mb if self._cgroup_flags else None,
            pids_limit=self.spec.pids_limit if self._cgroup_flags else None,
            userns=self._userns,
            instance=instance,
            start_script=Path(st(start_script)) if start_script is not None else None,
        )

    def limits_report(self) -> dict[str, Any]:
        report = super().limits_report()
        if self._cgroup_flags and report:
            for key, flag in (("memory_mb", "--memory"), ("pids_limit", "--pids-limit")):
                report["mechanisms"][key] = f"apptainer {flag} (cgroups) + {report['mechanisms'][key]}"
        if self._converted is not None:
            report["image"] = self._converted.report()
        return report

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        """The environment inside (exactly: nsenter passes its own on): the image's env scripts', then
        the bundle's, spec.env and the call's; HOME is the private one."""
        image = self._image.env if self._image is not None else {}
        return {**self._image_env, "LANG": "C.UTF-8", **image, **self.spec.env, **(extra or {}), "HOME": HOME}

    async def prepare(self) -> None:
        image = self.spec.image
        sif = image is not None and Path(image).is_file() and not self._fuse_usable()
        if image and (image.startswith(URI_SCHEMES) or sif) and self._root is None:
            self._converted = await ensure_sandbox(image, self._find_binary(),
                                                   key=sif_key(Path(image)) if sif else None)
        await super().prepare()

    def _find_binary(self) -> str:
        found = find_apptainer(self._binary_hint)
        if found is None:
            hint = self._binary_hint or os.environ.get("POLAR_APPTAINER") or "apptainer"
            raise ConfigError(f"apptainer binary {hint!r} not found; {APPTAINER_INSTALL}")
        return found

    async def _run(self, argv: list[str], cwd: str, env: dict[str, str], timeout_s: float, out: CappedBuffer,
                   err: CappedBuffer | None) -> tuple[int, CappedBuffer | None, bool, float]:
        if self._instance_pid is None:
            await self._start_instance()
        return await super()._run(argv, cwd, env, timeout_s, out, err)

    async def _start_instance(self) -> None:
        """``apptainer instance start`` (once; concurrent first execs wait for it), the image's env,
        and, for the gateway, one relay in the background for the whole session."""
        async with self._starting:
            if self._instance_pid is not None:
                return
            await self._start_instance_locked()

    async def _start_instance_locked(self) -> None:
        root = self.root
        cfg, script, name = config_dir(root), root / START_SCRIPT, instance_name(root)
        cfg.mkdir(exist_ok=True)
        script.write_text(START_TEXT)
        script.chmod(0o755)
        if self.uid is not None:
            await asyncio.to_thread(chown_tree, cfg, self.uid)
            os.lchown(script, self.uid, self.uid)
        full = [*(self.limits.prefix() if self.limits else []), *super()._privileged_prefix(),
                *self._apptainer_argv([], "/", instance=name, start_script=script)]
        env = {**apptainer_env(os.environ, {"LANG": "C.UTF-8"}), "APPTAINER_CONFIGDIR": self.staged(cfg)}
        proc = await asyncio.create_subprocess_exec(*full, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True)
        self._procs.add(proc)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
        except TimeoutError:
            out = f"no instance after {PROBE_TIMEOUT_S:g} s".encode()
        finally:
            if proc.returncode is None:
                killpg(proc)
                await proc.wait()
            self._procs.discard(proc)
        text = out.decode("utf-8", "replace")
        found = [r for r in records(cfg) if r.name == name]
        if proc.returncode != 0 or not found:
            stop_instances(cfg)
            raise ConfigError(start_error(self.name, text, self.uid, relay=False)
                              or f"apptainer: the session instance does not start (exit {proc.returncode}): {last_line(text)} "
                              "(its start action and every exec run the image's /bin/sh)")
        self._instance_pid = found[0].pid
        buf = CappedBuffer(1 * MIB)
        code, _, _, _ = await super()._run(["/bin/sh", "-c", ENV_SCRIPT], "/", {"PATH": DEFAULT_PATH},
                                           PROBE_TIMEOUT_S, buf, None)
        if code != 0:  # a dead instance, or an image without /bin/sh
            raise ConfigError(start_error(self.name, buf.text(), self.uid, relay=False)
                              or f"apptainer: cannot run /bin/sh in the session instance (exit {code}): {last_line(buf.text())}")
        self._image_env = {k: v for k, v in parse_env(buf.data()).items() if k not in ("PWD", "OLDPWD", "SHLVL", "_")}
        self._probed_path = self._image_env.get("PATH")
        if self.relay_enabled:
            relay = [*relay_argv(self.spec.gateway_port, [])[:-1], "--background"]
            buf = CappedBuffer(1 * MIB)
            code, _, _, _ = await super()._run(relay, "/", self._env(None), PROBE_TIMEOUT_S, buf, None)
            if code != 0:
                raise ConfigError(start_error(self.name, buf.text(), self.uid, relay=True)
                                  or f"apptainer: the gateway relay does not start in the instance: {buf.text().strip()}")

    async def _cleanup(self) -> None:
        """The instance first (its PID 1, so the kernel ends everything left in it), then the rest."""
        if self._root is not None:
            await asyncio.to_thread(stop_instances, config_dir(self._root))
        self._instance_pid = None
        await super()._cleanup()

    async def _export_workdir(self) -> bool:
        """A SIF has no host folder to copy its workdir from: ``tar`` it out
        through the image (the workspace not bound over it) into the workspace, member by member
        with tarfile's checks (``imagestore.extract_stream``)."""
        if self._image is not None or self.spec.image is None:
            return False
        workdir = inside_path(self.spec.workdir)
        script = '[ -d "$1" ] || exit 0; cd "$1" && exec tar -cf - .'
        full = [*(self.limits.prefix() if self.limits else []), *self._privileged_prefix(),
                *self._apptainer_argv(["/bin/sh", "-c", script, "sh", workdir], "/", workspace=False)]
        read, write = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(*full, stdin=asyncio.subprocess.DEVNULL, stdout=write,
                                                        stderr=asyncio.subprocess.PIPE,
                                                        env=apptainer_env(os.environ, self._env(None)),
                                                        start_new_session=True)
        finally:
            os.close(write)
        self._procs.add(proc)
        why = ""
        try:
            with os.fdopen(read, "rb") as stream:
                extract = asyncio.ensure_future(asyncio.to_thread(extract_stream, stream, self.workspace))
                try:
                    count = await asyncio.wait_for(asyncio.shield(extract), EXPORT_TIMEOUT_S)
                except (OSError, ValueError, tarfile.TarError) as exc:
                    count, why = -1, str(exc)
                except TimeoutError:
                    count, why = -1, f"no end after {EXPORT_TIMEOUT_S:g} s"
                finally:
                    if not extract.done():  # the writer dies first, so the reading thread sees the end
                        killpg(proc)
                        await asyncio.gather(extract, return_exceptions=True)
            err = await proc.stderr.read() if proc.stderr is not None else b""
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                killpg(proc)
                await proc.wait()
            self._procs.discard(proc)
        if code != 0 or count < 0:
            detail = why if count < 0 else err.decode("utf-8", "replace").strip()[-500:]
            raise ConfigError(f"apptainer: cannot copy {workdir} out of image {self.spec.image} (exit {code}): {detail}")
        return count > 0



async def probe(image: str, *, binary: str | None = None) -> str | None:
    """Run ``true`` through the runtime as a session would (uid drop, staging, ``--userns``, the
    binds), so a host that cannot run Apptainer fails preflight in about a second with one line
    instead of every session at INIT. The error line, or None when it ran."""
    spec = RuntimeSpec(kind="apptainer", image=image, network="none", disk_mb=None, memory_mb=None, pids_limit=None)
    rt = ApptainerRuntime(spec, binary=binary)
    quiet = logging.getLogger("polar_env.runtimes.hostworkspace")  # the git baseline's warning says nothing here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        await rt.prepare()
        res = await rt.exec(["true"], timeout_s=PROBE_TIMEOUT_S)
    except ConfigError as exc:
        return str(exc)
    finally:
        quiet.setLevel(level)
        await rt.stop()
    if res.exit_code == 0:
        return None
    lines = [ln.strip() for ln in res.output.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "FATAL" in ln or "ERROR" in ln]
    return (fatal or lines or [f"exit {res.exit_code}"])[-1]
