"""What a dead process leaves in the Docker daemon, and how the next node clears it.

A node killed with ``-9`` leaves its containers running (the daemon owns them) and, over many tasks,
derived agent images (``polar-agent:<key>``, one per image, workdir and uid) pile up. The runtime
folders are ``leftovers.sweep``'s; this is the daemon's side, run next to it at node start:

- every container the runtimes create carries ``OWNER`` = ``<hostname>:<pid>:<start time>`` of the
  creating process (the start time from ``/proc/<pid>/stat``, so a reused pid is not mistaken for
  its owner). A container whose owner is on this host and no longer alive is removed (force).
  Containers of other hosts (a shared daemon) and unlabelled ones are left alone.
- derived agent images beyond the newest ``POLAR_DOCKER_AGENT_IMAGES`` (default 32) are removed;
  one still used by a container is refused by the daemon and kept.

``sweep`` never raises and never starts anything: without the SDK or a daemon it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OWNER = "polar_env.owner"
LABEL = "polar_env.runtime"  # on every container and image the runtime makes (docker.py imports it from here)
AGENT_IMAGE_LABEL = "docker-agent-image"
AGENT_IMAGES_KEPT = int(os.environ.get("POLAR_DOCKER_AGENT_IMAGES", "32"))


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22: start time in clock ticks since boot


def owner(pid: int | None = None) -> str:
    """The ``OWNER`` label value for ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def owner_dead(value: str) -> bool:
    """True when ``value`` names a process on this host that is gone (pid free, or reused)."""
    host, _, rest = value.partition(":") if value.count(":") == 2 else ("", "", "")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return _start_time(int(pid)) != start


def sweep(client: Any = None, keep_images: int = AGENT_IMAGES_KEPT) -> list[str]:
    """Remove dead owners' containers and derived images beyond ``keep_images``; returns what went."""
    removed: list[str] = []
    try:
        if client is None:
            from polar_env.runtimes.docker_userns import unix_daemon_problem

            if unix_daemon_problem() is not None:
                return removed
            import docker

            client = docker.from_env()
        removed += _containers(client)
        removed += _images(client, keep_images)
    except Exception as e:  # noqa: BLE001 - a leftover must never stop the next node
        log.warning("docker leftovers: not swept: %s", e)
    return removed


def _containers(client: Any) -> list[str]:
    gone = []
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        who = (c.labels or {}).get(OWNER)
        if who and owner_dead(who):
            with contextlib.suppress(Exception):
                c.remove(force=True)
                gone.append(f"container {c.name}")
    if gone:
        log.warning("docker leftovers: removed %d container(s) of dead processes: %s", len(gone), ", ".join(gone))
    return gone


def _created(image: Any) -> str:
    """Docker's RFC 3339 ``Created`` (UTC, fraction trimmed of zeros) as a string that sorts by time."""
    head, _, frac = str(image.attrs.get("Created", "")).rstrip("Z").partition(".")
    return f"{head}.{frac.ljust(9, '0')}"


def _images(client: Any, keep: int) -> list[str]:
    images = client.images.list(filters={"label": f"{LABEL}={AGENT_IMAGE_LABEL}"})
    images.sort(key=_created, reverse=True)
    gone = []
    for image in images[max(keep, 0):]:
        with contextlib.suppress(Exception):  # in use: the daemon refuses, and it stays
            client.images.remove(image.id)
            gone.append(f"image {(image.tags or [image.id])[0]}")
    if gone:
        log.warning("docker leftovers: removed %d derived image(s) beyond %d: %s", len(gone), keep, ", ".join(gone))
    return gone
