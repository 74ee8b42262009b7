"""Apptainer runtime (rootless; HPC clusters). Every ``exec`` is one ``apptainer exec``.

Why per-exec ``exec`` rather than ``apptainer instance start/stop``: each exec then gets fresh
namespaces (the same model as the bwrap sandbox), execs can run concurrently, a timeout kills one
process group, and a crash leaves no named instance behind. The state that must survive between
execs lives in host directories bound in (the same layout as the sandbox, see ``sandbox.py``):

    <root>/workspace -> spec.workdir   <root>/tmp -> /tmp   <root>/home -> /root (via --home, so HOME=/root)

The argv (``apptainer_argv``, unit-tested exactly):

    apptainer exec --containall --cleanenv --home <root>/home:/root --pwd <cwd>
        -B <root>/workspace:<workdir> -B <root>/tmp:/tmp
        [-B <relay.py>:/run/polar/relay.py:ro -B <gateway.sock>:/run/polar/gw.sock]
        [-B <src>:<dst>:ro ...]                                  # spec.binds
        --net --network none                                     # only lo, always
        <image> [python3 /run/polar/relay.py --listen 127.0.0.1:<port> --socket /run/polar/gw.sock --] CMD...

``--home <dir>:/root`` replaces ``--no-home``: the user's real home is still not mounted, and HOME
points at a private per-episode directory like in the other runtimes (Apptainer refuses to set HOME
through ``APPTAINERENV_HOME``). ``IMAGE`` is a ``.sif``, a sandbox directory or a ``docker://`` URI
(e.g. ``docker://`` + ``polar_env.tasks.images.swegym_image(...)``). The environment is passed as ``APPTAINERENV_<K>``
variables (``--cleanenv`` keeps those and drops the rest of the host's), so values never appear in
argv; PATH is the image's unless ``spec.env`` sets it. The relay is per exec (launch mode, like the
sandbox): with ``--network none`` every exec has its own network namespace; ``relay.py`` brings ``lo``
up if Apptainer left it down.

Limits (``limits.py``): each exec joins the runtime's own cgroup first when the host gives one (as
root, or a delegated v2 subtree), else rlimits; with ``cgroup_flags=True`` (clusters whose Apptainer
has cgroup support: root, or rootless with systemd delegation) Apptainer's own ``--memory`` and
``--pids-limit`` are passed as well. Output, patch and disk caps are the shared ones: as root, the disk is the sized tmpfs on the
runtime root that holds the bound workspace, /tmp and HOME (``diskfs.py``).

CI has never run a real Apptainer (none is installable on Debian 12): the lifecycle is tested with a
fake ``apptainer`` that maps ``exec`` onto bwrap with a directory image
(``tests/fixtures/runtimes/fake_apptainer``), plus a real-binary test that is skipped without one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from polar_env.errors import ConfigError
from polar_env.runtimes.argv import GATEWAY_SOCKET, RELAY_PATH, RELAY_SOURCE
from polar_env.runtimes.base import RuntimeSpec
from polar_env.runtimes.hostworkspace import HOME, HostWorkspaceRuntime, _inside

APPTAINER_INSTALL = "install Apptainer (https://apptainer.org/docs/admin/main/installation.html); Debian 12 has no package"
URI_SCHEMES = ("docker://", "docker-archive://", "oras://", "library://", "shub://", "http://", "https://")
_HOST_ENV_DROP = ("APPTAINERENV_", "SINGULARITYENV_", "APPTAINER_ENV", "SINGULARITY_ENV")


def _bind_part(path: str | Path) -> str:
    s = str(path)
    if ":" in s or "," in s:
        raise ConfigError(f"apptainer bind paths cannot contain ':' or ',': {s}")
    return s


def apptainer_argv(
    *,
    binary: str,
    image: str,
    workdir: str,
    workspace: Path,
    tmp: Path,
    home: Path,
    cwd: str,
    command: Sequence[str],
    gateway_socket: Path | None = None,
    binds: Sequence[tuple[Path, str]] = (),
    memory_mb: int | None = None,
    pids_limit: int | None = None,
) -> list[str]:
    """The exact ``apptainer exec`` command line for one exec (see the module docstring)."""
    b = _bind_part
    argv = [binary, "exec", "--containall", "--cleanenv", "--home", f"{b(home)}:{HOME}", "--pwd", cwd]
    argv += ["-B", f"{b(workspace)}:{b(workdir)}", "-B", f"{b(tmp)}:/tmp"]
    if gateway_socket is not None:
        argv += ["-B", f"{b(RELAY_SOURCE)}:{RELAY_PATH}:ro", "-B", f"{b(gateway_socket)}:{GATEWAY_SOCKET}"]
    for src, dst in binds:
        argv += ["-B", f"{b(src)}:{b(dst)}:ro"]
    if memory_mb is not None:
        argv += ["--memory", f"{memory_mb}M", "--memory-swap", f"{memory_mb}M"]
    if pids_limit is not None:
        argv += ["--pids-limit", str(pids_limit)]
    argv += ["--net", "--network", "none", image, *command]
    return argv


def apptainer_env(host_env: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """The apptainer process environment: the host's (minus any APPTAINERENV_ leftovers) plus one
    ``APPTAINERENV_<K>`` per variable the container should see."""
    out = {k: v for k, v in host_env.items() if not k.startswith(_HOST_ENV_DROP)}
    for k, v in env.items():
        if k == "HOME":
            continue  # set by --home
        out[f"APPTAINERENV_{k}"] = v
    return out


class ApptainerRuntime(HostWorkspaceRuntime):
    """Apptainer, one ``apptainer exec`` per exec; see the module docstring."""

    name: ClassVar[str] = "apptainer"

    def __init__(self, spec: RuntimeSpec, *, root_dir: str | Path | None = None, binary: str | None = None,
                 cgroup_flags: bool = False) -> None:
        super().__init__(spec, root_dir=root_dir)
        self._cgroup_flags = cgroup_flags
        self._binary_hint = binary
        self._binary: str | None = None

    def _check(self) -> None:
        hint = self._binary_hint or os.environ.get("POLAR_APPTAINER") or "apptainer"
        found = shutil.which(hint)
        if found is None:
            raise ConfigError(f"apptainer binary {hint!r} not found; {APPTAINER_INSTALL}")
        self._binary = found
        image = self.spec.image
        if not image:
            raise ConfigError("the apptainer runtime needs spec.image (.sif, sandbox directory or docker:// URI)")
        if not image.startswith(URI_SCHEMES) and not Path(image).exists():
            raise ConfigError(f"apptainer image {image} does not exist")

    def _wrap(self, argv: list[str], cwd: str) -> list[str]:
        assert self._binary is not None and self.spec.image is not None
        image = self.spec.image
        if not image.startswith(URI_SCHEMES):
            image = str(Path(image).resolve())
        return apptainer_argv(
            binary=self._binary,
            image=image,
            workdir=_inside(self.spec.workdir),
            workspace=self.workspace,
            tmp=self.tmp_dir,
            home=self.home_dir,
            cwd=cwd,
            command=argv,
            gateway_socket=Path(self.spec.gateway_socket) if self.relay_enabled and self.spec.gateway_socket else None,
            binds=self.spec.binds,
            memory_mb=self.spec.memory_mb if self._cgroup_flags else None,
            pids_limit=self.spec.pids_limit if self._cgroup_flags else None,
        )

    def limits_report(self) -> dict[str, Any]:
        report = super().limits_report()
        if self._cgroup_flags and report:
            for key, flag in (("memory_mb", "--memory"), ("pids_limit", "--pids-limit")):
                report["mechanisms"][key] = f"apptainer {flag} (cgroups) + {report['mechanisms'][key]}"
        return report

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {"LANG": "C.UTF-8", **self.spec.env, **(extra or {})}
        return apptainer_env(os.environ, env)

