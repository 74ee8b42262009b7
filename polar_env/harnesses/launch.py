"""Run a harness preset inside a runtime (the bubblewrap sandbox, Docker, Apptainer).

Two steps, because binds are fixed when a runtime is prepared:

1. ``with_harness(runtime_spec, harness)`` adds the read-only binds the harness needs to a
   ``RuntimeSpec``: its cached install and, for npm CLIs, the host's ``node`` binary. npm installs
   are relocatable (``.bin`` entries are relative links), so they go under ``/opt/polar``; a pip
   venv is not (absolute shebangs, a ``python`` link to its base interpreter), so it and its base
   interpreter are bound at their host paths.
2. ``run_harness(runtime, harness, key=..., model=..., prompt=...)`` on the prepared runtime: renders
   the preset for the session (base URL ``http://127.0.0.1:<gateway_port>``, the runtime's relay),
   writes its config files under the runtime's ``$HOME``, and execs the headless command in the
   workspace with the install's bin directory first on ``PATH``.
"""

from __future__ import annotations

import posixpath
import shutil
from dataclasses import dataclass
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.harnesses.install import default_cache_dir, ensure_installed, install_hint, is_installed
from polar_env.harnesses.spec import HarnessSpec, render
from polar_env.records import ProviderAPI
from polar_env.runtimes.base import ExecResult, Runtime, RuntimeSpec

MOUNT_ROOT = "/opt/polar"
NODE_BIN_DIR = f"{MOUNT_ROOT}/node/bin"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_HOME = "/root"  # every runtime gives the harness a writable /root as $HOME


@dataclass(frozen=True, slots=True)
class HarnessMounts:
    """What a harness needs from the host inside a runtime."""

    binds: tuple[tuple[Path, str], ...]  # (host path, path inside), read-only
    path: tuple[str, ...]  # directories to put first on PATH inside
    binary: str  # the binary's path inside


def harness_mounts(harness: HarnessSpec, cache_dir: Path | None = None, *, node: str | Path | None = None,
                   install: bool = False) -> HarnessMounts:
    """The binds and PATH for ``harness``. ``install=True`` installs it into the cache first;
    otherwise a missing install is a ``ConfigError`` that says how to install it."""
    cache = default_cache_dir() if cache_dir is None else Path(cache_dir)
    spec = harness.install
    if install:
        ensure_installed(harness, cache)
    elif not is_installed(harness, cache):
        raise ConfigError(f"harness {harness.name} is not installed in {cache}; run {install_hint(harness)}")
    binds: list[tuple[Path, str]] = []
    path: list[str] = []
    if spec.kind == "npm":
        inside = f"{MOUNT_ROOT}/harnesses/{spec.dir}"
        binds.append((spec.prefix(cache), inside))
        path.append(f"{inside}/node_modules/.bin")
        binary = f"{inside}/node_modules/.bin/{spec.binary}"
    elif spec.kind == "pip":
        prefix = spec.prefix(cache).resolve()
        binds.append((prefix, str(prefix)))
        base = _venv_base(prefix / "venv")
        if base is not None and not _under(base, prefix):
            binds.append((base, str(base)))
        bin_dir = prefix / "venv" / "bin"
        path.append(str(bin_dir))
        binary = str(bin_dir / spec.binary)
    else:  # "path": the runtime itself provides it
        binary = spec.binary
    if harness.needs == "node":
        found = Path(node) if node is not None else _which("node")
        binds.append((found.resolve(), f"{NODE_BIN_DIR}/node"))
        path.append(NODE_BIN_DIR)
    return HarnessMounts(binds=tuple(binds), path=tuple(path), binary=binary)


def with_harness(spec: RuntimeSpec, harness: HarnessSpec, cache_dir: Path | None = None, *,
                 node: str | Path | None = None, install: bool = False) -> RuntimeSpec:
    """``spec`` plus the read-only binds ``harness`` needs (see ``harness_mounts``)."""
    mounts = harness_mounts(harness, cache_dir, node=node, install=install)
    known = {dst for _src, dst in spec.binds}
    extra = [(src, dst) for src, dst in mounts.binds if dst not in known]
    return spec.model_copy(update={"binds": [*spec.binds, *extra]})


async def run_harness(
    runtime: Runtime,
    harness: HarnessSpec,
    *,
    key: str,
    model: str,
    prompt: str,
    api: ProviderAPI | str | None = None,
    base_url: str | None = None,
    cache_dir: Path | None = None,
    home: str = DEFAULT_HOME,
    env: dict[str, str] | None = None,
    timeout_s: float = 1800.0,
) -> ExecResult:
    """Configure and run ``harness`` headless in the prepared ``runtime`` (see the module docstring).
    The runtime must have been built from ``with_harness(...)``; the result is the CLI's exec result
    (exit code 124 and ``timed_out`` on a timeout)."""
    mounts = harness_mounts(harness, cache_dir)
    missing = [dst for _src, dst in mounts.binds if dst not in {d for _s, d in runtime.spec.binds}]
    if missing:
        raise ConfigError(f"the runtime lacks the binds {missing} harness {harness.name} needs; "
                          "build its RuntimeSpec with polar_env.harnesses.launch.with_harness")
    url = base_url or f"http://127.0.0.1:{runtime.spec.gateway_port}"
    argv, overlay, files = render(harness.client(api), url, key, model, home, prompt)
    for rel, text in files.items():
        await runtime.write_file(posixpath.join(home, rel), text.encode())
    argv[0] = mounts.binary
    base_path = runtime.path  # spec.env's, else the image's (a venv's ENV PATH), else the default
    full_env = {"PATH": ":".join(dict.fromkeys([*mounts.path, *base_path.split(":")])), "HOME": home,
                "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", **overlay, **(env or {})}
    return await runtime.exec(argv, env=full_env, cwd=runtime.spec.workdir, timeout_s=timeout_s)


def _which(program: str) -> Path:
    found = shutil.which(program)
    if found is None:
        raise ConfigError(f"{program} is not on PATH; the npm harnesses need it (install nodejs)")
    return Path(found)


def _venv_base(venv: Path) -> Path | None:
    """The base interpreter's prefix of a venv (``home = <prefix>/bin`` in pyvenv.cfg)."""
    try:
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, sep, value = line.partition("=")
        if sep and name.strip() == "home":
            return Path(value.strip()).resolve().parent
    return None


def _under(path: Path, prefix: Path) -> bool:
    return path == prefix or prefix in path.parents
