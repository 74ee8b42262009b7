"""The Docker runtime's preflight check (its ``RUNTIMES`` entry's ``preflight``): the docker SDK
imports, a daemon answers its ping on ``DOCKER_HOST`` (never started here), one line says who the
agent will be (docker_userns.py), and every image the sessions do not pull is on the daemon."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from polar_env.errors import ConfigError
from polar_env.runtimes.base import RuntimeNeeds
from polar_env.runtimes.docker import AGENT_UID
from polar_env.runtimes.docker_image import pull_hint
from polar_env.runtimes.docker_userns import Userns, describe, docker_host, parse_info

DOCKER_PING_TIMEOUT_S = 2.0


def check_docker(needs: RuntimeNeeds) -> None:
    check_daemon(needs.agent_root)
    check_images([i for i in needs.images if i not in needs.pulled])


def docker_get(host: str, path: str) -> bytes | None:
    """The raw HTTP answer of the daemon at ``host`` to ``GET path`` (None: a scheme left to the SDK)."""
    if host.startswith("unix://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = host[len("unix://"):]
    elif host.startswith("tcp://"):
        name, _, port = host[len("tcp://"):].rstrip("/").rpartition(":")
        s, address = socket.socket(), (name, int(port))
    else:
        return None  # ssh:// and friends: the SDK's business
    chunks: list[bytes] = []
    with s:
        s.settimeout(DOCKER_PING_TIMEOUT_S)
        s.connect(address)
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n".encode())
        while (chunk := s.recv(65536)) and sum(map(len, chunks)) < 1 << 20:
            chunks.append(chunk)
    return b"".join(chunks)


def check_daemon(agent_root: str = "auto") -> None:
    """The daemon answers its ping; then one line says who the agent will be (root inside only where
    the daemon remaps uids), and ``agent_root=require`` on a daemon that does not is refused."""
    if importlib.util.find_spec("docker") is None:
        raise ConfigError("the docker SDK is not installed, runtime docker; pip install -e '.[docker]'")
    host = docker_host()
    hint = "start dockerd (scripts/start_dockerd.sh prints the DOCKER_HOST to export), or fix DOCKER_HOST"
    try:
        answer = docker_get(host, "/_ping")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no Docker daemon answers at {host} ({getattr(exc, 'strerror', None) or exc}), runtime docker; "
                          f"{hint}") from None
    if answer is None:
        return
    if b" 200 " not in answer.split(b"\r\n", 1)[0]:
        raise ConfigError(f"{host} does not answer like a Docker daemon ({answer[:80]!r}), runtime docker; {hint}")
    try:
        info = json.loads((docker_get(host, "/info") or b"").partition(b"\r\n\r\n")[2])
        ns = parse_info(info) if isinstance(info, dict) else Userns(False, None, "dockerd userns state unknown")
    except (OSError, ValueError):
        ns = Userns(False, None, "dockerd userns state unknown (no /info)")
    print(f"polar-env: runtime docker: {describe(ns, agent_root, AGENT_UID)}", file=sys.stderr, flush=True)


def check_images(images: Sequence[str]) -> None:
    """Every image is on the daemon (``docker image inspect``, over the socket ``check_daemon``
    pinged, else the SDK); all missing ones in one line, each with its pull command."""
    host = docker_host()
    missing: list[str] = []
    for image in dict.fromkeys(images):
        try:
            answer = docker_get(host, f"/images/{quote(image, safe='/:@')}/json")
        except (OSError, ValueError):
            return  # the ping answered; a flaky daemon is prepare's to report
        if answer is None:  # ssh:// and friends: the SDK
            import docker

            client = docker.from_env()
            try:
                client.images.get(image)
            except docker.errors.ImageNotFound:
                missing.append(image)
            finally:
                client.close()
        elif b" 404 " in answer.split(b"\r\n", 1)[0]:
            missing.append(image)
    if missing:
        each = "; ".join(f"{i} ({pull_hint(i)})" for i in missing)
        raise ConfigError(f"{len(missing)} docker image(s) not on the daemon at {host}, runtime docker: {each}; pull "
                          "them, or pass --pull (runtime.pull: true) to pull at prepare")
