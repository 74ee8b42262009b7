"""Apptainer images given as URIs (``docker://``, ``docker-archive://``, ``oras://``, ...:
``imagestore.URI_SCHEMES``), converted once per image into the local image store as an Apptainer
sandbox folder, which the runtime then runs like any store image. A local ``.sif`` goes the same way
when ``/dev/fuse`` is closed to the uid that runs Apptainer (rootless Apptainer mounts a SIF with
squashfuse): ``unsquashfs`` unpacks its root partition (offset from ``apptainer sif list``) once,
keyed by path, size and mtime (``sif_key``). Not ``apptainer build --sandbox SIF``: as root it takes
the privileged path, which fails where root's bounding set lacks CAP_SYS_RESOURCE.

Why: as root every exec drops to an unprivileged uid (``apptainer.py``) that has no writable
Apptainer cache, so a URI handed to each ``apptainer exec`` would be fetched and unpacked on every
exec, or fail; and a SIF needs squashfuse and an open ``/dev/fuse``, a folder nothing. So the first
session that needs a URI runs ``apptainer build --sandbox <store>/<name>.tmp-... URI`` as the
invoking user (``APPTAINER_CACHEDIR`` and ``APPTAINER_TMPDIR`` in the store unless set) and renames
the result onto ``<store>/<store_name(URI)>``; a crashed build leaves only a temp name, which the
next build removes. A per-image ``flock`` on ``<store>/.<name>.lock``, polled so that no thread and
no event loop blocks on it, makes concurrent sessions (threads, asyncio tasks, processes) wait for
that one build and reuse its folder. The folder keeps what Apptainer wrote: the image's ``ENV`` in
``.singularity.d/env`` (sourced by Apptainer at every exec) and its ``/testbed``, which seeds the
workspace through the store-image path. A converted tag is not re-fetched: remove the folder to
convert again. ``.<name>.converted.json`` beside it records the URI, disk bytes and build seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import json
import logging
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from polar_env.errors import ConfigError
from polar_env.runtimes import diskfs
from polar_env.runtimes.bundle import images_root, store_name
from polar_env.runtimes.hostworkspace import killpg

log = logging.getLogger(__name__)

CACHE_DIR = ".apptainer-cache"
TMP_DIR = ".apptainer-tmp"
LOG_DIR = ".logs"
BUILD_TIMEOUT_S = 3600.0
LOCK_POLL_S = 0.2
LOCAL_SCHEMES = ("docker-archive://", "oci-archive://")


@dataclass(frozen=True)
class Converted:
    """A URI's sandbox folder in the store; ``build_s`` is None when this call reused it."""

    uri: str
    path: Path
    bytes: int | None
    build_s: float | None

    @property
    def built(self) -> bool:
        return self.build_s is not None

    def report(self) -> dict[str, Any]:
        return {"uri": self.uri, "sandbox": str(self.path), "bytes": self.bytes, "built": self.built,
                "build_s": round(self.build_s, 2) if self.build_s is not None else None}


def sandbox_path(uri: str, store: Path | None = None) -> Path:
    """Where ``uri``'s sandbox folder lives: ``<store>/<store_name(uri)>``."""
    return (store or images_root()) / store_name(uri)


def sif_key(path: Path) -> str:
    """The store key of a SIF's unpacked folder: its path, size and mtime, so a rebuilt SIF is unpacked
    again (the old folder stays until removed by hand) and an unchanged one never."""
    st = path.stat()
    return f"sif-{path.resolve()}-{st.st_size}-{st.st_mtime_ns}"


def meta_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.converted.json")


def folder_bytes(path: Path) -> int | None:
    """Disk the folder uses (``du -s -B1``); None when du cannot tell."""
    proc = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=False)
    first = proc.stdout.split()[:1]
    return int(first[0]) if proc.returncode == 0 and first and first[0].isdigit() else None


def _reused(uri: str, target: Path) -> Converted:
    try:
        size = json.loads(meta_path(target).read_text())["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        size = folder_bytes(target)  # a folder put there by hand
    return Converted(uri, target, size if isinstance(size, int) else None, None)


async def ensure_sandbox(uri: str, binary: str, store: Path | None = None, *, key: str | None = None) -> Converted:
    """``uri`` (or a local ``.sif``) as a sandbox folder in the store, named after ``key`` (default:
    the URI): built here when absent (once, under the image's lock), else reused; a failed build is
    one ConfigError line naming its log."""
    store = store or images_root()
    target = sandbox_path(key or uri, store)
    if target.is_dir():
        return await asyncio.to_thread(_reused, uri, target)
    try:
        store.mkdir(parents=True, exist_ok=True)
        lock = (store / f".{target.name}.lock").open("a")
    except OSError as exc:
        raise ConfigError(f"apptainer image {uri}: cannot write the image store {store} to convert it ({exc}); "
                          "set POLAR_IMAGES to a writable folder") from None
    with lock:
        await _lock(lock, uri)
        try:
            if target.is_dir():  # another session built it while this one waited
                return await asyncio.to_thread(_reused, uri, target)
            return await _build(uri, binary, store, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


async def _lock(lock: TextIO, uri: str) -> None:
    """Take the image's exclusive lock, polling so that waiting blocks neither the loop nor a thread."""
    waited = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not waited:
                log.info("apptainer: waiting for another session's conversion of %s", uri)
                waited = True
            await asyncio.sleep(LOCK_POLL_S)


def build_env(store: Path) -> dict[str, str]:
    """The host environment with Apptainer's cache and temp folders in the store unless set: the
    build needs no cache of the user's own, and its layers and scratch space sit beside the images."""
    env = dict(os.environ)
    for key, folder in (("APPTAINER_CACHEDIR", CACHE_DIR), ("APPTAINER_TMPDIR", TMP_DIR)):
        env.setdefault(key, str(store / folder))
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    return env


def last_line(text: str) -> str:
    """The line that says why an apptainer command failed (its last FATAL or ERROR, else its last)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "FATAL" in ln or "ERROR" in ln]
    return (fatal or lines or ["(no output)"])[-1]


async def sif_offset(binary: str, sif: str) -> int:
    """Where a SIF's root filesystem (squashfs) partition starts: ``apptainer sif list``'s FS row."""
    proc = await asyncio.create_subprocess_exec(binary, "sif", "list", sif, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    text = out.decode("utf-8", "replace")
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) > 4 and "FS (Squashfs" in cells[4] and cells[3].split("-")[0].strip().isdigit():
            return int(cells[3].split("-")[0])
    raise ConfigError(f"apptainer: {sif} has no squashfs root partition (apptainer sif list: {last_line(text)})")


async def _build(uri: str, binary: str, store: Path, target: Path) -> Converted:
    """``apptainer build --sandbox`` into a temp name, then the rename; the caller holds the lock."""
    for stale in store.glob(f"{glob.escape(target.name)}.tmp-*"):  # a crashed build's
        await asyncio.to_thread(diskfs.remove_tree, stale)
    tmp = store / f"{target.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    logfile = store / LOG_DIR / f"{target.name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    log.info("apptainer: converting %s into %s (once; later sessions reuse it)", uri, target)
    start = time.monotonic()
    if os.path.isfile(uri):  # a SIF: its squashfs partition, unpacked (no starter, so no capability needs)
        argv = ["unsquashfs", "-no-progress", "-no-xattrs", "-ignore-errors", "-o", str(await sif_offset(binary, uri)),
                "-d", str(tmp), uri]
    else:  # caching a local archive's layers only costs disk
        local = ["--disable-cache"] if uri.startswith(LOCAL_SCHEMES) else []
        argv = [binary, "build", *local, "--sandbox", str(tmp), uri]
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                env=build_env(store), start_new_session=True)
    done = False
    try:
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), BUILD_TIMEOUT_S)
        except TimeoutError:
            killpg(proc)
            await proc.wait()
            out = f"no end after {BUILD_TIMEOUT_S:g} s".encode()
        text = out.decode("utf-8", "replace")
        logfile.write_text(f"$ {shlex.join(argv)}\n{text}\n[exit {proc.returncode}]\n")
        if proc.returncode != 0 or not tmp.is_dir():
            raise ConfigError(f"apptainer: cannot convert {uri} into a sandbox folder (exit {proc.returncode}): "
                              f"{last_line(text)}; full log: {logfile}; check the URI (a docker:// or oras:// one needs "
                              f"its registry), or fill the store yourself: apptainer build --sandbox {target} {uri}")
        build_s = time.monotonic() - start
        size = await asyncio.to_thread(folder_bytes, tmp)
        meta = {"uri": uri, "bytes": size, "build_s": round(build_s, 2), "built_at": datetime.now(UTC).isoformat()}
        staged = meta_path(target).with_suffix(".tmp")
        staged.write_text(json.dumps(meta) + "\n")
        os.replace(staged, meta_path(target))
        os.rename(tmp, target)
        done = True
    finally:
        if proc.returncode is None:  # timed out or cancelled: the build's whole group goes
            killpg(proc)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
        if not done:
            await asyncio.to_thread(diskfs.remove_tree, tmp)
    log.info("apptainer: converted %s in %.1f s (%s MB on disk): %s", uri, build_s,
             f"{size / 1e6:.1f}" if size is not None else "?", target)
    return Converted(uri, target, size, build_s)
