"""Isolated places where a harness runs a task: the bubblewrap sandbox (default), Docker, Apptainer.

``RUNTIMES`` (a ``Registry`` of runtime classes, each built as ``cls(spec, **options)``, each with its
preflight check) is the one table, filled in ``kinds.py``; ``make_runtime(spec)`` builds the runtime
named by ``spec.kind``. To add a runtime: its module plus one ``RUNTIMES.register`` line in
``kinds.py``. This package only re-exports: no module of it imports a name from here. See
``base.py`` for the interface and each module's docstring for how it isolates, execs and relays the
gateway.
"""

from __future__ import annotations

from polar_env.runtimes.apptainer import ApptainerRuntime
from polar_env.runtimes.base import RUNTIMES, ExecResult, Runtime, RuntimeNeeds, RuntimeSpec, Timings
from polar_env.runtimes.docker import DockerRuntime
from polar_env.runtimes.kinds import make_runtime
from polar_env.runtimes.sandbox import SandboxRuntime

__all__ = [
    "RUNTIMES",
    "ApptainerRuntime",
    "DockerRuntime",
    "ExecResult",
    "Runtime",
    "RuntimeNeeds",
    "RuntimeSpec",
    "SandboxRuntime",
    "Timings",
    "make_runtime",
]
