"""Build a SWE row's environment image from its recipe (``environment_setup``: a uv venv plus install
lines, as ``shared/swe-real/build_env.sh`` runs them), for sites that reach no registry (HPC, air-gapped
clusters). The image is named as the row's own image (``SweTask.image``), so published rows run
unchanged: ``rootfs`` kind writes an OCI runtime bundle into the local store, ``docker`` kind builds
a Docker image of that name from the same bundle on top of the imported base rootfs, ``sif`` kind
packs the bundle into ``<store>/<name>.sif`` for Apptainer (``image_sif.py``).

The base rootfs is copied with hardlinks (the build only adds files) into a temp folder beside the
target, the build runs inside it under bubblewrap, and the finished folder is renamed onto the name,
so a crashed or concurrent build never leaves half an image there. A rebuild with the same stamp
(recipe, repository, base) is skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from polar_env.errors import ConfigError
from polar_env.runtimes.bundle import CONFIG, ROOTFS, read_image_dir, store_name, write_bundle_config
from polar_env.tasks.image_sif import build_sif, require_apptainer, write_env_script
from polar_env.tasks.swe import SweTask

BUILDER_VERSION = "1"  # part of every stamp: a changed recipe rebuilds
UV_VERSION = "0.13.9"  # build_env.sh's
VENV = "/opt/venv"
TESTBED = "/testbed"
BUILD_WRITES = (TESTBED, VENV)  # all a build may write in the image (the rest is the shared base)
IMAGE_PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_ENV = {"PATH": IMAGE_PATH, "VIRTUAL_ENV": VENV, "LANG": "C.UTF-8"}
# build_env.sh's author and message, so a repo built here has the same commit id as one it builds
GIT_NAME, GIT_EMAIL = "swe-real", "swe-real@localhost"
EPOCH = "1970-01-01T00:00:00Z"
SOURCE_LABEL = "polar_env.image.source"
STAMP_KEY = "polar_env.image.stamp"
DEFAULT_BASE_IMAGE = "polar-test/py:bookworm"
BASE_STAMP_FILE = ".polar-complete"  # build_rootfs.sh's; also the base image's polar.rootfs label
MAKE_BASE = "make it with scripts/build_rootfs.sh (debootstrap, as root)"
# where the host's uv, its cache and the CA bundle appear inside the sandbox (/tmp is a tmpfs there)
UV_IN, CACHE_IN, CA_IN = "/tmp/.polar-uv", "/tmp/.polar-uv-cache", "/tmp/.polar-ca.crt"

Kind = Literal["rootfs", "docker", "sif"]


@dataclass(frozen=True)
class BuildOptions:
    """Where an image build reads and writes; ``from_env`` fills the defaults build_env.sh uses."""

    store: Path
    base: Path
    repos: Path | None = None
    kind: Kind = "rootfs"
    base_image: str = DEFAULT_BASE_IMAGE
    uv: Path | None = None  # a uv binary; None: build_env.sh's private one, installed on first use
    uv_dir: Path = Path.home() / ".cache" / "swe-real" / f"uv-{UV_VERSION}"
    uv_cache: Path = Path.home() / ".cache" / "uv"
    ca_file: Path | None = None  # SSL_CERT_FILE, passed on to uv inside the sandbox

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> BuildOptions:
        home = Path.home()
        cache = Path(environ.get("XDG_CACHE_HOME") or home / ".cache")
        ca = environ.get("SSL_CERT_FILE")
        return cls(uv=Path(environ["UV"]) if environ.get("UV") else None,
                   uv_dir=Path(environ.get("SWE_REAL_UV_DIR") or home / ".cache" / "swe-real" / f"uv-{UV_VERSION}"),
                   uv_cache=Path(environ.get("UV_CACHE_DIR") or cache / "uv"),
                   ca_file=Path(ca) if ca and os.path.isfile(ca) else None, **fields)


def default_base(environ: Mapping[str, str]) -> Path:
    """build_rootfs.sh's rootfs: ``$POLAR_ROOTFS_CACHE/bookworm-py``."""
    return Path(environ.get("POLAR_ROOTFS_CACHE") or Path.home() / ".cache" / "polar_env" / "rootfs") / "bookworm-py"


@dataclass
class BuildResult:
    """One image: where it is, whether it was already current, seconds per stage and disk."""

    instance_id: str
    image: str
    kind: Kind
    bundle: Path
    skipped: bool = False
    stages: dict[str, float] = field(default_factory=dict)
    unique_bytes: int | None = None  # bytes of the bundle not shared with the base (hardlinks)
    layer_bytes: int | None = None  # docker: the size the image adds to the base image
    sif_bytes: int | None = None  # sif: the size of <store>/<name>.sif
    commit: str = ""
    pytest: str = ""
    log: Path | None = None

    def line(self) -> str:
        if self.skipped:
            return f"{self.instance_id}: {self.image} up to date ({self.kind}, {self.bundle})"
        stages = " ".join(f"{k} {v:.1f}s" for k, v in self.stages.items())
        disk = ", ".join([f"{_mb(self.unique_bytes)} own" if self.unique_bytes is not None else "bundle current",
                          *([f"docker layer {_mb(self.layer_bytes)}"] if self.layer_bytes is not None else []),
                          *([f"sif {_mb(self.sif_bytes)}"] if self.sif_bytes is not None else [])])
        return f"{self.instance_id}: built {self.image} ({self.kind}) in {sum(self.stages.values()):.1f}s [{stages}]; {disk}; " \
               f"{self.pytest}, commit {self.commit[:12]}"

    def to_json(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "image": self.image, "kind": self.kind, "bundle": str(self.bundle),
                "skipped": self.skipped, "stages_s": {k: round(v, 2) for k, v in self.stages.items()},
                "unique_bytes": self.unique_bytes, "layer_bytes": self.layer_bytes, "sif_bytes": self.sif_bytes,
                "commit": self.commit, "pytest": self.pytest, "log": str(self.log) if self.log else None}


def _mb(n: int | None) -> str:
    return "? MB" if n is None else f"{n / 1e6:.1f} MB"


def environment_setup(task: SweTask) -> dict[str, Any]:
    """The row's recipe, or one line saying what to do instead."""
    setup = task.extra.get("environment_setup")
    if isinstance(setup, str):
        try:
            setup = json.loads(setup)  # parquet re-uploads store structs as JSON text
        except ValueError:
            setup = None
    if not isinstance(setup, Mapping) or not setup.get("install"):
        raise ConfigError(f"{task.instance_id}: the row has no environment_setup to build from; run its published image "
                          f"{task.image or '(none: local task)'}, or polar-env images unpack a saved copy of it")
    return dict(setup)


def _install_lines(setup: Mapping[str, Any]) -> list[str]:
    lines = setup["install"]
    return [str(x) for x in lines] if isinstance(lines, list) else [str(lines)]


def base_stamp(base: Path) -> str:
    """What identifies the base rootfs: build_rootfs.sh's stamp file, else the folder and its mtime."""
    if not (base / "bin" / "sh").exists():
        raise ConfigError(f"--base {base} is not a root filesystem (no bin/sh); {MAKE_BASE}, or pass --base ROOTFS_DIR")
    try:
        return (base / BASE_STAMP_FILE).read_text().strip()
    except OSError:
        return f"{base.resolve()}@{base.stat().st_mtime_ns}"


@dataclass(frozen=True)
class RepoSource:
    """Where ``/testbed`` comes from: a ``git archive`` tarball, a checkout, or a clone."""

    kind: Literal["tarball", "checkout", "clone"]
    path: Path | None
    identity: str  # into the stamp


def repo_source(task: SweTask, repos: Path | None) -> RepoSource:
    if repos is None:
        if not task.repo or not task.base_commit:
            raise ConfigError(f"{task.instance_id}: no --repos and the row has no repo/base_commit to clone; pass --repos DIR")
        return RepoSource("clone", None, f"git:{task.repo}@{task.base_commit}")
    tarball, checkout = repos / f"{task.instance_id}.tar.gz", repos / task.instance_id
    if tarball.is_file():
        digest = hashlib.sha256()
        with tarball.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return RepoSource("tarball", tarball, f"sha256:{digest.hexdigest()}")
    if checkout.is_dir():
        return RepoSource("checkout", checkout, f"checkout:{task.base_commit}")
    raise ConfigError(f"--repos {repos} has neither {tarball.name} (git archive at base_commit) nor {checkout.name}/ "
                      f"for {task.instance_id}; add one, or drop --repos to clone https://github.com/{task.repo}")


def _image_stamp(task: SweTask, setup: Mapping[str, Any], repo: RepoSource, base: str) -> str:
    recipe = {k: setup.get(k) for k in ("python", "exclude_newer", "install")}
    text = json.dumps([BUILDER_VERSION, recipe, task.base_commit, task.created_at, repo.identity, base, IMAGE_ENV], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def ensure_uv(opts: BuildOptions) -> Path:
    """The uv binary: ``$UV``, else build_env.sh's private copy, pip-installed there on first use."""
    if opts.uv is not None:
        if not os.access(opts.uv, os.X_OK):
            raise ConfigError(f"UV={opts.uv} is not an executable uv binary; unset UV to use a private uv {UV_VERSION}")
        return opts.uv
    uv = opts.uv_dir / "bin" / "uv"
    if not uv.is_file():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--no-warn-script-location", "--target", str(opts.uv_dir), f"uv=={UV_VERSION}"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not uv.is_file():
            raise ConfigError(f"could not install uv {UV_VERSION} into {opts.uv_dir}: {_last_line(proc.stderr + proc.stdout)}; "
                              "set UV to a uv binary")
    return uv


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


@contextmanager
def image_lock(store: Path, name: str) -> Iterator[None]:
    """One build per image name at a time (another process waits, then finds the image current)."""
    store.mkdir(parents=True, exist_ok=True)
    with (store / f".{name}.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def bundle_stamp(bundle: Path) -> str | None:
    """The stamp a finished bundle was built with; None when there is none or it is not one."""
    try:
        return read_image_dir(bundle).annotations.get(STAMP_KEY) if (bundle / CONFIG).is_file() else None
    except ConfigError:
        return None


def bwrap_argv(rootfs: Path, argv: list[str], *, env: Mapping[str, str], cwd: str = "/", writable: bool = False,
               binds: Sequence[tuple[str, Path, str]] = ()) -> list[str]:
    """``argv`` inside ``rootfs`` as ``/`` under bubblewrap, host network, a clean environment;
    ``binds``: (``--bind``/``--ro-bind``, host path, path inside). The rootfs is read-only even when
    ``writable``: then only ``/testbed`` and the venv are (``BUILD_WRITES``) and HOME is a tmpfs, so
    an install line cannot write through a hardlink into the base rootfs every image shares."""
    cmd = ["bwrap", "--ro-bind", str(rootfs), "/", "--dev", "/dev", "--proc", "/proc",
           "--tmpfs", "/tmp", "--share-net", "--die-with-parent", "--clearenv"]
    if writable:
        for inside in BUILD_WRITES:
            (rootfs / inside.lstrip("/")).mkdir(parents=True, exist_ok=True)
            cmd += ["--bind", str(rootfs / inside.lstrip("/")), inside]
        cmd += ["--tmpfs", "/root"]
    if os.path.isfile("/etc/resolv.conf") and os.path.lexists(rootfs / "etc" / "resolv.conf"):
        cmd += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    for how, host, inside in binds:
        cmd += [how, str(host), inside]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    return [*cmd, "--chdir", cwd, *argv]


class Builder:
    """Builds images for rows into ``opts.store``; one instance per command (uv resolved once)."""

    def __init__(self, opts: BuildOptions) -> None:
        if shutil.which("bwrap") is None:
            raise ConfigError("building images needs bubblewrap: apt-get install -y bubblewrap")
        self.opts = opts
        self.base_stamp = base_stamp(opts.base)
        self.uv = ensure_uv(opts)
        if opts.kind == "docker":
            check_base_image(opts.base_image, self.base_stamp, opts.base)
        if opts.kind == "sif":
            require_apptainer()

    def plan(self, task: SweTask) -> tuple[str, dict[str, Any], RepoSource, str]:
        """(image name, recipe, repo source, stamp), or one line saying why the row cannot be built."""
        setup = environment_setup(task)
        image = task.image
        if not image:
            raise ConfigError(f"{task.instance_id}: the row has no image name (image_style local); set image_name on the row")
        python = str(setup.get("python") or "3")
        if not (self.opts.base / "usr" / "bin" / f"python{python}").exists():
            raise ConfigError(f"{task.instance_id}: --base {self.opts.base} has no /usr/bin/python{python} "
                              "(environment_setup.python); use a base rootfs that has it")
        repo = repo_source(task, self.opts.repos)
        return image, setup, repo, _image_stamp(task, setup, repo, self.base_stamp)

    def build(self, task: SweTask) -> BuildResult:
        image, setup, repo, stamp = self.plan(task)
        name = store_name(image)
        target = self.opts.store / name
        with image_lock(self.opts.store, name):
            result = BuildResult(task.instance_id, image, self.opts.kind, target, log=self.opts.store / ".logs" / f"{name}.log")
            if bundle_stamp(target) == stamp:
                result.skipped = True
                result.commit = read_image_dir(target).annotations.get("polar_env.image.commit", "")
            else:
                self._build_bundle(task, setup, repo, stamp, target, result)
            if self.opts.kind == "docker":
                docker_build(target, image, stamp, task.instance_id, self.opts.base_image, result)
            if self.opts.kind == "sif":
                sif = build_sif(target, target.with_name(f"{name}.sif"), {STAMP_KEY: stamp, "polar_env.image.instance":
                                task.instance_id, SOURCE_LABEL: "environment_setup"}, STAMP_KEY, result.log)
                result.sif_bytes, result.skipped = sif.bytes, result.skipped and sif.seconds is None
                if sif.seconds is not None:
                    result.stages["sif"] = sif.seconds
            return result

    def _build_bundle(self, task: SweTask, setup: Mapping[str, Any], repo: RepoSource, stamp: str, target: Path,
                      result: BuildResult) -> None:
        store = self.opts.store
        for stale in store.glob(f".{target.name}.building-*"):  # a crashed build's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = store / f".{target.name}.building-{os.getpid()}-{time.monotonic_ns()}"
        assert result.log is not None
        result.log.parent.mkdir(parents=True, exist_ok=True)
        result.log.write_text(f"# {task.instance_id} -> {result.image} ({datetime.now(UTC).isoformat()})\n")
        try:
            tmp.mkdir()
            rootfs = tmp / ROOTFS
            with _stage(result, "copy"):
                _copy_base(self.opts.base, rootfs)
            with _stage(result, "repo"):
                _place_repo(task, repo, rootfs / TESTBED.lstrip("/"))
                result.commit = self._commit(task, rootfs, result.log)
            env = self._build_env(setup)
            python = f"/usr/bin/python{setup.get('python') or '3'}"
            with _stage(result, "venv"):
                self._run(rootfs, [str(Path(UV_IN) / "uv"), "venv", "-q", "-p", python, VENV], env, "uv venv", result.log)
            with _stage(result, "install"):
                script = "set -euo pipefail\n" + "\n".join(_install_lines(setup)) + "\n"
                self._run(rootfs, ["bash", "-c", script], env, "install line", result.log, cwd=TESTBED)
            with _stage(result, "verify"):
                result.pytest = self._verify(task, setup, rootfs, result.log)
            write_env_script(rootfs, IMAGE_ENV)  # what Apptainer sources: a SIF or sandbox built from rootfs/ keeps the env
            write_bundle_config(tmp, env=IMAGE_ENV, cwd=TESTBED, annotations={
                "polar_env.image.instance": task.instance_id, SOURCE_LABEL: "environment_setup",
                "polar_env.image.built_at": datetime.now(UTC).replace(microsecond=0).isoformat(),
                "polar_env.image.base": f"{self.opts.base} ({self.base_stamp})", "polar_env.image.commit": result.commit,
                "polar_env.image.repo": repo.identity, STAMP_KEY: stamp})
            result.unique_bytes = unique_bytes(self.opts.base, rootfs)
            swap_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _build_env(self, setup: Mapping[str, Any]) -> dict[str, str]:
        """build_env.sh's environment for ``uv venv`` and the install lines."""
        env = {"PATH": f"{UV_IN}:{IMAGE_PATH}", "HOME": "/root", "LANG": "C.UTF-8", "VENV": VENV,
               "PYTHONDONTWRITEBYTECODE": "1",  # nothing writes into the stdlib dirs shared with the base
               "UV_EXCLUDE_NEWER": str(setup.get("exclude_newer") or ""), "UV_PYTHON_PREFERENCE": "system",
               "UV_CACHE_DIR": CACHE_IN, "UV_LINK_MODE": "copy",  # the image owns its files, not the cache's inodes
               "UV_NO_PROGRESS": "1"}
        if not env["UV_EXCLUDE_NEWER"]:
            del env["UV_EXCLUDE_NEWER"]
        if self.opts.ca_file is not None:
            env["SSL_CERT_FILE"] = CA_IN
        return env

    def _binds(self) -> list[tuple[str, Path, str]]:
        self.opts.uv_cache.mkdir(parents=True, exist_ok=True)
        binds = [("--ro-bind", self.uv.resolve(), f"{UV_IN}/uv"), ("--bind", self.opts.uv_cache, CACHE_IN)]
        if self.opts.ca_file is not None:
            binds.append(("--ro-bind", self.opts.ca_file, CA_IN))
        return binds

    def _run(self, rootfs: Path, argv: list[str], env: Mapping[str, str], what: str, log: Path, *, cwd: str = "/",
             writable: bool = True) -> str:
        cmd = bwrap_argv(rootfs, argv, env=env, cwd=cwd, writable=writable, binds=self._binds())
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", check=False)
        with log.open("a") as f:
            f.write(f"$ {shlex.join(argv)}\n{proc.stdout}\n[exit {proc.returncode}]\n")
        if proc.returncode != 0:
            raise ConfigError(f"{what} failed (exit {proc.returncode}): {_last_line(proc.stdout)}; full log: {log}")
        return proc.stdout

    def _commit(self, task: SweTask, rootfs: Path, log: Path) -> str:
        """``git init`` + one commit whose id depends only on the tree, the row's date and base_commit."""
        date = task.created_at or EPOCH
        env = {"PATH": IMAGE_PATH, "HOME": "/root", "LANG": "C.UTF-8", "GIT_AUTHOR_NAME": GIT_NAME, "GIT_AUTHOR_EMAIL": GIT_EMAIL,
               "GIT_COMMITTER_NAME": GIT_NAME, "GIT_COMMITTER_EMAIL": GIT_EMAIL, "GIT_AUTHOR_DATE": date,
               "GIT_COMMITTER_DATE": date, "GIT_CONFIG_NOSYSTEM": "1"}
        script = (f"git init -q && git add -A -f . && git -c commit.gpgsign=false commit -q -m {shlex.quote(f'base {task.base_commit}')}"
                  " && git rev-parse HEAD")
        out = self._run(rootfs, ["sh", "-c", script], env, "git commit of /testbed", log, cwd=TESTBED)
        return out.strip().splitlines()[-1]

    def _verify(self, task: SweTask, setup: Mapping[str, Any], rootfs: Path, log: Path) -> str:
        """The test command's pytest, run read-only in the finished rootfs: it must be the venv's and,
        where the row says, the version the install resolves to."""
        argv = pytest_argv(str(setup.get("test_command") or "pytest"))
        script = 'command -v "$1" || true; exec "$@" --version'
        out = self._run(rootfs, ["sh", "-c", script, "verify", *argv], dict(IMAGE_ENV, HOME="/root", PYTHONDONTWRITEBYTECODE="1"),
                        "pytest --version in the image", log, cwd=TESTBED, writable=False)
        where = out.strip().splitlines()[0] if out.strip() else ""
        if argv[0] == "pytest" and not where.startswith(f"{VENV}/"):
            raise ConfigError(f"{task.instance_id}: the test command's pytest is {where or 'missing'}, not the venv's "
                              f"({VENV}/bin/pytest); add pytest to the row's install lines (log: {log})")
        found = re.search(r"pytest (?:version )?(\d[\w.]*)", out)
        version = found.group(1) if found else "?"
        wanted = setup.get("pytest_version")
        if wanted and version != str(wanted):
            raise ConfigError(f"{task.instance_id}: the image's pytest is {version}, the row's pytest_version is {wanted} (log: {log})")
        return f"pytest {version}"


def pytest_argv(test_command: str) -> list[str]:
    """The pytest invocation that starts ``test_command`` (``pytest``, ``python -m pytest``), without its arguments."""
    words = shlex.split(test_command)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # leading VAR=value assignments
    if words and Path(words[0]).name in ("pytest", "py.test"):
        return words[:1]
    if len(words) >= 3 and words[1:3] == ["-m", "pytest"]:
        return words[:3]
    return ["python", "-m", "pytest"]


@contextmanager
def _stage(result: BuildResult, name: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        result.stages[name] = time.monotonic() - start


def _copy_base(base: Path, rootfs: Path) -> None:
    """``cp -al``: hardlinks, cheap, when the store is on the base's filesystem; a full copy otherwise."""
    same_fs = base.stat().st_dev == rootfs.parent.stat().st_dev
    proc = subprocess.run(["cp", "-al" if same_fs else "-a", str(base), str(rootfs)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 and same_fs:  # e.g. fs.protected_hardlinks and a base someone else owns
        shutil.rmtree(rootfs, ignore_errors=True)
        proc = subprocess.run(["cp", "-a", str(base), str(rootfs)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"copying the base rootfs {base} to {rootfs} failed: {_last_line(proc.stderr)}")
    (rootfs / BASE_STAMP_FILE).unlink(missing_ok=True)  # an image is not a base


def require_data_filter() -> None:
    """Archives are extracted through tarfile's ``data`` filter (no writes outside the target), new in 3.11.4."""
    if not hasattr(tarfile, "data_filter"):
        raise ConfigError(f"extracting archives safely needs Python 3.11.4 or newer (tarfile's data filter); "
                          f"this is {sys.version.split()[0]}")


def _place_repo(task: SweTask, repo: RepoSource, testbed: Path) -> None:
    """The repository's files at base_commit into ``testbed`` (an empty folder), without history."""
    require_data_filter()
    if testbed.exists() and any(testbed.iterdir()):
        raise ConfigError(f"the base rootfs already has files in {TESTBED}; use a base without a repository")
    testbed.mkdir(parents=True, exist_ok=True)
    if repo.kind == "tarball":
        assert repo.path is not None
        with tarfile.open(repo.path) as tar:
            tar.extractall(testbed, filter="data")
        return
    with tempfile.TemporaryDirectory(prefix="polar-repo-") as scratch:
        if repo.kind == "checkout":
            assert repo.path is not None
            src = repo.path
            if not (src / ".git").exists():
                shutil.copytree(src, testbed, symlinks=True, dirs_exist_ok=True)
                return
        else:  # a clone needs github.com; not reachable from every site (then pass --repos)
            src = Path(scratch) / "clone"
            _git(["clone", "-q", "--filter=blob:none", "--no-checkout", f"https://github.com/{task.repo}", str(src)], task)
        archive = Path(scratch) / "repo.tar"
        _git(["-C", str(src), "archive", "-o", str(archive), task.base_commit], task)
        with tarfile.open(archive) as tar:
            tar.extractall(testbed, filter="data")


def _git(args: list[str], task: SweTask) -> None:
    proc = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"{task.instance_id}: git {args[0] if args[0] != '-C' else args[2]} failed: {_last_line(proc.stderr)}; "
                          "pass --repos DIR with <instance_id>.tar.gz (git archive at base_commit)")


def swap_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished bundle onto its name; an outdated one is moved aside first and removed after."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def unique_bytes(base: Path, rootfs: Path) -> int:
    """Disk the image adds: ``du`` over base and image together, less the base (hardlinks count once)."""
    return disk_bytes(base, rootfs)[-1]


def disk_bytes(*paths: Path) -> list[int]:
    """``du -s`` of each path in one run: a file linked from an earlier path counts only there."""
    proc = subprocess.run(["du", "-s", "-B1", *map(str, paths)], capture_output=True, text=True, check=False)
    sizes = [int(line.split()[0]) for line in proc.stdout.splitlines() if line.strip()]
    if len(sizes) != len(paths):
        raise ConfigError(f"du -s {' '.join(map(str, paths))} failed: {_last_line(proc.stderr)}")
    return sizes


# -- docker kind: the bundle's /testbed and /opt/venv as one layer on the imported base rootfs --------


def _docker(args: list[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker") is None:
        raise ConfigError("--kind docker needs the docker CLI and a daemon (DOCKER_HOST); or build --kind rootfs")
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=False, env=env, cwd=cwd)


def _image_labels(tag: str) -> dict[str, str] | None:
    proc = _docker(["image", "inspect", "--format", "{{json .Config.Labels}}", tag])
    if proc.returncode != 0:
        if "No such image" in proc.stderr or "No such object" in proc.stderr:
            return None
        raise ConfigError(f"docker image inspect {tag} failed: {_last_line(proc.stderr)}; start a daemon or set DOCKER_HOST")
    return json.loads(proc.stdout.strip() or "null") or {}


def _image_size(tag: str) -> int:
    proc = _docker(["image", "inspect", "--format", "{{.Size}}", tag])
    return int(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip().isdigit() else 0


def check_base_image(tag: str, stamp: str, base: Path) -> None:
    """The base image must be an import of the same base rootfs, so the venv's links to its python hold."""
    labels = _image_labels(tag)
    if labels is None:
        raise ConfigError(f"--base-image {tag} is not in the Docker daemon; import --base {base} with scripts/build_rootfs.sh")
    if labels.get("polar.rootfs") != stamp:
        raise ConfigError(f"--base-image {tag} is not an import of --base {base} (its polar.rootfs label is "
                          f"{labels.get('polar.rootfs')!r}, the rootfs's stamp {stamp!r}); re-import it with scripts/build_rootfs.sh")


def docker_build(bundle: Path, image: str, stamp: str, instance_id: str, base_image: str, result: BuildResult) -> None:
    """``docker build`` FROM the base image with only ``/testbed`` and ``/opt/venv`` as context; skipped
    when an image of that name has this stamp already."""
    labels = _image_labels(image)
    if labels is not None and labels.get(STAMP_KEY) == stamp:
        result.layer_bytes = _image_size(image) - _image_size(base_image)
        return
    result.skipped = False
    rootfs = bundle / ROOTFS
    ctx = bundle.parent / f".{bundle.name}.docker-{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    try:
        ctx.mkdir()
        for src, dst in ((rootfs / TESTBED.lstrip("/"), ctx / "testbed"), (rootfs / VENV.lstrip("/"), ctx / "venv")):
            subprocess.run(["cp", "-al", str(src), str(dst)], check=True, capture_output=True)
        env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in IMAGE_ENV.items())
        (ctx / "Dockerfile").write_text(
            f"FROM {base_image}\nCOPY testbed {TESTBED}\nCOPY venv {VENV}\nENV {env_line}\nWORKDIR {TESTBED}\n"
            f"LABEL {SOURCE_LABEL}=environment_setup {STAMP_KEY}={stamp} polar_env.image.instance={instance_id}\n")
        (ctx / ".dockerignore").write_text("Dockerfile\n.dockerignore\n")
        env = dict(os.environ)
        if _docker(["buildx", "version"]).returncode != 0:
            env["DOCKER_BUILDKIT"] = "0"  # no buildx plugin: the classic builder
        proc = _docker(["build", "-q", "-t", image, str(ctx)], env=env)
        if result.log is not None:
            with result.log.open("a") as f:
                f.write(f"$ docker build -t {image}\n{proc.stdout}{proc.stderr}\n[exit {proc.returncode}]\n")
        if proc.returncode != 0:
            raise ConfigError(f"docker build of {image} failed: {_last_line(proc.stderr)}; full log: {result.log}")
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
        result.stages["docker build"] = time.monotonic() - start
    result.layer_bytes = _image_size(image) - _image_size(base_image)
