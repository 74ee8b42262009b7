"""Who the agent is in a Docker container, from what the daemon says about user namespaces.

SWE-bench, SWE-Gym and the reference system run the agent as root in the container: the task's
environment (a conda env under ``/opt``, the repo at ``/testbed``) is root's, and an agent's ``pip
install`` into it must work as it did when the task was written. Root inside is only safe when it is
not root outside, so the choice follows the daemon (``docker info``):

- ``dockerd --userns-remap`` (``scripts/start_dockerd.sh`` with ``POLAR_DOCKERD_USERNS=1``): container
  uid ``n`` is host uid ``base + n``; ``base`` is read from ``DockerRootDir`` (``<data-root>/<uid>.<gid>``).
  The remap is daemon-wide: every container of that daemon shares the one range (Docker 20.10 has no
  per-container ``--userns`` map, only ``--userns=host`` to opt out, which the runtime never passes).
- rootless dockerd: container root is the daemon's own unprivileged user (host uid not reported).
- neither: container root is host root, so the agent keeps ``AGENT_UID`` (160000) inside and out.

``spec.agent_root``: ``auto`` (root inside where the daemon remaps, else ``AGENT_UID``), ``require``
(a one-line ConfigError where it does not), ``off`` (``AGENT_UID`` always; on a remapped daemon the
range must cover it: the start script maps 262144 uids). Grading runtimes (``spec.user="root"``) are
container root on every daemon, as before.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from polar_env.errors import ConfigError

REMAP_HINT = "start dockerd with --userns-remap (POLAR_DOCKERD_USERNS=1 scripts/start_dockerd.sh) or use rootless Docker"


@dataclass(frozen=True, slots=True)
class Userns:
    """What the daemon does with container uids; ``host_root``: host uid of container root, if known."""

    remaps: bool
    host_root: int | None
    line: str  # e.g. "dockerd userns-remap on (container root = host uid 1000000)"

    def host_uid(self, uid: int) -> int | None:
        """The host uid that container ``uid`` is (None: not known here, e.g. rootless)."""
        if not self.remaps:
            return uid
        return None if self.host_root is None else self.host_root + uid


def parse_info(info: dict[str, Any]) -> Userns:
    """``docker info`` (the SDK's dict) as a ``Userns``."""
    opts = " ".join(info.get("SecurityOptions") or [])
    if "name=rootless" in opts:
        return Userns(True, None, "rootless dockerd (container root = the daemon's unprivileged user)")
    if "name=userns" not in opts:
        return Userns(False, 0, "dockerd userns-remap off")
    m = re.fullmatch(r"(\d+)\.(\d+)", os.path.basename(str(info.get("DockerRootDir") or "").rstrip("/")))
    base = int(m.group(1)) if m else None
    return Userns(True, base, f"dockerd userns-remap on (container root = host uid {base if m else 'unknown'})")


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def unix_daemon_problem(host: str | None = None) -> str | None:
    """For a ``unix://`` DOCKER_HOST, why nothing answers there (None when a connect succeeds).
    Checked with our own socket first: the SDK leaks its socket when the connect fails."""
    host = host or docker_host()
    if not host.startswith("unix://"):
        return None
    path = host[len("unix://") :]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    finally:
        s.close()
    return None


_CACHE: dict[str, Userns] = {}


def userns_of(client: Any, where: str) -> Userns:
    """``parse_info`` of the daemon at ``where``, asked once per address; an unreadable answer is
    treated as no remap (the safe side: the agent stays unprivileged)."""
    if where not in _CACHE:
        try:
            info = client.info()
        except Exception as e:  # noqa: BLE001 - a report line, not a failure
            return Userns(False, None, f"dockerd userns state unknown ({e})")
        _CACHE[where] = parse_info(info)
    return _CACHE[where]


def agent_uid(user: str, agent_root: str, ns: Userns, unprivileged: int) -> tuple[int, str]:
    """(the uid execs run as in the container, one line saying why), for ``spec.user`` and
    ``spec.agent_root``; ``agent_root=require`` on a daemon that does not remap is a ConfigError."""
    if user == "root":
        return 0, "grading runtime: container root"
    if agent_root == "off":
        return unprivileged, f"agent_root=off: uid {unprivileged}"
    if ns.remaps:
        return 0, "agent is root in the container, unprivileged on the host (as SWE-bench runs it)"
    if agent_root == "require":
        raise ConfigError(f"agent_root=require, but the Docker daemon does not remap uids ({ns.line}), runtime docker; "
                          f"{REMAP_HINT}, or set agent_root=auto")
    return unprivileged, f"agent is uid {unprivileged}, not root: the daemon does not remap uids (pip into root-owned envs fails)"


def describe(ns: Userns, agent_root: str, unprivileged: int) -> str:
    """Preflight's one line: who the agent will be, inside and on the host."""
    uid, why = agent_uid("agent", agent_root, ns, unprivileged)
    host = ns.host_uid(uid)
    return f"{why}; container uid {uid} = host uid {host if host is not None else 'unprivileged (rootless)'}; {ns.line}"
