"""Apptainer runtime (rootless; HPC clusters). Every ``exec`` is one ``apptainer exec``.

Why per-exec ``exec`` rather than ``apptainer instance start/stop``: each exec then gets fresh
namespaces (the same model as the bwrap sandbox), execs can run concurrently, a timeout kills one
process group, and a crash leaves no named instance behind. The state that must survive between
execs lives in host directories bound in (the same layout as the sandbox, see ``sandbox.py``):

    <root>/workspace -> spec.workdir   <root>/tmp -> /tmp   <root>/home -> /root (via --home, so HOME=/root)

The argv (``apptainer_argv``, unit-tested exactly):

    apptainer exec --userns --containall --cleanenv --home <root>/home:/root --pwd <cwd>
        -B <root>/workspace:<workdir> -B <root>/tmp:/tmp
        [-B <relay.py>:/run/polar/relay.py:ro -B <gateway.sock>:/run/polar/gw.sock]
        [-B <src>:<dst>:ro ...]                                  # spec.binds
        --net --network none                                     # only lo, always
        <image> [python3 /run/polar/relay.py --listen 127.0.0.1:<port> --socket /run/polar/gw.sock --] CMD...

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
The environment is passed as ``APPTAINERENV_<K>``
variables (``--cleanenv`` keeps those and drops the rest of the host's), so values never appear in
argv; a bundle's ``process.env`` goes first, then ``spec.env``; PATH is the image's unless
``spec.env`` sets it (a SIF's is read at prepare, for ``path``). Without ``source_dir`` the workspace
starts as the image's workdir: copied from a folder image, or tarred out through a SIF (the
workspace not bound) and extracted with tarfile's checks. The relay is per exec (launch mode, like the
sandbox): with ``--network none`` every exec has its own network namespace; ``relay.py`` brings ``lo``
up if Apptainer left it down.

Limits (``limits.py``): each exec joins the runtime's own cgroup first when the host gives one (as
root, v1 or v2; or a delegated v2 subtree), else rlimits — the limits report names which. Apptainer's
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
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from polar_env.errors import ConfigError
from polar_env.runtimes.apptainer_images import Converted, ensure_sandbox
from polar_env.runtimes.argv import GATEWAY_SOCKET, RELAY_PATH, RELAY_SOURCE
from polar_env.runtimes.base import RuntimeSpec
from polar_env.runtimes.bundle import ImageDir
from polar_env.runtimes.hostworkspace import HOME, SANDBOX_UID_BASE, HostWorkspaceRuntime, _inside, _killpg
from polar_env.runtimes.imagestore import URI_SCHEMES, extract_stream, image_workdir, local_image
from polar_env.runtimes.reach import reachable

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
) -> list[str]:
    """The exact ``apptainer exec`` command line for one exec (see the module docstring); no
    ``workspace``: the image's own workdir shows (to copy it out)."""
    b = _bind_part
    argv = [binary, "exec", *(["--userns"] if userns else []), "--containall", "--cleanenv", "--home", f"{b(home)}:{HOME}", "--pwd", cwd]
    argv += [*(["-B", f"{b(workspace)}:{b(workdir)}"] if workspace is not None else []), "-B", f"{b(tmp)}:/tmp"]
    if gateway_socket is not None:
        argv += ["-B", f"{b(RELAY_SOURCE)}:{RELAY_PATH}:ro", "-B", f"{b(gateway_socket)}:{GATEWAY_SOCKET}"]
    for src, dst in binds:
        argv += ["-B", f"{b(src)}:{b(dst)}:ro"]
    if memory_mb is not None:
        argv += ["--memory", f"{memory_mb}M", "--memory-swap", f"{memory_mb}M"]
    if pids_limit is not None:
        argv += ["--pids-limit", str(pids_limit)]
    argv += ["--net", "--network", "none", image, *command]
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
    """Apptainer, one ``apptainer exec`` per exec; see the module docstring."""

    name: ClassVar[str] = "apptainer"
    drops_root: ClassVar[bool] = True

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
        self._converted: Converted | None = None  # a URI image's sandbox folder in the store

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
        if Path(image).is_file() and not self._fuse_usable():
            raise ConfigError(f"apptainer image {image} is a SIF, which rootless Apptainer mounts with squashfuse, but "
                              "/dev/fuse is not open to unprivileged uids here (mode "
                              f"{oct(os.stat('/dev/fuse').st_mode & 0o777) if os.path.exists('/dev/fuse') else 'missing'}); "
                              "make it 0666 as stock hosts do, or unpack the image once (apptainer build --sandbox DIR "
                              f"{image}) and use DIR")

    def _fuse_usable(self) -> bool:
        """Whether the uid that will run apptainer can open /dev/fuse (a SIF's squashfuse mount)."""
        try:
            mode = os.stat("/dev/fuse").st_mode
        except OSError:
            return False
        if self.drops_root and os.geteuid() == 0:
            return mode & 0o006 == 0o006
        return os.access("/dev/fuse", os.R_OK | os.W_OK)

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

    def _wrap(self, argv: list[str], cwd: str, *, workspace: bool = True) -> list[str]:
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
            workdir=_inside(self.spec.workdir),
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
        image = self._image.env if self._image is not None else {}
        env = {"LANG": "C.UTF-8", **image, **self.spec.env, **(extra or {})}
        return apptainer_env(os.environ, env)

    async def prepare(self) -> None:
        if self.spec.image and self.spec.image.startswith(URI_SCHEMES) and self._root is None:
            self._check()  # the binary first: it converts the URI
            assert self._binary is not None
            self._converted = await ensure_sandbox(self.spec.image, self._binary)
        await super().prepare()
        if "PATH" not in self.spec.env and not (self._image and "PATH" in self._image.env):
            start = time.monotonic()  # a SIF's or docker:// image's PATH is set by its own env scripts
            res = await self.exec(["/bin/sh", "-c", 'printf %s "$PATH"'], timeout_s=PROBE_TIMEOUT_S)
            self._probed_path = res.output.strip() if res.exit_code == 0 and res.output.strip() else None
            self.timings.exec_s.clear()
            self.timings.prepare_s += time.monotonic() - start

    async def _export_workdir(self) -> bool:
        """A SIF has no host folder to copy its workdir from: ``tar`` it out
        through the image (the workspace not bound over it) into the workspace, member by member
        with tarfile's checks (``imagestore.extract_stream``)."""
        if self._image is not None or self.spec.image is None:
            return False
        workdir = _inside(self.spec.workdir)
        script = '[ -d "$1" ] || exit 0; cd "$1" && exec tar -cf - .'
        full = [*(self.limits.prefix() if self.limits else []), *self._privileged_prefix(),
                *self._wrap(["/bin/sh", "-c", script, "sh", workdir], "/", workspace=False)]
        read, write = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(*full, stdin=asyncio.subprocess.DEVNULL, stdout=write,
                                                        stderr=asyncio.subprocess.PIPE, env=self._env(None),
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
                        _killpg(proc)
                        await asyncio.gather(extract, return_exceptions=True)
            err = await proc.stderr.read() if proc.stderr is not None else b""
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                _killpg(proc)
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
