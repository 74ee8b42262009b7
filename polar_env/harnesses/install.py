"""Install a harness once into a shared cache, so INIT never reinstalls it per session.

Layout (the same as ``scripts/install_harnesses.sh``): ``<cache>/<install.dir>/`` holds the npm
prefix (binary in ``node_modules/.bin``) or a venv (``venv/bin``), plus a stamp file
``.polar-installed`` with the requirement it holds. A harness whose stamp matches and whose binary
exists is not touched, so :func:`ensure_installed` is cheap and offline when already installed.
Concurrent callers are serialised by an ``flock`` on ``<cache>/<dir>.lock``.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.harnesses.spec import HarnessSpec, Install

STAMP = ".polar-installed"
INSTALL_TIMEOUT_S = 1800.0


def default_cache_dir() -> Path:
    """``$POLAR_HARNESS_CACHE``, else ``$POLAR_NPM_CACHE`` (what the install script reads), else
    ``~/.cache/polar_env/harnesses``."""
    for var in ("POLAR_HARNESS_CACHE", "POLAR_NPM_CACHE"):
        if value := os.environ.get(var):
            return Path(value)
    return Path.home() / ".cache" / "polar_env" / "harnesses"


def _install_of(spec: HarnessSpec | Install) -> Install:
    return spec.install if isinstance(spec, HarnessSpec) else spec


def is_installed(spec: HarnessSpec | Install, cache_dir: Path | None = None) -> bool:
    """The binary exists and the stamp names this exact requirement."""
    install = _install_of(spec)
    cache = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if install.kind == "path":
        return os.access(install.binary_path(cache), os.X_OK)
    stamp = install.prefix(cache) / STAMP
    try:
        stamped = stamp.read_text().strip()
    except OSError:
        return False
    return stamped == install.requirement and os.access(install.binary_path(cache), os.X_OK)


def binary_path(spec: HarnessSpec | Install, cache_dir: Path | None = None) -> Path:
    """Where the binary is (or will be) in the cache; does not install."""
    install = _install_of(spec)
    return install.binary_path(default_cache_dir() if cache_dir is None else Path(cache_dir))


def install_hint(spec: HarnessSpec | Install) -> str:
    install = _install_of(spec)
    if install.kind == "path":
        return f"put {install.binary} on PATH"
    if install.kind == "npm":
        return f"scripts/install_harnesses.sh {install.dir}"
    return f"python -m polar_env.harnesses install {install.dir}"


def ensure_installed(spec: HarnessSpec | Install, cache_dir: Path | None = None, *, log: bool = True) -> Path:
    """The harness binary in the cache, installing it first if needed (idempotent, network only then)."""
    install = _install_of(spec)
    cache = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if is_installed(install, cache):
        return install.binary_path(cache)
    if install.kind == "path":
        raise ConfigError(f"{install.binary} is not an executable on PATH (a 'path' harness is never installed)")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{install.dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_installed(install, cache):  # someone else finished while we waited
            return install.binary_path(cache)
        prefix = install.prefix(cache)
        (prefix / STAMP).unlink(missing_ok=True)
        prefix.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if log:
            print(f"polar_env: installing {install.requirement} into {prefix}", file=sys.stderr, flush=True)
        for argv in _commands(install, prefix):
            _run(argv, install)
        binary = install.binary_path(cache)
        if not os.access(binary, os.X_OK):
            raise ConfigError(f"installing {install.requirement} left no executable {binary}")
        (prefix / STAMP).write_text(install.requirement + "\n")
        if log:
            print(f"polar_env: {install.requirement} installed in {time.monotonic() - started:.0f}s",
                  file=sys.stderr, flush=True)
        return binary


def _commands(install: Install, prefix: Path) -> list[list[str]]:
    if install.kind == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise ConfigError(f"npm is not on PATH; it is needed to install {install.requirement}")
        return [[npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
                 install.requirement]]
    venv = prefix / "venv"
    python = venv / "bin" / "python"
    steps = [] if python.exists() else [[sys.executable, "-m", "venv", str(venv)]]
    steps.append([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  install.requirement])
    return steps


def _run(argv: list[str], install: Install) -> None:
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"installing {install.requirement}: {' '.join(argv)} failed: {exc}") from exc
    if proc.returncode != 0:
        raise ConfigError(f"installing {install.requirement}: {' '.join(argv)} exited {proc.returncode}: "
                          f"{(proc.stderr or proc.stdout)[-2000:].strip()}")


def check_installable(spec: HarnessSpec, cache_dir: Path | None = None) -> None:
    """Every harness's preflight check (``HARNESSES``' default; a preset's install and needs are
    data): its binary is in the shared cache, or what installs it (npm / a python that makes venvs)
    is here; an npm harness also needs node to run. One ConfigError line naming the fix."""
    where = f"harness {spec.name}"
    if spec.needs == "node" and shutil.which("node") is None:
        raise ConfigError(f"node is not on PATH, needed by {where}; install Node.js (apt-get install -y nodejs npm)")
    if is_installed(spec, cache_dir):
        return
    install = spec.install
    if install.kind == "path":
        raise ConfigError(f"{install.binary} is not an executable on PATH, {where}; {install_hint(spec)}")
    if install.kind == "npm" and shutil.which("npm") is None:
        raise ConfigError(f"{where} is not installed and npm is not on PATH to install it; install npm "
                          f"(apt-get install -y npm) or run {install_hint(spec)} where npm is")
    if install.kind == "pip" and importlib.util.find_spec("ensurepip") is None:
        raise ConfigError(f"{where} is not installed and {sys.executable} cannot make the venv it goes in "
                          f"(no ensurepip); apt-get install -y python3-venv, or run {install_hint(spec)}")
