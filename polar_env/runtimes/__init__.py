"""Isolated places where a harness runs a task: the bubblewrap sandbox (default), Docker, Apptainer.

``RUNTIMES`` (a ``Registry`` of runtime classes, each built as ``cls(spec, **options)``) is the one
table; ``make_runtime(spec)`` builds the runtime named by ``spec.kind``. To add a runtime: its module
plus one ``RUNTIMES.register`` line here. See ``base.py`` for the interface and each module's
docstring for how it isolates, execs and relays the gateway.
"""

from __future__ import annotations

from typing import Any

from polar_env.runtimes.apptainer import ApptainerRuntime
from polar_env.runtimes.base import RUNTIMES, ExecResult, Runtime, RuntimeSpec, Timings
from polar_env.runtimes.docker import DockerRuntime
from polar_env.runtimes.sandbox import SandboxRuntime

RUNTIMES.register("sandbox", SandboxRuntime, params=RuntimeSpec)
RUNTIMES.register("docker", DockerRuntime, params=RuntimeSpec)
RUNTIMES.register("apptainer", ApptainerRuntime, params=RuntimeSpec)


def make_runtime(spec: RuntimeSpec, **options: Any) -> Runtime:
    """A fresh, unprepared runtime for ``spec``; ``options`` go to its constructor
    (``root_dir``/``bwrap`` for sandbox, ``pull``/``client`` for docker, ``root_dir``/``binary`` for apptainer)."""
    cls = RUNTIMES.get(spec.kind)
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
