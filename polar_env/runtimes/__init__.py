"""Isolated places where a harness runs a task: the bubblewrap sandbox (default), Docker, Apptainer.

``make_runtime(spec)`` builds the runtime named by ``spec.kind``; see ``base.py`` for the interface
and each module's docstring for how it isolates, execs and relays the gateway.
"""

from __future__ import annotations

from typing import Any

from polar_env.errors import ConfigError
from polar_env.runtimes.apptainer import ApptainerRuntime
from polar_env.runtimes.base import ExecResult, Runtime, RuntimeSpec, Timings
from polar_env.runtimes.docker import DockerRuntime
from polar_env.runtimes.sandbox import SandboxRuntime

RUNTIMES: dict[str, type[Any]] = {
    "sandbox": SandboxRuntime,
    "docker": DockerRuntime,
    "apptainer": ApptainerRuntime,
}


def make_runtime(spec: RuntimeSpec, **options: Any) -> Runtime:
    """A fresh, unprepared runtime for ``spec``; ``options`` go to its constructor
    (``root_dir``/``bwrap`` for sandbox, ``pull``/``client`` for docker, ``root_dir``/``binary`` for apptainer)."""
    try:
        cls = RUNTIMES[spec.kind]
    except KeyError:
        raise ConfigError(f"unknown runtime kind {spec.kind!r}; known: {', '.join(RUNTIMES)}") from None
    runtime: Runtime = cls(spec, **options)
    return runtime


__all__ = [
    "RUNTIMES",
    "ApptainerRuntime",
    "DockerRuntime",
    "ExecResult",
    "Runtime",
    "RuntimeSpec",
    "SandboxRuntime",
    "Timings",
    "make_runtime",
]
