"""Image folders for the runtimes that run a host directory as ``/`` (bubblewrap, Apptainer): a plain
root filesystem, or an OCI runtime bundle (``config.json`` beside ``rootfs/``, the layout ``umoci
unpack`` and ``runc spec`` use) whose ``process.env`` and ``process.cwd`` carry what a container
image's ``ENV`` and ``WORKDIR`` carry. ``polar-env images build`` and ``polar-env images unpack``
write bundles; the runtimes read them with ``read_image_dir``, so the image's environment (a venv's
``PATH``, ``VIRTUAL_ENV``) is what the agent's shell and the grader see, and its ``/testbed`` seeds the
workspace, on every runtime.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_env.errors import ConfigError

CONFIG = "config.json"
ROOTFS = "rootfs"
OCI_VERSION = "1.0.2"


@dataclass(frozen=True)
class ImageDir:
    """A local image folder as the runtimes use it: the root filesystem, and the environment and
    working directory the image declares (empty / None for a plain rootfs)."""

    rootfs: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    annotations: dict[str, str] = field(default_factory=dict)


def is_bundle(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and (p / ROOTFS).is_dir()


def read_image_dir(path: str | Path) -> ImageDir:
    """``path`` as an image folder: a bundle (its config's env, cwd and root path) or a plain rootfs."""
    p = Path(path)
    if not is_bundle(p):
        return ImageDir(rootfs=p)
    where = p / CONFIG
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"image bundle {p}: {CONFIG} is not readable JSON ({exc}); rebuild it with "
                          "polar-env images build / unpack") from None
    process = config.get("process") or {}
    env: dict[str, str] = {}
    for item in process.get("env") or []:
        name, sep, value = str(item).partition("=")
        if sep and name:
            env[name] = value
    root = (config.get("root") or {}).get("path") or ROOTFS
    rootfs = Path(root) if os.path.isabs(root) else p / root
    if not rootfs.is_dir():
        raise ConfigError(f"image bundle {p}: its root path {rootfs} is not a directory")
    cwd = process.get("cwd")
    notes = {str(k): str(v) for k, v in (config.get("annotations") or {}).items()}
    return ImageDir(rootfs=rootfs, env=env, cwd=str(cwd) if cwd else None, annotations=notes)


def write_bundle_config(bundle: str | Path, *, env: Mapping[str, str], cwd: str | None = None,
                        annotations: Mapping[str, str] | None = None) -> Path:
    """Write ``bundle/config.json`` (the OCI runtime-spec fields the runtimes read) beside ``rootfs/``."""
    config: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "root": {"path": ROOTFS, "readonly": True},
        "process": {"env": [f"{k}={v}" for k, v in env.items()], "cwd": cwd or "/", "args": ["/bin/sh"]},
        "annotations": dict(annotations or {}),
    }
    where = Path(bundle) / CONFIG
    tmp = where.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, where)
    return where


def images_root() -> Path:
    """The local image store: ``$POLAR_IMAGES``, else ``~/.cache/polar_env/images``."""
    return Path(os.environ.get("POLAR_IMAGES") or Path.home() / ".cache" / "polar_env" / "images")


def store_name(image: str) -> str:
    """An image name (``docker.io/xingyaoww/sweb.eval.x86_64.pallets_s_click-2223:latest``) as one
    folder name of the store: every character but ``[A-Za-z0-9._-]`` becomes ``_``."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in image)


def resolve_image_dir(image: str, store: Path | None = None) -> Path | None:
    """The folder a local runtime runs for ``image``: the path itself when it is a directory, else
    the store's folder of that name when it exists; None when neither is there."""
    if os.path.isdir(image):
        return Path(image)
    candidate = (store or images_root()) / store_name(image)
    return candidate if candidate.is_dir() else None
