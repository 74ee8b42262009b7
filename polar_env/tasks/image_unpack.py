"""Unpack a saved image into the local store as an OCI runtime bundle, for sites that reach no
registry: a ``docker save`` archive, an OCI image layout folder, or an Apptainer sandbox folder made
elsewhere and carried over. Layers are applied in order with their whiteouts; the image config's
``Env`` and ``WorkingDir`` go into ``config.json``.

Layer members are extracted through ``tarfile``'s ``data`` filter (nothing outside the rootfs is
written: no absolute paths, no ``..``, no writes through links that lead out; device files, setuid
bits and ownership are dropped); members it refuses are dropped and counted. Symlinks are kept as
written (absolute ones, which images use everywhere, point inside the image once it runs); what is
checked is every write, where the host would resolve it.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

from polar_env.errors import ConfigError
from polar_env.runtimes.bundle import ROOTFS, store_name, write_bundle_config
from polar_env.tasks.image_build import disk_bytes, image_lock, require_data_filter, swap_into_place

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
SOURCE_KEY = "polar_env.image.source"
_OPENERS = frozenset({"if", "case", "for", "while", "until"})
_CLOSERS = frozenset({"fi", "esac", "done", "}"})


@dataclass
class UnpackResult:
    image: str
    bundle: Path
    source: str  # docker-save / oci-layout / apptainer-sandbox
    layers: int = 0
    seconds: float = 0.0
    bytes: int = 0
    dropped: list[str] = field(default_factory=list)  # unsafe members not written
    not_parsed: list[str] = field(default_factory=list)  # Apptainer env lines not taken over
    env: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        notes = ""
        if self.dropped:
            notes += f"; dropped {len(self.dropped)} members that were unsafe or device files (first: {self.dropped[0]})"
        if self.not_parsed:
            notes += f"; {len(self.not_parsed)} env lines not parsed (first: {self.not_parsed[0]})"
        return (f"unpacked {self.image} ({self.source}, {self.layers} layers) into {self.bundle} in {self.seconds:.1f}s, "
                f"{self.bytes / 1e6:.1f} MB{notes}")


@dataclass
class ImageConfig:
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


def unpack(src: Path, image: str, store: Path) -> UnpackResult:
    """Write ``src`` as the bundle ``store/<store_name(image)>``, replacing one of that name atomically."""
    if not src.exists():
        raise ConfigError(f"{src}: no such file or folder; pass a docker save archive, an OCI layout or an Apptainer sandbox")
    require_data_filter()
    name = store_name(image)
    target = store / name
    start = time.monotonic()
    with image_lock(store, name):
        tmp = store / f".{name}.unpacking-{os.getpid()}-{time.monotonic_ns()}"
        try:
            tmp.mkdir()
            rootfs = tmp / ROOTFS
            rootfs.mkdir()
            result = UnpackResult(image, target, "")
            config = _unpack_into(src, rootfs, result)
            write_bundle_config(tmp, env=config.env, cwd=config.cwd, annotations={
                SOURCE_KEY: result.source, "polar_env.image.unpacked_from": str(src.resolve()),
                "polar_env.image.built_at": datetime.now(UTC).replace(microsecond=0).isoformat()})
            result.env = config.env
            result.bytes = disk_bytes(rootfs)[0]
            swap_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    result.seconds = time.monotonic() - start
    return result


def _unpack_into(src: Path, rootfs: Path, result: UnpackResult) -> ImageConfig:
    if src.is_dir() and (src / "index.json").is_file() and (src / "blobs").is_dir():
        result.source = "oci-layout"
        return _from_oci_layout(src, rootfs, result)
    if src.is_dir() and (src / ".singularity.d").is_dir():
        result.source = "apptainer-sandbox"
        return _from_sandbox(src, rootfs, result)
    if src.is_file() and tarfile.is_tarfile(src):
        result.source = "docker-save"
        return _from_docker_save(src, rootfs, result)
    raise ConfigError(f"{src} is neither a docker save archive (tar with manifest.json), an OCI image layout "
                      "(index.json + blobs/) nor an Apptainer sandbox (.singularity.d/)")


def _config_of(doc: dict[str, Any]) -> ImageConfig:
    """Env and WorkingDir of a Docker / OCI image config."""
    inner = doc.get("config") or doc.get("Config") or {}
    env: dict[str, str] = {}
    for item in inner.get("Env") or []:
        key, sep, value = str(item).partition("=")
        if sep and key:
            env[key] = value
    return ImageConfig(env=env, cwd=inner.get("WorkingDir") or None)


def _from_docker_save(src: Path, rootfs: Path, result: UnpackResult) -> ImageConfig:
    with tarfile.open(src) as outer:
        try:
            manifest = json.load(_member(outer, "manifest.json", src))
        except ValueError as exc:
            raise ConfigError(f"{src}: manifest.json is not JSON ({exc}); make the archive with docker save") from None
        if not isinstance(manifest, list) or not manifest:
            raise ConfigError(f"{src}: manifest.json lists no image; make the archive with docker save IMAGE -o FILE")
        entry = manifest[0]
        config = _config_of(json.load(_member(outer, entry["Config"], src)))
        for layer in entry.get("Layers") or []:
            _apply_layer(_member(outer, layer, src), rootfs, result, layer)
    return config


def _member(tar: tarfile.TarFile, name: str, src: Path) -> IO[bytes]:
    try:
        f = tar.extractfile(name)
    except KeyError:
        f = None
    if f is None:
        raise ConfigError(f"{src}: no file {name} in the archive; is it a complete docker save archive?")
    return f


def _from_oci_layout(src: Path, rootfs: Path, result: UnpackResult) -> ImageConfig:
    def blob(descriptor: dict[str, Any]) -> Path:
        algo, _, digest = str(descriptor.get("digest", "")).partition(":")
        path = src / "blobs" / algo / digest
        if not digest or "/" in digest or not path.is_file():
            raise ConfigError(f"{src}: blob {descriptor.get('digest')} is missing from blobs/; copy the whole layout")
        return path

    doc = json.loads((src / "index.json").read_text())
    while "manifests" in doc:  # an index (maybe nested): the linux/amd64 manifest, else the first
        manifests = doc["manifests"] or []
        if not manifests:
            raise ConfigError(f"{src}: the index lists no manifest")
        chosen = next((m for m in manifests if (m.get("platform") or {}).get("architecture") == "amd64"), manifests[0])
        doc = json.loads(blob(chosen).read_text())
    config = _config_of(json.loads(blob(doc["config"]).read_text()))
    for layer in doc.get("layers") or []:
        if "zstd" in str(layer.get("mediaType", "")):
            raise ConfigError(f"{src}: layer {layer.get('digest')} is zstd-compressed, which Python's tarfile cannot read; "
                              "re-save it with gzip layers (skopeo copy --dest-compress-format gzip)")
        with blob(layer).open("rb") as f:
            _apply_layer(f, rootfs, result, str(layer.get("digest")))
    return config


def _apply_layer(stream: IO[bytes], rootfs: Path, result: UnpackResult, label: str) -> None:
    """One layer over ``rootfs``: its whiteouts remove what lower layers wrote, then its files."""
    head = stream.read(2)
    stream.seek(0)
    fileobj: IO[bytes] = gzip.GzipFile(fileobj=stream) if head == b"\x1f\x8b" else stream  # type: ignore[assignment]
    with tarfile.open(fileobj=fileobj, mode="r:") as layer:
        members = layer.getmembers()
        for m in members:
            path = PurePosixPath(m.name)
            if path.name == OPAQUE:
                _clear(rootfs, path.parent, result)
            elif path.name.startswith(WHITEOUT):
                _remove(rootfs, path.parent / path.name[len(WHITEOUT):], result)
        root = str(rootfs)

        def safe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
            target = os.path.join(root, member.name.lstrip("/"))
            parent = os.path.realpath(os.path.dirname(target))
            if not _inside(parent, root):
                result.dropped.append(f"{member.name} (in {label})")
                return None
            if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target) and not os.path.islink(target)):
                _delete(Path(target))  # a member replaces what a lower layer had there, never writes through it
            # A symlink is kept as written (absolute ones point inside the image once it runs): a link writes
            # nothing, and every member written later is checked against where the host resolves it.
            check = member.replace(linkname=".", deep=False) if member.issym() else member
            try:
                checked = tarfile.data_filter(check, dest)
            except tarfile.FilterError as exc:
                result.dropped.append(f"{member.name} (in {label}: {type(exc).__name__})")
                return None
            return checked.replace(linkname=member.linkname, deep=False) if member.issym() else checked

        layer.extractall(rootfs, members=_data_members(members), filter=safe)
    result.layers += 1


def _data_members(members: Iterable[tarfile.TarInfo]) -> Iterator[tarfile.TarInfo]:
    for m in members:
        if not PurePosixPath(m.name).name.startswith(WHITEOUT):
            yield m


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _resolved_dir(rootfs: Path, rel: PurePosixPath, result: UnpackResult) -> Path | None:
    """``rel``'s folder in the rootfs when it lies inside it (links followed), else None (counted as dropped)."""
    parts = [p for p in rel.parts if p not in ("/", ".")]
    if ".." in parts:
        result.dropped.append(f"{rel} (whiteout with ..)")
        return None
    real = os.path.realpath(rootfs.joinpath(*parts)) if parts else str(rootfs)
    if not _inside(real, str(rootfs)):
        result.dropped.append(f"{rel} (whiteout outside the rootfs)")
        return None
    return Path(real)


def _clear(rootfs: Path, folder: PurePosixPath, result: UnpackResult) -> None:
    real = _resolved_dir(rootfs, folder, result)
    if real is not None and real.is_dir():
        for child in real.iterdir():
            _delete(child)


def _remove(rootfs: Path, rel: PurePosixPath, result: UnpackResult) -> None:
    parent = _resolved_dir(rootfs, rel.parent, result)
    if parent is not None and rel.name not in ("", ".", ".."):
        target = parent / rel.name
        if os.path.lexists(target):
            _delete(target)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# -- Apptainer sandbox: the folder is the root filesystem; env from .singularity.d/env/*.sh ------------


def _from_sandbox(src: Path, rootfs: Path, result: UnpackResult) -> ImageConfig:
    rootfs.rmdir()
    shutil.copytree(src, rootfs, symlinks=True)
    result.layers = 1
    env: dict[str, str] = {}
    for script in sorted((src / ".singularity.d" / "env").glob("*.sh")):
        depth = 0  # inside if/case/loops/functions nothing is taken: whether it runs depends on the shell
        for raw in script.read_text(errors="replace").splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            first = line.split()[0]
            parsed = parse_export(line, env) if depth == 0 else None
            depth += first in _OPENERS or line.endswith("{")
            depth = max(0, depth - (first in _CLOSERS))
            if parsed is None:
                result.not_parsed.append(f"{script.name}: {line[:60]}")
            else:
                env[parsed[0]] = parsed[1]
    return ImageConfig(env=env, cwd=None)  # a sandbox records no working directory


def parse_export(line: str, env: dict[str, str]) -> tuple[str, str] | None:
    """``export K=V`` (V quoted or not, ``$VAR`` / ``${VAR}`` taken from what came before), without running
    anything; None for every other line (conditionals, functions, command substitution, defaults)."""
    try:
        words = shlex.split(line, posix=True)
    except ValueError:
        return None
    if len(words) != 2 or words[0] != "export" or "=" not in words[1]:
        return None
    key, _, value = words[1].partition("=")
    if not key.isidentifier() or "`" in line or "$(" in line:
        return None
    if "'" in line:  # single quotes: literal
        return key, value
    expanded = _expand(value, env)  # otherwise simple references are expanded
    return None if expanded is None else (key, expanded)


def _expand(value: str, env: dict[str, str]) -> str | None:
    import re

    if re.search(r"\$\{[^}]*[^A-Za-z0-9_}][^}]*\}", value):  # ${VAR:-x} and the like
        return None
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), ""), value)
