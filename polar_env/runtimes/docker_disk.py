"""The Docker runtime's kernel disk bound: one sized tmpfs per container, on the host, bind-mounted
over everything the agent can write.

Why bind mounts: Docker's archive API (``put_archive``, which ``write_file`` and the harness's HOME
config need) does not reach a tmpfs mounted *inside* a container, but it does reach bind mounts. So,
as root, with ``disk_mb`` set and the agent's uid (not the grading runtime, which runs as root) on a
dockerd whose uid map is known (no remap: the container's uid; ``--userns-remap``: its base plus that
uid; rootless: unknown, so no tmpfs), since the host-side chown names the agent's host uid,
``DockerDisk.create`` mounts ``diskfs.mount_tmpfs`` (``size=<disk_mb>m,nr_inodes=...``) on a host
directory (under the node's incarnation folder when one is given, so ``leftovers.sweep`` unmounts and
removes what a dead node left) holding ``workspace/``, ``STICKY`` (1777) and one folder per agent
directory (HOME, ``/logs``, ``/tests``), owned by the agent's uid, and the container gets them at
``spec.workdir``, ``/tmp``, ``/var/tmp``, ``/run/lock`` and those paths. The kernel refuses
writes past the bound with ENOSPC (files deleted while held open, many directories included); one
``statvfs`` of the host mount (``diskfs.full``) trips the limit. Outside the bound: ``/dev/shm``
(Docker's own 64 MiB tmpfs), the root-owned paths of the container layer, which the unprivileged
agent cannot write, and any other world-writable directory a particular image ships, which stays in
the layer, unbounded (the test image has none).

Populating. With ``spec.source_dir`` the tree is copied on the host. The image's own workdir (a SWE
image's ``/testbed``), HOME, ``/logs`` and ``/tests`` are read from the derived agent image **once per node** with a
stopped container's ``get_archive`` into a host cache, and copied from there per session.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
import secrets
import tarfile
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from polar_env.runtimes import diskfs
from polar_env.runtimes.docker_leftovers import LABEL, OWNER, owner
from polar_env.runtimes.hostworkspace import chown_tree, copy_tree

if TYPE_CHECKING:
    from docker import DockerClient

    from polar_env.runtimes.base import RuntimeSpec

log = logging.getLogger(__name__)

CACHE_DIR = "polar-docker-images"  # the image-tree cache, under the incarnation folder or the temp dir
_CACHE_LOCK = threading.Lock()  # one extraction at a time in this process
POLL_S = 0.5  # the tmpfs's statvfs while the container lives
STICKY = ("tmp", "vartmp", "runlock")  # 1777, as in the image: /tmp, /var/tmp, /run/lock (Debian's /var/lock)


def no_tmpfs_reason(disk_mb: int | None, user: str, host_uid: int | None, workdir: str, agent_dirs: tuple[str, ...],
                    userns: str) -> str | None:
    """None when this container gets the tmpfs, else why it keeps the ``du`` watchdog. ``host_uid``:
    who the agent is on the host (None: unknown, e.g. rootless; the host-side chown needs it)."""
    if disk_mb is None:
        return "no disk_mb"
    if user == "root" or host_uid == 0:
        return "grading runtime runs as root (user=root)"
    if host_uid is None:
        return f"{userns}: the agent's host uid is unknown"
    if posixpath.normpath(workdir) in ("/", "/tmp", "/var/tmp", "/run/lock", *agent_dirs):
        return f"workdir {workdir} is itself a bound tree"
    return diskfs.tmpfs_wanted()


def _extract(container: Any, path: str, into: Path) -> Path:
    """``path`` of a (stopped) container, unpacked under ``into``; the unpacked tree (empty when the image
    lacks it: a root agent's image is not derived, so ``/logs`` or ``/tests`` may be missing)."""
    import docker

    try:
        stream, _stat = container.get_archive(path)
    except docker.errors.NotFound:
        (into / posixpath.basename(posixpath.normpath(path))).mkdir(parents=True)
        return into / posixpath.basename(posixpath.normpath(path))
    with tempfile.TemporaryFile() as buf:
        for chunk in stream:
            buf.write(chunk)
        buf.seek(0)
        with tarfile.open(fileobj=buf, mode="r|") as tar:
            tar.extractall(into, numeric_owner=True, filter="tar")
    return into / posixpath.basename(posixpath.normpath(path))


def image_trees(client: DockerClient, image: str, paths: list[str], cache_base: Path) -> list[Path]:
    """``paths`` of ``image`` as host trees, extracted once (per image and paths) into ``cache_base``."""
    image_id = cast(str, client.images.get(image).id)  # an image the daemon has always has one
    key = hashlib.sha256("\0".join([image_id, *paths]).encode()).hexdigest()[:20]
    done = cache_base / key
    trees = [done / str(i) / posixpath.basename(posixpath.normpath(p)) for i, p in enumerate(paths)]
    with _CACHE_LOCK:
        if done.is_dir():
            return trees
        cache_base.mkdir(parents=True, exist_ok=True)
        tmp = cache_base / f".{key}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700)
        box = client.containers.create(image, command=["true"], network_mode="none", labels={LABEL: "docker-cache", OWNER: owner()})
        try:
            for i, p in enumerate(paths):
                _extract(box, p, tmp / str(i))
            try:
                os.rename(tmp, done)
            except OSError:  # another process finished first
                diskfs.remove_tree(tmp)
        except BaseException:
            diskfs.remove_tree(tmp)
            raise
        finally:
            box.remove(force=True)
    log.info("docker: cached %s of %s in %s", ", ".join(paths), image, done)
    return trees


def disk_mechanism(disk: DockerDisk | None, disk_mb: int | None, fallback: str) -> str:
    """``mechanisms["disk_mb"]``: the tmpfs, or the watchdog and why there is no tmpfs."""
    return disk.mechanism if disk is not None else "none" if disk_mb is None else fallback


class DockerDisk:
    """One container's sized tmpfs on the host (see the module doc); ``mounted`` once it is up."""

    def __init__(self, disk_mb: int, uid: int, workdir: str, agent_dirs: tuple[str, ...], root_dir: str | Path | None) -> None:
        self.disk_mb = disk_mb
        self.uid = uid
        self.workdir = posixpath.normpath(workdir)
        self.agent_dirs = agent_dirs  # HOME first: copied from the image, like the workdir without a source_dir
        self.dests = {"workspace": self.workdir, "tmp": "/tmp", "vartmp": "/var/tmp", "runlock": "/run/lock",
                      **{f"{i}{posixpath.basename(d)}": d for i, d in enumerate(agent_dirs)}}
        self.parent = Path(root_dir) if root_dir else Path(os.environ.get("POLAR_RUNTIME_DIR") or tempfile.gettempdir())
        self.root: Path | None = None
        self.mounted = False

    @classmethod
    def setup(cls, spec: RuntimeSpec, host_uid: int | None, agent_dirs: tuple[str, ...], root_dir: str | Path | None,
              client: DockerClient, image: str, userns: str) -> tuple[DockerDisk | None, str | None]:
        """(the mounted, populated disk, None) or (None, why the container keeps the watchdog); blocking.
        ``host_uid``: the agent's uid as the host sees it (the trees are chowned to it)."""
        why = no_tmpfs_reason(spec.disk_mb, spec.user, host_uid, spec.workdir, agent_dirs, userns)
        if why is not None or spec.disk_mb is None or host_uid is None:
            return None, why
        disk = cls(spec.disk_mb, host_uid, spec.workdir, agent_dirs, root_dir)
        try:
            why = disk.create(client, image, spec.source_dir)
        except BaseException:
            disk.remove()
            raise
        if why is not None:
            disk.remove()
            return None, why
        return disk, None

    async def watch(self, hit: Callable[[], str | None], trip: Callable[[str, str, str], Awaitable[None]]) -> None:
        """Trip every ``POLL_S`` the mount is full: a file held open while deleted counts while its writer lives."""
        while hit() is None and self.root is not None:
            await asyncio.sleep(POLL_S)
            if (why := self.full()) is not None:
                await trip("disk_mb", self.mechanism, why)

    @property
    def mechanism(self) -> str:
        return (f"tmpfs size={self.disk_mb}m nr_inodes={diskfs.inodes_for(self.disk_mb)} on the container's writable "
                "trees (bind mounts: workdir, /tmp, /var/tmp, /run/lock, HOME, /logs, /tests; kernel ENOSPC; full mount trips the limit)")

    def create(self, client: DockerClient, image: str, source_dir: str | Path | None) -> str | None:
        """Mount and populate (blocking); None when mounted, else why not (the caller falls back)."""
        self.parent.mkdir(parents=True, exist_ok=True)
        self.root = root = Path(tempfile.mkdtemp(prefix="polar-docker-", dir=self.parent))
        why = diskfs.mount_tmpfs(root, self.disk_mb)
        if why is not None:
            return why
        self.mounted = True
        for name in self.dests:
            (root / name).mkdir()
        own = [*([] if source_dir is not None else [self.workdir]), *self.agent_dirs]
        cached = dict(zip(own, image_trees(client, image, own, self.parent / CACHE_DIR), strict=True))
        for name, dest in self.dests.items():
            if dest in cached or name == "workspace":
                copy_tree(cached[dest] if dest in cached else Path(str(source_dir)), root / name)
            chown_tree(root / name, self.uid)
        os.chmod(root / f"0{posixpath.basename(self.agent_dirs[0])}", 0o700)  # HOME
        for name in STICKY:
            os.chmod(root / name, 0o1777)
        return None

    def volumes(self) -> dict[str, dict[str, str]]:
        """The binds for ``containers.run`` (host path -> container path, read-write)."""
        assert self.root is not None
        return {str(self.root / name): {"bind": dest, "mode": "rw"} for name, dest in self.dests.items()}

    def full(self) -> str | None:
        """What is exhausted on the tmpfs (one statvfs), if anything."""
        return diskfs.full(self.root) if self.mounted and self.root is not None else None

    def remove(self) -> None:
        """Unmount (lazily when busy) and remove the mount point; never raises (what stays is logged)."""
        root, self.root = self.root, None
        if root is None:
            return
        try:
            left = diskfs.unmount(root) if self.mounted else None
            self.mounted = False
            left = left or diskfs.remove_tree(root)
        except Exception as e:  # noqa: BLE001 - teardown must not fail
            left = str(e)
        if left is not None:
            log.warning("docker: could not remove %s (left for leftovers.sweep): %s", root, left)
