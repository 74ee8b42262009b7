"""The runtime kinds: ``RUNTIMES`` (declared in ``base.py``) filled here, each kind with its class,
its params model and its preflight check, and ``make_runtime``. A new runtime is its module (the
class and its check) plus one ``RUNTIMES.register`` line here; a kind without a check is refused
at registration, so the preflight (which runs every job's kinds' checks) cannot skip it.
"""

from __future__ import annotations

from polar_env.runtimes.apptainer import ApptainerRuntime
from polar_env.runtimes.apptainer_check import check_apptainer
from polar_env.runtimes.base import RUNTIMES, Runtime, RuntimeSpec
from polar_env.runtimes.docker import DockerRuntime
from polar_env.runtimes.docker_check import check_docker
from polar_env.runtimes.sandbox import SandboxRuntime
from polar_env.runtimes.sandbox_check import check_sandbox

RUNTIMES.register("sandbox", SandboxRuntime, params=RuntimeSpec, preflight=check_sandbox)
RUNTIMES.register("docker", DockerRuntime, params=RuntimeSpec, preflight=check_docker)
RUNTIMES.register("apptainer", ApptainerRuntime, params=RuntimeSpec, preflight=check_apptainer)


def make_runtime(spec: RuntimeSpec, **options: object) -> Runtime:
    """A fresh, unprepared runtime for ``spec``; ``options`` go to its constructor
    (``root_dir``/``bwrap`` for sandbox, ``pull``/``client`` for docker, ``root_dir``/``binary`` for apptainer)."""
    cls = RUNTIMES.get(spec.kind)
    runtime: Runtime = cls(spec, **options)
    return runtime
