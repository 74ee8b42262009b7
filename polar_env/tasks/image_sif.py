"""``polar-env images build --kind sif``: the row's rootfs bundle (built as for ``--kind rootfs``) as
one SIF file, ``<store>/<store_name(image)>.sif``, for sites that copy single files to compute nodes
and whose Apptainer mounts SIFs (squashfuse, and ``/dev/fuse`` open to users).

The environment: Apptainer sources ``/.singularity.d/env/*.sh`` at every exec (its ``exec`` action),
so the bundle's ``process.env`` goes into the rootfs as ``.singularity.d/env/90-polar.sh`` (the rootfs
kind writes it too, so a user's own ``apptainer build x.sif BUNDLE/rootfs`` or ``--sandbox`` keeps
the env); Apptainer adds its other base scripts around it at build, but a ``99-base.sh`` must be
there already when the folder itself is run (``BASE_SCRIPT_TEXT`` says why). The SIF is built from a
``Bootstrap: localimage`` definition whose ``%labels`` carry the bundle's stamp, read back with
``apptainer inspect --labels --json`` (SIF metadata, no FUSE): a SIF with the bundle's stamp is
current and not rebuilt. It is built into a temp name and renamed, under the caller's image lock.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.runtimes.apptainer import APPTAINER_INSTALL, find_apptainer
from polar_env.runtimes.apptainer_images import build_env, last_line
from polar_env.runtimes.bundle import read_image_dir

ENV_SCRIPT = ".singularity.d/env/90-polar.sh"
BASE_SCRIPT = ".singularity.d/env/99-base.sh"
# Apptainer applies the caller's APPTAINERENV_* variables and PATH where it sources 99-base.sh: with a
# .singularity.d/env folder but no such file they are lost (seen with 1.4.5), so one is written
# beside ours when the rootfs has none; its body is Apptainer's own (the libs folder, the prompt).
BASE_SCRIPT_TEXT = """#!/bin/sh
# Apptainer applies the caller's APPTAINERENV_* variables where it sources this file; keep it.
if [ -z "${LD_LIBRARY_PATH:-}" ]; then
    LD_LIBRARY_PATH="/.singularity.d/libs"
else
    LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/.singularity.d/libs"
fi
if [ -z "${PS1:-}" ]; then
    PS1="Apptainer> "
fi
export LD_LIBRARY_PATH PS1
"""
SIF_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class SifBuild:
    """The SIF, its size, and the seconds its build took (None: it was current)."""

    path: Path
    bytes: int
    seconds: float | None


def require_apptainer() -> str:
    """The apptainer binary a SIF build runs, or one line saying how to get one."""
    found = find_apptainer()
    if found is None:
        raise ConfigError(f"--kind sif needs apptainer; {APPTAINER_INSTALL}; or build --kind rootfs")
    return found


def env_script(env: Mapping[str, str]) -> str:
    lines = ["#!/bin/sh", "# the image bundle's environment (config.json process.env), written by polar-env images build"]
    return "\n".join([*lines, *(f"export {k}={shlex.quote(v)}" for k, v in env.items())]) + "\n"


def write_env_script(rootfs: Path, env: Mapping[str, str]) -> Path:
    """``<rootfs>/.singularity.d/env/90-polar.sh`` exporting ``env`` (rewritten only when it differs),
    and a ``99-base.sh`` beside it when there is none, without which Apptainer drops the caller's env."""
    path = rootfs / ENV_SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent.parent, 0o755)
    os.chmod(path.parent, 0o755)
    if not (rootfs / BASE_SCRIPT).exists():
        _replace(rootfs / BASE_SCRIPT, BASE_SCRIPT_TEXT)
    text = env_script(env)
    if not (path.is_file() and path.read_text() == text):
        _replace(path, text)
    return path


def _replace(path: Path, text: str) -> None:
    """Write a new file (never through an existing one: a bundle's files may be hardlinks to the base)."""
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text)
    os.chmod(staged, 0o755)
    os.replace(staged, path)


def sif_labels(binary: str, sif: Path) -> dict[str, str]:
    """The SIF's labels (empty when it has none or is not a SIF)."""
    proc = subprocess.run([binary, "inspect", "--labels", "--json", str(sif)], capture_output=True, text=True, check=False)
    try:
        labels = json.loads(proc.stdout)["data"]["attributes"]["labels"] if proc.returncode == 0 else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return {str(k): str(v) for k, v in (labels or {}).items()}


def build_sif(bundle: Path, sif: Path, labels: Mapping[str, str], stamp_key: str, log: Path | None) -> SifBuild:
    """``bundle``'s rootfs as ``sif``; skipped when ``sif`` carries ``labels[stamp_key]`` already.
    The caller holds the image's lock."""
    binary = require_apptainer()
    if sif.is_file() and sif_labels(binary, sif).get(stamp_key) == labels[stamp_key]:
        return SifBuild(sif, sif.stat().st_size, None)
    image = read_image_dir(bundle)
    write_env_script(image.rootfs, image.env)
    for stale in sif.parent.glob(f".{sif.name}.tmp-*"):  # a crashed build's
        stale.unlink(missing_ok=True)
    tmp = sif.with_name(f".{sif.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    definition = tmp.with_name(f"{tmp.name}.def")
    body = "".join(f"    {k} {v}\n" for k, v in labels.items())
    definition.write_text(f"Bootstrap: localimage\nFrom: {image.rootfs.resolve()}\n\n%labels\n{body}")
    start = time.monotonic()
    try:
        try:
            proc = subprocess.run([binary, "build", str(tmp), str(definition)], capture_output=True, text=True,
                                  errors="replace", timeout=SIF_TIMEOUT_S, env=build_env(sif.parent), check=False,
                                  stdin=subprocess.DEVNULL)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            code, out = -1, f"no end after {SIF_TIMEOUT_S:g} s"
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(f"$ {binary} build {tmp} {definition}\n{out}\n[exit {code}]\n")
        if code != 0 or not tmp.is_file():
            raise ConfigError(f"apptainer build of {sif.name} failed (exit {code}): {last_line(out)}; full log: {log}")
        os.chmod(tmp, 0o755)  # as apptainer leaves it (a SIF runs as ./x.sif)
        os.replace(tmp, sif)
    finally:
        tmp.unlink(missing_ok=True)
        definition.unlink(missing_ok=True)
    return SifBuild(sif, sif.stat().st_size, time.monotonic() - start)
