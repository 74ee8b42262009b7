"""The Docker runtime's image: present on the daemon (pulled once per image per process when
``RuntimeSpec.pull`` is on, however many sessions prepare at once), and the environment it declares
(``Config.Env``), read once at prepare so ``DockerRuntime.path`` is the image's ``ENV PATH`` (a
SWE-Gym venv's, conda's) without an exec.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from polar_env.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# one lock per image per event loop: sessions preparing together pull an image once
_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()


def pull_hint(image: str) -> str:
    return f"docker pull {image}"


def _image_env(attrs: dict[str, Any]) -> dict[str, str]:
    """``Config.Env`` of ``docker image inspect`` as a mapping."""
    env: dict[str, str] = {}
    for item in (attrs.get("Config") or {}).get("Env") or []:
        name, sep, value = str(item).partition("=")
        if sep and name:
            env[name] = value
    return env


async def ensure_image(client: Any, image: str, pull: bool, blocking: Callable[..., Awaitable[Any]],
                       where: str) -> dict[str, str]:
    """The image's environment, pulling it first when it is missing and ``pull`` is on; missing
    without ``pull`` is one line with the command that fixes it. ``blocking`` runs an SDK call off the loop."""
    import docker

    locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
    async with locks.setdefault(image, asyncio.Lock()):
        try:
            found = await blocking(client.images.get, image)
        except docker.errors.ImageNotFound:
            if not pull:
                raise ConfigError(f"docker image {image} is not present locally (the daemon at {where}), runtime docker; run "
                                  f"`{pull_hint(image)}` (or docker load/import it), or pass --pull (runtime.pull: true)"
                                  ) from None
            log.info("pulling %s", image)
            try:
                found = await blocking(client.images.pull, image)
            except docker.errors.APIError as exc:
                raise ConfigError(f"docker image {image} could not be pulled ({exc.explanation or exc}), runtime "
                                  f"docker; check the name and the registry, or `{pull_hint(image)}` by hand") from None
    attrs = getattr(found, "attrs", None)
    return _image_env(attrs if isinstance(attrs, dict) else {})
