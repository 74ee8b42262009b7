"""The Apptainer runtime's preflight check (its ``RUNTIMES`` entry's ``preflight``): the binary
exists; rootless without a delegated cgroup is refused unless no session needs memory/pids bounded;
every local image is there and, for one of them, ``true`` runs in it the way a session's exec will.
A URI image (``docker://``, ...) is converted on first use by the first session's prepare
(apptainer_images.py), not here: the preflight stays quick."""

from __future__ import annotations

import asyncio
import os
import sys

from polar_env.errors import ConfigError
from polar_env.runtimes import apptainer, hostworkspace, limits  # read at each call (tests stand in for hosts)
from polar_env.runtimes.base import RuntimeNeeds
from polar_env.runtimes.imagestore import URI_SCHEMES, missing_local


def check_apptainer(needs: RuntimeNeeds) -> None:
    image = needs.image
    hint = os.environ.get("POLAR_APPTAINER") or "apptainer"
    binary = apptainer.find_apptainer()
    if binary is None:
        raise ConfigError(f"no {hint!r} binary on PATH, runtime apptainer; {apptainer.APPTAINER_INSTALL}, or use --runtime "
                          "sandbox")
    if not hostworkspace.drops_privileges() and not needs.unbounded_ok and (why := limits.rootless_bound()) is not None:
        raise ConfigError(apptainer.unbounded_refusal(why))
    if (missing := missing_local([*needs.images, *([image] if image else [])], "apptainer", accepts_files=True)) is not None:
        raise ConfigError(missing)
    if image is not None and not image.startswith(URI_SCHEMES) and (why := asyncio.run(apptainer.probe(image))) is not None:
        raise ConfigError(f"apptainer cannot run {image} ({why}), runtime apptainer; check unprivileged user namespaces "
                          "(sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone) and, for a .sif, "
                          "squashfuse and /dev/fuse, or use --runtime sandbox")
    print(f"polar-env: runtime apptainer: {apptainer.describe_host(binary)}", file=sys.stderr, flush=True)
